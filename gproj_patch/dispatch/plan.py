"""One backward plan per attention call, made at its forward: what its backward will run, decided once.

Every hook makes its call's record (``record.py``) at the forward and then, still at the forward, its plan with
``make_plan(record, tensors, has_original)``; the backward (``router.run_backward``) executes the plan and reads
nothing else — no options, no environment, no device query, no second support check, no policy decision.

A ``BackwardPlan`` holds:

* ``tier`` — ``"gproj"`` (the GProj kernel), ``"fp32"`` (FP32 attention with the projection) or ``"original"``
  (the caller's own backward), and ``reason``: why not the tier the mode asked for (counted and logged once per
  reason and shape class when the backward runs);
* ``kernel`` — for the kernel tier: the KV-major launch (the warp-specialized Gluon kernel or the portable tl
  one, with why not Gluon; on CPU tensors, planned only where the context's ``cpu_kernel`` allows it, the kernels
  run through Triton's interpreter);
* ``fp32_kernel`` — how the FP32 tier runs: the kernel on fp32 copies (its ``KernelPlan``) or, when None, the
  chunked recomputation (``backends/fp32_tier.py``); also what ``audit`` compares with;
* ``layer`` and ``step`` — the layer name and the sampling step of ``auto``/``audit`` (their policy decided at
  the forward: ``policy.decide`` samples the detector on the forward's q, k and LSE);
* ``dense`` — for a mask that may be right or left padding around causal flags: the plan if, at the backward,
  the zero rows of dO do not make it one (then the mask stays a dense tensor, which only the chunked FP32 tier
  takes). Whether it is padding depends on dO, the one input the forward cannot see.

Reasons are checked in order, each right before the fallback it causes. ``kernel_reason`` answers for a
``_kernel_key``, and the kernel tier's ``KernelPlan`` for a ``_launch_plan_key``, are memoized in the runtime
state (``STATE.kernel_reasons``, ``STATE.kernel_plans``; bounded, cleared by ``reset()``): pure functions of
their keys, asked at every call of a shape.

The SDPA seam makes the plan in the backward op's kernel (it has no forward); under ``torch.compile`` that kernel
runs when the compiled backward runs, and the compiled flex hook makes its plan inside its forward custom op at
run time (``hooks/flex.py``, ``gproj::flex_context``): a plan never enters a traced graph, so it cannot
become a Dynamo guard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import policy
from ..backends.configs import gluon_measured_faster
from ..runtime.config import POLICY_MODES, Config
from .record import BackwardPlan, CallRecord, KernelPlan, Problem
from ..runtime.state import STATE

#: the refusal of tier "triton": the plan sees the resolved option, not whether a keyword (enable(),
#: GProjCallback) or the variable set it, so the message names both
TRITON_REFUSED = 'tier="triton" (as a keyword or GPROJ_TIER=triton) but the GProj kernel cannot run: '


@dataclass(frozen=True, eq=False)
class ForwardTensors:
    """What the forward has for planning: the inputs, and the output and LSE the backward will receive (None
    when the forward has none: then the kernel tier, which needs both, is not planned — unless the hook
    recomputes them for the backward, ``recomputed_lse``: HF eager attention, whose forward has no LSE)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]
    recomputed_lse: bool = False

    @property
    def has_lse(self) -> bool:
        return self.recomputed_lse or (self.o is not None and self.lse is not None)


_KERNEL_CACHE_SIZE = 1024
_MISSING = object()


def _triton_bwd():
    """``backends.triton_bwd``, imported on first use (it imports triton; ImportError while it cannot be)."""
    from ..backends import triton_bwd
    return triton_bwd


def _kernel_key(t: ForwardTensors, problem: Problem, cpu_kernel: bool) -> Optional[tuple]:
    """Cache key of ``kernel_reason`` (None: not cacheable): for 4-D inputs with no mask tensor, sink or
    softcap and the forward's output and LSE, ``kernel_unsupported_reason`` reads only the device type, the
    dtypes, the head dims, B·H and ``cpu_kernel``. A new input of that predicate must join this key."""
    q, k, v = t.q, t.k, t.v
    if (problem.attn_mask is not None or problem.sink is not None or problem.softcap != 0.0 or not t.has_lse
            or q.dim() != 4 or k.dim() != 4 or v.dim() != 4):
        return None
    qs = q.shape
    return q.device.type, cpu_kernel, q.dtype, k.dtype, v.dtype, qs[0] * qs[1], qs[3], k.shape[3], v.shape[3]


