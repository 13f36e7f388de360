"""The fp64 oracle: attention forward and backward from explicit formulas, chunked over queries.

Everything is computed in float64 from whatever dtype the inputs carry, so low-precision inputs are taken
at their exact values. The backward uses the exact score gradient

    dP = dO·Vᵀ,  D_i = Σ_j P_ij dP_ij,  G = P∘(dP − D)      (Σ_j G_ij = 0 up to fp64 rounding)

with D computed from P and dP (never from a saved output), so this is the gradient of the exact function.
Memory is bounded by one (heads × chunk × Sk) fp64 block at a time, not S×S for every head.

Masking, varlen, GQA and softcap follow ``spec.py``. ``attn_mask`` (SDPA semantics) may be a boolean mask
(True = attend) or an additive float mask, broadcastable to (B, Hq, Sq, Sk); it is not combined with varlen.

Learnable sinks (``sink``, shape (Hq,), see ``spec.py``): the sink logit is a column appended to every row's
scores after the masks (never masked), so

    LSE_i = log(Σ_j exp(S_ij) + exp(s_h)),  P_sink,i = exp(s_h − LSE_i),  G = P∘(dP − D),  Σ_j G_ij = P_sink,i·D_i
    dsink_h = −Σ_{b,i} P_sink,i·D_i

with D still Σ_j P_ij dP_ij over the real keys (the sink has no value row). Softcap with a sink is refused.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .spec import (MaskArgs, MaskSpec, default_scale, expand_attn_mask, segments, validate_attn_mask,
                   validate_cu_seqlens, validate_qkv, validate_sink)

_BLOCK_ELEMENTS = 1 << 24  # fp64 elements per score block (128 MiB)


def _check(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, extra=(), sink=None, softcap=0.0):
    validate_qkv(q, k, v, *extra)
    validate_sink(sink, q, softcap=float(softcap))
    validate_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], q.shape[2], k.shape[2])
    validate_attn_mask(attn_mask, q, k, varlen=cu_seqlens_q is not None)


def _scores(qc, kk, scale, mask: MaskSpec, rows, cols, sq, sk, attn_mask_block):
    """Scores of a query chunk (after softcap and masks) and the tanh derivative (or None)."""
    s = scale * torch.matmul(qc, kk.transpose(-1, -2))
    dcap = None
    if mask.softcap > 0:
        th = torch.tanh(s / mask.softcap)
        s = mask.softcap * th
        dcap = 1.0 - th * th
    if attn_mask_block is not None:
        if attn_mask_block.dtype == torch.bool:
            s = s.masked_fill(~attn_mask_block, float("-inf"))
        else:
            s = s + attn_mask_block.to(torch.float64)
    if not mask.is_dense:
        vis = mask.visible(rows[:, None], cols[None, :], sq, sk)
        s = s.masked_fill(~vis, float("-inf"))
    return s, dcap


def _probabilities(s, sink_col=None):
    """(P over the real keys, LSE, P_sink or None); ``sink_col`` (Hq, 1, 1) fp64 is appended as a column."""
    full = s if sink_col is None else torch.cat([s, sink_col.expand(*s.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    empty = torch.isneginf(lse)
    shift = lse.masked_fill(empty, 0.0)[..., None]
    p = torch.exp(s - shift).masked_fill(empty[..., None], 0.0)
    psink = None
    if sink_col is not None:
        psink = torch.exp(sink_col[..., 0] - shift[..., 0]).masked_fill(empty, 0.0)
    return p, lse, psink


def _sink_column(sink):
    return None if sink is None else sink.to(torch.float64).view(-1, 1, 1)


def _mask_block(attn_mask, b, q0, q1, full_shape):
    if attn_mask is None:
        return None
    return expand_attn_mask(attn_mask, full_shape)[b, :, q0:q1, :]


def _walk(q, k, v, attn_mask, scale, mask, cu_seqlens_q, cu_seqlens_k):
    """Yield (segment, head-expanded K/V in fp64, query chunk bounds, scores, tanh derivative)."""
    B, Hq, Sq, D = q.shape
    group = Hq // k.shape[1]
    for seg in segments(B, Sq, k.shape[2], cu_seqlens_q, cu_seqlens_k):
        if seg.q_len == 0:
            continue
        kk = k[seg.batch, :, seg.k_start:seg.k_start + seg.k_len].to(torch.float64).repeat_interleave(group, 0)
        vv = v[seg.batch, :, seg.k_start:seg.k_start + seg.k_len].to(torch.float64).repeat_interleave(group, 0)
        chunk = max(1, _BLOCK_ELEMENTS // max(1, Hq * max(seg.k_len, 1)))
        cols = torch.arange(seg.k_len, device=q.device)
        for c0 in range(0, seg.q_len, chunk):
            c1 = min(seg.q_len, c0 + chunk)
            qc = q[seg.batch, :, seg.q_start + c0:seg.q_start + c1].to(torch.float64)
            rows = torch.arange(c0, c1, device=q.device)
            if seg.k_len == 0:
                s, dcap = qc.new_full((Hq, c1 - c0, 0), float("-inf")), None
            else:
                mb = _mask_block(attn_mask, seg.batch, c0, c1, (B, Hq, Sq, k.shape[2]))
                s, dcap = _scores(qc, kk, scale, mask, rows, cols, seg.q_len, seg.k_len, mb)
            yield seg, kk, vv, (c0, c1), qc, s, dcap


def reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                      sink: Optional[torch.Tensor] = None, **mask) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact attention output (B, Hq, Sq, Dv) and natural-log LSE (B, Hq, Sq), both fp64.

    ``mask``: the mask kwargs (``spec.MASK_KWARGS``). Rows that see no key get output 0 and LSE = -inf (= s_h
    with a ``sink``: the LSE includes the sink).
    """
    args = MaskArgs.from_kwargs("reference_forward", mask)
    cu_seqlens_q, cu_seqlens_k = args.varlen.cu_seqlens_q, args.varlen.cu_seqlens_k
    _check(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, sink=sink, softcap=args.softcap)
    sink_col = _sink_column(sink)
    mask = args.mask_spec()
    scale = default_scale(q.shape[-1], args.scale)
    B, Hq, Sq, _ = q.shape
    out = torch.zeros(B, Hq, Sq, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float64, device=q.device)
    for seg, _kk, vv, (c0, c1), _qc, s, _ in _walk(q, k, v, attn_mask, scale, mask, cu_seqlens_q, cu_seqlens_k):
        p, l, _ = _probabilities(s, sink_col)
        rows = slice(seg.q_start + c0, seg.q_start + c1)
        out[seg.batch, :, rows] = torch.matmul(p, vv)
        lse[seg.batch, :, rows] = l
    return out, lse


