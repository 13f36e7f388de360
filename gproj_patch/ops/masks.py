"""Boolean masks the GProj kernel can take as flags instead of a mask tensor.

``mask_as_flags`` (at the forward): a mask that is exactly a causal / sliding-window / full pattern, shared by
every batch and head, becomes the flags. ``padding_as_flags`` (at the backward, from the recorded mask and dO):
a right-padded causal (or windowed) mask whose padded query rows have an exactly zero output gradient — those
rows contribute nothing to any gradient, so the others are computed with the flags and the dead rows get
LSE = +inf (P = 0) in the kernel. Both are exact; anything else stays a mask (FP32 tier).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..backends.spec import MaskSpec


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
