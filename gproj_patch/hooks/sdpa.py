"""Hook: SDPA's corrected backward as the autograd-level kernel of its fused backward ops (the dispatcher seam).

Why this level. Whoever calls SDPA's fused kernels — ``F.scaled_dot_product_attention`` however it was bound (a
module global, a default argument, ``torch._C._nn``), ``nn.MultiheadAttention``, a compiled graph (AOTAutograd's
backward graph calls the aten backward op when it runs), ``torch.nn.attention.varlen.varlen_attn`` (its backward
custom op), a DTensor's local calls — reaches the backward through one of a few ops (``SEAM_OPS``). ``install()``
registers a Python kernel for each at the ``AutogradCUDA`` / ``AutogradCPU`` key (``torch.library``,
``with_keyset=True``; above PyTorch's own autograd kernel, which is an alias-key registration, so nothing is
overridden); ``uninstall()`` destroys the library and PyTorch's kernels are in force again. The forward is
untouched: no Python of this package runs in an SDPA forward, so the output, the errors, the backend choice and
the compile behaviour (one graph, no recompile) are PyTorch's own.

One decision per call, here. The kernel receives everything a corrected backward needs — dO, q, k, v, the
output, the LSE, the causal flag, the scale, the mask's bias, dropout — so it makes the call's record and plan
(``dispatch/plan.py``: tier, kernel launches, the ``auto`` policy's sample on q, k and the LSE) and the router
carries them out. A plan of ``"original"`` redispatches below autograd to PyTorch's kernel (no recursion: the
redispatch continues past this key). What it cannot correct exactly it passes through untouched, reason counted
(``pass_reason``): dropout > 0, a bias that needs a gradient, nested tensors, ...

Tracing. AOTAutograd calls the kernel while it traces a compiled backward (FakeTensor / FunctionalTensor
arguments, a dispatch mode on the stack): there it only redispatches, so the graph records the aten op, which
reaches this kernel again with real tensors each time the compiled backward runs.

Tensor subclasses. A DTensor (or any wrapper subclass) is redispatched past autograd without excluding autograd
from the calls its ``__torch_dispatch__`` makes (``compat.redispatch_reentrant``): its local calls on plain
tensors — tensor parallelism's local heads, context parallelism's ring per KV shard — reach this kernel
themselves, each as the attention problem it is. A ring's per-shard call (merged LSE: its keys are a shard of
the row) is corrected by the kernels only where the rows are whole; shard rows are left unprojected and counted
(``stats()["partial_rows"]``).

cuDNN's cached plan. PyTorch's cuDNN SDPA backward (torch 2.11, cuDNN 9.19) caches its execution plan per
thread, keyed on q/k/v sizes and strides (and the bias's, dropout, causal) but not on dO's, while the plan is
built with the first call's dO strides (a dO whose innermost stride is 1 is passed as it is): a later call of the
same key with another dO layout reads dO wrongly, silently (upstream). Every cuDNN backward the seam passes on
gets dO in the output's layout (``_output_layout``; the forward allocates the output from q's layout, so one
layout per key), so every plan the seam builds has it. A key whose plan may predate the seam — a CUDA backward had
run before ``install()`` — is never handed to cuDNN: its calls take the corrected tier, whatever the mode.

Without the seam. ``sdpa()`` is SDPA with the corrected backward whether or not the patch is enabled:
``gproj_patch.attention`` and HF's ``"gproj"`` attention call it. With the seam installed the call *is*
``F.scaled_dot_product_attention`` and the seam corrects its backward. Otherwise ``_Attention`` runs SDPA on
detached aliases that require grad (PyTorch picks and runs its own fused kernel: the same output bits) and, in its
backward, gives the fused node's own backward call — the op and the arguments autograd would pass it
(``compat.fused_node_backward``) — to the seam's ``corrected``: the same decision, made in one place, which is
why this autograd Function lives in the seam's module. PyTorch's backward ("original") is that op run below
autograd. The gradients reach the caller's tensors through whatever SDPA did before its fused op (autocast's
cast, a head-dim pad): the node's saved inputs keep their graph back to the aliases.
"""
from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends import compat
from ..backends.spec import LOW_PRECISION, default_scale
from ..dispatch.autograd import (SECOND_ORDER_ERROR, has_backward, inner_saved_tensors_hooks, once_differentiable,
                                 transform_reason)
