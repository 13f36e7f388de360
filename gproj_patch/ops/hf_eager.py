"""Eager (unfused) attention with its own forward and the corrected backward: HF's ``eager_attention_forward``
(``integrations/hf_eager.py``), and the ``"gproj"`` attention's softcap and sink paths (``attention_sink.py``).

``run_eager(call, query, key, value, sink)`` runs ``call.fn`` — the model's own eager function, or another
forward of known math — on detached aliases, without a graph (the same ops, so the same bits as unpatched),
and returns what it returns: ``(attn_output (B, Sq, Hq, D), attn_weights)``. The call's record is made now;
the backward routes it (``router.run_backward``) as attention with the record's scale, softcap and sink:

* masks. HF's eager masks are additive floats (0 / the dtype's minimum, ``masking_utils.eager_mask``). One that
  only holds 0 and values ≤ ``MASKED_ADDITIVE`` is read as a boolean pattern: exactly causal / windowed →
  flags (at the forward); padding around those → flags + dead rows (right padding) or varlen segments (left
  padding), checked at the backward against the zero-dO rows (``dispatch/masks.py``); anything else → the FP32 tier
  with the mask itself, whose additive semantics are eager's (a fully masked row gets uniform weights, as in
  eager). A pattern is never taken from a float mask with fully masked rows at the forward: those rows differ
  between the float semantics (uniform) and the flags (empty), so they must be dead rows.
* the LSE and output the kernel needs are recomputed in FP32 at the backward, only when the kernel will run
  (``backends.fp32_tier.fp32_forward``: the scores the kernel recomputes, not the eager forward's BF16-rounded
  ones, which differ from them by far more than the kernel's tolerance when keys carry a large offset).
* the attention weights the function returns stay an output; when they receive a gradient (a loss on them) the
  call's original backward runs instead (the forward is recomputed under autograd; reason counted).
* the original backward (policy choice in ``auto``/``audit``) is the same recomputation.

Dropout is not handled here: callers pass dropout > 0 through untouched (``integrations/hf_eager.py`` says why).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ..runtime import telemetry
from ..backends.spec import LOW_PRECISION
from ..layers.scope import backward_ran
from ..dispatch.autograd import once_differentiable
from ..dispatch.plan import ForwardTensors, kernel_reason, make_plan
from ..runtime.config import POLICY_MODES
from ..dispatch.record import CallRecord, Problem, make_context
from ..dispatch.router import BackwardTensors, run_backward
from ..dispatch.masks import mask_as_flags, packed_call, padding_as_flags, padding_as_varlen, unpack_grads

#: an additive mask value at or below this hides its key: HF uses the dtype's minimum (−65504 for FP16 models,
#: about −3.4e38 for BF16/FP32), and exp(s + m − rowmax) is 0 in fp32 once m is below −104 minus the spread of
#: a row's scores (assumed below 6.5e4 here; FP16 scores cannot exceed it)
MASKED_ADDITIVE = -65504.0
#: why a call keeps its original backward when its attention weights receive a gradient
WEIGHTS_GRAD_REASON = "eager: the attention weights receive a gradient (original backward, recomputed)"

EagerFn = Callable[[Tensor, Tensor, Tensor, Optional[Tensor]], Tuple[Tensor, Optional[Tensor]]]


@dataclass(frozen=True, eq=False)
class EagerCall:
    """One eager attention call. ``fn(q, k, v, sink)`` returns ``(attn_output (B, Sq, Hq, D), weights or None)``;
    ``sink_is_argument``: ``fn`` reads the sink it is given (else it reads the very tensor ``sink`` itself, as
    gpt-oss's eager function reads ``module.sinks``). ``mask``: the mask ``fn`` applies (float additive,
    boolean, or None); ``causal``: ``fn`` applies a top-left causal pattern besides ``mask``."""
    fn: EagerFn
    scale: float
    mask: Optional[Tensor] = None
    causal: bool = False
    softcap: float = 0.0
    sink: Optional[Tensor] = None
    sink_is_argument: bool = True
    layer: Optional[str] = None
    source: str = "hf_eager"


def _pattern(mask: Optional[Tensor]) -> Optional[Tensor]:
    """The boolean pattern of a mask (True = attend), or None when it is not one (a float bias)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    visible = mask == 0
    return visible if bool((visible | (mask <= MASKED_ADDITIVE)).all()) else None


