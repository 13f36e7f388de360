"""One FlexAttention call as the hooks take it (eager ``ops/flex.py`` and compiled ``ops/flex_compiled.py``
alike): the original function the hook replaced, the score_mods and masks it recognises, the call's
``Problem``, pass-through reasons and the routed backward. Imports neither hook module (they import it).
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from ..backends.compat import FLEX_SLICED_MASK_MOD, flex_identity_score_mod
from ..backends.spec import default_scale
from ..dispatch.record import CallRecord, Problem
from ..dispatch.router import BackwardTensors, run_backward
from .flex_masks import NO_MASK, BlockStructure, MaskVerdict, analyse

SOURCE = "flex"


SLICED_MASK_MOD = FLEX_SLICED_MASK_MOD  # the stub flex puts in a sliced BlockMask (compat)


NO_FLEX_BACKWARD = ("cpu", "mps")  # devices where PyTorch's flex raises when inputs require grad


_PLAIN = (torch.Tensor, torch.nn.Parameter)


_HF_SCORE_MOD_NAME = "score_mod"


@dataclass(frozen=True, eq=False)
class FlexCall:
    """The original call's arguments (what the forward runs again) and how to run it."""
    score_mod: Optional[Callable]
    block_mask: object
    scale: Optional[float]
    enable_gqa: bool
    kernel_options: Optional[dict]
    forward_fn: Callable  # (q, k, v, score_mod=, block_mask=, scale=, enable_gqa=, kernel_options=, return_aux=)
    forward_lse: bool = True  # ask forward_fn for the LSE (HF's Inductor-compiled flex on CPU has none)


class _Original:
    """The flex_attention function the hook replaced (``integrations/flex.py`` sets it while installed)."""
    fn: Optional[Callable] = None


def original_flex() -> Callable:
    if _Original.fn is None:
        from torch.nn.attention.flex_attention import flex_attention
        _Original.fn = flex_attention
    return _Original.fn


def set_original(fn: Optional[Callable]) -> None:
    _Original.fn = fn


def softcap_score_mod(cap: float) -> Callable:
    """A score_mod ``cap · tanh(score / cap)`` this hook recognises exactly (eager calls)."""
    cap = float(cap)
    if not cap > 0.0:
        raise ValueError(f"softcap must be > 0, got {cap!r}")

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap


_SOFTCAP_CODE = softcap_score_mod(1.0).__code__


def _hf_score_mod_code():
    """The code object of HF's ``flex_attention_forward`` score_mod closure, when Transformers is loaded."""
    import sys
    module = sys.modules.get("transformers.integrations.flex_attention")
    fn = getattr(module, "flex_attention_forward", None)
    for const in getattr(getattr(fn, "__code__", None), "co_consts", ()):
        if getattr(const, "co_name", None) == _HF_SCORE_MOD_NAME:
            return const
    return None


def _cells(fn) -> Dict[str, object]:
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())}


def score_mod_softcap(score_mod, declared_softcap: Optional[float] = None) -> Tuple[float, Optional[str]]:
    """(softcap, None) for a score_mod this hook computes exactly (0 = none), else (0, reason). Eager only:
    under compile, closures are not readable (``flex_compiled`` accepts only none or a declared softcap)."""
    _identity = flex_identity_score_mod()
    if declared_softcap is not None:
        return float(declared_softcap), None
    if score_mod is None or score_mod is _identity:
        return 0.0, None
    code = getattr(score_mod, "__code__", None)
    if code is _SOFTCAP_CODE:
        return float(_cells(score_mod)["cap"]), None
    if code is not None and code is _hf_score_mod_code():
        cells = _cells(score_mod)
        if cells.get("score_mask") is None and cells.get("position_bias") is None:
            cap = cells.get("softcap")
            return (0.0 if cap is None else float(cap)), None
        return 0.0, "flex: HF score_mod with an additive score mask or position bias"
    return 0.0, f"flex: score_mod {getattr(score_mod, '__name__', type(score_mod).__name__)} not recognised"


#: bounded cache: a BlockMask's verdict per (id, batch, heads), each entry dropped when its BlockMask is freed
#: (weakref.finalize), so it holds no more entries than there are live BlockMask objects (× batch/head shapes)
_VERDICTS: Dict[Tuple[int, int, int], MaskVerdict] = {}


def mask_verdict(block_mask, q: Tensor, k: Tensor) -> MaskVerdict:
    """The block mask's exact form for this call, computed once per (BlockMask object, batch, heads)."""
    if block_mask is None:
        return NO_MASK
    key = (id(block_mask), q.shape[0], q.shape[1])
    verdict = _VERDICTS.get(key)
    if verdict is None:
        verdict = analyse(block_mask.mask_mod, BlockStructure.of(block_mask), q.shape[0], q.shape[1], q.shape[2],
                          k.shape[2], q.device)
        _VERDICTS[key] = verdict
        weakref.finalize(block_mask, _VERDICTS.pop, key, None)
    return verdict


