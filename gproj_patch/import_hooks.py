"""Run a callback right after a module is imported, without importing it (stdlib only: used at start-up).

Used by the ``GPROJ_PATCH=1`` start-up hook (enable the patch once ``torch`` is imported) and by the
transformers target (register the ``"gproj"`` attention once ``transformers.modeling_utils`` is imported), so
that processes which never import those modules do not pay for them.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional


class AfterImport:
    """A one-shot meta-path finder: finds ``fullname`` through the other finders and runs ``callback()`` right
    after the module's code has executed (the loader object is kept; only its ``exec_module`` is wrapped)."""

    def __init__(self, fullname: str, callback: Callable[[], None]):
        self.fullname = fullname
        self.callback = callback

    def cancel(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.fullname:
            return None
        self.cancel()
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        inner = loader.exec_module
        callback = self.callback

        def exec_module(module):
            try:
                inner(module)
            finally:
                loader.__dict__.pop("exec_module", None)
            callback()

        loader.exec_module = exec_module
        return spec

    def invalidate_caches(self):
        pass


def call_after_import(fullname: str, callback: Callable[[], None]) -> Optional[AfterImport]:
    """``callback()`` now if ``fullname`` is already imported (returns None), else right after its import
    (returns the pending hook; ``.cancel()`` withdraws it)."""
    if fullname in sys.modules:
        callback()
        return None
    hook = AfterImport(fullname, callback)
    sys.meta_path.insert(0, hook)
    return hook