from ..dispatch.plan import ForwardTensors, make_plan, settled_original
from ..dispatch.record import CallRecord, Problem, make_context
from ..dispatch.router import BackwardTensors, run_backward, run_settled_original
from ..layers.scope import backward_op_layer, layer_scope
from ..dispatch.masks import mask_as_flags, packed_call, padding_as_flags, padding_as_varlen, unpack_grads
from ..runtime import config as _config
from ..runtime import telemetry

logger = logging.getLogger("gproj_patch")

SOURCE = "sdpa"
_PLAIN = (torch.Tensor, torch.nn.Parameter)


# ------------------------------------------------------------------------------------------------------------
# One backward op call, in the backends' shared layout

@dataclass(frozen=True, eq=False)
class SeamCall:
    """One backward op call in the shared layout (``backends/spec.py``: (B, H, S, D) views, any strides;
    varlen as B = 1 over the packed axis), with what it asks of the backward."""
    do: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor
    scale: float
    causal: bool
    align: str                       # causal alignment: "top_left" (SDPA's) or "bottom_right" (flash's)
    window: Tuple[int, int]          # (left, right) around the diagonal, -1 unbounded
    mask: Optional[Tensor]           # boolean (True: attend) or additive bias, broadcast to (B, H, Sq, Sk)
    dropout_p: float
    bias_grad: bool                  # the bias needs a gradient (the efficient op's fourth output)
    layout: str = "bhsd"             # the op's own: "bhsd" (SDPA's), "bshd" (flash's, efficient's), "thd" (varlen)
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    max_q: Optional[int] = None
    max_k: Optional[int] = None


def _bshd(t: Tensor) -> Tensor:
    return t.transpose(1, 2)


def _thd(t: Tensor) -> Tensor:
    return t.unsqueeze(0).transpose(1, 2)


def _from_thd(t: Tensor) -> Tensor:
    return t.transpose(1, 2).squeeze(0)


#: each op layout's view as the shared (B, H, S, D) one, and back (views both ways: no copy)
TO_SHARED = {"bhsd": lambda t: t, "bshd": _bshd, "thd": _thd}
FROM_SHARED = {"bhsd": lambda t: t, "bshd": _bshd, "thd": _from_thd}


def _window(left, right) -> Tuple[int, int]:
    return (-1 if left is None else int(left), -1 if right is None else int(right))


def _read_sdpa(b: Dict[str, Any], align: str, grad: str = "grad_out", bias: Optional[str] = None,
               mask: Optional[str] = None) -> SeamCall:
    """The SDPA-level ops: (B, H, S, D) already; ``bias`` / ``mask`` name the mask argument. ``bias_grad``: the
    efficient op's ``grad_input_mask`` asks for the bias's gradient — also when there is no bias, which
    PyTorch's kernel rejects (the call then goes to it, and raises as it would unpatched)."""
    q = b["query"]
    m = b.get(bias) if bias else b.get(mask) if mask else None
    gim = b.get("grad_input_mask")
    return SeamCall(do=b[grad], q=q, k=b["key"], v=b["value"], out=b["out"], lse=b["logsumexp"],
                    scale=default_scale(q.shape[-1], b.get("scale")), causal=bool(b["is_causal"]), align=align,
                    window=(-1, -1), mask=m, dropout_p=float(b["dropout_p"]),
                    bias_grad=bool(gim[3]) if gim is not None else False)


def _read_flash(b: Dict[str, Any], lse: str = "logsumexp", window: Optional[Tuple[int, int]] = None) -> SeamCall:
    """flash's own layout: (B, S, H, D), or (total, H, D) with ``cum_seq_q/k`` (varlen); causal is bottom-right
    (per sequence), the window ``(left, right)``."""
    varlen = b.get("cum_seq_q") is not None
    view = _thd if varlen else _bshd
    q = b["query"]
    if window is None:
        window = _window(b.get("window_size_left"), b.get("window_size_right"))
    return SeamCall(do=view(b["grad_out"]), q=view(q), k=view(b["key"]), v=view(b["value"]), out=view(b["out"]),
                    lse=b[lse], scale=default_scale(q.shape[-1], b.get("scale")), causal=bool(b["is_causal"]),
                    align="bottom_right", window=window, mask=None, dropout_p=float(b.get("dropout_p", 0.0)),
                    bias_grad=False, layout="thd" if varlen else "bshd", cu_seqlens_q=b.get("cum_seq_q"),
                    cu_seqlens_k=b.get("cum_seq_k"),
                    max_q=int(b["max_q"]) if varlen else None, max_k=int(b["max_k"]) if varlen else None)


