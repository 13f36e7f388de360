"""Triton's private APIs the package touches: the interpreter knob and index patch (the kernels on CPU), the Gluon
release gate, and the compiled kernel's launcher with the launch hooks (prepared launches), plus the raw CUDA stream
handle Triton's launch path passes. Versions in the package docstring (``backends/compat/__init__.py``)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

#: the names ``compat`` re-exports (``compat.NAME``)
__all__ = ['load_interpreted_module', 'triton_interpreter_index_patch', 'GLUON_CHECKED_TRITON',
           'gluon_unsupported_reason', 'LAUNCHER_CHECKED_TRITON', 'compiled_launcher', 'launch_hooks_set',
           'current_cuda_stream']

# ---- Triton's interpreter ----------------------------------------------------------------------------------
def load_interpreted_module(name: str, path: str, interpret: bool):
    """The Python file ``path`` loaded as module ``name`` with Triton's interpreter on (``interpret``) or off:
    Triton decides when a file's ``@triton.jit`` decorators run (its ``knobs.runtime.interpret``, which defaults
    to the TRITON_INTERPRET variable), so the same kernels load as a compiled and an interpreted copy; the knob is
    set inside ``knobs.runtime.scope()`` (restored afterwards) and no environment variable is read or written.

    ``name``'s parent (one per mode, e.g. ``gproj_patch.backends._interp``) is a package made here over
    ``path``'s folder, so the file's relative imports of its helper files (``from .triton_tiles import ...``)
    load them within this call, in the same mode, as its siblings: a kernel never calls a helper of the other
    mode. A file already loaded there (another file's helper) is returned as it is; a parent that exists but was
    not made for this mode raises ValueError."""
    import importlib.util
    import os
    import sys
    import types

    from triton import knobs
    parent = name.rpartition(".")[0]
    with knobs.runtime.scope():
        knobs.runtime.interpret = bool(interpret)
        pkg = sys.modules.get(parent)
        if pkg is None:
            pkg = sys.modules[parent] = types.ModuleType(parent, "Triton kernel files loaded in one mode")
            pkg.__path__ = [os.path.dirname(os.path.abspath(path))]
            pkg.triton_interpret = bool(interpret)
        if getattr(pkg, "triton_interpret", None) is not bool(interpret):
            raise ValueError(f"{parent!r} is not a package of kernel files loaded with interpret={interpret}")
        mod = sys.modules.get(name)
        if mod is None:
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def triton_interpreter_index_patch() -> Iterator[None]:
    """Triton 3.6's interpreter converts loop bounds with ``int(ndarray of shape (1,))``, which numpy >= 2.4
    rejects; while interpreted kernels run, convert through ``.reshape(-1)[0]`` instead."""
    try:
        import triton.runtime.interpreter as ti
        orig = ti._patch_lang_tensor
    except (ImportError, AttributeError):  # other triton versions: nothing to patch
        yield
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched
    try:
        yield
    finally:
        ti._patch_lang_tensor = orig


# ---- Triton's Gluon (experimental) -------------------------------------------------------------------------
#: Triton releases the Gluon KV-major kernel (``backends/gluon_kernels.py``) was compiled and run on (H200).
#: Gluon is experimental: between releases ``gl.warp_specialize`` changed its signature (a list of
#: (function, args) in 3.6, keyword default/worker partitions later), so other releases get the tl kernel.
GLUON_CHECKED_TRITON = ("3.6",)


def gluon_unsupported_reason(version: Optional[str] = None) -> Optional[str]:
    """None when ``version`` (default: the installed Triton's) is a release the Gluon kernel was checked
    against (``GLUON_CHECKED_TRITON``, any patch level); otherwise why the tl kernel runs instead."""
    if version is None:
        try:
            import triton
        except Exception as exc:  # pragma: no cover - triton is a dependency
            return f"no triton ({type(exc).__name__})"
        version = triton.__version__
    if any(version == v or version.startswith(v + ".") for v in GLUON_CHECKED_TRITON):
        return None
    return f"triton {version}: the Gluon kernel was checked against triton {', '.join(GLUON_CHECKED_TRITON)} only"


# ---- Triton's compiled-kernel launcher (the host cost of a launch) ------------------------------------------
#: Triton releases whose ``CompiledKernel`` launcher call ``compiled_launcher`` was checked against
LAUNCHER_CHECKED_TRITON = ("3.6",)


def compiled_launcher(kernel) -> Optional[Any]:
    """``go(grid_x, grid_y, grid_z, stream, args)`` launching the compiled kernel ``kernel`` (what
    ``JITFunction.run`` returned) as ``JITFunction.run`` does after its argument binding, or None where this
    Triton's ``CompiledKernel`` is not the one checked. ``args``: every parameter of the kernel in signature order,
    constexprs included (the launcher skips them), as ``JITFunction.run`` passes ``bound_args.values()``. Checked:
    triton 3.6.0 (``CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
    enter_hook, exit_hook, *args)``). The launch hooks (a profiler's) are not called: ``launch_hooks_set()`` says
    when a caller must take Triton's own path instead."""
    import triton
    if not triton.__version__.startswith(LAUNCHER_CHECKED_TRITON):
        return None
    try:
        run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata
    except AttributeError:
        return None
    if function is None or not callable(run):
        return None

    def go(grid_x: int, grid_y: int, grid_z: int, stream: int, args) -> None:
        run(grid_x, grid_y, grid_z, stream, function, metadata, None, None, None, *args)
    return go


def launch_hooks_set() -> bool:
    """True when a Triton launch enter/exit hook is set (``triton.knobs.runtime``; a profiler such as Proton):
    launches must then go through ``JITFunction.run``, which calls them. Triton 3.6 keeps each as a ``HookChain``
    (never None; set when its ``calls`` list is not empty); a plain callable set in its place counts as set.
    Checked: triton 3.6.0."""
    from triton import knobs
    return _hook_set(knobs.runtime.launch_enter_hook) or _hook_set(knobs.runtime.launch_exit_hook)


def _hook_set(hook) -> bool:
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


def current_cuda_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream of ``device_index`` (what Triton's launch path passes),
    ``torch._C._cuda_getCurrentRawStream``. Checked: torch 2.11, 2.13."""
    return torch._C._cuda_getCurrentRawStream(device_index)
