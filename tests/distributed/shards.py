"""Shards of attention rows, as ring attention makes them, and their fp64 gradients.

A ring (context-parallel) backward calls a fused backward once per key shard with the *merged* output and LSE of
the whole row: P_ij = exp(α q_i·k_j − LSE_i) over the shard's keys sums to less than 1, D_i = dO_i·O_i is the
whole row's. The exact gradient of that call is the shard's part of the whole attention's gradient:

    g_ij = P_ij (dP_ij − D_i)  (j in the shard)     dq_i^(s) = α Σ_{j∈s} g_ij k_j
    dk_j = α Σ_i g_ij q_i      dv_j = Σ_i P_ij dO_i   (the whole attention's dk, dv rows of the shard's keys)

``problem`` draws the inputs (keys at a common offset, or a sink key that takes nearly all the mass, on top of a
common offset), ``whole`` gives the fp64 forward and gradients of the unsharded attention and ``shard_dq`` the
fp64 dq part of a shard. Used by the shard-row tests (tests/numerics/test_shard_rows.py, the GPU ones) and the
context-parallel tests of this folder.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from gproj_patch.backends.reference import reference_backward, reference_forward
from gproj_patch.backends.spec import SHARD_MASS_REL_TOL

#: the sink case's margin: every query prefers the sink key by about this many logits (its P ≈ 1 − 1e-5)
SINK_LOGITS = 20.0


@dataclass(frozen=True)
class Problem:
    """Inputs in their dtype (B, H, S, D) / (B, HKV, S, D), with the fp64 forward of the whole attention."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    o: Optional[torch.Tensor]  # fp64 (None: not asked for)
    lse: Optional[torch.Tensor]  # fp64 (B, H, S)
    causal: bool


def problem(B, H, HKV, S, D, *, offset: float = 0.0, sink: bool = False, causal: bool = False, seed: int = 0,
            dtype=torch.bfloat16, device="cpu", forward: bool = True) -> Problem:
    """N(0, 1) draws in fp64; keys moved by ``offset``σ per coordinate (random signs: a common offset of norm
    offset·√D); ``sink``: key 0 of every head along a unit direction e that every query shares, so that each row
    gives it ~``SINK_LOGITS`` more logits than the others (the other keys' noise along e removed) — the true dq
    is then tiny while the keys are large. Rounded to ``dtype``; the forward of the rounded inputs in fp64
    (top-left causal, as SDPA) unless ``forward`` is False."""
    g = torch.Generator(device=device).manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=torch.float64)  # noqa: E731
    q, k, v, do = draw(B, H, S, D), draw(B, HKV, S, D), draw(B, HKV, S, D), draw(B, H, S, D)
    if sink:
        e = draw(D)
        e = e / e.norm()
        k = k - (k @ e)[..., None] * e
        k[:, :, 0] += math.sqrt(D) * e  # with q's component SINK_LOGITS along e: α q·k_0 gains SINK_LOGITS
        q = q - (q @ e)[..., None] * e + SINK_LOGITS * e
    if offset:
        signs = torch.where(torch.rand(D, generator=g, device=device) < 0.5, -1.0, 1.0).to(torch.float64)
        if sink:
            signs = signs - (signs @ e) * e  # the offset along e would move every key's sink logit alike
        k = k + offset * signs
    q, k, v, do = (x.to(dtype) for x in (q, k, v, do))
    o, lse = reference_forward(q, k, v, causal=causal) if forward else (None, None)
    return Problem(q, k, v, do, o, lse, causal)


def whole(p: Problem, device=None):
    """fp64 (dq, dk, dv) of the unsharded attention (computed on ``device``: the inputs' by default)."""
    q, k, v, do = (x.to(device) if device is not None else x for x in (p.q, p.k, p.v, p.do))
    return reference_backward(q, k, v, do, causal=p.causal)


def shard_dq(p: Problem, keys: slice, rows: slice = slice(None)) -> torch.Tensor:
    """fp64 α Σ_{j ∈ keys} g_ij k_j for the query rows ``rows``: the shard's part of the whole dq."""
    B, H, S, D = p.q.shape
    group = H // p.k.shape[1]
    q, do = p.q.double()[:, :, rows], p.do.double()[:, :, rows]
    k = p.k.double().repeat_interleave(group, 1)[:, :, keys]
    v = p.v.double().repeat_interleave(group, 1)[:, :, keys]
    alpha = D ** -0.5
    P = torch.exp(alpha * q @ k.transpose(-1, -2) - p.lse[:, :, rows, None])
    if p.causal:
        i = torch.arange(S, device=q.device)[rows]
        j = torch.arange(S, device=q.device)[keys]
        P = P.masked_fill(j[None, :] > i[:, None], 0.0)
    G = P * (do @ v.transpose(-1, -2) - (do * p.o[:, :, rows]).sum(-1, keepdim=True))
    return alpha * G @ k


def shard_masses(p: Problem, keys: slice) -> torch.Tensor:
    """fp64 (B, H, S): each row's probability mass over the keys of the shard it sees (its whole row's LSE), the
    Σ_j P_ij the kernels compare with 1 to tell a shard row from a whole one (0: the row sees no key here)."""
    B, H, S, D = p.q.shape
    group = H // p.k.shape[1]
    k = p.k.double().repeat_interleave(group, 1)[:, :, keys]
    P = torch.exp(D ** -0.5 * p.q.double() @ k.transpose(-1, -2) - p.lse[..., None])
    if p.causal:
        i = torch.arange(S, device=P.device)
        j = torch.arange(S, device=P.device)[keys]
        P = P.masked_fill(j[None, :] > i[:, None], 0.0)
    return P.sum(-1)


def shard_rows(p: Problem, keys: slice, rel_tol: float = SHARD_MASS_REL_TOL):
    """(surely, maybe): boolean (B, H, S) masks of the rows a kernel must / may treat as shards of this shard,
    from the fp64 masses: surely when the mass is clearly positive and misses 1 by twice the tolerance, maybe when
    it has mass and misses 1 by half of it (rows near the threshold go either way with the kernel's roundings)."""
    m = shard_masses(p, keys)
    return (m > 1e-30) & ((m - 1).abs() > 2 * rel_tol), (m > 0) & ((m - 1).abs() > rel_tol / 2)


def shard_row_bounds(p: Problem, keys: slice, rel_tol: float = SHARD_MASS_REL_TOL):
    """(fewest, most) rows a kernel's shard count may give for this shard (``shard_rows``)."""
    surely, maybe = shard_rows(p, keys, rel_tol)
    return int(surely.sum()), int(maybe.sum())