def unsupported_reason(q, k, v, block_mask, enable_gqa: bool, return_lse: bool, return_aux) -> Optional[str]:
    """Why this flex call keeps the original path, before its score_mod and mask are looked at."""
    subclass = [type(t).__name__ for t in (q, k, v) if type(t) not in _PLAIN]
    if subclass:
        return f"flex: tensor subclass {', '.join(dict.fromkeys(subclass))}"
    if any(t.is_nested for t in (q, k, v)):
        return "flex: nested tensors"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or any(t.numel() == 0 for t in (q, k, v)):
        return "flex: inputs are not non-empty 4-D (B, H, S, D)"
    if q.shape[0] != k.shape[0] or k.shape[1] == 0 or q.shape[1] % k.shape[1] or q.dtype != k.dtype:
        return "flex: broadcast batch, head counts or dtypes the backends do not take"
    if q.shape[1] != k.shape[1] and not enable_gqa:
        return "flex: different head counts without enable_gqa (the original decides)"
    if return_lse or (return_aux is not None and (return_aux.lse or return_aux.max_scores)):
        return "flex: LSE / max scores requested as outputs (their gradients are not the corrected backward's)"
    if block_mask is not None and tuple(block_mask.seq_lengths) != (q.shape[2], k.shape[2]):
        return "flex: BlockMask made for other sequence lengths (the original decides)"
    if block_mask is not None and getattr(block_mask.mask_mod, "__name__", "") == SLICED_MASK_MOD:
        return "flex: sliced BlockMask (no mask_mod; the original decides)"
    return None


def problem_for(verdict: MaskVerdict, softcap: float, scale: Optional[float], head_dim: int) -> Problem:
    return Problem(scale=default_scale(head_dim, scale), causal=verdict.causal, causal_align=verdict.causal_align,
                   window=verdict.window, softcap=softcap, cu_seqlens_q=verdict.cu_seqlens,
                   cu_seqlens_k=verdict.cu_seqlens, max_seqlen_q=verdict.max_seqlen, max_seqlen_k=verdict.max_seqlen,
                   attn_mask=verdict.dense)


def _pack(t: Tensor) -> Tensor:
    """(B, H, S, ...) -> (1, H, B·S, ...): the batch packed along the sequence (varlen documents)."""
    return t.transpose(0, 1).reshape(1, t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:])


def _unpack(t: Tensor, batch: int) -> Tensor:
    return t.reshape(t.shape[1], batch, t.shape[2] // batch, *t.shape[3:]).transpose(0, 1)


def routed_backward(record: CallRecord, do, q, k, v, out, lse, original=None, stand_in_reason=None):
    """(dq, dk, dv) through the router; documents over a batch > 1 run packed as one varlen sequence."""
    batch = q.shape[0]
    packed = record.problem.cu_seqlens_q is not None and batch > 1
    if packed:
        do, q, k, v, out = (_pack(t) for t in (do, q, k, v, out))
        lse = None if lse is None else _pack(lse.reshape(batch, q.shape[1], -1))
        if original is not None:  # the caller's backward returns unpacked gradients: pack them like the others
            unpacked_original = original

            def original():
                return tuple(_pack(g) for g in unpacked_original()[:3])
    grads = run_backward(record, BackwardTensors(do, q, k, v, out, lse), original, stand_in_reason=stand_in_reason)
    return tuple(_unpack(g, batch) for g in grads[:3]) if packed else tuple(grads[:3])


class _OwnForward(threading.local):
    """``active`` while the hook runs its forward function itself. A compiled flex it calls (HF's
    ``torch.compile(flex_attention)``) runs this hook again, traced, and passes the call through (it asks for the
    LSE, or runs without grad): a pass-through that is the hook's own, not a fallback to report
    (``flex_compiled._note_trace_reason`` reads this at trace time only, so no Dynamo guard depends on it)."""
    active = False


OWN_FORWARD = _OwnForward()


@dataclass(frozen=True)
class Caller:
    """What a hook that is not torch's ``flex_attention`` itself tells ``flex`` (the HF hook).

    ``declared_softcap``: it built ``score_mod`` as exactly that softcap. ``forward_fn``: the function that
    computes the forward (None: the original flex_attention; the HF hook passes HF's compiled one).
    ``forward_lse``: whether to ask that function for the LSE (eager calls; False where it has none).
    ``layer``: the call's name for the policy when no ``layer_scope`` is open."""
    declared_softcap: Optional[float] = None
    forward_fn: Optional[Callable] = None
    forward_lse: bool = True
    layer: Optional[str] = None


FLEX_ATTENTION = Caller()  # a call of flex_attention itself
