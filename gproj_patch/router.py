"""The router: one attention backward, from its forward's record to gradients, through one tier.

``run_backward(record, tensors, original)`` picks the tier the record's context asks for, runs it, counts it
(``telemetry``), logs why it fell back (once per reason and shape class) and, in ``audit`` mode, reports to the
policy. Tiers:

* ``"gproj"`` — the GProj Triton kernel (``backends.triton_bwd.gproj_backward``; its KV-major launch the Gluon
  sm_90a kernel or the portable tl one, per call);
* ``"fp32"`` — attention recomputed in FP32 with the projection (``backends.fp32_tier.fp32_backward``);
* ``"original"`` — the caller's own uncorrected backward (``original()``, given by the hook).

Modes: ``gproj`` → the kernel where ``kernel_reason`` is None, else the FP32 tier; ``fp32`` → the FP32 tier;
``off`` → original; ``auto``/``audit`` → ``policy.decide`` chooses. The tier option ``fp32`` forces the FP32
tier; ``triton`` turns a missing kernel into a ``RuntimeError``.

Tensors are in the shared layout (``backends/spec.py``): q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), any strides;
gradients come back in the dtypes of q, k, v (plus the sink's gradient when the record has a sink).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from . import policy, telemetry
from .config import POLICY_MODES
from .backends.spec import normalize_lse
from .layer_context import backward_ran
from .record import CallRecord, Problem
from .state import STATE

Grads = Tuple[torch.Tensor, ...]


@dataclass(frozen=True, eq=False)
class BackwardTensors:
    do: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]       # the forward's natural-log LSE, any layout normalize_lse reads
    dead_rows: Optional[torch.Tensor] = None  # (B, Sq) bool: rows with zero dO outside the flags (LSE := +inf)


def graph_backward(kept, do: torch.Tensor) -> Optional[Callable[[], Grads]]:
    """The caller's own backward, from an inner graph a forward kept as ``(output, (q, k, v) aliases)``
    (``torch.autograd.grad`` on it *is* the original fused backward), or None when nothing was kept."""
    if kept is None:
        return None
    inner, aliases = kept
    return lambda: torch.autograd.grad(inner, aliases, do)


#: devices whose kernel predicate depends only on the cache key below (on CPU it also reads the interpreter's
#: environment variables at each call, so CPU answers are never cached)
CACHED_DEVICES = ("cuda",)
_KERNEL_CACHE_SIZE = 1024
_MISSING = object()
_kernel_module = None


def _triton_bwd():
    """``backends.triton_bwd``, imported on first use (it imports triton) and then held (ImportError each time
    while it cannot be imported)."""
    global _kernel_module
    if _kernel_module is None:
        from .backends import triton_bwd
        _kernel_module = triton_bwd
    return _kernel_module


def _kernel_key(t: BackwardTensors, problem: Problem) -> Optional[tuple]:
    """Cache key of ``kernel_reason`` (None: not cacheable): for 4-D inputs on a ``CACHED_DEVICES`` device, with
    no mask tensor, sink or softcap and the forward's output and LSE, ``kernel_unsupported_reason`` reads only
    the device type, the dtypes, the head dims and B·H. A new input of that predicate must join this key."""
    q, k, v = t.q, t.k, t.v
    device = q.device.type
    if (device not in CACHED_DEVICES or problem.attn_mask is not None or problem.sink is not None
            or problem.softcap != 0.0 or t.o is None or t.lse is None or q.dim() != 4 or k.dim() != 4
            or v.dim() != 4):
        return None
    qs = q.shape
    return device, q.dtype, k.dtype, v.dtype, qs[0] * qs[1], qs[3], k.shape[3], v.shape[3]


def kernel_reason(t: BackwardTensors, problem: Problem, *, fp32: bool = False) -> Optional[str]:
    """Why the GProj Triton kernel cannot take this backward (None when it can). Answers for a ``_kernel_key``
    are kept in the runtime state (``STATE.kernel_reasons``, cleared by ``reset()``).

    ``fp32=True`` asks about the FP32 tier's kernel form: the kernel on fp32 copies with fp32-level products
    (``triton_bwd.FP32_DOT_PRECISION``); on CPU only under the Triton interpreter, as the kernel tier. Not with a
    learnable sink: there the saved output's rounding enters the target P_sink·D and leaves δ·P_sink/(1 − P_sink)
    of it in dq (measured 6e-4 of fp64 at a 128σ offset, tests/test_fp32_kernel.py), while the chunked tier
    recomputes O in fp32 (1e-5). Its answers are not kept (the FP32 tier is the rare path)."""
    if problem.dropout_p > 0.0:
        return "dropout > 0 (the kernel takes no dropout mask)"
    if fp32 and problem.sink is not None:
        return "learnable sink (the chunked tier recomputes the output the sink target needs)"
    key = None if fp32 else _kernel_key(t, problem)
    cache = STATE.kernel_reasons
    if key is not None:
        cached = cache.get(key, _MISSING)
        if cached is not _MISSING:
            return cached
    try:
        triton_bwd = _triton_bwd()
    except ImportError as exc:  # triton missing
        return f"no triton kernel ({exc})"
    reason = triton_bwd.kernel_unsupported_reason(t.q, t.k, t.v, attn_mask=problem.attn_mask,
                                                  softcap=problem.softcap, sink=problem.sink, fp32=fp32)
    if reason is None and (t.o is None or t.lse is None):
        return "the forward returned no LSE (non-fused forward)"
    if key is not None:
        if len(cache) >= _KERNEL_CACHE_SIZE:  # bounded (many B·H values): start over
            cache.clear()
        cache[key] = reason
    return reason


def _kernel_lse(lse: torch.Tensor, dead_rows: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, H, Sq) fp32, +inf on ``dead_rows`` so that their P is 0 (exact: their dO is 0)."""
    return lse if dead_rows is None else lse.masked_fill(dead_rows[:, None, :], float("inf"))