def kernel_reason(t: ForwardTensors, problem: Problem, *, cpu_kernel: bool, fp32: bool = False,
                  mask_as_flags: bool = False) -> Optional[str]:
    """Why the GProj kernel cannot take this call's backward (None when it can).

    ``fp32=True`` asks about the FP32 tier's kernel form (the kernel on fp32 copies, fp32-level products). Not
    with a learnable sink: there the saved output's rounding enters the target P_sink·D and leaves
    δ·P_sink/(1 − P_sink) of it in dq (measured 6e-4 of fp64 at a 128σ offset), while the chunked tier recomputes
    O in fp32 (1e-5). ``mask_as_flags``: plan as if the mask were flags (a padding candidate, ``dense`` below)."""
    if problem.dropout_p > 0.0:
        return "dropout > 0 (the kernel takes no dropout mask)"
    if fp32 and problem.sink is not None:
        return "learnable sink (the chunked tier recomputes the output the sink target needs)"
    if not t.has_lse:
        return "the forward returned no LSE (non-fused forward)"
    attn_mask = None if mask_as_flags else problem.attn_mask
    key = None if fp32 or attn_mask is not None else _kernel_key(t, problem, cpu_kernel)
    if key is not None:
        cached = STATE.kernel_reasons.get(key, _MISSING)
        if cached is not _MISSING:
            return cached
    try:
        triton_bwd = _triton_bwd()
    except ImportError as exc:  # triton missing
        return f"no triton kernel ({exc})"
    reason = triton_bwd.kernel_unsupported_reason(t.q, t.k, t.v, attn_mask=attn_mask, softcap=problem.softcap,
                                                  sink=problem.sink, fp32=fp32, cpu_kernel=cpu_kernel)
    if key is not None:
        _memo_put(STATE.kernel_reasons, key, reason, _KERNEL_CACHE_SIZE)  # bounded: many B·H values
    return reason


def _memo_put(memo: dict, key: tuple, value, size: int) -> None:
    """``memo[key] = value`` in one of the runtime state's bounded memos: full at ``size`` entries, it starts
    over (the shapes a process runs are few; a process cycling through more re-asks the predicates)."""
    if len(memo) >= size:
        memo.clear()
    memo[key] = value


def kv_major_choice(t: ForwardTensors, problem: Problem, option: str) -> Tuple[str, Optional[str]]:
    """(KV-major kernel, why not Gluon): the Gluon kernel where ``gluon_bwd.kv_major_reason`` allows it and it
    was measured faster than the tl kernel (``configs.gluon_measured_faster``), else tl; always tl under the
    option ``kv_major="tl"``. dO is planned as laid out like q (the router passes a contiguous dO to Gluon)."""
    if option == "tl":
        return "tl", "kv_major=tl (GPROJ_KV_MAJOR / enable option)"
    from ..backends import gluon_bwd
    return _faster_gluon(gluon_bwd.kv_major_reason(t.q, t.k, t.v, **_gluon_mask(problem)), t, "kv_major",
                         "KV-major")


def dq_major_choice(t: ForwardTensors, problem: Problem, option: str) -> Tuple[str, Optional[str]]:
    """(dQ-major kernel, why not Gluon): the Gluon kernel where ``gluon_dq.dq_major_reason`` allows it and it was
    measured faster than the tl kernel (``configs.gluon_measured_faster``), else tl; always tl under the option
    ``dq_major="tl"``."""
    if option == "tl":
        return "tl", "dq_major=tl (GPROJ_DQ_MAJOR / enable option)"
    from ..backends import gluon_dq
    return _faster_gluon(gluon_dq.dq_major_reason(t.q, t.k, t.v, **_gluon_mask(problem)), t, "dq_major",
                         "dQ-major")


def _gluon_mask(problem: Problem) -> dict:
    """What the Gluon predicates ask of the problem's mask (window, softcap, varlen)."""
    return dict(window=problem.window, softcap=problem.softcap,
                varlen=problem.cu_seqlens_q is not None or problem.cu_seqlens_k is not None)