def reference_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                       attn_mask: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None, **mask):
    """Exact (dq, dk, dv) in fp64 for the loss ⟨do, attention(q, k, v)⟩; with a ``sink``, (dq, dk, dv, dsink),
    dsink (Hq,) fp64 = −Σ_{b,i} P_sink,i·D_i (see the module docstring).

    ``mask``: the mask kwargs (``spec.MASK_KWARGS``). dk and dv are summed over each query-head group (GQA/MQA).
    Rows that see no key contribute nothing.
    """
    args = MaskArgs.from_kwargs("reference_backward", mask)
    cu_seqlens_q, cu_seqlens_k = args.varlen.cu_seqlens_q, args.varlen.cu_seqlens_k
    _check(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, extra=(("do", do),), sink=sink, softcap=args.softcap)
    sink_col = _sink_column(sink)
    mask = args.mask_spec()
    scale = default_scale(q.shape[-1], args.scale)
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dk_full = torch.zeros(B, Hq, Sk, k.shape[-1], dtype=torch.float64, device=q.device)
    dv_full = torch.zeros(B, Hq, Sk, v.shape[-1], dtype=torch.float64, device=q.device)
    dsink = torch.zeros(Hq, dtype=torch.float64, device=q.device)
    for seg, kk, vv, (c0, c1), qc, s, dcap in _walk(q, k, v, attn_mask, scale, mask, cu_seqlens_q, cu_seqlens_k):
        if seg.k_len == 0:
            continue  # output 0, so D = 0: no sink gradient either
        p, _, psink = _probabilities(s, sink_col)
        rows = slice(seg.q_start + c0, seg.q_start + c1)
        keys = slice(seg.k_start, seg.k_start + seg.k_len)
        doc = do[seg.batch, :, rows].to(torch.float64)
        dp = torch.matmul(doc, vv.transpose(-1, -2))
        delta = (p * dp).sum(-1, keepdim=True)
        g = p * (dp - delta)
        if psink is not None:
            dsink -= (psink * delta[..., 0]).sum(-1)
        if dcap is not None:
            g = g * dcap
        dq[seg.batch, :, rows] = scale * torch.matmul(g, kk)
        dk_full[seg.batch, :, keys] += scale * torch.matmul(g.transpose(-1, -2), qc)
        dv_full[seg.batch, :, keys] += torch.matmul(p.transpose(-1, -2), doc)
    dk = dk_full.view(B, Hkv, group, Sk, -1).sum(2)
    dv = dv_full.view(B, Hkv, group, Sk, -1).sum(2)
    return (dq, dk, dv) if sink is None else (dq, dk, dv, dsink)
