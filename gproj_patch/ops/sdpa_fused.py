"""SDPA's own fused op inside the compiled SDPA hook (``ops/sdpa_compiled.py``): the forward runs torch's SDPA
composite — the same backend choice, mask conversion and fused aten op as the unpatched compiled call — and keeps
that op's own LSE, and an ``"original"`` backward runs that op's own aten backward.

``fused_forward`` runs the composite once (``compat.sdpa_fused_call``: as a training call, so the choice and the
LSE are those of the unpatched call's joint graph) and returns its output, the LSE as (B, H, Sq) fp32, and a
``FusedForward``: what the op's backward needs besides tensors the backward op already has (scalars, the layouts
of the op's output and LSE, the metadata of its dropout RNG state), never a tensor. Where the fused path does not
apply (the math backend, q/k/v changed by the composite before the op, ...) it says why, and the caller keeps
its LSE recompute. ``fused_backward`` rebuilds the op's own output and LSE layouts (the efficient op's LSE padding
is +inf, as its forward writes it) and the mask's bias (the composite run up to the op, that backend only), and
calls the op's backward: bitwise the unpatched backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backends.compat import BUILTIN_SDPA, SDPA_FUSED_OPS, sdpa_fused_backward, sdpa_fused_call
from ..backends.spec import normalize_lse
from .sdpa_call import original_sdpa

NOT_BUILTIN = "the SDPA function the hook replaced is not torch's builtin"
MATH_BACKEND = "SDPA chose no fused op (math backend)"
INPUTS_CHANGED = "SDPA's composite changed q/k/v before its fused op (head-dim padding)"
SEQUENCE_OFFSETS = "the fused op returned sequence offsets (nested inputs)"
_LSE_PAD = float("inf")  # the efficient op pads its LSE past Sq with +inf (its forward writes it so)

Layout = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (shape, stride)


@dataclass(frozen=True)
class FusedForward:
    """One fused forward, as its backward needs it (no tensors; filed with the call's plan)."""
    op: str                                   # the aten forward op (compat.SDPA_FUSED_OPS)
    sdpa: Tuple[bool, Optional[float], bool]  # SDPA's is_causal, scale, enable_gqa (to rebuild the mask's bias)
    scalars: Tuple[Tuple[str, object], ...]   # dropout_p, is_causal, scale, max_q, max_k as the op took/returned
    rng: Tuple[Optional[Tuple[Tuple[int, ...], torch.dtype, str]], ...]  # its RNG state outputs' metadata
    out_layout: Layout                        # the op's own output
    lse_layout: Layout                        # the op's own LSE
    biased: bool                              # the op took a bias made from the mask


@dataclass(frozen=True, eq=False)
class FusedResult:
    out: Tensor                     # SDPA's output (same bits as the unpatched call)
    lse: Optional[Tensor]           # the fused op's LSE as (B, H, Sq) fp32 contiguous, or None
    fused: Optional[FusedForward]   # None: the fused path does not apply (``reason``)
    reason: Optional[str]


def _layout(t: Tensor) -> Layout:
    return tuple(t.shape), tuple(t.stride())


def _canonical_lse(lse: Tensor, q: Tensor) -> Tensor:
    """The op's LSE as a fresh (B, H, Sq) fp32 contiguous tensor (flash's already is: kept as it is)."""
    B, H, Sq = q.shape[:3]
    if tuple(lse.shape) == (B, H, Sq) and lse.dtype == torch.float32 and lse.is_contiguous():
        return lse
    return torch.empty((B, H, Sq), dtype=torch.float32, device=q.device).copy_(normalize_lse(lse, B, H, Sq))


def fused_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                  scale: Optional[float], enable_gqa: bool) -> FusedResult:
    """SDPA's output with the fused op's own LSE (inside the compiled forward op: autograd is below, nothing is
    recorded), or the output with the reason the fused path does not apply."""
    if original_sdpa() is not BUILTIN_SDPA:
        with torch.no_grad():
            out = original_sdpa()(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                                  enable_gqa=enable_gqa)
        return FusedResult(out, None, None, NOT_BUILTIN)
    out, call = sdpa_fused_call(q, k, v, attn_mask, is_causal, scale, enable_gqa)
    if call is None:
        return FusedResult(out, None, None, MATH_BACKEND)
    a, spec = call.args, SDPA_FUSED_OPS[call.op]
    if a["query"] is not q or a["key"] is not k or a["value"] is not v or call.outputs[0] is not out:
        return FusedResult(out, None, None, INPUTS_CHANGED)
    seqlens = tuple(call.outputs[i] for i in spec.seqlens)
    if any(isinstance(t, Tensor) for t in seqlens):
        return FusedResult(out, None, None, SEQUENCE_OFFSETS)
    lse = call.outputs[1]
    rng = tuple(None if t is None else (tuple(t.shape), t.dtype, str(t.device))
                for t in (call.outputs[i] for i in spec.rng))
    scalars = (("dropout_p", a["dropout_p"]), ("is_causal", a["is_causal"]), ("scale", a["scale"]),
               ("max_q", seqlens[2] if seqlens else None), ("max_k", seqlens[3] if seqlens else None))
    bias = a.get("attn_bias", a.get("attn_mask"))
    fused = FusedForward(call.op, (is_causal, scale, enable_gqa), scalars, rng, _layout(out), _layout(lse),
                         biased=bias is not None)
    return FusedResult(out, _canonical_lse(lse, q), fused, None)


def _as_layout(t: Tensor, layout: Layout, fill: Optional[float] = None) -> Tensor:
    """``t`` (same values) in ``layout``; an LSE laid out as (B, H, Sq[+pad]) or (B, H, Sq, 1) takes ``fill`` on
    the padded rows."""
    shape, stride = layout
    if tuple(t.shape) == shape and tuple(t.stride()) == stride:
        return t
    raw = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    target = raw.select(-1, 0) if raw.dim() == t.dim() + 1 else raw  # cuDNN's (B, H, Sq, 1)
    n = t.shape[-1]
    if target.shape[-1] > n:  # the efficient op's (B, H, ceil(Sq/32)·32)
        target[..., n:].fill_(fill)
    target[..., :n].copy_(t)
    return raw


def _bias(f: FusedForward, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor]) -> Optional[Tensor]:
    """The bias the op took: the composite run again up to the op (not running it), with only its backend."""
    if not f.biased:
        return None
    is_causal, scale, enable_gqa = f.sdpa
    _, call = sdpa_fused_call(q, k, v, attn_mask, is_causal, scale, enable_gqa, stop=True,
                              backend=SDPA_FUSED_OPS[f.op].backend)
    if call is None or call.op != f.op:
        raise RuntimeError(f"SDPA's composite no longer calls {f.op} for this call's inputs (its mask's bias for "
                           "the original backward cannot be rebuilt)")
    return call.args.get("attn_bias", call.args.get("attn_mask"))


def fused_backward(f: FusedForward, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   attn_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """The fused op's own backward on the forward's tensors: the unpatched compiled backward, bit for bit."""
    rng = tuple(None if m is None else torch.zeros(m[0], dtype=m[1], device=m[2]) for m in f.rng)  # unread at p=0
    tensors = dict(grad_out=do, query=q, key=k, value=v, out=_as_layout(out, f.out_layout),
                   logsumexp=_as_layout(lse, f.lse_layout, _LSE_PAD), attn_bias=_bias(f, q, k, v, attn_mask),
                   cum_seq_q=None, cum_seq_k=None)
    tensors.update((f"rng_{i}", t) for i, t in enumerate(rng))
    with torch.no_grad():
        return sdpa_fused_backward(f.op, tensors, dict(f.scalars))