def _read_varlen(b: Dict[str, Any]) -> SeamCall:
    """``torch_attn::_varlen_attn_backward``: flash's varlen op under PyTorch's own names (lse, cu_seq_*)."""
    w = b.get("window_size") or (-1, -1)
    b = dict(b, cum_seq_q=b["cu_seq_q"], cum_seq_k=b["cu_seq_k"])
    return _read_flash(b, lse="lse", window=_window(w[0], w[1]))


def _read_efficient(b: Dict[str, Any]) -> SeamCall:
    """``aten::_efficient_attention_backward``: (B, S, H, D); causal from ``custom_mask_type`` (0 none, 1 top-left,
    2 bottom-right); no varlen, window or shared gradient storage here (``_efficient_reason``)."""
    q = b["query"]
    kind = int(b["custom_mask_type"])
    return SeamCall(do=_bshd(b["grad_out_"]), q=_bshd(q), k=_bshd(b["key"]), v=_bshd(b["value"]),
                    out=_bshd(b["out"]), lse=b["logsumexp"], scale=default_scale(q.shape[-1], b.get("scale")),
                    causal=kind in (1, 2), align="bottom_right" if kind == 2 else "top_left", window=(-1, -1),
                    mask=b.get("bias"), dropout_p=float(b["dropout_p"]), bias_grad=bool(b["bias_requires_grad"]),
                    layout="bshd")


def _efficient_reason(b: Dict[str, Any]) -> Optional[str]:
    if b.get("cu_seqlens_q") is not None or b.get("window_size") is not None:
        return "the efficient op with cu_seqlens or window_size"
    if b.get("shared_storage_dqdkdv"):
        return "the efficient op with shared gradient storage"
    if int(b["custom_mask_type"]) not in (0, 1, 2):
        return f"the efficient op with custom_mask_type={b['custom_mask_type']}"
    return None


def _nested_reason(b: Dict[str, Any]) -> Optional[str]:
    """SDPA's flash and cuDNN ops carry sequence offsets only for nested tensors."""
    if b.get("cum_seq_q") is not None or b.get("cum_seq_k") is not None:
        return "nested tensors (sequence offsets)"
    return None


# ------------------------------------------------------------------------------------------------------------
# The ops

def _like(t: Tensor) -> Tuple[int, ...]:
    """The strides ``torch.empty_like(t)`` gives (t's own for a contiguous tensor, the common case, without
    allocating)."""
    if t.is_contiguous():
        return t.stride()
    return torch.empty_like(t).stride()


def _bshd_like(t: Tensor) -> Tuple[int, ...]:
    """The strides of ``torch.empty_permuted(t.shape, (0, 2, 1, 3))``: (B, S, H, D) order in memory."""
    B, H, S, D = t.shape
    return (S * H * D, D, H * D, 1)


@dataclass(frozen=True)
class SeamOp:
    """One backward op the seam takes: where, how its arguments read (``read`` → ``SeamCall``; ``reason`` says
    why a call is not taken), and how its outputs are laid out — the strides of the op's meta kernel, which a
    compiled graph relies on (``alloc``), in the op's own dimension order (``restore``), and its arity."""
    qualname: str
    keys: Tuple[str, ...]
    read: Callable[[Dict[str, Any]], SeamCall]
    reason: Callable[[Dict[str, Any]], Optional[str]] = lambda b: None
    alloc: Callable[[Tensor], Tuple[int, ...]] = _like  # the strides of the meta kernel's gradient of an input
    extra: Callable[[Dict[str, Any]], tuple] = lambda b: ()  # outputs after (dq, dk, dv)
    cudnn: bool = False


def _no_bias_grad(b: Dict[str, Any]) -> tuple:
    return (None,)


def _empty_bias_grad(b: Dict[str, Any]) -> tuple:
    return (torch.empty((), device=b["query"].device),)


_CUDA, _CPU = ("AutogradCUDA",), ("AutogradCPU",)

