"""Every private upstream API the package touches, in one place, with the versions it was checked against.

Each touch-point is a small function (or, for names only, a constant) that either does its job or raises
``CompatError`` naming what changed — never a silently wrong result. ``tests/test_structure.py`` exercises each
one on the installed versions, so an upstream change fails loudly in CI. Checked against: torch 2.11.0+cu130 (the
H200 image) and 2.13.0 (CPU); transformers 5.17 (H200) and 5.24 (CPU); triton 3.6.0; flash-attn-4 4.0.0b36.
Imports of triton, transformers and flash-attn happen inside the functions: this module imports without them.

| touch-point | upstream private name | checked | used by |
|---|---|---|---|
| ``fused_sdpa_lse(grad_fn)`` | ``ScaledDotProduct{Cudnn,Flash,FlashForCpu,Efficient}AttentionBackward0`` and their ``_saved_logsumexp`` / ``_saved_log_sumexp`` | torch 2.11, 2.13 | SDPA hook |
| ``overrides_torch_function(cls)`` | ``torch._C._disabled_torch_function_impl`` (a subclass that opted out of ``__torch_function__``) | torch 2.11, 2.13 | SDPA hook |
| ``functorch_transform_active()``, ``forward_ad_active()``, ``saved_tensors_hooks_enabled()``, ``saved_tensors_default_hooks_active()``, ``graph_task_id()``, ``delayed_error(message, outputs)`` | ``torch._C._functorch.peek_interpreter_stack``, ``torch.autograd.forward_ad._current_level``, ``torch._C._autograd._saved_tensors_hooks_is_enabled``, ``torch._C._autograd._top_saved_tensors_default_hooks``, ``torch._C._current_graph_task_id``, ``torch._C._functions.DelayedError`` (what ``once_differentiable`` uses) | torch 2.13 | hooked calls' autograd (``dispatch/autograd.py``), SDPA/flex forwards |
| ``custom_op_def(qualname)`` | ``torch._library.custom_ops.OPDEFS``; ``CustomOpDef._backend_fns``, ``_init_fn``, ``_abstract_fn`` | torch 2.11, 2.13 | flash-attn hook |
| ``FA2_BACKWARD_OPS``, ``FA3_BACKWARD_OPS``, ``FA_FORWARD_OPS`` | flash-attn's private ops ``flash_attn::_flash_attn_{,varlen_}{forward,backward}`` (``flashattn::`` in newer FA2), ``flash_attn_3::_flash_attn_{forward,backward}`` | flash-attn 2.7–2.8, FA3 (H200 image) | flash-attn hook |
| ``fa4_interface()`` | ``flash_attn.cute.interface._flash_attn_bwd`` / ``_flash_attn_fwd`` (module functions its autograd Functions look up as globals; JIT cache ``compile_cache`` on the function) | flash-attn-4 4.0.0b36 | flash-attn hook |
| ``hf_registry_mapping(registry)`` | ``transformers`` ``AttentionInterface._global_mapping`` (and the mask interface's) | transformers 5.17, 5.24 | HF hooks |
| ``is_context_parallel_wrapper(fn)`` | ``torch.distributed.tensor.experimental._context_parallel._attention._replaced_functions`` | torch 2.11, 2.13 | SDPA hook |
| ``register_torchscript_builtin(fn, op)`` | ``torch.jit._builtins._register_builtin`` | torch 2.11, 2.13 | SDPA hook (TorchScript) |
| ``dynamo_module_name()`` | the module ``torch._dynamo`` (imported first by ``torch.compile``; its import loads the compiled flex path) | torch 2.11, 2.13 | flex hook |
| ``BUILTIN_SDPA`` | ``torch._C._nn.scaled_dot_product_attention`` (the C builtin behind ``F.scaled_dot_product_attention``) | torch 2.11, 2.13 | SDPA hook |
| ``assume_constant_result(fn)`` | ``torch._dynamo.assume_constant_result`` (a trace-time call folded to its result) | torch 2.11, 2.13 | compiled flex hook |
| ``flex_identity_score_mod()``, ``FLEX_SLICED_MASK_MOD`` | ``torch.nn.attention.flex_attention._identity``; the name of the stub flex puts in a sliced BlockMask (``_sliced_mask_mod_error``) | torch 2.11, 2.13 | flex hook |
| ``load_interpreted_module(name, path, interpret)`` | ``triton.knobs.runtime.interpret`` (read when a file's ``@triton.jit`` decorators run) and ``knobs.runtime.scope()`` | triton 3.6 | Triton kernel on CPU |
| ``triton_interpreter_index_patch()`` | ``triton.runtime.interpreter._patch_lang_tensor`` | triton 3.6 | Triton kernel on CPU |
| ``compiled_launcher(kernel)``, ``launch_hooks_set()`` | ``CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``; ``triton.knobs.runtime.launch_enter_hook`` / ``launch_exit_hook`` | triton 3.6 | prepared launches (host cost) |
| ``current_cuda_stream(index)`` | ``torch._C._cuda_getCurrentRawStream`` | torch 2.11, 2.13 | prepared launches |
| ``gluon_unsupported_reason(version)`` | ``triton.experimental.gluon`` (experimental: ``warp_specialize``'s signature, ``warpgroup_mma_init``, rank-1 ``NVMMASharedLayout`` TMA boxes) | triton 3.6 | Gluon KV-major kernel |

This module imports nothing from the rest of the package.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch


class CompatError(RuntimeError):
    """An upstream private API is not what this version of gproj_patch was written against."""


# ---- PyTorch SDPA: the builtin, and the LSE saved by the fused autograd node ---------------------------------
BUILTIN_SDPA = torch._C._nn.scaled_dot_product_attention


def assume_constant_result(fn):
    """``torch._dynamo.assume_constant_result(fn)``: under tracing, ``fn``'s call is evaluated once and its result
    becomes a constant of the graph (no guard on what it read)."""
    import torch._dynamo
    return torch._dynamo.assume_constant_result(fn)


#: the name of the stub mask_mod FlexAttention puts in a sliced BlockMask (its mask_mod is not the original's)
FLEX_SLICED_MASK_MOD = "_sliced_mask_mod_error"


def flex_identity_score_mod():
    """FlexAttention's default score_mod (``flex_attention._identity``): a call with it has no score_mod."""
    from torch.nn.attention import flex_attention as fa
    fn = getattr(fa, "_identity", None)
    if fn is None:
        raise CompatError("torch.nn.attention.flex_attention._identity is gone (checked on torch 2.11, 2.13)")
    return fn



