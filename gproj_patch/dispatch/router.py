"""The router: one attention backward, from its forward's record to gradients, through its planned tier.

``run_backward(record, tensors, original)`` carries out the call's plan (``record.plan``, made at the forward by
``plan.make_plan``: tier, kernel and KV-major launch, FP32 form, sampling step), counts it (``telemetry``), logs
the plan's fallback reason (once per reason and shape class) and, in ``auto``/``audit``, reports the tier that
ran to the policy (``audit`` also compares with the FP32 tier). It decides nothing. Tiers:

* ``"gproj"`` — the GProj Triton kernel (``backends.triton_bwd.launch_planned``, its KV-major launch the one
  the plan names);
* ``"fp32"`` — FP32 attention with the projection: the kernel on fp32 copies or the chunked recomputation
  (``backends.fp32_tier.fp32_backward``), as planned;
* ``"original"`` — the caller's own uncorrected backward (``original()``, given by the hook).

Tensors are in the shared layout (``backends/spec.py``): q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), any strides;
gradients come back in the dtypes of q, k, v (plus the sink's gradient when the record has a sink).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from .. import policy
from ..runtime import telemetry
from ..backends.spec import MaskSpec, Varlen, normalize_lse
from ..layers.scope import backward_ran
from .record import KernelPlan
from .record import CallRecord, Problem

Grads = Tuple[torch.Tensor, ...]
#: the ``Varlen`` of a problem without varlen offsets (frozen; shared by every such call)
NO_VARLEN = Varlen()


@dataclass(frozen=True, eq=False)
class BackwardTensors:
    do: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]       # the forward's natural-log LSE, any layout normalize_lse reads
    dead_rows: Optional[torch.Tensor] = None  # (B, Sq) bool: rows with zero dO outside the flags (LSE := +inf)
    partial_rows: Optional[torch.Tensor] = None  # the device's counter of shard rows (set by run_backward)


def graph_backward(kept, do: torch.Tensor) -> Optional[Callable[[], Grads]]:
    """The caller's own backward, from an inner graph a forward kept as ``(output, (q, k, v) aliases)``
    (``torch.autograd.grad`` on it *is* the original fused backward), or None when nothing was kept."""
    if kept is None:
        return None
    inner, aliases = kept
    return lambda: torch.autograd.grad(inner, aliases, do)


def _kernel_lse(lse: torch.Tensor, dead_rows: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, H, Sq) fp32, +inf on ``dead_rows`` so that their P is 0 (exact: their dO is 0)."""
    return lse if dead_rows is None else lse.masked_fill(dead_rows[:, None, :], float("inf"))


def _run_kernel(t: BackwardTensors, problem: Problem, kernel: KernelPlan) -> Grads:
    """The kernel tier as planned: its KV-major launch the Gluon kernel or the tl one (counted in
    ``stats()["kv_major"]``), on CUDA or, for CPU tensors the plan allowed, through Triton's interpreter."""
    from ..backends.triton_bwd import launch_planned  # here: triton may be missing (then no plan has this tier)
    telemetry.record_kernels(kernel)
    do = _tma_do(t.do) if "gluon" in (kernel.kv_major, kernel.dq_major) else t.do
    mask = MaskSpec(causal=problem.causal, causal_align=problem.causal_align, window=tuple(problem.window),
                    softcap=float(problem.softcap))
    return launch_planned(do, t.q, t.k, t.v, t.o, _kernel_lse(t.lse, t.dead_rows), scale=problem.scale, mask=mask,
                          varlen=_varlen(problem), kernels=(kernel.dq_major, kernel.kv_major),
                          sink=problem.sink, partial_rows=t.partial_rows)


def _tma_do(do: torch.Tensor) -> torch.Tensor:
    """dO for a Gluon launch, which reads it through a TMA descriptor: as it is where its strides suit one (the
    transposed view ``out.transpose(1, 2)`` hands back in attention layers: no copy), else a contiguous copy. dO
    is the one input the forward's plan could not check (q, k, v were, ``gluon_bwd.gluon_reason``)."""
    from ..backends.gluon_bwd import tma_strides_reason
    return do if tma_strides_reason("do", do) is None else do.contiguous()


def _varlen(problem: Problem) -> Varlen:
    """The problem's varlen offsets as the kernel takes them (``NO_VARLEN`` when it has none)."""
    if problem.cu_seqlens_q is None and problem.cu_seqlens_k is None:
        return NO_VARLEN
    return Varlen(cu_seqlens_q=problem.cu_seqlens_q, cu_seqlens_k=problem.cu_seqlens_k,
                  max_seqlen_q=problem.max_seqlen_q, max_seqlen_k=problem.max_seqlen_k)