#: every op the seam takes. ``_cudnn_attention_backward`` is not among them: in the releases checked its
#: only caller is ``varlen_attn`` with cuDNN, which torch 2.11 never picks (``_should_use_cudnn`` is False), and
#: its layout for dense calls is undocumented; a direct autograd call of ``_cudnn_attention_forward`` keeps
#: PyTorch's backward.
SEAM_OPS: Tuple[SeamOp, ...] = (
    SeamOp(compat.SDPA_FLASH_BACKWARD, _CUDA,
           read=lambda b: _read_sdpa(b, align="bottom_right"), reason=_nested_reason),
    SeamOp(compat.SDPA_EFFICIENT_BACKWARD, _CUDA,
           read=lambda b: _read_sdpa(b, align="top_left", grad="grad_out_", bias="attn_bias"),
           alloc=_bshd_like, extra=_no_bias_grad),
    SeamOp(compat.SDPA_CUDNN_BACKWARD, _CUDA,
           read=lambda b: _read_sdpa(b, align="top_left", bias="attn_bias"), reason=_nested_reason, cudnn=True),
    SeamOp(compat.SDPA_CPU_FLASH_BACKWARD, _CPU,
           read=lambda b: _read_sdpa(b, align="top_left", mask="attn_mask"), alloc=_bshd_like),
    SeamOp(compat.FLASH_BACKWARD, _CUDA, read=_read_flash),
    SeamOp(compat.EFFICIENT_BACKWARD, _CUDA, read=_read_efficient, reason=_efficient_reason,
           extra=_empty_bias_grad),
    SeamOp(compat.VARLEN_BACKWARD, _CUDA, read=_read_varlen),
)


@functools.lru_cache(maxsize=32)  # bounded: one entry per op overload the seam takes
def _schema(op) -> Tuple[Tuple[str, ...], Dict[str, Any]]:
    """(argument names, defaults) of an op's schema, read once (host time: every backward binds its call)."""
    arguments = op._schema.arguments
    return tuple(a.name for a in arguments), {a.name: a.default_value for a in arguments if a.has_default_value()}