FUSED_SDPA_NODES = ("ScaledDotProductCudnnAttentionBackward0", "ScaledDotProductFlashAttentionBackward0",
                    "ScaledDotProductFlashAttentionForCpuBackward0", "ScaledDotProductEfficientAttentionBackward0",
                    "ScaledDotProductFusedAttentionOverrideableBackward0")
_LSE_ATTRS = ("_saved_logsumexp", "_saved_log_sumexp")
_SEARCH_DEPTH = 4  # SDPA wraps the fused op in at most a transpose/view or two


def fused_sdpa_node(grad_fn) -> Optional[Any]:
    """The fused SDPA autograd node behind ``grad_fn`` (an SDPA output's), or None (the math backend)."""
    frontier = [grad_fn]
    for _ in range(_SEARCH_DEPTH):
        nxt = []
        for f in frontier:
            if f is None:
                continue
            if type(f).__name__ in FUSED_SDPA_NODES:
                return f
            nxt.extend(g for g, _ in f.next_functions)
        frontier = nxt
    return None


def fused_sdpa_lse(grad_fn) -> Optional[torch.Tensor]:
    """The natural-log LSE saved by the fused SDPA node behind ``grad_fn``, or None when no fused node ran.
    Raises CompatError if a fused node is there but keeps its LSE under another name."""
    node = fused_sdpa_node(grad_fn)
    if node is None:
        return None
    for attr in _LSE_ATTRS:
        if hasattr(node, attr):
            return getattr(node, attr)
    raise CompatError(f"{type(node).__name__} has none of {_LSE_ATTRS}: PyTorch renamed the saved LSE")


