"""Run a callback right after a module is imported, without importing it (stdlib only: used at start-up).

Used by the ``GPROJ_PATCH=1`` start-up hook (enable the patch once ``torch`` is imported) and by the
transformers target (register the ``"gproj"`` attention once ``transformers.modeling_utils`` is imported), so
that processes which never import those modules do not pay for them.

How. The import system marks a module's spec ``_initializing = True`` before it runs the module's code and
sets it back to ``False`` when the import is over, after a failed import has already been removed from
``sys.modules`` (``importlib._bootstrap._load_unlocked``, read here on CPython 3.11; the C import path reads the
same flag to detect partially initialized modules; ``tests/test_import_order.py`` fails if it stops holding). One finder (``_Watcher``) sits at the front of
``sys.meta_path`` while any callback is pending. Asked for a watched name, it gets the real spec from the other
finders and returns it with its class switched to ``_ObservedSpec``, a ``ModuleSpec`` subclass that notices
that final ``_initializing = False``; the spec's class is then switched back and, if the module is in
``sys.modules``, the callbacks run. The loader and the module are untouched. So:

* a probe (``importlib.util.find_spec("torch")``, which Transformers runs for every optional dependency) gets
  a spec but imports nothing: the callbacks stay pending, the watcher stays installed, and the real import
  that follows fires them (the old one-shot finder removed itself at the first ``find_spec`` and lost them);
* a module whose code raises is gone from ``sys.modules`` when the flag drops: nothing fires, the callbacks
  stay pending and fire on a later successful import;
* each callback fires exactly once (the pending callbacks are taken under a lock before they run);
* a module that is being imported right now (its code is still running, e.g. ``torch`` imported from inside
  ``transformers.modeling_utils``) counts as not imported yet: ``call_after_import`` observes its spec and
  fires when that import ends; ``imported(name)`` says False meanwhile;
* namespace packages and legacy (``load_module``) loaders go through the same flag;
* ``importlib.reload`` and a spec executed by hand (``module_from_spec`` + ``exec_module``) never set the
  flag, so they fire nothing by themselves. For that hand-made import, a spec that is not a plain
  ``ModuleSpec``, or a finder placed in front of the watcher that serves the name itself, the watcher notices
  the module in ``sys.modules`` (fully initialized) the next time any import reaches it and fires then.

A callback that raises does not fail the import it waited for: the error is logged on the ``gproj_patch``
logger with its traceback.
"""
from __future__ import annotations

import logging
import sys
import threading
from importlib.machinery import ModuleSpec
from typing import Callable, Dict, List, Optional

_logger = logging.getLogger("gproj_patch")


class AfterImport:
    """One pending callback: ``callback()`` runs right after ``fullname`` has been imported. ``cancel()``
    withdraws it (a no-op once it has fired); ``pending`` says whether it is still waiting."""

    def __init__(self, fullname: str, callback: Callable[[], None]):
        self.fullname = fullname
        self.callback = callback

    @property
    def pending(self) -> bool:
        return _WATCHER.is_pending(self)

    def cancel(self) -> None:
        _WATCHER.remove(self)


class _ObservedSpec(ModuleSpec):
    """A ``ModuleSpec`` that reports the end of its module's import (the import system's last write to it)."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "_initializing" and value is False:
            self.__class__ = ModuleSpec
            _WATCHER.import_ended(self.name)


def _observe(spec) -> bool:
    if type(spec) is ModuleSpec:
        spec.__class__ = _ObservedSpec
    return type(spec) is _ObservedSpec


def imported(fullname: str) -> bool:
    """Whether ``fullname`` is in ``sys.modules`` with its import finished (not partially initialized)."""
    module = sys.modules.get(fullname)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


class _Watcher:
    """The meta-path finder holding every pending callback, by module name."""

    def __init__(self):
        self._lock = threading.RLock()
        self._pending: Dict[str, List[AfterImport]] = {}
        self._busy = threading.local()  # names this thread is resolving through the other finders

    def add(self, hook: AfterImport) -> None:
        with self._lock:
            self._pending.setdefault(hook.fullname, []).append(hook)
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)

    def remove(self, hook: AfterImport) -> None:
        with self._lock:
            hooks = self._pending.get(hook.fullname, [])
            if hook in hooks:
                hooks.remove(hook)
            if not hooks:
                self._pending.pop(hook.fullname, None)
            self._uninstall_if_idle()

    def is_pending(self, hook: AfterImport) -> bool:
        with self._lock:
            return hook in self._pending.get(hook.fullname, ())

    def pending_names(self) -> List[str]:
        with self._lock:
            return sorted(self._pending)

    def _uninstall_if_idle(self) -> None:
        if not self._pending:
            while self in sys.meta_path:
                sys.meta_path.remove(self)

    def import_ended(self, fullname: str) -> None:
        """The import of ``fullname`` is over: fire its callbacks if it succeeded."""
        with self._lock:
            if fullname not in self._pending or not imported(fullname):
                return
            hooks = self._pending.pop(fullname)
            self._uninstall_if_idle()
        for hook in hooks:
            try:
                hook.callback()
            except Exception:  # noqa: BLE001 - the import it waited for succeeded; do not fail it
                _logger.error("the after-import callback %r for %s failed", hook.callback, fullname, exc_info=True)

    def _fire_missed(self) -> None:
        for name in [n for n in list(self._pending) if imported(n)]:
            self.import_ended(name)

    # ------------------------------------------------------------------------------------ finder protocol
    def find_spec(self, fullname, path=None, target=None):
        busy = self._busy.__dict__.setdefault("names", set())
        if self._pending and not busy:
            self._fire_missed()
        if fullname not in self._pending or fullname in busy:  # busy: another finder re-asked the meta path
            return None
        busy.add(fullname)
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    _observe(spec)
                    return spec
            return None
        finally:
            busy.discard(fullname)

    def invalidate_caches(self) -> None:
        pass


_WATCHER = _Watcher()


def call_after_import(fullname: str, callback: Callable[[], None]) -> Optional[AfterImport]:
    """``callback()`` now if ``fullname`` is imported (returns None), else right after a successful import of it
    ends (returns the pending ``AfterImport``; ``.cancel()`` withdraws it). A module whose import is still
    running counts as not imported: the callback waits for the end of that import."""
    if imported(fullname):
        callback()
        return None
    hook = AfterImport(fullname, callback)
    _WATCHER.add(hook)
    module = sys.modules.get(fullname)
    if module is not None:  # being imported right now: watch the end of that import
        _observe(getattr(module, "__spec__", None))
    return hook


def pending() -> List[str]:
    """Names of the modules that still have callbacks waiting for their import."""
    return _WATCHER.pending_names()
