"""PyTorch's private APIs the package touches (SDPA's builtin, fused nodes and fused ops, tensor subclasses,
autograd internals, custom ops, context parallel, TorchScript, Dynamo, flex) and the libraries registered through
them (flash-attn's ops and FA4's interface, Transformers' attention registries). The table of touch-points with
the versions each was checked against is in the package docstring (``backends/compat/__init__.py``)."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Dict, Optional, Tuple

import torch

from .errors import CompatError

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


#: torch's reader of the saved-tensor hook stack: ``_top_saved_tensors_default_hooks(ignore_is_tracing)`` (torch
#: 2.8+; checked on 2.11, 2.13); None on an older torch, where ``saved_tensors_default_hooks_active`` answers True
_TOP_SAVED_TENSORS_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
#: ``torch._C._current_graph_task_id`` (what ``torch.utils.checkpoint`` reads; torch 2.1+, checked on 2.11, 2.13)
_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def saved_tensors_default_hooks_active() -> bool:
    """True inside ``torch.autograd.graph.saved_tensors_hooks`` (a non-reentrant checkpoint's forward and its
    recomputation, ``save_on_cpu``, ...): the stack of default pack/unpack hooks is not empty. On a torch without
    the reader, True (the caller then takes the path that is right with hooks too, only slower)."""
    if _TOP_SAVED_TENSORS_HOOKS is None:
        return True
    try:
        return _TOP_SAVED_TENSORS_HOOKS(False) is not None
    except TypeError:  # a torch whose reader takes no argument
        return _TOP_SAVED_TENSORS_HOOKS() is not None


def graph_task_id() -> int:
    """The id of the backward autograd's engine runs on this thread (a checkpoint's recomputation, reentrant or
    not, runs its forward there), -1 outside one (and always on a torch without the reader: every forward then
    counts as outside a backward, as before checkpoint recomputations were told apart)."""
    return -1 if _GRAPH_TASK_ID is None else _GRAPH_TASK_ID()


def delayed_error(message: str, outputs: tuple) -> tuple:
    """``outputs`` as aliases that require grad through a node raising ``RuntimeError(message)`` when a backward
    reaches it (``once_differentiable``'s mechanism); None entries stay None."""
    aliases = [None if t is None else t.detach().requires_grad_() for t in outputs]
    result = torch._C._functions.DelayedError(message, len(aliases))(*aliases)
    return result if isinstance(result, tuple) else (result,)


# ---- torch.library custom ops (flash-attn's backward ops) --------------------------------------------------
#: tags of the custom ops whose Python must run at every call (the compiled SDPA/flex hook files and reads the
#: call's plan there): ``torch.Tag.cudagraph_unsafe`` keeps them out of inductor's CUDA-graph partitions
#: (``torch.compile(mode="reduce-overhead")``; untagged, a partition returned the forward op's output tuple and
#: cudagraph trees asserted, H200 run 49). Empty where the tag does not exist. Checked: torch 2.11, 2.13.
CUDAGRAPH_UNSAFE_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


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


#: the names of PyTorch's ring attention (``torch.distributed.tensor.experimental._context_parallel._attention``,
#: torch 2.11 and 2.13: the same ring code, 2.13 gathers with ``all_gather_single`` where 2.11 has
#: ``all_gather_tensor``) that the corrected ring backward replaces or calls: the module global the three
#: ``_scaled_dot_product_ring_*_backward`` functions look up at call time, the rotaters, the per-step causal
#: behaviour and the load-balancing chunk update, the options
RING_BACKWARD = "_templated_ring_attention_backward"
RING_NAMES = (RING_BACKWARD, "_create_rotater", "_RotateMethod", "_AllGatherRotater", "_is_causal_behavior",
              "_CausalBehavior", "_partial_update", "_cp_options")


def context_parallel_attention_module():
    """PyTorch's ring-attention module (``_CP_MODULES[0]``), imported, with every name of ``RING_NAMES``; raises
    ``CompatError`` where it is missing or lacks one (checked on torch 2.11, 2.13)."""
    import importlib
    try:
        module = importlib.import_module(_CP_MODULES[0])
    except ImportError as exc:
        raise CompatError(f"{_CP_MODULES[0]} cannot be imported ({exc}; checked on torch 2.11, 2.13)") from exc
    missing = [name for name in RING_NAMES if not hasattr(module, name)]
    if missing:
        raise CompatError(f"{_CP_MODULES[0]} has no {', '.join(missing)} (checked on torch 2.11, 2.13)")
    return module


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


# ---- SDPA's fused ops as its own composite calls them (the compiled SDPA hook) -----------------------------
# Touch-points, checked against torch 2.13 (CPU: the flash-for-CPU op, tests/hooks/test_compiled_fused.py) and
# 2.11 (H200: flash, efficient, cuDNN; that file's CUDA tests): the kernel of ``aten.scaled_dot_product_attention``
# (``OpOverload.decompose``: the composite that chooses the backend, converts a boolean mask, pads head dims);
# ``torch.utils._python_dispatch.TorchDispatchMode`` (to see the fused op that composite calls); the aten ops
# ``_scaled_dot_product_{flash_attention, flash_attention_for_cpu, efficient_attention, cudnn_attention}`` (their
# argument names, the positions of their outputs) and their ``_backward`` ops (argument names).


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