# ---- tensor subclasses: __torch_function__ ----------------------------------------------------------------
def overrides_torch_function(cls) -> bool:
    """True for a tensor subclass with its own ``__torch_function__`` (it may take an op over, as
    ``CausalBias`` takes SDPA): neither ``torch.Tensor``'s default nor torch's private "disabled" marker
    (``torch._C._disabled_torch_function_impl``, what ``Parameter``-like subclasses set to opt out)."""
    fn = getattr(cls, "__torch_function__", None)
    if fn is None:
        return False
    disabled = getattr(torch._C, "_disabled_torch_function_impl", None)
    if disabled is None:
        raise CompatError("torch._C._disabled_torch_function_impl is gone: torch changed __torch_function__")
    return getattr(fn, "__func__", fn) not in (torch.Tensor.__torch_function__.__func__, disabled)


# ---- autograd: torch.func transforms, forward-mode AD, saved-tensor hooks, a node that raises when reached ----
def functorch_transform_active() -> bool:
    """True inside a ``torch.func`` transform (``grad``, ``vjp``, ``jacrev``, ``vmap``, ``jvp``, ...): its
    interpreter stack is not empty."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def forward_ad_active() -> bool:
    """True inside ``torch.autograd.forward_ad.dual_level()`` (its module-level current level is set)."""
    from torch.autograd import forward_ad
    return forward_ad._current_level >= 0


def saved_tensors_hooks_enabled() -> bool:
    """False inside ``torch.autograd.graph.disable_saved_tensors_hooks`` (entering saved-tensor hooks raises)."""
    return torch._C._autograd._saved_tensors_hooks_is_enabled()


def saved_tensors_default_hooks_active() -> bool:
    """True inside ``torch.autograd.graph.saved_tensors_hooks`` (a non-reentrant checkpoint's forward and its
    recomputation, ``save_on_cpu``, ...): the stack of default pack/unpack hooks is not empty."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def graph_task_id() -> int:
    """The id of the backward autograd's engine runs on this thread (a checkpoint's recomputation, reentrant or
    not, runs its forward there), -1 outside one: ``torch._C._current_graph_task_id()``."""
    return torch._C._current_graph_task_id()


def delayed_error(message: str, outputs: tuple) -> tuple:
    """``outputs`` as aliases that require grad through a node raising ``RuntimeError(message)`` when a backward
    reaches it (``once_differentiable``'s mechanism); None entries stay None."""
    aliases = [None if t is None else t.detach().requires_grad_() for t in outputs]
    result = torch._C._functions.DelayedError(message, len(aliases))(*aliases)
    return result if isinstance(result, tuple) else (result,)


# ---- torch.library custom ops (flash-attn's backward ops) --------------------------------------------------
def custom_op_def(qualname: str):
    """The ``CustomOpDef`` of a ``torch.library.custom_op`` named ``qualname``, or None if none is defined."""
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError as exc:
        raise CompatError(f"torch._library.custom_ops.OPDEFS is gone ({exc})") from exc
    opdef = OPDEFS.get(qualname)
    if opdef is not None:
        for attr in ("_backend_fns", "_init_fn", "register_kernel"):
            if not hasattr(opdef, attr):
                raise CompatError(f"CustomOpDef has no {attr!r}: torch changed custom ops")
    return opdef


def custom_op_kernel(opdef, device_type: str):
    """The kernel registered for ``device_type`` on ``opdef`` (None if none)."""
    return opdef._backend_fns.get(device_type)