def _faster_gluon(reason: Optional[str], t: ForwardTensors, launch: str, label: str) -> Tuple[str, Optional[str]]:
    """("gluon", None) where the predicate gave no ``reason`` and Gluon's ``launch`` ("kv_major" | "dq_major") was
    measured faster at the head dim (``configs.gluon_measured_faster``), else ("tl", why not; ``label`` names the
    launch)."""
    if reason is None and not gluon_measured_faster(launch, t.q.shape[-1]):
        reason = f"head_dim={t.q.shape[-1]}: the tl {label} kernel is faster there"
    return ("gluon", None) if reason is None else ("tl", reason)


#: the TMA base alignment the Gluon predicates check (``gluon_bwd.TMA_ALIGN_BYTES``; not imported from there:
#: planning imports no triton)
_TMA_ALIGN = 16
_KERNEL_PLAN_CACHE_SIZE = 256


def _launch_plan_key(t: ForwardTensors, problem: Problem, record: CallRecord) -> Optional[tuple]:
    """Cache key of ``_launch_plan`` (None: not cached): everything the Gluon predicates
    (``gluon_bwd.gluon_reason``), ``configs.gluon_measured_faster`` and the compiled-graph rule read — the launch
    options, whether the call is in a compiled graph, q's, k's and v's device, dtype, shape and strides and
    their base address modulo the TMA alignment, and the mask's window, softcap and varlen. Plain tensors only (a
    subclass's data pointer may not be readable). A new input of those predicates must join this key."""
    q, k, v = t.q, t.k, t.v
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    ctx = record.context
    return (ctx.kv_major, ctx.dq_major, ctx.in_graph, q.device, q.dtype, k.dtype, v.dtype, q.shape, q.stride(),
            k.shape, k.stride(), v.shape, v.stride(), q.data_ptr() % _TMA_ALIGN, k.data_ptr() % _TMA_ALIGN,
            v.data_ptr() % _TMA_ALIGN, tuple(problem.window), problem.softcap,
            problem.cu_seqlens_q is not None or problem.cu_seqlens_k is not None)


def _kernel_plan(t: ForwardTensors, problem: Problem, record: CallRecord, fp32: bool) -> KernelPlan:
    if fp32:  # fp32 copies: the Gluon kernels are bf16/fp16 only
        why = "fp32 (the FP32 tier's kernel form)"
        return KernelPlan(kv_major="tl", kv_major_reason=why, dq_major="tl", dq_major_reason=why)
    if problem.padded:  # left padding runs as packed varlen segments, which the Gluon kernels do not take
        why = "padding mask (may run as varlen)"
        return KernelPlan(kv_major="tl", kv_major_reason=why, dq_major="tl", dq_major_reason=why)
    key = _launch_plan_key(t, problem, record)
    if key is not None:
        cached = STATE.kernel_plans.get(key)
        if cached is not None:
            return cached
    plan = _launch_plan(t, problem, record)
    if key is not None:
        _memo_put(STATE.kernel_plans, key, plan, _KERNEL_PLAN_CACHE_SIZE)  # bounded: many shapes
    return plan


def _launch_plan(t: ForwardTensors, problem: Problem, record: CallRecord) -> KernelPlan:
    """The kernel tier's launches (Gluon or tl, each with why not Gluon) for a bf16/fp16 call without a padding
    mask."""
    kv_major, kv_why = kv_major_choice(t, problem, record.context.kv_major)
    dq_major, dq_why = dq_major_choice(t, problem, record.context.dq_major)
    if dq_major == "gluon" and record.context.in_graph:
        # the Gluon dQ launch keeps its one-hot columns' tensor for the shape class: made inside a compiled
        # graph's CUDA-graph warm-up it would live in the graph's pool untracked, which cudagraph trees refuse
        dq_major, dq_why = "tl", "in a compiled graph (the Gluon dQ launch caches a tensor a CUDA-graph pool refuses)"
    return KernelPlan(kv_major=kv_major, kv_major_reason=kv_why, dq_major=dq_major, dq_major_reason=dq_why)