def _empty_rows_inert(mask: Tensor, sink: Optional[Tensor]) -> bool:
    """Whether a row whose keys are all masked contributes nothing (output 0, zero gradients, whatever its dO):
    under a boolean mask (no weight at all), or with a sink (all the weight on the sink logit, which the
    additive minimum cannot reach). Not under an additive mask without a sink: eager then spreads the row's
    weight uniformly over every key."""
    return mask.dtype == torch.bool or sink is not None


def mask_unsupported_reason(mask, sq: int, sk: int) -> Optional[str]:
    """Why an eager call's mask cannot be routed (None: it can)."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        return f"attention_mask of type {type(mask).__name__}"
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (sq, sk):
        return f"attention_mask of shape {tuple(mask.shape)} (not (B, H, {sq}, {sk}))"
    if mask.requires_grad:
        return "attention_mask requires grad"
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return f"attention_mask of dtype {mask.dtype}"
    return None


def problem_for(call: EagerCall, sq: int, sk: int) -> Tuple[Problem, Optional[Tensor]]:
    """(Problem, boolean pattern for the backward's padding check or None), made at the forward."""
    base = dict(scale=call.scale, softcap=call.softcap, sink=call.sink)
    if call.causal:
        if call.mask is not None:
            raise ValueError("EagerCall: causal together with a mask")
        return Problem(causal=True, **base), None
    if call.mask is None:
        return Problem(**base), None
    pattern = _pattern(call.mask)
    if pattern is None:
        return Problem(attn_mask=call.mask, **base), None
    empty_rows = bool((~pattern).all(-1).any())
    if not empty_rows or _empty_rows_inert(call.mask, call.sink):
        rest, causal, align, window = mask_as_flags(pattern, sq, sk)
        if rest is None:
            return Problem(causal=causal, causal_align=align, window=window, **base), None
    return Problem(attn_mask=call.mask, padded=True, **base), pattern


def _lse_and_output(q, k, v, problem: Problem):
    from ..backends.fp32_tier import fp32_forward
    extra = {} if problem.sink is None else {"sink": problem.sink}
    out, lse = fp32_forward(q, k, v, scale=problem.scale, check_finite=False, **problem.flags, **extra)
    return out.to(q.dtype), lse


def route(record: CallRecord, pattern: Optional[Tensor], *, do: Tensor, q: Tensor, k: Tensor, v: Tensor,
          original=None, saved: Optional[Tuple[Tensor, Tensor]] = None):
    """Gradients (dq, dk, dv[, dsink]) of one eager call through the router; ``do`` (B, Hq, Sq, D). ``saved``:
    the (output, LSE) the forward already computed in FP32 for the policy (a call without a mask)."""
    problem, pad = record.problem, None
    if problem.padded and pattern is not None:
        flags = padding_as_flags(pattern, do, q.shape[2], k.shape[2])
        if flags is not None:
            window, dead = flags
            problem = Problem(scale=problem.scale, causal=True, window=window, softcap=problem.softcap,
                              sink=problem.sink)
            return _routed(CallRecord(problem, record.context, record.plan), do, q, k, v, dead, original)
        pad = padding_as_varlen(pattern, do, q.shape[2], k.shape[2],
                                empty_rows_inert=_empty_rows_inert(problem.attn_mask, problem.sink))
    if pad is None:
        if problem.padded:  # the mask stayed a dense tensor: the plan made for that case
            record = CallRecord(problem, record.context, record.plan.dense)
        return _routed(record, do, q, k, v, None, original, saved)
    tensors, packed = packed_call(pad, problem, do=do, q=q, k=k, v=v, out=None, lse=None)
    packed_original = None
    if original is not None:
        def packed_original():
            return tuple(pad.pack(g) if i < 3 else g for i, g in enumerate(original()))
    grads = _routed(CallRecord(packed, record.context, record.plan), tensors.do, tensors.q, tensors.k, tensors.v,
                    pad.dead_rows, packed_original)
    return unpack_grads(pad, grads)


def _routed(record: CallRecord, do, q, k, v, dead, original, saved=None):
    out, lse = None, None
    plan = record.plan
    if (plan.tier == "gproj" or (plan.tier == "fp32" and plan.fp32_kernel is not None)
            or (record.context.mode == "audit" and plan.fp32_kernel is not None)):
        # the kernel forms take them: planned so (computed at the forward already when the policy sampled them)
        out, lse = saved if saved is not None else _lse_and_output(q, k, v, record.problem)
    return run_backward(record, BackwardTensors(do, q, k, v, out, lse, dead_rows=dead), original)


def _recompute_original(call: EagerCall, q, k, v, sink, d_out, d_weights):
    """The call's own (uncorrected) backward: its forward again under autograd, then ``autograd.grad``."""
    with torch.enable_grad():
        qi, ki, vi = (t.detach().requires_grad_() for t in (q, k, v))
        si = sink
        if sink is not None and call.sink_is_argument:
            si = sink.detach().requires_grad_()
        out, weights = call.fn(qi, ki, vi, si)
        inputs = [qi, ki, vi] + ([si] if si is not None and si.requires_grad else [])
        outputs, grads = [out], [d_out if d_out is not None else torch.zeros_like(out)]
        if d_weights is not None and weights is not None:
            outputs.append(weights)
            grads.append(d_weights)
        got = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    got = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(got, inputs))
    return got if sink is None else (got + (torch.zeros_like(sink),))[:4]