def set_custom_op_kernel(opdef, device_type: str, fn) -> None:
    """Put ``fn`` back as ``opdef``'s kernel for ``device_type`` (by identity; the public API only adds)."""
    opdef._backend_fns[device_type] = fn


def custom_op_fake(opdef):
    """The op's fake (abstract) implementation, or None."""
    return getattr(opdef, "_abstract_fn", None)


def custom_op_signature_fn(opdef):
    """The Python function the op was defined from (its signature names the arguments)."""
    return opdef._init_fn


# ---- flash-attn: the private ops and functions its hook replaces -----------------------------------------
#: FA2's backward ops (dense, varlen; namespace ``flashattn`` in newer releases) and FA3's (one op for both)
FA2_BACKWARD_OPS = ("flash_attn::_flash_attn_backward", "flash_attn::_flash_attn_varlen_backward",
                    "flashattn::_flash_attn_backward", "flashattn::_flash_attn_varlen_backward")
FA3_BACKWARD_OPS = ("flash_attn_3::_flash_attn_backward",)
#: the forward ops whose calls file their records (FA2 dense/varlen, both namespaces; FA3)
FA_FORWARD_OPS = ("flash_attn::_flash_attn_forward", "flash_attn::_flash_attn_varlen_forward",
                  "flashattn::_flash_attn_forward", "flashattn::_flash_attn_varlen_forward",
                  "flash_attn_3::_flash_attn_forward")
#: FA4: the interface module and its private module functions (looked up as globals by its autograd Functions)
FA4_INTERFACE = "flash_attn.cute.interface"
FA4_BACKWARD = "_flash_attn_bwd"
FA4_FORWARD = "_flash_attn_fwd"


def fa4_interface():
    """FA4's interface module when FA4 is installed and has its private backward ``_flash_attn_bwd``, else None
    (not installed, or an import that fails: a broken build must not break ``enable()``)."""
    import importlib
    import importlib.util
    try:
        if importlib.util.find_spec("flash_attn.cute") is None:
            return None
        module = importlib.import_module(FA4_INTERFACE)
    except Exception:  # noqa: BLE001 - FA4 absent or broken: not patched
        return None
    return module if hasattr(module, FA4_BACKWARD) else None


# ---- Transformers' attention registries --------------------------------------------------------------------
def hf_registry_mapping(registry) -> dict:
    """The global name → function mapping of an HF ``AttentionInterface`` / ``AttentionMaskInterface``."""
    mapping = getattr(registry, "_global_mapping", None)
    if not isinstance(mapping, dict):
        raise CompatError(f"{registry!r} has no dict _global_mapping: transformers changed its registries")
    return mapping


# ---- context parallel ---------------------------------------------------------------------------------------
_CP_MODULES = ("torch.distributed.tensor.experimental._context_parallel._attention",
               "torch.distributed.tensor.experimental._attention")


def is_context_parallel_wrapper(fn) -> bool:
    """True when ``fn`` is the SDPA wrapper ``torch.distributed.tensor.experimental.context_parallel`` installs
    while its context is open (only modules already imported are asked: CP imported them if it is active)."""
    import sys
    for name in _CP_MODULES:
        module = sys.modules.get(name)
        replaced = getattr(module, "_replaced_functions", None) if module is not None else None
        if isinstance(replaced, dict) and fn in replaced:
            return True
    return False


# ---- TorchScript -------------------------------------------------------------------------------------------
def register_torchscript_builtin(fn, op: str) -> None:
    """Make TorchScript compile calls of the Python function ``fn`` as the aten op ``op`` (what it does for the
    builtins it knows): scripted code that reaches ``fn`` through a module global (``F.multi_head_attention_forward``
    calling the patched ``F.scaled_dot_product_attention``) runs the op instead of failing to compile ``fn``."""
    try:
        from torch.jit._builtins import _register_builtin
    except ImportError as exc:
        raise CompatError(f"torch.jit._builtins._register_builtin is gone ({exc})") from exc
    _register_builtin(fn, op)