def _tier(record: CallRecord, t: ForwardTensors, has_original: bool, mask_as_flags: bool,
          policy_tier: Optional[str], defer_error: bool = False) -> Tuple[str, Optional[str]]:
    """(tier, fallback reason or None), in the order of the rules: mode off, fp32 asked, the policy's choice
    (``policy_tier``, decided once per call by ``make_plan``), then the kernel's support."""
    ctx, problem = record.context, record.problem
    if ctx.mode == "off":
        return ("original", None) if has_original else ("fp32", f"{ctx.source}: no original backward available")
    if ctx.mode == "fp32" or ctx.tier_option == "fp32":
        return "fp32", None
    if policy_tier is not None:
        tier = policy_tier
        if tier == "original" and not has_original:
            # the caller has no trustworthy original (a hook without one; cuDNN's plan of unknown dO layout):
            # the corrected tier instead, decided below like mode "gproj"
            tier = "gproj"
        if tier != "gproj":
            return tier, None
    if t.q.device.type == "cpu" and not ctx.cpu_kernel:
        # the documented CPU backward: the kernel runs on CUDA (on CPU only in Triton's interpreter, when asked)
        return "fp32", None
    reason = kernel_reason(t, problem, cpu_kernel=ctx.cpu_kernel, mask_as_flags=mask_as_flags)
    if reason is None:
        return "gproj", None
    if ctx.tier_option == "triton" and not defer_error:
        raise RuntimeError(f"{TRITON_REFUSED}{reason}")
    return "fp32", reason


def _plan(record: CallRecord, t: ForwardTensors, has_original: bool, mask_as_flags: bool, step: int,
          policy_tier: Optional[str], defer_error: bool = False) -> BackwardPlan:
    problem, ctx = record.problem, record.context
    tier, reason = _tier(record, t, has_original, mask_as_flags, policy_tier, defer_error)
    error = f"{TRITON_REFUSED}{reason}" if defer_error and ctx.tier_option == "triton" and tier == "fp32" \
        and reason is not None else None
    kernel = _kernel_plan(t, problem, record, fp32=False) if tier == "gproj" else None
    fp32_kernel = None
    if tier == "fp32" or ctx.mode == "audit":  # the FP32 tier runs, or audit compares with it
        fp32_reason = kernel_reason(t, problem, cpu_kernel=ctx.cpu_kernel, fp32=True, mask_as_flags=mask_as_flags)
        if fp32_reason is None:
            fp32_kernel = _kernel_plan(t, problem, record, fp32=True)
    return BackwardPlan(tier=tier, reason=reason, kernel=kernel, fp32_kernel=fp32_kernel, layer=ctx.layer,
                        step=step, error=error)


def make_plan(record: CallRecord, t: ForwardTensors, has_original: bool) -> CallRecord:
    """The record with its backward plan, made now (at the forward). ``has_original``: the hook can run the
    caller's own backward. A record whose mask may be padding (``problem.padded``) gets the plan of the mask as
    flags, and as ``dense`` the plan of the mask as a tensor (the chunked FP32 tier)."""
    step = STATE.step()
    ctx = record.context
    policy_tier = None
    if ctx.mode in POLICY_MODES and ctx.mode != "off" and ctx.tier_option != "fp32":
        # sampled on the forward's own q, k and LSE, at this step: once per call
        policy_tier = policy.decide(record, q=t.q, k=t.k, lse=t.lse)
    if record.problem.padded and record.problem.attn_mask is not None:
        # used only if dO does not make the mask padding: a refusal of tier "triton" is raised then, not now
        dense = _plan(record, t, has_original, mask_as_flags=False, step=step, policy_tier=policy_tier,
                      defer_error=True)
        plan = _plan(record, t, has_original, mask_as_flags=True, step=step, policy_tier=policy_tier)
        plan = BackwardPlan(tier=plan.tier, reason=plan.reason, kernel=plan.kernel, fp32_kernel=plan.fp32_kernel,
                            layer=plan.layer, step=step, dense=dense)
    else:
        plan = _plan(record, t, has_original, mask_as_flags=False, step=step, policy_tier=policy_tier)
    return CallRecord(record.problem, record.context, plan)


def settled_original(cfg: Config, layer: str, has_original: bool) -> bool:
    """Whether ``make_plan`` would plan "original" for a call of ``layer`` made now with the options ``cfg``,
    without sampling it: mode "auto" (not "audit", whose plans also carry the FP32 form it compares with), the
    tier option not "fp32", the hook has the caller's backward, and the layer's tier settled on "original" for
    this sampling bucket (``policy.settled_tier``). A hook deciding in the backward op (it has no forward to make
    the plan at) then runs ``router.run_settled_original`` instead of building the record and plan: the same
    outcome and counts, for the host time of a healthy layer's call (most calls under ``auto``)."""
    return (cfg.mode == "auto" and cfg.tier != "fp32" and has_original
            and policy.settled_tier(layer, policy.effective_config(cfg.policy)) == "original")
