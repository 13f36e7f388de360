"""The flex hook inside ``torch.compile``: the forward stays in the graph, the backward is a custom op.

Dynamo traces ``_CompiledFlexFunction`` (an autograd Function): its forward is the original flex call (the
flex higher-order op, lowered by Inductor to the same fused kernel as an unpatched compiled call) plus
``gproj::flex_context``, an opaque op that makes the call's context at run time (``record.make_context``,
interned as in ``sdpa_compiled``); its backward is ``gproj::flex_bwd``, an opaque op that routes the backward
at run time (``router.run_backward``). The original fused backward is unreachable from inside an op: in
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
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import telemetry
from ..config import Config
from ..record import CallRecord, make_context
from ..router import kernel_reason
from .flex import OWN_FORWARD, SOURCE, Caller, problem_for, routed_backward, unsupported_reason
from .flex_masks import (INCONSISTENT, NO_MASK, BlockMaps, BlockStructure, MaskVerdict, Rows, classify,
                         evaluate_chunk, grid, structure_reason)
from .sdpa_compiled import _CONTEXTS, _intern

STAND_IN_REASON = "flex under torch.compile: original fused backward unreachable in a custom op; uncorrected stand-in"
MAX_COMPILED_MASK_ELEMENTS = 1 << 28  # b·h·Sq·Sk mask_mod evaluations in one compiled forward


@torch._dynamo.assume_constant_result
def _note_trace_reason(reason: str) -> bool:
    """Log (once) and count a pass-through decided while tracing, unless it is the hook's own forward (a compiled
    flex the eager hook calls: ``flex.OWN_FORWARD``; read here, at trace time, so that no guard depends on it)."""
    if not OWN_FORWARD.active:
        telemetry.note_reason(reason, (SOURCE, "compile"))
    return True


@torch._dynamo.assume_constant_result
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


@torch.library.custom_op("gproj::flex_context", mutates_args=())
def _flex_context(layer: str, mode: str) -> Tensor:
    from .. import config
    cfg = config.active() or config.resolve(mode=mode)
    return torch.tensor([_intern(make_context(SOURCE, layer or None, cfg))], dtype=torch.int64)


@_flex_context.register_fake
def _(layer, mode):
    return torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("gproj::flex_bwd", mutates_args=())
def _flex_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: Tensor,
              lo: Optional[Tensor], hi: Optional[Tensor], cnt: Optional[Tensor], violation: Optional[Tensor],
              scale: Optional[float], softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    context = _CONTEXTS[int(aux[0])]
    verdict = NO_MASK
    if lo is not None:
        verdict = MaskVerdict(reason=INCONSISTENT) if bool(violation) else \
            classify(Rows(lo, hi, cnt), None, q.shape[0], q.shape[2], k.shape[2])
    if verdict.reason is not None:
        raise RuntimeError(f"gproj flex backward: the mask checked at run time has no exact form ({verdict.reason}); "
                           "disable the patch for this call or use the eager flex_attention")
    record = CallRecord(problem_for(verdict, softcap, scale, q.shape[-1]), context)
    lse_or_none = lse if lse.numel() else None

    def stand_in():
        from ..router import BackwardTensors
        p = record.problem
        if kernel_reason(BackwardTensors(do, q, k, v, out, lse_or_none), p) is None:
            from ..backends.triton_bwd import gproj_backward
            return gproj_backward(do, q, k, v, out, lse_or_none, scale=p.scale, correct=False,
                                  max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k, **p.flags)
        from ..backends.fp32_tier import fp32_backward
        return fp32_backward(q, k, v, do, attn_mask=p.attn_mask, project=False, scale=p.scale, check_finite=False,
                             **p.flags)
    if record.problem.cu_seqlens_q is not None and q.shape[0] > 1:
        stand_in = None  # packed documents: the stand-in would need the packing too; the policy falls to FP32
    dq, dk, dv = routed_backward(record, do, q, k, v, out, lse_or_none, stand_in, stand_in_reason=STAND_IN_REASON)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_flex_bwd.register_fake
def _(do, q, k, v, out, lse, aux, lo, hi, cnt, violation, scale, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class _CompiledFlexFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, forward_fn, softcap, layer,
                mode):
        want_lse = q.device.type == "cuda"
        kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                      kernel_options=kernel_options)
        if want_lse:
            from torch.nn.attention.flex_attention import AuxRequest
            out, aux_out = forward_fn(q.detach(), k.detach(), v.detach(), return_aux=AuxRequest(lse=True), **kwargs)
            lse = aux_out.lse
        else:
            out = forward_fn(q.detach(), k.detach(), v.detach(), **kwargs)
            lse = q.new_empty((0,), dtype=torch.float32)
        aux = _flex_context(layer, mode)
        summary = (None,) * 4 if block_mask is None else \
            _mask_summary(block_mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
        ctx.save_for_backward(q, k, v, out, lse, aux, *summary)
        ctx.args = (scale, softcap)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, aux, *summary = ctx.saved_tensors
        dq, dk, dv = _flex_bwd(do, q, k, v, out, lse, aux, *summary, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _compiled_reason(q, k, score_mod, block_mask, declared_softcap) -> Optional[str]:
    """Why a call inside a compiled region passes through (trace-time decision; module docstring)."""
    from torch.nn.attention.flex_attention import _identity
    if declared_softcap is None and score_mod is not None and score_mod is not _identity:
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


def compiled_flex(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                  return_aux, *, caller: Caller, forward_fn, cfg: Config, passthrough):
    """``flex.flex`` inside a compiled region (module docstring); ``forward_fn``: the forward it resolved."""
    reason = unsupported_reason(query, key, value, block_mask, enable_gqa, return_lse, return_aux)
    if reason is None:
        reason = _compiled_reason(query, key, score_mod, block_mask, caller.declared_softcap)
    if reason is not None:
        _note_trace_reason(reason)
        return passthrough()
    softcap = 0.0 if caller.declared_softcap is None else float(caller.declared_softcap)
    return _CompiledFlexFunction.apply(query, key, value, score_mod, block_mask, scale, bool(enable_gqa),
                                       kernel_options, forward_fn, softcap, caller.layer or "", cfg.mode)
