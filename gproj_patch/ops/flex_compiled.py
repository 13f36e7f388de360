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
* ``block_mask``: none, or a ``mask_mod`` with no free variables (a pure function of its indices and module
  globals). Its code is interned at trace time (``_intern_mask_mod``); the op rebuilds it at run time and
  ``flex_masks.analyse`` checks it against the real block tensors (cached per block-tensor content). mask_mods
  that capture variables (document ids, HF's padding closures) pass through under compile.
"""
from __future__ import annotations

import hashlib
import sys
import threading
import types
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .. import telemetry
from ..config import Config
from ..record import CallRecord, make_context
from ..router import kernel_reason
from .flex import SOURCE, problem_for, routed_backward, unsupported_reason
from .flex_masks import NO_MASK, BlockStructure, MaskVerdict, analyse
from .sdpa_compiled import _CONTEXTS, _intern

STAND_IN_REASON = "flex under torch.compile: original fused backward unreachable in a custom op; uncorrected stand-in"
NO_MASK_INDEX = -1
_MASK_ARGS = 4
_VERDICT_CACHE_SIZE = 64

_lock = threading.Lock()
_MASK_MODS: List[Tuple[types.CodeType, str]] = []
_VERDICTS: Dict[Tuple, MaskVerdict] = {}


@torch._dynamo.assume_constant_result
def _intern_mask_mod(code: types.CodeType, module: str) -> int:
    """Index of (code, module) in the mask_mod registry (runs once, at trace time)."""
    with _lock:
        entry = (code, module)
        if entry not in _MASK_MODS:
            _MASK_MODS.append(entry)
        return _MASK_MODS.index(entry)


@torch._dynamo.assume_constant_result
def _note_trace_reason(reason: str) -> bool:
    """Log (once) and count a pass-through decided while tracing."""
    telemetry.note_reason(reason, (SOURCE, "compile"))
    return True


def _mask_mod_at_runtime(index: int):
    code, module = _MASK_MODS[index]
    return types.FunctionType(code, vars(sys.modules[module]))


def _digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        if t is not None:
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
            h.update(str(tuple(t.shape)).encode())
    return h.hexdigest()


def _runtime_verdict(index: int, blocks: BlockStructure, q: Tensor, k: Tensor) -> MaskVerdict:
    if index == NO_MASK_INDEX:
        return NO_MASK
    key = (index, tuple(q.shape[:3]), k.shape[2], blocks.block_size,
           _digest((blocks.kv_num_blocks, blocks.kv_indices, blocks.full_kv_num_blocks, blocks.full_kv_indices)))
    verdict = _VERDICTS.get(key)
    if verdict is None:
        verdict = analyse(_mask_mod_at_runtime(index), blocks, q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                          q.device)
        with _lock:
            if len(_VERDICTS) >= _VERDICT_CACHE_SIZE:
                _VERDICTS.pop(next(iter(_VERDICTS)))
            _VERDICTS[key] = verdict
    return verdict


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
              kv_num_blocks: Optional[Tensor], kv_indices: Optional[Tensor], full_kv_num_blocks: Optional[Tensor],
              full_kv_indices: Optional[Tensor], mask_index: int, block_q: int, block_k: int,
              scale: Optional[float], softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    context = _CONTEXTS[int(aux[0])]
    blocks = BlockStructure(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, (block_q, block_k))
    verdict = _runtime_verdict(mask_index, blocks, q, k)
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
def _(do, q, k, v, out, lse, aux, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, mask_index,
      block_q, block_k, scale, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class _CompiledFlexFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, forward_fn, mask_index,
                softcap, layer, mode):
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
        if block_mask is None:
            blocks, sizes = (None, None, None, None), (0, 0)
        else:
            blocks = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                      block_mask.full_kv_indices)
            sizes = (block_mask.BLOCK_SIZE[0], block_mask.BLOCK_SIZE[1])
        ctx.save_for_backward(q, k, v, out, lse, aux, *blocks)
        ctx.args = (mask_index, sizes[0], sizes[1], scale, softcap)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, aux, *blocks = ctx.saved_tensors
        dq, dk, dv = _flex_bwd(do, q, k, v, out, lse, aux, *blocks, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


def _compiled_reason(score_mod, block_mask, declared_softcap) -> Tuple[Optional[str], int]:
    """(reason to pass through or None, mask index) — trace-time decisions (module docstring)."""
    from torch.nn.attention.flex_attention import _identity
    if declared_softcap is None and score_mod is not None and score_mod is not _identity:
        return "flex under torch.compile: score_mod is not readable inside the compiled region", NO_MASK_INDEX
    if block_mask is None:
        return None, NO_MASK_INDEX
    code = block_mask.mask_mod.__code__
    if code.co_freevars or code.co_argcount != _MASK_ARGS or code.co_kwonlyargcount:
        return "flex under torch.compile: mask_mod captures variables (checked only in eager calls)", NO_MASK_INDEX
    return None, _intern_mask_mod(code, block_mask.mask_mod.__module__)


def compiled_flex(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                  return_aux, *, declared_softcap: Optional[float], forward_fn, layer: Optional[str], cfg: Config,
                  passthrough):
    reason = unsupported_reason(query, key, value, block_mask, enable_gqa, return_lse, return_aux)
    mask_index = NO_MASK_INDEX
    if reason is None:
        reason, mask_index = _compiled_reason(score_mod, block_mask, declared_softcap)
    if reason is not None:
        _note_trace_reason(reason)
        return passthrough()
    softcap = 0.0 if declared_softcap is None else float(declared_softcap)
    return _CompiledFlexFunction.apply(query, key, value, score_mod, block_mask, scale, bool(enable_gqa),
                                       kernel_options, forward_fn, mask_index, softcap, layer or "", cfg.mode)