def bind(op, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """The call's arguments by schema name, defaults filled in."""
    names, defaults = _schema(op)
    bound = dict(defaults)
    bound.update(zip(names, args))
    if kwargs:
        bound.update(kwargs)
    return bound


def _restore(spec: SeamOp, b: Dict[str, Any], call: SeamCall, grads) -> tuple:
    """(dq, dk, dv[, extra]) of the shared layout as the op returns them: its dimension order, its meta kernel's
    strides (a compiled graph reads them so; copied only where they differ), its dtype, its arity."""
    back = FROM_SHARED[call.layout]
    out = []
    for g, like in zip(grads[:3], (b["query"], b["key"], b["value"])):
        g = back(g)
        strides = spec.alloc(like)
        if g.stride() != strides or g.dtype != like.dtype:
            g = torch.empty_strided(like.shape, strides, dtype=like.dtype, device=like.device).copy_(g)
        out.append(g)
    return tuple(out) + spec.extra(b)


# ------------------------------------------------------------------------------------------------------------
# Why a call passes through

def pass_reason(call: SeamCall) -> Optional[str]:
    """Why this backward keeps PyTorch's (None: it is corrected). Checked in this order, each right before the
    pass-through it causes."""
    q, k, v = call.q, call.k, call.v
    if call.dropout_p > 0.0:
        return "dropout > 0 (the fused kernel's dropout mask cannot be replayed by another backward)"
    if call.bias_grad:
        return "attn_mask requires grad"
    if q.is_nested or k.is_nested or v.is_nested:
        return "nested tensors"
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return "empty input"
    qs, ks, vs = q.shape, k.shape, v.shape
    if ks[:3] != vs[:3] or qs[3] != ks[3] or qs[0] != ks[0] or qs[1] % ks[1] != 0:
        # PyTorch's kernels do not all check this; their own backward is what the caller gets without the patch
        return "q, k, v disagree in batch, heads, key count or head dim (PyTorch's kernel decides)"
    if not (q.dtype == k.dtype == v.dtype == call.do.dtype):
        return "q, k, v differ in dtype (PyTorch's kernel decides)"
    if q.is_cuda and torch.are_deterministic_algorithms_enabled():
        return ("torch.use_deterministic_algorithms is on: the original runs its own determinism check (PyTorch's "
                "fused backwards warn or raise there)")
    if call.mask is not None and call.causal:
        return "attn_mask together with is_causal (the original decides what that means)"
    return None


def _mask_problem(call: SeamCall) -> Tuple[Optional[Tensor], bool, str, Tuple[int, int]]:
    """(mask, causal, align, window): a boolean mask, or an additive bias that is one (only 0 and -inf: what
    SDPA makes of a boolean mask), that is exactly a causal / window pattern becomes flags; any other bias
    stays a tensor (the FP32 tier adds it to the scores)."""
    if call.mask is None:
        return None, call.causal, call.align, call.window
    mask = call.mask
    sq, sk = call.q.shape[2], call.k.shape[2]
    if mask.dtype == torch.bool:
        return mask_as_flags(mask, sq, sk)
    # an additive bias that is a boolean mask: 0 where visible; where hidden -inf (SDPA's conversion for its flash,
    # efficient and CPU ops), -65504 (its conversion for the cuDNN op, which took no -inf) or lower (code that
    # builds its mask with the dtype's lowest value). exp of such a logit is 0 in fp32 next to any visible score,
    # so it is taken as a boolean mask where that is exact: a -inf bias always; a finite one only as causal /
    # window flags, whose rows all see a key (a row a finite bias hides entirely gets uniform weights, not none)
    hidden = mask <= CUDNN_MASK_VALUE
    if not bool(((mask == 0) | hidden).all()):
        return mask, False, "top_left", (-1, -1)
    flags = mask_as_flags(~hidden, sq, sk)
    if flags[0] is None or bool((mask == float("-inf")).eq(hidden).all()):
        return flags
    return mask, False, "top_left", (-1, -1)


#: the additive value SDPA's conversion of a boolean mask gives hidden positions for the cuDNN op (torch 2.11:
#: ``convert_boolean_attn_mask_cudnn``; the other ops get -inf)
CUDNN_MASK_VALUE = -65504.0


def _problem(call: SeamCall) -> Problem:
    mask, causal, align, window = _mask_problem(call)
    if mask is None and call.cu_seqlens_q is None and type(call.scale) is float:
        return _flags_problem(call.scale, causal, align, tuple(window))
    return Problem(scale=call.scale, causal=causal, causal_align=align, window=window, attn_mask=mask,
                   padded=mask is not None and mask.dtype == torch.bool, cu_seqlens_q=call.cu_seqlens_q,
                   cu_seqlens_k=call.cu_seqlens_k, max_seqlen_q=call.max_q, max_seqlen_k=call.max_k)


@functools.lru_cache(maxsize=256)  # bounded: one entry per (scale, flags) in use
def _flags_problem(scale: float, causal: bool, align: str, window: Tuple[int, int]) -> Problem:
    """The problem of a call without a mask tensor or varlen offsets, one frozen instance per (scale, flags)
    (pure: immutable key and value, no tensor): calls share it instead of building 14 fields each time."""
    return Problem(scale=scale, causal=causal, causal_align=align, window=window)


# ------------------------------------------------------------------------------------------------------------
# The corrected backward

def corrected(spec: SeamOp, b: Dict[str, Any], original: Callable[[], tuple], cfg: _config.Config,
              node=None, has_original: bool = True, source: str = SOURCE) -> tuple:
    """The op's outputs for the call ``b`` (arguments by schema name): planned and run here, once. ``original()``
    computes PyTorch's backward (the op's outputs as they are); ``has_original=False``: the plan must not choose
    it (the corrected tier instead); ``node`` is the autograd node being run (its forward's layer name), None for
    a direct call."""
    reason = spec.reason(b)
    call = None
    if reason is None:
        call = spec.read(b)
        if call.q.dtype not in LOW_PRECISION:  # FP32/FP64 inputs: nothing to repair, nothing to report
            return original()
        reason = pass_reason(call)
    if reason is not None:
        q = call.q if call is not None else b["query"]
        telemetry.record_pass_through(f"{source}: {reason}", telemetry.shape_class(source, q, None))
        return original()
    layer = backward_op_layer(node)
    if settled_original(cfg, layer, has_original):  # auto, a healthy layer between samples: no record, no plan
        return run_settled_original(layer, original)
    context = make_context(source, layer, cfg, named=True, in_graph=compat.is_compiled_graph_node(node))
    record = make_plan(CallRecord(_problem(call), context),
                       ForwardTensors(call.q, call.k, call.v, call.out, call.lse), has_original=has_original)
    to_shared = TO_SHARED[call.layout]
    ran = []

    def pytorchs():
        ran.append(original())
        return tuple(to_shared(g) for g in ran[0][:3])
    grads = _run(record, call, pytorchs)
    return ran[0] if ran else _restore(spec, b, call, grads)  # PyTorch's own outputs as they are


def _run(record: CallRecord, call: SeamCall, original: Callable[[], tuple]) -> tuple:
    """The plan carried out; a boolean mask that dO makes right/left padding runs as flags / varlen (exact)."""
    problem = record.problem
    do, q, k, v, out, lse = call.do, call.q, call.k, call.v, call.out, call.lse
    if problem.padded:
        flags = padding_as_flags(problem.attn_mask, do, q.shape[2], k.shape[2])
        if flags is not None:
            window, dead = flags
            problem = Problem(scale=problem.scale, causal=True, causal_align="top_left", window=window)
            return run_backward(CallRecord(problem, record.context, record.plan),
                                BackwardTensors(do, q, k, v, out, lse, dead_rows=dead), original)
        pad = padding_as_varlen(problem.attn_mask, do, q.shape[2], k.shape[2], empty_rows_inert=True)
        if pad is not None:
            tensors, packed = packed_call(pad, problem, do=do, q=q, k=k, v=v, out=out, lse=lse)
            packed_original = lambda: tuple(pad.pack(g) for g in original())  # noqa: E731
            return unpack_grads(pad, run_backward(CallRecord(packed, record.context, record.plan), tensors,
                                                  packed_original))
        record = CallRecord(problem, record.context, record.plan.dense)  # the mask stays a dense tensor
    return run_backward(record, BackwardTensors(do, q, k, v, out, lse), original)


# ------------------------------------------------------------------------------------------------------------
# cuDNN's plan cache (module docstring)

@dataclass
class _CudnnKeys:
    """The cuDNN backward keys whose plan the seam built (dO in the output's layout), and whether cuDNN could
    have built plans before the seam was installed (then other keys take the corrected tier)."""
    ours: set = field(default_factory=set)
    unknown_before: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def _cudnn_key(b: Dict[str, Any]) -> tuple:
    """What PyTorch's cuDNN MHA plan cache keys a backward on (``MHAParams``): device, dtype, q/k/v sizes and
    strides, the bias's, dropout, causal."""
    q, k, v, bias = b["query"], b["key"], b["value"], b.get("attn_bias")
    return (q.device.index, q.dtype, tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), tuple(v.shape),
            v.stride(), None if bias is None else (tuple(bias.shape), bias.stride()), float(b["dropout_p"]),
            bool(b["is_causal"]))


