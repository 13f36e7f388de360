"""The SDPA hook under ``torch.compile``: custom ops ``gproj::sdpa_fwd`` / ``gproj::sdpa_bwd``, opaque to Dynamo.

Inside ``sdpa_fwd`` the output is torch's own SDPA composite run as the unpatched compiled call runs it — the same
backend choice, mask conversion and fused aten op (``sdpa_fused.fused_forward``): the same bits — and that op's
own LSE is kept (no second pass). The call's record and plan are made there (``record.make_context``,
``plan.make_plan``: at the forward, at run time, so never a graph constant or a Dynamo guard) and filed in the
runtime state (``STATE.file_compiled_call``, bounded, no tensors): the call number travels to the backward in the
``aux`` output and the mask as an op input, so the backward reads only what the forward recorded and planned. A
plan of ``"original"`` (``auto``/``audit`` keeping the layer) runs the fused op's own aten backward
(``sdpa_fused.fused_backward``): the unpatched gradients, bit for bit.

Where no fused op applies (the math backend, a composite that changed q/k/v, a replaced SDPA), the reason is
counted and the LSE is recomputed on CUDA — by the Triton LSE kernel (``triton_lse.attention_lse``, a forward
without V) without a mask, else by a chunked FP32 pass — and an ``"original"`` plan runs an uncorrected stand-in
(that reason logged). The LSE output is (B, H, Sq) fp32 on every path, so the fake kernel needs no backend.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..runtime.config import Config
from ..dispatch.plan import BackwardPlan, ForwardTensors, kernel_reason, make_plan
from ..dispatch.record import CallRecord, Context, Problem, make_context
from ..dispatch.router import run_backward
from ..backends.compat import CUDAGRAPH_UNSAFE_TAGS
from ..runtime.state import STATE
from ..runtime import telemetry
from .sdpa_call import backward_tensors, problem_for
from .sdpa_fused import FusedForward, fused_backward, fused_forward

STAND_IN_REASON = "torch.compile: no fused SDPA op to run backward; uncorrected stand-in"
_CHUNK_ROWS = 256


@dataclass(frozen=True)
class CompiledCall:
    """What a compiled forward op leaves for its backward op (filed in ``STATE.compiled_calls``; no tensors):
    the call's context and plan, the fused op whose own backward an ``original`` plan runs (or, without one,
    whether its uncorrected stand-in can run on the kernel: decided with the plan, at the forward), and whether
    the LSE output holds an LSE."""
    problem: Problem            # without its mask tensor (the backward op gets the mask as an input)
    context: Context
    plan: BackwardPlan
    fused: Optional[FusedForward]
    stand_in_kernel: bool
    has_lse: bool

    def record(self, attn_mask: Optional[Tensor]) -> CallRecord:
        problem = self.problem if self.problem.attn_mask is None and not self.problem.padded else \
            replace(self.problem, attn_mask=attn_mask)
        return CallRecord(problem, self.context, self.plan)


def lse_fp32(q, k, attn_mask, is_causal, scale, chunk: int = _CHUNK_ROWS) -> Tensor:
    """Natural-log LSE (B, Hq, Sq) fp32 of SDPA's scores, one chunked FP32 pass (GQA by head grouping)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    kf = k.float()
    out = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    cols = torch.arange(Sk, device=q.device)
    for s0 in range(0, Sq, chunk):
        s1 = min(Sq, s0 + chunk)
        qc = q[:, :, s0:s1].float().reshape(B, Hkv, g * (s1 - s0), D)
        s = (scale * torch.matmul(qc, kf.transpose(-1, -2))).reshape(B, Hq, s1 - s0, Sk)
        if is_causal:
            rows = torch.arange(s0, s1, device=q.device)
            s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        if attn_mask is not None:
            mb = attn_mask[..., s0:s1, :] if attn_mask.dim() >= 2 and attn_mask.shape[-2] == Sq else attn_mask
            s = s.masked_fill(~mb, float("-inf")) if mb.dtype == torch.bool else s + mb.float()
        out[:, :, s0:s1] = torch.logsumexp(s, dim=-1)
    return out


def _recomputed_lse(q, k, attn_mask, is_causal, problem: Problem) -> Tensor:
    """The LSE the backward needs: one Triton launch (a forward without V) where the kernel applies, else a
    chunked FP32 pass. ``problem`` is the call's (``problem_for``: a boolean mask that is exactly the full or the
    top-left causal pattern is already flags there — what HF builds under torch.compile, where it does not skip
    the mask for ``is_causal``); such a call takes the Triton launch too: the chunked pass costs ~6 ms per layer at
    2·16·4096·128 (H200 run 26: a compiled 0.5B Llama step +138%)."""
    as_flags = problem.attn_mask is None and tuple(problem.window) == (-1, -1) and \
        (not problem.causal or problem.causal_align == "top_left")
    if not as_flags:
        return lse_fp32(q, k, attn_mask, is_causal, problem.scale)
    try:
        from ..backends.triton_bwd import kernel_unsupported_reason
        from ..backends.triton_lse import attention_lse
    except ImportError:
        return lse_fp32(q, k, attn_mask, is_causal, problem.scale)
    if kernel_unsupported_reason(q, k, k) is None:
        return attention_lse(q, k, scale=problem.scale, causal=problem.causal)
    return lse_fp32(q, k, attn_mask, is_causal, problem.scale)