def _run_kernel(t: BackwardTensors, problem: Problem, kv_major_option: str = "auto") -> Grads:
    """The kernel tier; its KV-major launch is the Gluon kernel or the tl one, chosen per call
    (``gluon_bwd.kv_major_kernel``; always tl under the recorded option ``kv_major="tl"``) and counted
    (``stats()["kv_major"]``)."""
    triton_bwd = _triton_bwd()
    extra = {} if problem.sink is None else {"sink": problem.sink}  # the LSE includes the sink: never drop it
    if kv_major_option == "tl":
        kv_major, why = "tl", "kv_major=tl (GPROJ_KV_MAJOR / enable option)"
    else:
        from .backends.gluon_bwd import kv_major_kernel
        kv_major, why = kv_major_kernel(t.q, t.k, t.v, t.do, **problem.flags)
    telemetry.record_kv_major(kv_major, why)
    return triton_bwd.gproj_backward(t.do, t.q, t.k, t.v, t.o, _kernel_lse(t.lse, t.dead_rows), scale=problem.scale,
                                     max_seqlen_q=problem.max_seqlen_q, max_seqlen_k=problem.max_seqlen_k,
                                     correct=True, kv_major=kv_major, **problem.flags, **extra)


def _run_fp32(t: BackwardTensors, problem: Problem, kv_major_option: str = "auto") -> Grads:
    """The FP32 tier: the kernel on fp32 copies where ``kernel_reason(fp32=True)`` allows (no S×S scores,
    fp32-level products), else attention recomputed in chunked FP32 GEMMs (``backends.fp32_tier``)."""
    if kernel_reason(t, problem, fp32=True) is None:
        return _run_kernel(BackwardTensors(*(x.float() for x in (t.do, t.q, t.k, t.v, t.o)), t.lse, t.dead_rows),
                           problem, kv_major_option)
    from .backends.fp32_tier import fp32_backward
    extra = {}
    if problem.sink is not None:
        extra["sink"] = problem.sink
    if problem.dropout_mask is not None:
        extra["dropout_mask"] = problem.dropout_mask
    return fp32_backward(t.q, t.k, t.v, t.do, attn_mask=problem.attn_mask, dropout_p=problem.dropout_p,
                         project=True, scale=problem.scale, check_finite=False, **problem.flags, **extra)


def _cast(grads: Grads, t: BackwardTensors) -> Grads:
    if grads[0].dtype == t.q.dtype and grads[1].dtype == t.k.dtype and grads[2].dtype == t.v.dtype:
        return grads
    like = (t.q, t.k, t.v)
    return tuple(g if i >= 3 or g.dtype == like[i].dtype else g.to(like[i].dtype) for i, g in enumerate(grads))


def choose_tier(record: CallRecord, t: BackwardTensors, has_original: bool) -> Tuple[str, Optional[str]]:
    """(tier, fallback reason or None) for this call."""
    ctx, problem = record.context, record.problem
    if ctx.mode == "off":
        return ("original", None) if has_original else ("fp32", f"{ctx.source}: no original backward available")
    if ctx.mode == "fp32" or ctx.tier_option == "fp32":
        return "fp32", None
    if ctx.mode in POLICY_MODES:
        tier = policy.decide(record, q=t.q, k=t.k, lse=t.lse)
        if tier == "original" and not has_original:
            return "fp32", f"{ctx.source}: no original backward available"
        if tier != "gproj":
            return tier, None
    reason = kernel_reason(t, problem)
    if reason is None:
        return "gproj", None
    if ctx.tier_option == "triton":
        raise RuntimeError(f"GPROJ_TIER=triton but the GProj kernel cannot run: {reason}")
    return "fp32", reason


def run_backward(record: CallRecord, t: BackwardTensors, original: Optional[Callable[[], Grads]] = None, *,
                 stand_in_reason: Optional[str] = None) -> Grads:
    """Gradients (dq, dk, dv[, dsink]) of one attention call through the tier its record selects.

    ``original()`` computes the caller's own backward; ``stand_in_reason``, when set, says that ``original`` is
    an uncorrected stand-in rather than the real fused backward (logged as the reason when it runs).
    """
    backward_ran()
    lse = t.lse
    if lse is not None and not (lse.dtype == torch.float32 and lse.shape == t.q.shape[:3]):  # else already so
        t = BackwardTensors(t.do, t.q, t.k, t.v, t.o, normalize_lse(lse, *t.q.shape[:3]), t.dead_rows)
    tier, reason = choose_tier(record, t, original is not None)
    if tier == "original":
        reason = stand_in_reason or reason
        grads = original()
    elif tier == "gproj":
        grads = _run_kernel(t, record.problem, record.context.kv_major)
    else:
        grads = _run_fp32(t, record.problem, record.context.kv_major)
    grads = _cast(tuple(grads), t)
    # the shape class only keys the once-per-class log of a reason: built only when there is one
    telemetry.record_backward(tier, reason, telemetry.shape_class(record.context.source, t.q, t.k) if reason else ())
    if record.context.mode in policy.MODES:
        policy.after_backward(record, tier=tier, grads=grads, fp32_grads=lambda: _run_fp32(t, record.problem, record.context.kv_major))
    return grads
