"""PyTorch's private APIs the package touches (the dispatcher seam's registration and redispatch, SDPA's fused
autograd nodes, autograd internals, custom ops, Dynamo, flex) and the libraries registered through them
(flash-attn's ops and FA4's interface, Transformers' attention registries). The table of touch-points with the
versions each was checked against is in the package docstring (``backends/compat/__init__.py``)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .errors import CompatError

#: the names ``compat`` re-exports (``compat.NAME``)
__all__ = ['SDPA_FLASH_BACKWARD', 'SDPA_EFFICIENT_BACKWARD', 'SDPA_CUDNN_BACKWARD', 'SDPA_CPU_FLASH_BACKWARD',
           'FLASH_BACKWARD', 'EFFICIENT_BACKWARD', 'VARLEN_BACKWARD', 'VARLEN_MODULE', 'below_autograd',
           'assume_constant_result', 'FLEX_SLICED_MASK_MOD', 'flex_identity_score_mod', 'FUSED_SDPA_NODES',
           'fused_sdpa_node', 'fused_sdpa_lse', 'op_overload', 'autograd_library', 'register_autograd_kernel',
           'destroy_library', 'redispatch_native', 'redispatch_reentrant', 'dispatches_itself', 'dispatch_mode_active',
           'current_autograd_node', 'is_compiled_graph_node', 'autograd_sequence_nr', 'node_sequence_nr', 'AUTOGRAD_THREAD_PREFIX', 'autograd_device_threads_started', 'enclosing_backward_node',
           'FUSED_NODE_FORMULAS',
           'fused_node_backward', 'functorch_transform_active', 'forward_ad_active', 'saved_tensors_hooks_enabled',
           'saved_tensors_default_hooks_active', 'graph_task_id', 'delayed_error', 'CUDAGRAPH_UNSAFE_TAGS',
           'custom_op_def', 'custom_op_kernel', 'set_custom_op_kernel', 'custom_op_fake', 'custom_op_signature_fn',
           'FA2_BACKWARD_OPS', 'FA3_BACKWARD_OPS', 'FA4_INTERFACE', 'FA4_BACKWARD', 'FA4_FORWARD',
           'fa4_interface', 'hf_registry_mapping', 'CP_ATTENTION_MODULE', 'RING_BACKWARD', 'RING_NAMES',
           'context_parallel_attention_module', 'dynamo_module_name']


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


# ---- the dispatcher seam: a Python kernel at an op's autograd key ---------------------------------------------
# ``torch.library.Library(ns, "IMPL").impl(name, fn, "AutogradCUDA", with_keyset=True)`` puts ``fn`` above
# PyTorch's own autograd kernel of the op for that backend (a concrete key beats the ``Autograd`` alias PyTorch
# registers at, so nothing is overridden and no warning is printed); destroying the library removes it. Checked:
# torch 2.13 (CPU: eager, aot_eager, inductor), 2.11 (H100/H200: the three CUDA SDPA backward ops).

def op_overload(qualname: str) -> Optional[Any]:
    """The ``.default`` overload of the op ``"namespace::name"``, or None where this torch has no such op (a custom
    op whose defining module is not imported yet, an op newer than the installed torch)."""
    namespace, _, name = qualname.partition("::")
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def autograd_library(namespace: str):
    """A ``torch.library.Library`` of the IMPL kind for ``namespace`` (the seam's registrations live in it)."""
    return torch.library.Library(namespace, "IMPL")


def register_autograd_kernel(lib, op, fn: Callable, key: str) -> None:
    """Register ``fn(keyset, *args, **kwargs)`` as ``op``'s kernel at the autograd dispatch key ``key``."""
    lib.impl(op._schema.name.partition("::")[2], fn, key, with_keyset=True)


def destroy_library(lib) -> None:
    """Remove every kernel ``lib`` registered (PyTorch's own kernels are in force again)."""
    lib._destroy()


#: the backward ops of PyTorch's fused attention kernels that the SDPA seam takes (their argument names are read
#: by schema name). Checked: torch 2.11, 2.13.
SDPA_FLASH_BACKWARD = "aten::_scaled_dot_product_flash_attention_backward"
SDPA_EFFICIENT_BACKWARD = "aten::_scaled_dot_product_efficient_attention_backward"
SDPA_CUDNN_BACKWARD = "aten::_scaled_dot_product_cudnn_attention_backward"
SDPA_CPU_FLASH_BACKWARD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"
FLASH_BACKWARD = "aten::_flash_attention_backward"
EFFICIENT_BACKWARD = "aten::_efficient_attention_backward"
#: ``torch.nn.attention.varlen.varlen_attn``'s backward custom op, defined when its module is imported
VARLEN_BACKWARD = "torch_attn::_varlen_attn_backward"
VARLEN_MODULE = "torch.nn.attention.varlen"


def below_autograd():
    """A context in which op calls skip the autograd keys (what PyTorch's autograd kernels redispatch under)."""
    return torch._C._AutoDispatchBelowAutograd()


#: the keys a redispatch from an autograd kernel continues with (PyTorch's generated autograd kernels use it)
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


def redispatch_native(op, keyset, args, kwargs):
    """What PyTorch's own autograd kernel of a non-differentiable op does: the kernels below autograd, with
    autograd excluded for every call they make (``AutoDispatchBelowAutograd``)."""
    with below_autograd():
        return op.redispatch(keyset & _AFTER_AUTOGRAD, *args, **kwargs)


def redispatch_reentrant(op, keyset, args, kwargs):
    """The kernels below autograd with autograd left on for the calls *they* make: a tensor subclass that runs
    the op on its inner plain tensors (DTensor's local calls, its context-parallel ring) reaches the seam again
    with each of those calls."""
    return op.redispatch(keyset & _AFTER_AUTOGRAD, *args, **kwargs)


def dispatches_itself(cls) -> bool:
    """True for a tensor subclass with its own ``__torch_dispatch__`` (DTensor, FakeTensor, ...): a wrapper whose
    values live elsewhere. A subclass without one (``nn.Parameter``, ``x.as_subclass(...)``) holds plain memory;
    ``torch.Tensor``'s own is ``torch._C._disabled_torch_dispatch_impl``."""
    return getattr(cls, "__torch_dispatch__", None) is not torch._C._disabled_torch_dispatch_impl


def dispatch_mode_active() -> bool:
    """True while a ``TorchDispatchMode`` is on the stack (FakeTensorMode, AOTAutograd's tracing modes, ...)."""
    return torch._C._len_torch_dispatch_stack() > 0


def current_autograd_node() -> Optional[Any]:
    """The autograd node whose backward is running on this thread (``torch._C._current_autograd_node``), or
    None outside one (a backward op called directly)."""
    return torch._C._current_autograd_node()


def is_compiled_graph_node(node) -> bool:
    """True when ``node`` is the backward of a ``torch.compile``d graph (AOTAutograd's
    ``CompiledFunctionBackward``): its aten ops run inside the compiled backward, which CUDA-graph trees may
    warm up and capture. Checked: torch 2.11, 2.13."""
    return node is not None and type(node).__name__ == "CompiledFunctionBackward"


def autograd_sequence_nr() -> int:
    """This thread's autograd sequence counter: the number the next node made on this thread will carry
    (``Node._sequence_nr()`` of the nodes made so far is below it)."""
    return torch._C._autograd._get_sequence_nr()


def node_sequence_nr(node) -> int:
    """``node._sequence_nr()``: the counter value of the thread that made it, when it was made."""
    return node._sequence_nr()


#: the name prefix of the autograd engine's device threads (``c10::setThreadName("pt_autograd_" + device)``),
#: started by the first backward that runs on a device. Checked: torch 2.11 (H100).
AUTOGRAD_THREAD_PREFIX = "pt_autograd_"


def autograd_device_threads_started() -> Optional[bool]:
    """Whether the autograd engine has started its device threads in this process (a CUDA backward has run),
    read from the thread names in ``/proc/self/task``; None where they cannot be read (not Linux)."""
    import os
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as f:
                if f.read().startswith(AUTOGRAD_THREAD_PREFIX):
                    return True
        except OSError:  # the thread ended while we looked
            continue
    return False


#: the file and function of the Python frame that runs an autograd Function's backward (``BackwardCFunction.apply``)
_FUNCTION_BACKWARD = ("torch/autograd/function.py", "apply")


def enclosing_backward_node() -> Optional[Any]:
    """The autograd node of an autograd Function whose backward is running on this thread's Python stack — the
    backward this one was started from, as a reentrant activation checkpoint starts one per block — or None when
    this backward is not nested in another. Checked: torch 2.11, 2.13 (``BackwardCFunction.apply(self, ...)``)."""
    import sys
    path, name = _FUNCTION_BACKWARD
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == name and code.co_filename.replace("\\", "/").endswith(path):
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


#: each fused SDPA node: its backward op and the saved fields its formula passes, in the op's argument order
#: (``torchgen/packaged/autograd/derivatives.yaml``; "grad" is the incoming gradient, "grad_input_mask" the
#: inputs that need one). Checked: torch 2.11, 2.13.
FUSED_NODE_FORMULAS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "ScaledDotProductFlashAttentionForCpuBackward0": (
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        ("grad", "query", "key", "value", "output", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale")),
    "ScaledDotProductFlashAttentionBackward0": (
        "aten::_scaled_dot_product_flash_attention_backward",
        ("grad", "query", "key", "value", "output", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
         "dropout_p", "is_causal", "rng_state", "unused", "scale")),
    "ScaledDotProductEfficientAttentionBackward0": (
        "aten::_scaled_dot_product_efficient_attention_backward",
        ("grad", "query", "key", "value", "attn_bias", "output", "log_sumexp", "philox_seed", "philox_offset",
         "dropout_p", "grad_input_mask", "is_causal", "scale")),
    "ScaledDotProductCudnnAttentionBackward0": (
        "aten::_scaled_dot_product_cudnn_attention_backward",
        ("grad", "query", "key", "value", "output", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
         "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale")),
}


def fused_node_backward(node, grad: torch.Tensor, grad_input_mask: Tuple[bool, ...]) -> Tuple[Any, tuple]:
    """(backward op, positional arguments) of the call the fused SDPA ``node`` makes for ``grad``: its formula's
    arguments read from the node's saved fields."""
    name = type(node).__name__
    if name not in FUSED_NODE_FORMULAS:
        raise CompatError(f"{name} is not a fused SDPA node this version knows (checked on torch 2.11, 2.13)")
    qualname, fields = FUSED_NODE_FORMULAS[name]
    args = []
    for f in fields:
        if f == "grad":
            args.append(grad)
        elif f == "grad_input_mask":
            args.append(list(grad_input_mask))
        else:
            attr = "_saved_" + f
            if not hasattr(node, attr):
                raise CompatError(f"{name} has no {attr}: PyTorch changed the node's saved fields")
            args.append(getattr(node, attr))
    return op_overload(qualname), tuple(args)


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
#: tags of the custom ops whose Python must run at every call (the compiled flex hook files and reads the call's
#: plan there): ``torch.Tag.cudagraph_unsafe`` keeps them out of inductor's CUDA-graph partitions
#: (``torch.compile(mode="reduce-overhead")``; untagged, a partition returned the forward op's output tuple and
#: cudagraph trees asserted). Empty where the tag does not exist. Checked: torch 2.11, 2.13.
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
#: FA2's backward ops (dense, varlen) and FA3's (one op for both): the schemas of flash-attention's
#: ``flash_attn/flash_attn_interface.py`` (2.7-2.8) and ``hopper/flash_attn_interface.py``. The ``flashattn``
#: namespace appears in no Dao-AILab release source (checked to 2026-12); it is taken where a build defines it
FA2_BACKWARD_OPS = ("flash_attn::_flash_attn_backward", "flash_attn::_flash_attn_varlen_backward",
                    "flashattn::_flash_attn_backward", "flashattn::_flash_attn_varlen_backward")
FA3_BACKWARD_OPS = ("flash_attn_3::_flash_attn_backward",)
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


# ---- context parallel: PyTorch's ring attention ------------------------------------------------------------
#: PyTorch's ring-attention module (torch 2.11 and 2.13: the same ring code; 2.13 gathers with
#: ``all_gather_single`` where 2.11 has ``all_gather_tensor``)
CP_ATTENTION_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"
#: the names of that module that the corrected ring backward replaces or calls: the module global the three
#: ``_scaled_dot_product_ring_*_backward`` functions look up at call time, the rotaters, the per-step causal
#: behaviour and the load-balancing chunk update, the options
RING_BACKWARD = "_templated_ring_attention_backward"
RING_NAMES = (RING_BACKWARD, "_create_rotater", "_RotateMethod", "_AllGatherRotater", "_is_causal_behavior",
              "_CausalBehavior", "_partial_update", "_cp_options")


def context_parallel_attention_module():
    """PyTorch's ring-attention module (``CP_ATTENTION_MODULE``), imported, with every name of ``RING_NAMES``;
    raises ``CompatError`` where it is missing or lacks one (checked on torch 2.11, 2.13)."""
    import importlib
    try:
        module = importlib.import_module(CP_ATTENTION_MODULE)
    except ImportError as exc:
        raise CompatError(f"{CP_ATTENTION_MODULE} cannot be imported ({exc}; checked on torch 2.11, 2.13)") from exc
    missing = [name for name in RING_NAMES if not hasattr(module, name)]
    if missing:
        raise CompatError(f"{CP_ATTENTION_MODULE} has no {', '.join(missing)} (checked on torch 2.11, 2.13)")
    return module


# ---- Dynamo -------------------------------------------------------------------------------------------------
def dynamo_module_name() -> str:
    """The name of the module ``torch.compile`` imports first (``torch._dynamo``): a hook that must be in place
    before any compiled region traces it waits for this import, not for ``torch`` (Dynamo costs ~1.3 s)."""
    return "torch._dynamo"


