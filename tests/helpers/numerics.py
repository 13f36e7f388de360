"""The error measure, layout conversions and input draws shared by the numerical tests."""
import math

import torch

from gproj_patch.backends.reference import reference_forward


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error ‖got − want‖ / ‖want‖ in fp64 (Frobenius norm over all elements); where the reference is
    exactly zero, the largest absolute difference instead, so an exact-zero reference still measures something."""
    got, want = got.double(), want.double()
    norm = want.norm()
    if norm > 0:
        return float((got - want).norm() / norm)
    return float((got - want).abs().max())


def saved_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **mask):
    """(O, LSE) as a low-precision fused forward saves them: the fp64 oracle's output rounded to q's dtype and its
    natural-log LSE in fp32 (``mask``: the oracle's keywords, a learnable ``sink`` included)."""
    o, lse = reference_forward(q, k, v, **mask)
    return o.to(q.dtype), lse.float()


def bhsd(t: torch.Tensor, varlen: bool = False) -> torch.Tensor:
    """flash-attn's (B, S, H, D) layout — (total, H, D) when ``varlen`` — as the oracle's (B, H, S, D)."""
    return t.unsqueeze(0).transpose(1, 2) if varlen else t.transpose(1, 2)


def kernel_inputs(B, H, HKV, SQ, SK, D, *, offset=0.0, seed=0, dtype=torch.float16):
    """q (B, H, SQ, D), k and v (B, HKV, SK, D), dO like q: N(0, 1) drawn in fp64, the keys shifted by a common
    random vector times ``offset`` (the gauge leak's driver), then rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, SQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, SK, D, generator=g, dtype=torch.float64)
    k = k + offset * torch.randn(D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, SK, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, SQ, D, generator=g, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, do))


def offset_along_direction(q: torch.Tensor, k: torch.Tensor, offset: float, gen: torch.Generator, *,
                           orthogonal: bool = False):
    """(q, k) with every key moved by ``offset``σ per coordinate (a shift of norm offset·√D) along a random unit
    direction u, the next draw of ``gen``; ``orthogonal`` first removes u from the queries, so the scores (and a
    sink's weight) do not see the shift and only the gradients carry it. fp64 in, fp64 out."""
    D = q.shape[-1]
    u = torch.randn(D, generator=gen, dtype=torch.float64)
    u = u / u.norm()
    if orthogonal:
        q = q - (q @ u)[..., None] * u
    return q, k + offset * math.sqrt(D) * u
