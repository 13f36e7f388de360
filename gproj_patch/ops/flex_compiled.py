"""The flex hook inside ``torch.compile``: the forward stays in the graph, the backward is a custom op.

Dynamo traces ``_CompiledFlexFunction`` (an autograd Function): its forward is the original flex call (the
flex higher-order op, lowered by Inductor to the same fused kernel as an unpatched compiled call) plus
``gproj::flex_context``, an opaque op that makes the call's record and plan at run time (``record.make_context``,
``plan.make_plan``, from the forward's q, k, v, output, LSE and mask summaries; filed in the runtime state under
a call number that travels through the graph); its backward is ``gproj::flex_bwd``, an opaque op that carries the plan out at run time
(``router.run_backward``). The original fused backward is unreachable from inside an op: in
``auto``/``audit`` a policy choice of "original" runs an uncorrected stand-in, with that reason logged.

What is decided at trace time (a non-supported call keeps the original compiled forward *and* backward; its
reason is logged once per trace, the compiled calls themselves are not counted):

* ``score_mod``: none, flex's identity, or a softcap declared by the caller (the HF hook). Closures made
  inside the compiled region cannot be read there, so other score_mods pass through;
* ``block_mask``: any whose (b, h, q, kv) grid has at most ``MAX_COMPILED_MASK_ELEMENTS`` elements. Its
  ``mask_mod`` is evaluated *in the graph* at the forward (vmapped over the grid, as ``create_block_mask``
  does; closures and captured tensors included, a transient bool grid unless Inductor fuses the reductions)
  and reduced to per-row summaries (first/last visible key, count) plus a block-structure consistency flag,
  which the backward op reads at run time (``flex_masks.classify``): flags, documents, or the dense mask
  rebuilt from row intervals. A mask with no exact form there (rows that are not key intervals beyond the
  dense budget, a block structure that disagrees with its mask_mod) raises in the backward, never a silent
  wrong gradient; eager calls handle those (dense mask or pass-through).
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..runtime import telemetry
from ..backends.compat import assume_constant_result, flex_identity_score_mod
from ..runtime.config import Config
from ..dispatch.plan import ForwardTensors, kernel_reason, make_plan
from ..dispatch.record import BackwardPlan, CallRecord, Context, make_context
from ..backends.compat import CUDAGRAPH_UNSAFE_TAGS
from ..runtime.state import STATE
from .flex_call import OWN_FORWARD, SOURCE, Caller, FlexCall, problem_for, routed_backward, unsupported_reason
from .flex_masks import (INCONSISTENT, NO_MASK, BlockMaps, BlockStructure, MaskVerdict, Rows, classify,
                         evaluate_chunk, grid, structure_reason)

STAND_IN_REASON = "flex under torch.compile: original fused backward unreachable in a custom op; uncorrected stand-in"
MAX_COMPILED_MASK_ELEMENTS = 1 << 28  # b·h·Sq·Sk mask_mod evaluations in one compiled forward


@assume_constant_result
def _note_trace_reason(reason: str) -> bool:
    """Log (once) and count a pass-through decided while tracing, unless it is the hook's own forward (a compiled
    flex the eager hook calls: ``flex.OWN_FORWARD``; read here, at trace time, so that no guard depends on it)."""
    if not OWN_FORWARD.active:
        telemetry.note_reason(reason, (SOURCE, "compile"))
    return True


@assume_constant_result
def _mask_grid(code: types.CodeType, block_batch: int, block_heads: int, batch: int, heads: int) -> Tuple[int, int]:
    """``flex_masks.grid`` at trace time (bytecode inspection is not traceable)."""
    return grid(code, block_batch, block_heads, batch, heads)


def _mask_summary(block_mask, batch: int, heads: int, sq: int, sk: int, device):
    """(lo, hi, cnt, violation) of the block mask, computed by traced ops (module docstring)."""
    blocks = BlockStructure.of(block_mask)
    nb, nh = _mask_grid(block_mask.mask_mod.__code__, blocks.kv_num_blocks.shape[0], blocks.kv_num_blocks.shape[1],
                        batch, heads)
    _, rows, bad = evaluate_chunk(block_mask.mask_mod, BlockMaps(blocks, sk), nb, nh,
                                  torch.arange(sq, device=device), sk)
    return rows.lo, rows.hi, rows.cnt, bad


def _verdict(q, k, lo, hi, cnt, violation) -> MaskVerdict:
    """The call's mask as the backends take it, from the forward's in-graph summaries (``flex_masks.classify``):
    a pure function of forward data, evaluated by both ops."""
    if lo is None:
        return NO_MASK
    if bool(violation):
        return MaskVerdict(reason=INCONSISTENT)
    return classify(Rows(lo, hi, cnt), None, q.shape[0], q.shape[2], k.shape[2])


@dataclass(frozen=True)
class FlexCompiledCall:
    """What the forward op ``gproj::flex_context`` files for the backward op (no tensors): the call's context
    and plan, whether the uncorrected stand-in of an ``original`` plan can run on the kernel, and the mask's
    reason when it has no exact form (raised by the backward, as before plans existed)."""
    context: Context
    plan: Optional[BackwardPlan]
    stand_in_kernel: bool
    mask_error: Optional[str] = None


@torch.library.custom_op("gproj::flex_context", mutates_args=(), tags=CUDAGRAPH_UNSAFE_TAGS)
def _flex_context(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lo: Optional[Tensor],
                  hi: Optional[Tensor], cnt: Optional[Tensor], violation: Optional[Tensor], scale: Optional[float],
                  softcap: float, layer: str, mode: str) -> Tensor:
    """The call's record and plan, made at the forward (at run time: never a graph constant or a guard)."""
    from ..runtime import config
    cfg = config.active() or config.resolve(mode=mode)
    context = make_context(SOURCE, layer or None, cfg)
    verdict = _verdict(q, k, lo, hi, cnt, violation)
    if verdict.reason is not None:
        return _filed(FlexCompiledCall(context, None, False, mask_error=verdict.reason))
    record = CallRecord(problem_for(verdict, softcap, scale, q.shape[-1]), context)
    tensors = ForwardTensors(q, k, v, out, lse if lse.numel() else None)
    packed = record.problem.cu_seqlens_q is not None and q.shape[0] > 1
    # packed documents: the stand-in would need the packing too, so there is no "original" (the policy falls to FP32)
    record = make_plan(record, tensors, has_original=not packed)
    stand_in_kernel = (record.plan.tier == "original"
                       and kernel_reason(tensors, record.problem, cpu_kernel=context.cpu_kernel) is None)
    return _filed(FlexCompiledCall(context, record.plan, stand_in_kernel))


