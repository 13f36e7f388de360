"""Boolean masks the GProj kernel can take as flags instead of a mask tensor.

``mask_as_flags`` (at the forward): a mask that is exactly a causal / sliding-window / full pattern, shared by
every batch and head, becomes the flags. ``padding_as_flags`` (at the backward, from the recorded mask and dO):
a right-padded causal (or windowed) mask whose padded query rows have an exactly zero output gradient — those
rows contribute nothing to any gradient, so the others are computed with the flags and the dead rows get
LSE = +inf (P = 0) in the kernel. ``padding_as_varlen`` (at the backward): left (and/or right) padding around a
causal (or windowed) pattern, zero dO on every row that differs, handed to the kernel as varlen segments over
the flattened batch (``PackedPadding``). All are exact; anything else stays a mask (FP32 tier).

Why in ``dispatch/``: this is how one call's mask becomes its ``Problem`` (flags, dead rows, varlen segments) and
its ``BackwardTensors`` on the way to the router, the same for every hook that takes a boolean mask (the SDPA
seam, HF eager); it belongs to no single hook.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backends.spec import MaskSpec, normalize_lse
from .record import Problem
from .router import BackwardTensors


def mask_as_flags(attn_mask: Optional[Tensor], sq: int, sk: int):
    """(attn_mask or None, causal, causal_align, window): a boolean mask that is exactly a causal / sliding
    window / full pattern, shared by every batch and head, is replaced by the flags the kernel takes."""
    if attn_mask is None or attn_mask.dtype != torch.bool or attn_mask.shape[-2:] != (sq, sk):
        return attn_mask, False, "top_left", (-1, -1)
    m = attn_mask.reshape(-1, sq, sk)
    m0 = m[0]
    if m.shape[0] > 1 and not torch.equal(m, m0.expand_as(m)):
        return attn_mask, False, "top_left", (-1, -1)
    if bool(m0.all()):
        return None, False, "top_left", (-1, -1)
    i = torch.arange(sq, device=m0.device)[:, None]
    j = torch.arange(sk, device=m0.device)[None, :]
    for align in ("top_left", "bottom_right") if sq != sk else ("top_left",):
        shift = sk - sq if align == "bottom_right" else 0
        last = sq - 1 + shift
        n_last = int(m0[-1].sum())
        left = n_last - 1 if 0 <= last < sk and n_last - 1 < last else -1
        spec = MaskSpec(causal=True, causal_align=align, window=(left, -1))
        if torch.equal(m0, spec.visible(i, j, sq, sk)):
            return None, True, align, (left, -1)
    return attn_mask, False, "top_left", (-1, -1)


def padding_as_flags(attn_mask: Optional[Tensor], do: Tensor, sq: int, sk: int):
    """Right padding: a boolean mask that is a causal (or causal + sliding window) pattern on every row whose
    output gradient is nonzero. Returns ``(window, dead_rows (B, Sq) bool)`` or None.

    Rows whose dO is exactly zero (padded positions whose labels are ignored, the usual right-padded batch)
    contribute nothing to any gradient, whatever their mask row; computing the others with the causal flags is
    exact, and the dead rows are zeroed by giving them LSE = +inf (P = 0). Only the first candidate pattern
    that fits is used: causal, else causal with the widest window the mask shows."""
    if attn_mask is None or attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[1] != 1 \
            or attn_mask.shape[-2:] != (sq, sk) or sq != sk:
        return None
    m = attn_mask[:, 0]
    i = torch.arange(sq, device=m.device)[:, None]
    j = torch.arange(sk, device=m.device)[None, :]
    live = do.abs().amax(dim=(1, 3)) != 0  # (B, Sq): rows whose output gradient is nonzero
    widest = int(m.sum(-1).max())
    for left in dict.fromkeys((-1, widest - 1 if widest < sk else -1)):
        pattern = MaskSpec(causal=True, window=(left, -1)).visible(i, j, sq, sk)
        dead = (m != pattern).any(-1).expand(live.shape[0], sq)  # (B, Sq): rows that differ from the pattern
        if not bool((dead & live).any()):
            return (left, -1), dead
    return None


@dataclass(frozen=True, eq=False)
class PackedPadding:
    """A padded batch as one varlen problem over the flattened ``B·S`` sequence axis (``padding_as_varlen``).

    ``cu_seqlens`` (int32) cuts each batch entry into its pad prefix ``[b·S, b·S + start_b)`` (when nonempty) and
    its live segment ``[b·S + start_b, (b+1)·S)``; the kernel runs causal (+ ``window``) attention inside each
    segment, top-left aligned, and ``dead_rows`` (1, B·S) are the rows with an exactly zero output gradient
    (given LSE = +inf: P = 0). ``pack``/``unpack`` move (B, H, S, ·) tensors to (1, H, B·S, ·) and back (views
    where the strides allow, e.g. HF's (B, S, H, D) transposed; a copy otherwise)."""
    cu_seqlens: Tensor
    max_seqlen: int
    window: Tuple[int, int]
    dead_rows: Tensor
    batch: int
    seq: int

    def pack(self, t: Tensor) -> Tensor:
        """(B, H, S, ...) -> (1, H, B·S, ...)."""
        return t.transpose(0, 1).reshape(t.shape[1], self.batch * self.seq, *t.shape[3:]).unsqueeze(0)

    def unpack(self, t: Tensor) -> Tensor:
        """(1, H, B·S, ...) -> (B, H, S, ...)."""
        return t[0].reshape(t.shape[1], self.batch, self.seq, *t.shape[3:]).transpose(0, 1)


def _segment_starts(m: Tensor, live: Tensor) -> Tensor:
    """(B,) the first key column any live row of each batch entry sees (0 where no live row sees any)."""
    sq, sk = m.shape[-2:]
    cols = torch.arange(sk, device=m.device)
    first = torch.where(m, cols, sk).amin(-1)                       # (B, Sq): first visible key per row
    first = torch.where(live, first, sk).amin(-1)                   # (B,): over live rows
    return torch.where(first >= sk, torch.zeros_like(first), first)


def padding_as_varlen(attn_mask: Optional[Tensor], do: Tensor, sq: int, sk: int, *,
                      empty_rows_inert: bool = False) -> Optional[PackedPadding]:
    """Left (and/or right) padding: a boolean (B or 1, 1, S, S) mask under which every row with a nonzero
    output gradient of batch entry b sees exactly the keys ``start_b <= j <= i`` (within a causal window if the
    mask shows one), ``start_b`` the number of left-pad positions of b. Returns the ``PackedPadding`` that hands
    this to the kernel as varlen segments (exact), or None.

    Why exact: a live row's visible keys are its causal keys inside its own segment, which is what varlen
    attention computes; the keys before ``start_b`` are never seen by a live row, so within b they form their
    own segment seen only by dead rows; every zero-dO row contributes nothing to any gradient and gets LSE =
    +inf in the kernel (and P·0 = 0 in the FP32 tier). HF's left-padded masks have fully masked pad rows (the
    eager float mask gives them uniform weights, the boolean one none): with zero dO neither matters.

    ``empty_rows_inert``: a row that sees no key contributes nothing whatever its dO — true of boolean masks
    under SDPA (output 0, zero gradients) and the backends' convention (with a sink: P_sink = 1, O = 0, so
    D = 0), not of HF's additive eager masks. HF's causal-LM loss gives the last pad row (it predicts the first
    real token) a nonzero dO; with this flag it is still a dead row."""
    if attn_mask is None or attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[1] != 1 \
            or attn_mask.shape[-2:] != (sq, sk) or sq != sk or attn_mask.shape[0] not in (1, do.shape[0]):
        return None
    batch = do.shape[0]
    m = attn_mask[:, 0].expand(batch, sq, sk)
    live = do.abs().amax(dim=(1, 3)) != 0                            # (B, Sq)
    if empty_rows_inert:
        live = live & m.any(-1)
    starts = _segment_starts(m, live)
    rows = torch.arange(sq, device=m.device)
    if bool((live & (rows[None, :] < starts[:, None])).any()):
        return None  # a live row inside the pad prefix sees no key: varlen would give it the pad keys
    i = torch.arange(sq, device=m.device)[:, None]
    j = torch.arange(sk, device=m.device)[None, :]
    widest = int(m.sum(-1).max()) if m.numel() else 0
    for left in dict.fromkeys((-1, widest - 1 if widest < sk else -1)):
        causal = MaskSpec(causal=True, window=(left, -1)).visible(i, j, sq, sk)      # (S, S)
        expected = causal[None] & (j[None] >= starts[:, None, None])                 # (B, S, S)
        if bool(((m != expected).any(-1) & live).any()):
            continue
        bounds = torch.arange(batch + 1, device=m.device) * sq
        inner = (torch.arange(batch, device=m.device) * sq + starts)[starts > 0]
        cu = torch.unique(torch.cat([bounds, inner])).to(torch.int32)   # sorted, empty segments dropped
        max_len = int((cu[1:] - cu[:-1]).max())
        return PackedPadding(cu_seqlens=cu, max_seqlen=max_len, window=(left, -1),
                             dead_rows=(~live).reshape(1, batch * sq), batch=batch, seq=sq)
    return None


def packed_call(pad: PackedPadding, problem, *, do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor],
                lse: Optional[Tensor]):
    """(BackwardTensors, Problem) of a padded call as its packed varlen problem (``router.run_backward`` takes
    them; ``unpack_grads`` brings the gradients back). ``problem`` keeps its scale, softcap and sink."""
    packed_lse = None
    if lse is not None:
        packed_lse = pad.pack(normalize_lse(lse, *q.shape[:3]).unsqueeze(-1)).squeeze(-1)
    dead = pad.dead_rows[:, None, :, None]  # zero dO there: the FP32 tier reads no LSE (empty_rows_inert rows)
    packed_out = None
    if out is not None:  # a fused forward may leave NaN on fully masked (dead) rows: D = dO·O must stay 0 there
        packed_out = pad.pack(out).masked_fill(dead, 0)
    tensors = BackwardTensors(pad.pack(do).masked_fill(dead, 0), pad.pack(q), pad.pack(k), pad.pack(v),
                              packed_out, packed_lse, dead_rows=pad.dead_rows)
    packed = Problem(scale=problem.scale, causal=True, causal_align="top_left", window=pad.window,
                     softcap=problem.softcap, cu_seqlens_q=pad.cu_seqlens, cu_seqlens_k=pad.cu_seqlens,
                     max_seqlen_q=pad.max_seqlen, max_seqlen_k=pad.max_seqlen, sink=problem.sink)
    return tensors, packed


def unpack_grads(pad: PackedPadding, grads):
    """(dq, dk, dv[, dsink]) of the packed problem in the (B, H, S, D) layout (dsink unchanged)."""
    return tuple(pad.unpack(g) if i < 3 else g for i, g in enumerate(grads))
