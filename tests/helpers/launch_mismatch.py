"""The GProj kernel's two launches compute dP = dO·Vᵀ separately; what that does to dk (test helper).

The dQ-major launch computes dP = dO·Vᵀ per tile and derives λ_i from it; the KV-major launch recomputes the
transposed tile dPᵀ = V·dOᵀ and forms the fused dk operand P∘(dP − D − λ) from its own copy. Each copy is an
fp32-accurate product, but nothing makes the two bitwise equal: under Triton's interpreter a ``tl.dot`` is
``np.matmul`` of the two tiles, and whether numpy's sgemm gives A·Bᵀ and (B·Aᵀ)ᵀ the same bits depends on the
BLAS kernel. OpenBLAS's SkylakeX sgemm does (measured: 0 of 12,800 elements differ at 16×64·64×16); its
Haswell sgemm (``OPENBLAS_CORETYPE=Haswell``) does not (4,981 of 12,800 differ by an ulp or two), although it is
as accurate (≤ 4u·Σ|a||b| against fp64 for both). On a GPU the two launches' MMA orders play the same role.

The projection removes what is common to a row (λ absorbs the dQ-major copy's errors), not this difference:
dk_j gains α Σ_i P_ij (dP^K_ij − dP^Q_ij) q_i, to first order. That is tiny against the terms of dk, but on a
sharp row (the ``sink_offset_64`` case: P ≈ 1 on the sink key, whose exact dk is a cancellation down to ~e^-20
of |dP|) it is a few percent of dk itself. ``dp_launch_mismatch`` computes dP^K − dP^Q exactly as the
interpreter's dots do on this machine (same tiles, same numpy call); ``dk_mismatch_term`` maps it to dk in
fp64. With it, the kernel's dk matches an fp64 evaluation of its own products: ref + term, to 1e-4.
"""
from __future__ import annotations

import numpy as np
import torch

from gproj_patch.backends import reference as R
from gproj_patch.backends import configs
from gproj_patch.backends.spec import MaskSpec, default_scale, segments


def _tiles(x: torch.Tensor, start: int, length: int, block: int, width: int) -> np.ndarray:
    """Rows [start, start + length) of a (S, D) tensor as the kernel loads them: zero-padded to whole tiles of
    ``block`` rows and to ``width`` columns, in the tensor's own dtype."""
    rows = -(-length // block) * block
    out = np.zeros((rows, width), dtype=x.numpy().dtype)
    out[:length, : x.shape[-1]] = x[start:start + length].numpy()
    return out


def dp_launch_mismatch(do: torch.Tensor, v: torch.Tensor, *, cu_seqlens_q=None, cu_seqlens_k=None) -> torch.Tensor:
    """dP^K − dP^Q (B, Hq, Sq, Sk) fp64: the KV-major launch's dP minus the dQ-major launch's, each tile computed
    as the interpreter computes ``tl.dot(do, tl.trans(v))`` and ``tl.dot(v, tl.trans(do))``: ``np.matmul`` of the
    loaded tiles (``configs.INTERP_BLOCK`` rows, head dim padded to ``configs.block_d``), accumulator fp32.
    Zero for pairs in different varlen sequences."""
    block, width = configs.INTERP_BLOCK, configs.block_d(do.shape[-1])
    B, Hq, Sq, _ = do.shape
    group = Hq // v.shape[1]
    out = torch.zeros(B, Hq, Sq, v.shape[2], dtype=torch.float64)
    for seg in segments(B, Sq, v.shape[2], cu_seqlens_q, cu_seqlens_k):
        if seg.q_len == 0 or seg.k_len == 0:
            continue
        for h in range(Hq):
            dot = _tiles(do[seg.batch, h].cpu(), seg.q_start, seg.q_len, block, width)
            vt = _tiles(v[seg.batch, h // group].cpu(), seg.k_start, seg.k_len, block, width)
            diff = np.zeros((dot.shape[0], vt.shape[0]))
            for i0 in range(0, dot.shape[0], block):
                a = dot[i0:i0 + block]
                for j0 in range(0, vt.shape[0], block):
                    b = vt[j0:j0 + block]
                    dq_major = np.matmul(a, b.T, dtype=np.float32)
                    kv_major = np.matmul(b, a.T, dtype=np.float32).T
                    diff[i0:i0 + block, j0:j0 + block] = kv_major.astype(np.float64) - dq_major
            out[seg.batch, h, seg.q_start:seg.q_start + seg.q_len, seg.k_start:seg.k_start + seg.k_len] = \
                torch.from_numpy(diff[: seg.q_len, : seg.k_len])
    return out


def dk_mismatch_term(q, k, v, delta: torch.Tensor, **mask) -> torch.Tensor:
    """α Σ_i P_ij δ_ij q_i (B, Hkv, Sk, D) fp64: dk's first-order change when the fused operand P∘(dP − D − λ)
    is formed from a dP that differs by ``delta`` from the one λ came from. P exact (fp64), masks as
    ``reference_backward`` takes them (causal, window, varlen; no softcap, no attn_mask)."""
    spec = MaskSpec(mask.get("causal", False), mask.get("causal_align", "top_left"),
                    tuple(mask.get("window", (-1, -1))), 0.0)
    scale = default_scale(q.shape[-1], mask.get("scale"))
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    sink_col = R._sink_column(mask.get("sink"))
    term = torch.zeros(B, Hq, Sk, D, dtype=torch.float64)
    walk = R._walk(q, k, v, None, scale, spec, mask.get("cu_seqlens_q"), mask.get("cu_seqlens_k"))
    for seg, _kk, _vv, (c0, c1), qc, s, _ in walk:
        if seg.k_len == 0:
            continue
        p, _, _ = R._probabilities(s, sink_col)
        rows = slice(seg.q_start + c0, seg.q_start + c1)
        keys = slice(seg.k_start, seg.k_start + seg.k_len)
        d = delta[seg.batch, :, rows, keys]
        term[seg.batch, :, keys] += scale * torch.matmul((p * d).transpose(-1, -2), qc)
    return term.view(B, Hkv, Hq // Hkv, Sk, D).sum(2)