def _policy_lse(record: CallRecord, q: Tensor, k: Tensor, v: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """(output, LSE) in FP32 for ``auto``/``audit``'s detector at the forward (its LSE statistics: sink weight,
    LSE gap), where the kernel tier could run and would need them anyway (no mask tensor); else None."""
    problem, ctx = record.problem, record.context
    if ctx.mode not in POLICY_MODES or ctx.tier_option == "fp32" or problem.attn_mask is not None:
        return None
    if kernel_reason(ForwardTensors(q, k, v, None, None, recomputed_lse=True), problem,
                     cpu_kernel=ctx.cpu_kernel) is not None:
        return None
    with torch.no_grad():
        return _lse_and_output(q.detach(), k.detach(), v.detach(), problem)


class _EagerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, call: EagerCall, record: CallRecord, pattern):
        with torch.no_grad():
            out, weights = call.fn(q.detach(), k.detach(), v.detach(), None if sink is None else sink.detach())
        ctx.set_materialize_grads(False)
        # planned as if output and LSE were there: the backward recomputes both in FP32 where the plan runs a
        # kernel form (this forward has no LSE)
        ctx.saved_lse = _policy_lse(record, q, k, v)
        o, lse = ctx.saved_lse if ctx.saved_lse is not None else (None, None)
        ctx.record = make_plan(record, ForwardTensors(q, k, v, o, lse, recomputed_lse=True), has_original=True)
        ctx.call, ctx.pattern = call, pattern
        ctx.save_for_backward(q, k, v, sink)
        return out, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_weights):
        q, k, v, sink = ctx.saved_tensors
        call, record = ctx.call, ctx.record
        if d_weights is not None:
            backward_ran()
            grads = _recompute_original(call, q, k, v, sink, d_out, d_weights)
            telemetry.record_backward("original", WEIGHTS_GRAD_REASON, telemetry.shape_class(call.source, q, k))
        elif d_out is None:
            return None, None, None, None, None, None, None
        else:
            do = d_out.transpose(1, 2)

            def original():
                return _recompute_original(call, q, k, v, sink, d_out, None)
            grads = route(record, ctx.pattern, do=do, q=q, k=k, v=v, original=original, saved=ctx.saved_lse)
        ctx.saved_lse = None
        dsink = None
        if sink is not None and len(grads) > 3 and ctx.needs_input_grad[3]:
            dsink = grads[3].to(sink.dtype)
        return grads[0], grads[1], grads[2], dsink, None, None, None


def needs_correction(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor] = None) -> bool:
    """A gradient is needed and the inputs are BF16/FP16 (FP32/FP64 eager attention has nothing to repair)."""
    wants = q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad)
    return torch.is_grad_enabled() and wants and q.dtype in LOW_PRECISION


def run_eager(call: EagerCall, query: Tensor, key: Tensor, value: Tensor):
    """``call.fn``'s output (same bits), with the corrected backward. The caller checked ``needs_correction``
    and every pass-through reason (``mask_unsupported_reason``, dropout, ...)."""
    problem, pattern = problem_for(call, query.shape[2], key.shape[2])
    record = CallRecord(problem, make_context(call.source, call.layer))
    telemetry.record_forward("patched")
    return _EagerFunction.apply(query, key, value, call.sink, call, record, pattern)