def _run_fp32(t: BackwardTensors, problem: Problem, fp32_kernel: Optional[KernelPlan]) -> Grads:
    """The FP32 tier as planned: the kernel on fp32 copies (no S×S scores, fp32-level products), or attention
    recomputed in chunked FP32 GEMMs (``backends.fp32_tier``)."""
    if fp32_kernel is not None:
        return _run_kernel(BackwardTensors(*(x.float() for x in (t.do, t.q, t.k, t.v, t.o)), t.lse, t.dead_rows,
                                           t.partial_rows), problem, fp32_kernel)
    from ..backends.fp32_tier import fp32_backward
    extra = {}
    if problem.sink is not None:
        extra["sink"] = problem.sink
    elif t.lse is not None and t.o is not None and t.dead_rows is None and problem.dropout_p == 0.0:
        # the forward's own statistics: P relative to its LSE, D from its output — what the fused backward it
        # replaces uses — so a call over a shard of a row's keys (a ring's per-shard call with the merged LSE)
        # gets the gradient of its part, its rows left unprojected and counted
        extra.update(lse=t.lse, out=t.o, partial_rows=t.partial_rows)
    if problem.dropout_mask is not None:
        extra["dropout_mask"] = problem.dropout_mask
    return fp32_backward(t.q, t.k, t.v, t.do, attn_mask=problem.attn_mask, dropout_p=problem.dropout_p,
                         project=True, scale=problem.scale, check_finite=False, **problem.flags, **extra)


def _cast(grads: Grads, t: BackwardTensors) -> Grads:
    if grads[0].dtype == t.q.dtype and grads[1].dtype == t.k.dtype and grads[2].dtype == t.v.dtype:
        return grads
    like = (t.q, t.k, t.v)
    return tuple(g if i >= 3 or g.dtype == like[i].dtype else g.to(like[i].dtype) for i, g in enumerate(grads))


def run_backward(record: CallRecord, t: BackwardTensors, original: Optional[Callable[[], Grads]] = None, *,
                 stand_in_reason: Optional[str] = None) -> Grads:
    """Gradients (dq, dk, dv[, dsink]) of one attention call: its plan (``record.plan``, made at the forward by
    ``plan.make_plan``) carried out.

    ``original()`` computes the caller's own backward (the plan chose it only where the hook said it has one);
    ``stand_in_reason``, when set, says that ``original`` is an uncorrected stand-in rather than the real fused
    backward (logged as the reason when it runs).
    """
    plan = record.plan
    if plan is None:
        raise RuntimeError(f"{record.context.source}: a backward without a plan (every hook plans at its forward)")
    if plan.error is not None:
        raise RuntimeError(plan.error)
    backward_ran()
    tier, reason = plan.tier, plan.reason
    # the caller's backward takes the tensors as they are: only the GProj tiers need them prepared
    prepared = None if tier == "original" else _prepared(t, record)
    if tier == "original":
        reason = stand_in_reason or reason
        grads = original()
    elif tier == "gproj":
        grads = _run_kernel(prepared, record.problem, plan.kernel)
    else:
        grads = _run_fp32(prepared, record.problem, plan.fp32_kernel)
    grads = _cast(tuple(grads), t)
    # the shape class only keys the once-per-class log of a reason: built only when there is one
    telemetry.record_backward(tier, reason, telemetry.shape_class(record.context.source, t.q, t.k) if reason else ())
    if record.context.mode in policy.MODES:
        policy.after_backward(record, tier=tier, grads=grads, step=plan.step, fp32_grads=lambda: _run_fp32(
            prepared if prepared is not None else _prepared(t, record), record.problem, plan.fp32_kernel))
    return grads


def run_settled_original(layer: str, original: Callable[[], Grads]) -> Grads:
    """The caller's own backward for a call ``plan.settled_original`` answered for (``auto``, its layer settled on
    "original", no sample due), counted as ``run_backward`` counts a planned "original" without a reason."""
    backward_ran()
    grads = original()
    telemetry.record_backward("original")
    policy.count_ran(layer, "original")
    return grads


def _prepared(t: BackwardTensors, record: CallRecord) -> BackwardTensors:
    """The tensors as the GProj tiers take them: the LSE as (B, H, Sq) fp32, and the device's shard-row counter —
    rows found to be shards of a row are counted on the device, except inside a compiled graph: a counter made
    during its CUDA-graph warm-up would live in the graph's pool (those rows' guard applies all the same)."""
    lse = t.lse
    if lse is not None and not (lse.dtype == torch.float32 and lse.shape == t.q.shape[:3]):  # else already so
        lse = normalize_lse(lse, *t.q.shape[:3])
    counter = None if record.context.in_graph else telemetry.partial_rows_counter(t.q.device)
    return BackwardTensors(t.do, t.q, t.k, t.v, t.o, lse, t.dead_rows, counter)