def _filed(call: FlexCompiledCall) -> Tensor:
    return torch.tensor([STATE.file_compiled_call(call)], dtype=torch.int64)


@_flex_context.register_fake
def _(q, k, v, out, lse, lo, hi, cnt, violation, scale, softcap, layer, mode):
    return torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("gproj::flex_bwd", mutates_args=(), tags=CUDAGRAPH_UNSAFE_TAGS)
def _flex_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: Tensor,
              lo: Optional[Tensor], hi: Optional[Tensor], cnt: Optional[Tensor], violation: Optional[Tensor],
              scale: Optional[float], softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    call = STATE.compiled_call(int(aux[0]))
    if call.mask_error is not None:
        raise RuntimeError(f"gproj flex backward: the mask checked at run time has no exact form "
                           f"({call.mask_error}); disable the patch for this call or use the eager flex_attention")
    problem = problem_for(_verdict(q, k, lo, hi, cnt, violation), softcap, scale, q.shape[-1])
    record = CallRecord(problem, call.context, call.plan)
    lse_or_none = lse if lse.numel() else None

    def stand_in():
        p = record.problem
        if call.stand_in_kernel:
            from ..backends.triton_bwd import gproj_backward
            return gproj_backward(do, q, k, v, out, lse_or_none, scale=p.scale, correct=False,
                                  max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k, **p.flags)
        from ..backends.fp32_tier import fp32_backward
        return fp32_backward(q, k, v, do, attn_mask=p.attn_mask, project=False, scale=p.scale, check_finite=False,
                             **p.flags)
    packed = problem.cu_seqlens_q is not None and q.shape[0] > 1
    dq, dk, dv = routed_backward(record, do, q, k, v, out, lse_or_none, None if packed else stand_in,
                                 stand_in_reason=STAND_IN_REASON)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_flex_bwd.register_fake