@torch.library.custom_op("gproj::sdpa_fwd", mutates_args=(), tags=CUDAGRAPH_UNSAFE_TAGS)
def _sdpa_fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
              scale: Optional[float], enable_gqa: bool, layer: str, mode: str) -> Tuple[Tensor, Tensor, Tensor]:
    result = fused_forward(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    problem = problem_for(q, k, attn_mask, is_causal, scale)  # the mask's flags, derived once per call
    lse = result.lse
    if result.fused is None:
        telemetry.note_reason(f"torch.compile SDPA: {result.reason}; "
                              f"{'LSE recomputed' if q.is_cuda else 'no LSE (CPU tiers)'}",
                              telemetry.shape_class("sdpa", q, k))
        if q.is_cuda:
            lse = _recomputed_lse(q, k, attn_mask, is_causal, problem)
    from ..runtime import config
    cfg = config.active() or config.resolve(mode=mode)
    out = _in_query_layout(result.out, q, v)
    aux = torch.tensor([_plan_call(ForwardTensors(q, k, v, out, lse), problem, result.fused, layer, cfg)],
                       dtype=torch.int64)
    if lse is None:  # the output's place (no LSE: the plan knows it)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return out, lse, aux


def _plan_call(tensors: ForwardTensors, problem: Problem, fused: Optional[FusedForward], layer: str,
               cfg: Config) -> int:
    """The call's record and plan, made at the forward (inside the op, at run time: never a graph constant or
    a Dynamo guard) and filed for the backward op; returns the call number."""
    record = CallRecord(problem, make_context("sdpa", layer or None, cfg))
    record = make_plan(record, tensors, has_original=True)  # "original": the fused op's backward (or stand-in)
    stand_in_kernel = (fused is None and record.plan.tier == "original"
                       and kernel_reason(tensors, record.problem, cpu_kernel=record.context.cpu_kernel) is None)
    problem = replace(record.problem, attn_mask=None) if record.problem.attn_mask is not None else record.problem
    return STATE.file_compiled_call(CompiledCall(problem, record.context, record.plan, fused, stand_in_kernel,
                                                 has_lse=tensors.lse is not None))


def _in_query_layout(out: Tensor, q: Tensor, v: Tensor) -> Tensor:
    """The output in q's dimension order (what cuDNN returns; callers such as PyTorch's own tests check it),
    a layout the fake kernel can state without knowing which backend runs; copied only when not already so."""
    if v.shape[3] != q.shape[3]:
        return out.contiguous()
    res = torch.empty_like(q)
    if res.stride() == out.stride():
        return out
    res.copy_(out)
    return res


@_sdpa_fwd.register_fake
def _(q, k, v, attn_mask, is_causal, scale, enable_gqa, layer, mode):
    out = torch.empty_like(q) if v.shape[3] == q.shape[3] else q.new_empty(q.shape[:3] + (v.shape[3],))
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)  # on every path (the backend is not needed here)
    return out, lse, torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("gproj::sdpa_bwd", mutates_args=(), tags=CUDAGRAPH_UNSAFE_TAGS)
def _sdpa_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, attn_mask: Optional[Tensor],
              aux: Tensor, is_causal: bool, scale: Optional[float]) -> Tuple[Tensor, Tensor, Tensor]:
    call = STATE.compiled_call(int(aux[0]))
    tensors, record = backward_tensors(call.record(attn_mask), do, q, k, v, out, lse if call.has_lse else None)
    if record.problem.padded:  # the mask stayed a dense tensor: the plan made for that case
        record = CallRecord(record.problem, record.context, record.plan.dense)
    if call.fused is not None:
        dq, dk, dv = run_backward(record, tensors, lambda: fused_backward(call.fused, do, q, k, v, out, lse,
                                                                          attn_mask))[:3]
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    def stand_in():
        p = record.problem
        if call.stand_in_kernel and not p.padded:
            from ..backends.triton_bwd import gproj_backward
            return gproj_backward(tensors.do, q, k, v, out, tensors.lse, scale=p.scale, correct=False, **p.flags)
        from ..backends.fp32_tier import fp32_backward
        return fp32_backward(q, k, v, do, attn_mask=p.attn_mask, project=False, scale=p.scale, check_finite=False,
                             **p.flags)
    dq, dk, dv = run_backward(record, tensors, stand_in, stand_in_reason=STAND_IN_REASON)[:3]
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_sdpa_bwd.register_fake
def _(do, q, k, v, out, lse, attn_mask, aux, is_causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the real op


def _fwd_setup(ctx, inputs, output):
    q, k, v, attn_mask, is_causal, scale, _gqa, _layer, _mode = inputs
    out, lse, aux = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, aux)
    ctx.args = (is_causal, scale)


def _fwd_backward(ctx, dout, _dlse, _daux):
    q, k, v, out, lse, attn_mask, aux = ctx.saved_tensors
    dq, dk, dv = _sdpa_bwd(dout, q, k, v, out, lse, attn_mask, aux, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_sdpa_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def compiled_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa, *, cfg: Config,
                  layer: Optional[str]) -> Tensor:
    return _sdpa_fwd(query, key, value, attn_mask, bool(is_causal), scale, bool(enable_gqa), layer or "",
                     cfg.mode)[0]