# ---- Dynamo -------------------------------------------------------------------------------------------------
def dynamo_module_name() -> str:
    """The name of the module ``torch.compile`` imports first (``torch._dynamo``): a hook that must be in place
    before any compiled region traces it waits for this import, not for ``torch`` (Dynamo costs ~1.3 s)."""
    return "torch._dynamo"


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
#: Triton releases the Gluon KV-major kernel (``backends/gluon_kernels.py``) was compiled and run on (H200, runs
#: 22–25). Gluon is experimental: between releases ``gl.warp_specialize`` changed its signature (a list of
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


# ---- SDPA's fused ops as its own composite calls them (the compiled SDPA hook) -----------------------------
# Touch-points, checked against torch 2.13 (CPU: the flash-for-CPU op, tests/hooks/test_compiled_fused.py) and
# 2.11 (H200: flash, efficient, cuDNN; that file's CUDA tests): the kernel of ``aten.scaled_dot_product_attention``
# (``OpOverload.decompose``: the composite that chooses the backend, converts a boolean mask, pads head dims);
# ``torch.utils._python_dispatch.TorchDispatchMode`` (to see the fused op that composite calls); the aten ops
# ``_scaled_dot_product_{flash_attention, flash_attention_for_cpu, efficient_attention, cudnn_attention}`` (their
# argument names, the positions of their outputs) and their ``_backward`` ops (argument names).
import functools  # noqa: E402  (this block's own imports, kept with it)
from dataclasses import dataclass  # noqa: E402
from types import MappingProxyType  # noqa: E402
from typing import Dict, Tuple  # noqa: E402


@dataclass(frozen=True)
class FusedSdpaOp:
    """One fused SDPA forward op: its backward op, the ``SDPBackend`` member that selects it, and the positions
    of its outputs beyond (output, logsumexp): the dropout RNG state, and (cum_seq_q, cum_seq_k, max_q, max_k)."""
    backward: str
    backend: str
    rng: Tuple[int, ...]
    seqlens: Tuple[int, ...]


#: the fused forward ops SDPA's composite calls (aten names), each with what its backward needs
SDPA_FUSED_OPS = MappingProxyType({
    "_scaled_dot_product_flash_attention_for_cpu": FusedSdpaOp(
        "_scaled_dot_product_flash_attention_for_cpu_backward", "FLASH_ATTENTION", (), ()),
    "_scaled_dot_product_flash_attention": FusedSdpaOp(
        "_scaled_dot_product_flash_attention_backward", "FLASH_ATTENTION", (6, 7), (2, 3, 4, 5)),
    "_scaled_dot_product_efficient_attention": FusedSdpaOp(
        "_scaled_dot_product_efficient_attention_backward", "EFFICIENT_ATTENTION", (2, 3), ()),
    "_scaled_dot_product_cudnn_attention": FusedSdpaOp(
        "_scaled_dot_product_cudnn_attention_backward", "CUDNN_ATTENTION", (6, 7), (2, 3, 4, 5)),
})
#: backward-argument names that take a forward's value under another name
_SDPA_BACKWARD_ALIASES = MappingProxyType({"grad_out_": "grad_out", "attn_mask": "attn_bias",
                                           "philox_seed": "rng_0", "philox_offset": "rng_1"})


@dataclass(frozen=True, eq=False)
class FusedSdpaCall:
    """The fused op one SDPA call ran: its aten name, its arguments by schema name (tensors included; the query
    alias the capture made is given back as the caller's query) and its outputs (empty when not run)."""
    op: str
    args: Dict[str, Any]
    outputs: Tuple[Any, ...]


class _StopAtFused(Exception):
    """Raised by the capture at the fused op when only its arguments are wanted."""