def _output_layout(do: Tensor, out: Tensor) -> Tensor:
    """dO with the strides of the output (a copy only where they differ), as cuDNN's own code makes a dO whose
    innermost stride is not 1."""
    if do.stride() == out.stride():
        return do
    order = sorted(range(out.dim()), key=lambda d: -out.stride(d))
    inverse = [order.index(d) for d in range(out.dim())]
    return do.permute(order).contiguous().permute(inverse)


# ------------------------------------------------------------------------------------------------------------
# The kernel at the autograd key

def spec_of(op) -> SeamOp:
    """The ``SeamOp`` of an op overload."""
    name = op._schema.name
    for spec in SEAM_OPS:
        if spec.qualname == name:
            return spec
    raise KeyError(f"{name} is not an op of the SDPA seam")


def _kernel(spec: SeamOp, op) -> Callable:
    def kernel(keyset, *args, **kwargs):
        return _backward(spec, op, keyset, args, kwargs)
    kernel.__name__ = f"gproj_{spec.qualname.partition('::')[2]}"
    return kernel


def _backward(spec: SeamOp, op, keyset, args: tuple, kwargs: dict):
    cfg = _config.active()
    if cfg is None or cfg.mode == "off" or compat.dispatch_mode_active() or _PASSING.depth:
        # off; traced (AOTAutograd, FakeTensorMode, ...); or a call made while the seam passes a torch.func
        # call through (functorch re-runs the op on the level below): exactly PyTorch's kernel
        return compat.redispatch_native(op, keyset, args, kwargs)
    if compat.functorch_transform_active():
        # a torch.func transform (grad, vjp, vmap, ...): its wrapped tensors and higher-order autograd are
        # PyTorch's business; the op it re-dispatches on the level below is part of this call
        _PASSING.depth += 1
        try:
            return compat.redispatch_native(op, keyset, args, kwargs)
        finally:
            _PASSING.depth -= 1
    tensors = [a for a in args if isinstance(a, Tensor)]
    if kwargs:
        tensors += [a for a in kwargs.values() if isinstance(a, Tensor)]
    if any(type(t) not in _PLAIN and compat.dispatches_itself(type(t)) for t in tensors):
        if any(_is_tracing(t) for t in tensors):
            return compat.redispatch_native(op, keyset, args, kwargs)
        return compat.redispatch_reentrant(op, keyset, args, kwargs)  # DTensor: its local calls come back here
    b = bind(op, args, kwargs)
    key = None  # the call's cuDNN plan key, read only where a cuDNN backward may predate the seam
    if spec.cudnn:
        key = _cudnn_key(b) if CUDNN_KEYS.unknown_before else None
        original = lambda: _cudnn_original(op, keyset, args, kwargs, b, key)  # noqa: E731
    else:
        original = lambda: compat.redispatch_native(op, keyset, args, kwargs)  # noqa: E731
    known = not spec.cudnn or _cudnn_plan_known(key)
    with torch.no_grad():
        outputs = corrected(spec, b, original, cfg, compat.current_autograd_node(), has_original=known)
    if has_backward(*tensors):
        # create_graph=True: PyTorch's kernel of this op is not differentiable either; its gradients raise when
        # a second backward reaches them (a clear error, not a silently missing term)
        return tuple(compat.delayed_error(SECOND_ORDER_ERROR, tuple(outputs)))
    return outputs