def _(do, q, k, v, out, lse, aux, lo, hi, cnt, violation, scale, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class _CompiledFlexFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: FlexCall, softcap, layer, mode):
        """``call``: the original call's arguments and forward (its ``forward_lse`` is not read here: the LSE is
        asked for on CUDA); ``softcap``, ``layer``, ``mode``: what the record is made of."""
        block_mask, scale = call.block_mask, call.scale
        want_lse = q.device.type == "cuda"
        kwargs = dict(score_mod=call.score_mod, block_mask=block_mask, scale=scale, enable_gqa=call.enable_gqa,
                      kernel_options=call.kernel_options)
        if want_lse:
            from torch.nn.attention.flex_attention import AuxRequest
            out, aux_out = call.forward_fn(q.detach(), k.detach(), v.detach(), return_aux=AuxRequest(lse=True),
                                           **kwargs)
            lse = aux_out.lse
        else:
            out = call.forward_fn(q.detach(), k.detach(), v.detach(), **kwargs)
            lse = q.new_empty((0,), dtype=torch.float32)
        summary = (None,) * 4 if block_mask is None else \
            _mask_summary(block_mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
        aux = _flex_context(q, k, v, out, lse, *summary, scale, softcap, layer, mode)
        ctx.save_for_backward(q, k, v, out, lse, aux, *summary)
        ctx.args = (scale, softcap)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, aux, *summary = ctx.saved_tensors
        dq, dk, dv = _flex_bwd(do, q, k, v, out, lse, aux, *summary, *ctx.args)
        return dq, dk, dv, None, None, None, None


def _compiled_reason(q, k, score_mod, block_mask, declared_softcap) -> Optional[str]:
    """Why a call inside a compiled region passes through (trace-time decision; module docstring)."""
    if declared_softcap is None and score_mod is not None and score_mod is not flex_identity_score_mod():
        return "flex under torch.compile: score_mod is not readable inside the compiled region"
    if block_mask is None:
        return None
    blocks = BlockStructure.of(block_mask)
    reason = structure_reason(blocks, q.shape[0], q.shape[1])
    if reason is not None:
        return f"flex: {reason}"
    nb, nh = _mask_grid(block_mask.mask_mod.__code__, blocks.kv_num_blocks.shape[0], blocks.kv_num_blocks.shape[1],
                        q.shape[0], q.shape[1])
    if nb * nh * q.shape[2] * k.shape[2] > MAX_COMPILED_MASK_ELEMENTS:
        return "flex under torch.compile: BlockMask grid too large to check in the graph (eager calls check it)"
    return None


def compiled_flex(query, key, value, call: FlexCall, return_lse, return_aux, *, caller: Caller, cfg: Config,
                  passthrough):
    """``flex.flex`` inside a compiled region (module docstring); ``call``: the call's arguments and the forward
    ``flex`` resolved; ``return_lse``/``return_aux``: what the caller asked for besides the output."""
    reason = unsupported_reason(query, key, value, call.block_mask, call.enable_gqa, return_lse, return_aux)
    if reason is None:
        reason = _compiled_reason(query, key, call.score_mod, call.block_mask, caller.declared_softcap)
    if reason is not None:
        _note_trace_reason(reason)
        return passthrough()
    softcap = 0.0 if caller.declared_softcap is None else float(caller.declared_softcap)
    return _CompiledFlexFunction.apply(query, key, value, call, softcap, caller.layer or "", cfg.mode)