@functools.lru_cache(maxsize=16)  # bounded: one entry per fused op overload (four)
def _schema_of(func) -> Tuple[Tuple[str, ...], Tuple[Tuple[str, Any], ...]]:
    """(argument names, (name, default) of the arguments with one) of an op overload's schema."""
    arguments = func._schema.arguments
    return tuple(a.name for a in arguments), tuple((a.name, a.default_value) for a in arguments
                                                    if a.has_default_value())


def _bound_args(func, args, kwargs) -> Dict[str, Any]:
    names, defaults = _schema_of(func)
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


@functools.lru_cache(maxsize=1)  # bounded: one class, made on first use
def _fused_capture_class():
    """The dispatch mode that passes every op through and records the first fused SDPA op (``SDPA_FUSED_OPS``)
    with its arguments (``torch.utils._python_dispatch`` imported on first use, not while this module loads)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class FusedCapture(TorchDispatchMode):
        def __init__(self, stop: bool):
            super().__init__()
            self.stop, self.call = stop, None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if self.call is not None or func.namespace != "aten" or name not in SDPA_FUSED_OPS:
                return func(*args, **kwargs)
            bound = _bound_args(func, args, kwargs)
            if self.stop:
                self.call = FusedSdpaCall(name, bound, ())
                raise _StopAtFused
            out = func(*args, **kwargs)
            self.call = FusedSdpaCall(name, bound, tuple(out))
            return out
    return FusedCapture


def sdpa_fused_call(q, k, v, attn_mask, is_causal: bool, scale, enable_gqa: bool, *, stop: bool = False,
                    backend: Optional[str] = None):
    """(output, FusedSdpaCall or None): torch's own SDPA composite run on these inputs as a training call runs
    (grad mode on, a query that requires grad: the backend choice and the LSE of the unpatched compiled call's
    joint graph, and what the ``sdpa_kernel`` flags in force allow), with the fused op it called (None: the math
    backend). ``stop``: the fused op is not run (output None; its arguments, e.g. the mask's bias, are wanted);
    ``backend``: only that ``SDPBackend`` member enabled. Dropout is 0 (the hook passes dropout through)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qa = q.detach().requires_grad_()
    capture = _fused_capture_class()(stop)
    only = sdpa_kernel([getattr(SDPBackend, backend)]) if backend else contextlib.nullcontext()
    out = None
    with torch.enable_grad(), only, capture:
        try:
            out = torch.ops.aten.scaled_dot_product_attention.default.decompose(
                qa, k, v, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
        except _StopAtFused:
            pass
    if out is NotImplemented:
        raise CompatError("aten.scaled_dot_product_attention has no composite kernel (checked on torch 2.11, 2.13)")
    call = capture.call
    if call is not None and call.args.get("query") is qa:
        call.args["query"] = q
    return out, call


def sdpa_fused_backward(op: str, tensors: Dict[str, Any], scalars: Dict[str, Any]):
    """(dq, dk, dv) of the fused op ``op``'s own backward, its arguments taken by name from ``tensors``
    (grad_out, query, key, value, out, logsumexp, attn_bias, rng_0/rng_1: the forward's RNG state, cum_seq_q,
    cum_seq_k) and ``scalars`` (max_q, max_k, dropout_p, is_causal, scale); ``grad_input_mask`` (efficient):
    q, k, v, and not the bias (a mask that requires grad never takes this path)."""
    func = getattr(torch.ops.aten, SDPA_FUSED_OPS[op].backward).default
    given = dict(tensors, **scalars, grad_input_mask=[True, True, True, False])
    args, kwargs = [], {}
    for a in func._schema.arguments:
        key = _SDPA_BACKWARD_ALIASES.get(a.name, a.name)
        if key not in given:
            raise CompatError(f"{func} takes {a.name!r}, which its forward does not give (checked on torch 2.11, "
                              "2.13)")
        if a.kwarg_only:
            kwargs[a.name] = given[key]
        else:
            args.append(given[key])
    return tuple(func(*args, **kwargs)[:3])