class _Passing(threading.local):
    """Per thread: how deep the seam is in passing a torch.func call through (its nested calls pass too)."""
    depth = 0


_PASSING = _Passing()


def _is_tracing(t: Tensor) -> bool:
    """FakeTensor, FunctionalTensor and the other tracing wrappers (no values to correct)."""
    name = type(t).__name__
    return name in ("FakeTensor", "FunctionalTensor") or t.device.type == "meta"


def _cudnn_original(op, keyset, args: tuple, kwargs: dict, b: Dict[str, Any], key: Optional[tuple]):
    """PyTorch's cuDNN backward with dO in the output's layout (module docstring); ``key``: the call's plan key,
    None where no cuDNN backward predates the seam (then the keys the seam built are never asked for)."""
    if key is not None:
        with CUDNN_KEYS.lock:
            CUDNN_KEYS.ours.add(key)  # a plan this call builds has dO in the output's layout
    do = _output_layout(b["grad_out"], b["out"])
    if do is b["grad_out"]:  # already so (the common case): the call as it came
        return compat.redispatch_native(op, keyset, args, kwargs)
    b = dict(b, grad_out=do)
    positional, keyword = _arg_split(op)
    return compat.redispatch_native(op, keyset, tuple(b[n] for n in positional), {n: b[n] for n in keyword})


@functools.lru_cache(maxsize=32)  # bounded: one entry per op overload the seam takes
def _arg_split(op) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """The op's argument names: (positional, keyword-only), in schema order."""
    args = op._schema.arguments
    return tuple(a.name for a in args if not a.kwarg_only), tuple(a.name for a in args if a.kwarg_only)


def _cudnn_plan_known(key: Optional[tuple]) -> bool:
    """Whether cuDNN's cached plan for a call's ``key`` has dO in the output's layout: no cuDNN backward can have
    run before the seam was installed (``key`` None), or the seam built it."""
    if key is None:
        return True
    with CUDNN_KEYS.lock:
        return key in CUDNN_KEYS.ours


CUDNN_KEYS = _CudnnKeys()


# ------------------------------------------------------------------------------------------------------------
# install / uninstall

@dataclass
class InstalledSeam:
    """What ``install()`` registered (hook bookkeeping: ``reset()`` leaves it alone). One instance."""
    libraries: List[Any] = field(default_factory=list)
    ops: List[str] = field(default_factory=list)
    pending: Any = None  # the import hook waiting for torch.nn.attention.varlen (its custom op)


INSTALLED = InstalledSeam()


def _register(specs) -> List[str]:
    """Register the seam's kernel for every op of ``specs`` this torch has; returns their names."""
    done = []
    by_namespace: Dict[str, Any] = {}
    for spec in specs:
        op = compat.op_overload(spec.qualname)
        if op is None:
            continue
        namespace = spec.qualname.partition("::")[0]
        lib = by_namespace.get(namespace)
        if lib is None:
            lib = by_namespace[namespace] = compat.autograd_library(namespace)
            INSTALLED.libraries.append(lib)
        for key in spec.keys:
            compat.register_autograd_kernel(lib, op, _kernel(spec, op), key)
        done.append(spec.qualname)
    INSTALLED.ops.extend(done)
    return done


def _cuda_backward_may_have_run() -> bool:
    """Whether a cuDNN backward can have run in this process already: CUDA is initialized and the autograd
    engine's device threads exist (a CUDA backward started them), or their names cannot be read. (A cuDNN
    backward op called directly on a user thread, outside autograd, before ``enable()`` is not seen.)"""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    return compat.autograd_device_threads_started() is not False


def install() -> str:
    if INSTALLED.libraries or INSTALLED.pending is not None:
        return "installed"
    CUDNN_KEYS.unknown_before = _cuda_backward_may_have_run()
    CUDNN_KEYS.ours.clear()
    custom = tuple(s for s in SEAM_OPS if not s.qualname.startswith("aten::"))
    _register(tuple(s for s in SEAM_OPS if s.qualname.startswith("aten::")))
    from ..runtime.import_hooks import call_after_import, imported
    if imported(compat.VARLEN_MODULE):
        _register(custom)
    else:  # its custom op exists once its module is imported (torchtitan imports it when it builds the model)
        INSTALLED.pending = call_after_import(compat.VARLEN_MODULE, lambda: _register_pending(custom))
    return "installed"


def _register_pending(specs) -> None:
    INSTALLED.pending = None
    _register(specs)


def uninstall() -> None:
    if INSTALLED.pending is not None:
        INSTALLED.pending.cancel()
        INSTALLED.pending = None
    while INSTALLED.libraries:
        compat.destroy_library(INSTALLED.libraries.pop())
    INSTALLED.ops.clear()


def is_installed() -> bool:
    return bool(INSTALLED.libraries)


def seam_ops() -> List[str]:
    """The ops the seam is registered on now."""
    return list(INSTALLED.ops)


# ------------------------------------------------------------------------------------------------------------
# SDPA without the seam: gproj_patch.attention and HF's "gproj" attention (module docstring)

MATH_BACKEND = "SDPA chose no fused op (math backend): its backward is PyTorch's composite"


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, call):
        dropout_p, is_causal, scale, enable_gqa, cfg, source = call
        with torch.enable_grad(), inner_saved_tensors_hooks():
            aliases = tuple(t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
            inner = F.scaled_dot_product_attention(*aliases, attn_mask=attn_mask, dropout_p=dropout_p,
                                                   is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        ctx.inner = (inner, aliases, compat.fused_sdpa_node(inner.grad_fn))
        ctx.cfg, ctx.source = cfg, source
        return inner.detach()

    @staticmethod
    def backward(ctx, do):
        return _attention_backward(ctx, do)


@once_differentiable
def _attention_backward(ctx, do):
    inner, aliases, node = ctx.inner
    ctx.inner = None  # nothing of the call outlives its backward
    wanted = tuple(a for a in aliases if a.requires_grad)
    if node is None:
        telemetry.record_pass_through(f"{ctx.source}: {MATH_BACKEND}", telemetry.shape_class(ctx.source))
        grads = iter(torch.autograd.grad(inner, wanted, do))
        return tuple(next(grads) if a.requires_grad else None for a in aliases) + (None, None)
    op, args = compat.fused_node_backward(node, do, grad_input_mask=(True, True, True, False))
    spec = spec_of(op)

    def original():
        with compat.below_autograd():
            return op(*args)
    grads = corrected(spec, bind(op, args, {}), original, ctx.cfg, node, source=ctx.source)
    saved = (node._saved_query, node._saved_key, node._saved_value)
    # from the fused op's inputs back to the caller's (casts, head-dim padding SDPA made in between)
    pairs = [(s, g) for s, g, a in zip(saved, grads[:3], aliases) if a.requires_grad]
    back = iter(torch.autograd.grad([s for s, _ in pairs], wanted, [g for _, g in pairs]))
    return tuple(next(back) if a.requires_grad else None for a in aliases) + (None, None)


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
         *, cfg: Optional[_config.Config] = None, layer: Optional[str] = None, source: str = "sdpa"):
    """SDPA's semantics with the corrected backward, enabled or not. ``cfg``: the options when the patch is not
    enabled (else the environment's); ``layer`` names the call for the ``auto`` policy when no ``layer_scope`` is
    open; ``source`` labels its reasons (HF's ``"gproj"`` attention: ``"hf_gproj"``)."""
    if layer is None or torch.compiler.is_compiling():  # traced: no per-call scope (backward-order names)
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, cfg, source)
    with layer_scope(layer):
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, cfg, source)


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, cfg, source):
    args = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    cfg = _config.active() or cfg or _config.Config()
    if is_installed() or cfg.mode == "off" or not has_backward(query, key, value):
        return F.scaled_dot_product_attention(query, key, value, **args)  # the seam (when installed) corrects it
    plain = all(type(t) in _PLAIN for t in (query, key, value, attn_mask) if t is not None)
    reason = None if plain else "a tensor subclass (it dispatches SDPA itself)"
    reason = reason or transform_reason(query, key, value, attn_mask)
    if reason is not None or not (query.dtype in LOW_PRECISION or torch.is_autocast_enabled(query.device.type)):
        if reason is not None:
            telemetry.record_forward("original", f"{source}: {reason}", telemetry.shape_class(source, query, key))
        return F.scaled_dot_product_attention(query, key, value, **args)
    telemetry.record_forward("patched")
    return _Attention.apply(query, key, value, attn_mask,
                            (dropout_p, bool(is_causal), scale, bool(enable_gqa), cfg, source))
