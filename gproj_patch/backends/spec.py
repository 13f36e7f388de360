"""Shared conventions of every gproj backend: layout, masking semantics, LSE layouts, input checks.

Layout. Every backend takes ``q`` of shape (B, Hq, Sq, D) and ``k``, ``v`` of shape (B, Hkv, Sk, D)
(any strides), Hq a multiple of Hkv (GQA/MQA: query head h reads KV head h // (Hq // Hkv)).
Varlen (flash-attn's packed ``(total, H, D)``) is expressed as B = 1 with ``cu_seqlens_q`` / ``cu_seqlens_k``
splitting the sequence axis: ``packed.unsqueeze(0).transpose(1, 2)`` is that view, no copy.

Masking. For one sequence with Sq queries and Sk keys, ``shift = Sk - Sq`` for the bottom-right alignment
(flash-attn's ``causal=True``) and ``shift = 0`` for top-left (SDPA's ``is_causal=True``). Key j is visible
from query i iff

    causal:          j <= i + shift
    window left L:   j >= i + shift - L      (L < 0: unbounded)
    window right R:  j <= i + shift + R      (R < 0: unbounded)

Softcap c > 0 replaces the score s by c·tanh(s / c) before the softmax. A row that sees no key has output 0,
LSE = -inf and zero gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

ALIGNMENTS = ("top_left", "bottom_right")
#: the dtypes whose fused backwards round dS (FP32/FP64 attention has nothing to repair)
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MaskSpec:
    causal: bool = False
    causal_align: str = "top_left"
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0

    def __post_init__(self):
        if self.causal_align not in ALIGNMENTS:
            raise ValueError(f"causal_align must be one of {ALIGNMENTS}, got {self.causal_align!r}")
        if len(self.window) != 2 or not all(isinstance(w, int) for w in self.window):
            raise ValueError(f"window must be a pair of ints (left, right), got {self.window!r}")
        if not (self.softcap >= 0.0):
            raise ValueError(f"softcap must be >= 0 (0 disables it), got {self.softcap!r}")

    @property
    def is_dense(self) -> bool:
        """True when every key is visible from every query."""
        return not self.causal and self.window == (-1, -1)

    def visible(self, i: torch.Tensor, j: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
        """Boolean visibility of keys ``j`` from queries ``i`` (broadcasting integer tensors)."""
        shift = sk - sq if self.causal_align == "bottom_right" else 0
        diag = i + shift
        ok = torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device)
        if self.causal:
            ok &= j <= diag
        left, right = self.window
        if left >= 0:
            ok &= j >= diag - left
        if right >= 0:
            ok &= j <= diag + right
        return ok


def default_scale(head_dim: int, scale: Optional[float]) -> float:
    return head_dim ** -0.5 if scale is None else float(scale)


# The mask kwargs ---------------------------------------------------------------------------------------------
#
# Every backend takes the same keywords for the score scale, the mask and the varlen packing (ARCHITECTURE.md).
# Their public functions take them as ``**mask`` and turn them into a ``MaskArgs`` at their first line, so the
# keyword call convention of every call site stays as it was while the functions' own parameter lists stay short.

#: the mask kwargs every backend takes, with their defaults as ``MaskArgs`` holds them
MASK_KWARGS = ("scale", "causal", "causal_align", "window", "softcap", "cu_seqlens_q", "cu_seqlens_k")
#: the longest sequence of each side of a varlen pack: mask kwargs of the Triton kernel only (no device sync)
MAX_SEQLEN_KWARGS = ("max_seqlen_q", "max_seqlen_k")
#: the keywords ``Varlen`` is made of
VARLEN_KWARGS = ("cu_seqlens_q", "cu_seqlens_k") + MAX_SEQLEN_KWARGS


def split_keywords(function: str, kwargs: dict, *groups: Tuple[str, ...]) -> Tuple[dict, ...]:
    """``kwargs`` split by name into one dict per group of names (in the order of ``groups``). A keyword that no
    group names raises the TypeError Python raises for a function ``function`` without that parameter (the
    first such keyword, in call order), so a function taking ``**kwargs`` refuses what it refused before."""
    for name in kwargs:
        if not any(name in group for group in groups):
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    return tuple({n: x for n, x in kwargs.items() if n in group} for group in groups)


@dataclass(frozen=True, eq=False)
class Varlen:
    """Packed sequences (flash-attn's varlen, module docstring): B = 1, the offsets ``cu_seqlens_q/k`` split
    the sequence axis (both or neither; the backends validate them) and, for the kernel, the longest sequence
    of each side (None: computed from the offsets, which syncs the device)."""
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None


@dataclass(frozen=True, eq=False)
class MaskArgs:
    """One call's mask kwargs (``MASK_KWARGS``, plus ``MAX_SEQLEN_KWARGS`` for the kernel) as the caller gave
    them. Not validated here: each backend checks them where it always did (``MaskSpec``, ``default_scale``,
    ``validate_cu_seqlens``), so its errors and their order are those of its former keyword parameters."""
    scale: Optional[float] = None
    causal: bool = False
    causal_align: str = "top_left"
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    varlen: Varlen = Varlen()

    @classmethod
    def from_kwargs(cls, function: str, kwargs: dict, *, max_seqlen: bool = False) -> "MaskArgs":
        """The mask kwargs ``kwargs`` of a call of ``function``; any other keyword (``max_seqlen_*`` unless
        ``max_seqlen``) raises TypeError exactly as Python does for an unknown keyword argument."""
        mask, varlen = split_keywords(function, kwargs, MASK_KWARGS[:5],
                                      VARLEN_KWARGS if max_seqlen else VARLEN_KWARGS[:2])
        return cls(**mask, varlen=Varlen(**varlen))

    def mask_spec(self) -> MaskSpec:
        """The validated mask (ValueError on a bad alignment, window or softcap)."""
        return MaskSpec(bool(self.causal), self.causal_align, tuple(self.window), float(self.softcap))


@dataclass(frozen=True)
class Segment:
    """One attention problem inside a (possibly packed) batch."""
    batch: int
    q_start: int
    q_len: int
    k_start: int
    k_len: int


def segments(batch: int, sq: int, sk: int, cu_seqlens_q=None, cu_seqlens_k=None) -> Iterator[Segment]:
    """Yield the independent (query range, key range) problems of a dense or varlen batch."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    if cu_seqlens_q is None:
        for b in range(batch):
            yield Segment(b, 0, sq, 0, sk)
        return
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    for s in range(len(cq) - 1):
        yield Segment(0, cq[s], cq[s + 1] - cq[s], ck[s], ck[s + 1] - ck[s])


def validate_cu_seqlens(cu_seqlens_q, cu_seqlens_k, batch: int, sq: int, sk: int) -> None:
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    if cu_seqlens_q is None:
        return
    if batch != 1:
        raise ValueError(f"varlen inputs must have batch 1 (packed along the sequence axis), got {batch}")
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, sq), ("cu_seqlens_k", cu_seqlens_k, sk)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor")
        if cu.numel() < 2:
            raise ValueError(f"{name} must hold at least two offsets")
        vals = cu.tolist()
        if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])):
            raise ValueError(f"{name} must start at 0 and be non-decreasing, got {vals}")
        if vals[-1] > total:
            raise ValueError(f"{name} ends at {vals[-1]} but the packed length is {total}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same number of sequences")


def validate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *extra: Tuple[str, Optional[torch.Tensor]],
                 check_finite: bool = True) -> None:
    """Raise ValueError on inputs no backend can handle. ``extra`` are (name, tensor) pairs shaped like q."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H, S, D), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Sq, D = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in (B, H, S), got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be (B={B}, Hkv, Sk, D={D}), got {tuple(k.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if Sq == 0 or k.shape[2] == 0:
        raise ValueError(f"empty sequence: Sq={Sq}, Sk={k.shape[2]}")
    for name, t in extra:
        if t is None:
            continue
        if t.shape[:3] != q.shape[:3] or t.shape[3] != v.shape[3]:
            raise ValueError(f"{name} must have shape {tuple(q.shape[:3]) + (v.shape[3],)}, got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if check_finite:
        for name, t in (("q", q), ("k", k), ("v", v)) + tuple(extra):
            if t is not None and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} contains non-finite values")


def validate_attn_mask(attn_mask, q: torch.Tensor, k: torch.Tensor, varlen: bool) -> None:
    """SDPA's ``attn_mask``: bool (True = attend) or additive float, broadcastable to (B, Hq, Sq, Sk), on q's
    device, not combined with varlen. Raises ValueError otherwise; None passes."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise ValueError("attn_mask must be a tensor")
    if varlen:
        raise ValueError("attn_mask cannot be combined with cu_seqlens (varlen)")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}")
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        if attn_mask.dim() > 4:
            raise RuntimeError
        torch.broadcast_shapes(attn_mask.shape, target)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {target}") from None


def expand_attn_mask(attn_mask: torch.Tensor, full_shape) -> torch.Tensor:
    """A validated ``attn_mask`` as a (B, Hq, Sq, Sk) view (no copy)."""
    return attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)).expand(full_shape)


def normalize_lse(lse: torch.Tensor, batch: int, heads: int, sq: int) -> torch.Tensor:
    """View any forward's natural-log LSE as (B, H, Sq) fp32 (no copy where possible).

    Accepts SDPA flash / FA2 (B, H, S); SDPA efficient (B, H, ceil(S/32)*32), padded; cuDNN (B, H, S, 1),
    possibly strided; FA2/FA3 varlen (H, total) when ``batch == 1``.
    """
    if lse.dtype == torch.float32 and lse.shape == (batch, heads, sq):
        return lse  # already (B, H, Sq) fp32 (the router's normalized LSE): the slice below would be itself
    if lse.dim() == 4 and lse.shape[-1] == 1:
        lse = lse.squeeze(-1)
    if lse.dim() == 2 and batch == 1:
        lse = lse.unsqueeze(0)
    if lse.dim() != 3 or lse.shape[0] != batch or lse.shape[1] != heads or lse.shape[2] < sq:
        raise ValueError(f"cannot read an LSE of shape {tuple(lse.shape)} as (B={batch}, H={heads}, S={sq})")
    lse = lse[..., :sq]
    return lse if lse.dtype == torch.float32 else lse.float()


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-(mantissa bits + 1): 2^-8 for bf16, 2^-11 for fp16, 2^-24 for fp32."""
    return {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24,
            torch.float64: 2.0 ** -53}[dtype]


# Learnable attention sinks ---------------------------------------------------------------------------------
#
# A sink is a per-query-head logit s_h (a tensor of shape (Hq,)) that enters every row's softmax denominator
# with no value row:  LSE_i = log(Σ_j exp(S_ij) + exp(s_h)),  P_ij = exp(S_ij − LSE_i),  P_sink,i = exp(s_h − LSE_i),
# so Σ_j P_ij = 1 − P_sink,i (S_ij the scaled, masked scores of the visible keys; a row that sees no key has
# LSE = s_h, P_sink = 1, output 0). The exact score gradient then has the row sum Σ_j dS_ij = P_sink,i·D_i
# (D_i = Σ_j P_ij dP_ij = dO_i·O_i), not 0, and the sink's own gradient is dsink_h = −Σ_{b,i} P_sink,i·D_i
# (the rows of every batch entry / varlen sequence of head h). The sink logit is not passed through a softcap
# and is never masked. A backward given ``sink`` returns (dq, dk, dv, dsink), dsink shaped like ``sink``.

#: softcap and a sink together: no common convention for whether the sink logit is capped, so it is refused
SINK_SOFTCAP_REASON = "softcap with a learnable sink (is the sink logit capped? no common convention)"


def sink_unsupported_reason(sink, q: torch.Tensor, *, softcap: float = 0.0) -> Optional[str]:
    """None when ``sink`` (or None) is a valid learnable sink for queries ``q`` of shape (B, Hq, Sq, D):
    a floating tensor of shape (Hq,), fp32 or q's dtype, on q's device; softcap must be 0 with a sink.
    Otherwise a short reason naming what is wrong."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor):
        return f"sink must be a tensor, got {type(sink).__name__}"
    heads = q.shape[1] if q.dim() == 4 else None
    if sink.dim() != 1 or heads is None or sink.shape[0] != heads:
        return f"sink must have shape (Hq,) = ({heads},), got {tuple(sink.shape)}"
    if sink.dtype not in (torch.float32, q.dtype):
        return f"sink dtype={str(sink.dtype).replace('torch.', '')} (must be float32 or the input dtype)"
    if sink.device != q.device:
        return f"sink is on {sink.device}, q on {q.device}"
    if softcap > 0:
        return SINK_SOFTCAP_REASON
    return None


def validate_sink(sink, q: torch.Tensor, *, softcap: float = 0.0) -> None:
    """Raise ValueError with ``sink_unsupported_reason`` when it is not None."""
    reason = sink_unsupported_reason(sink, q, softcap=softcap)
    if reason is not None:
        raise ValueError(reason)


# Shards of a row ------------------------------------------------------------------------------------------------
#
# A backward given an LSE that does not normalize its keys' probabilities, Σ_j P_ij < 1 − P_sink,i, computes the
# gradient of one shard of row i (ring attention calls the fused backward per key shard with the merged output
# and LSE). The shard's exact dS has a non-zero row sum (only the whole row's sums to 0), so projecting it to
# zero is wrong by that sum: a shard row keeps λ = 0 (docs/math.md §8). A row is a shard when its keys' mass
# m = Σ_j low(P_ij) misses M = 1 − P_sink by more than a full row's m can:
#   * low(P)'s rounding: |low(p) − p| ≤ u·p (u = 2^-8 bf16, 2^-11 fp16, 0 for fp32 P), coherent in the worst
#     case: uniform rows over N keys have m = N·low(1/N) = 1 + 0.99·2^-8 in bf16 at N = 255;
#   * the scores recomputed against the forward's LSE (another kernel's fp32 sums; a common key offset makes
#     their rounding common to the row's keys, and it grows with |LSE|'s fp32 spacing): 1.4e-4 (2^-12.8) at a
#     512σ key offset (|LSE| ≈ 1800), D = 64 and 128, fp32 scores against the fp64 LSE on the CPU;
#   * m's fp32 sum over the key tiles: ≤ (n/64 + 6)·2^-24·m, 2^-10 at a million keys;
#   * fp16 only: P below 2^-14 is subnormal, rounded to a multiple of 2^-24, ≤ 2^-25 per key and not relative
#     to M (uniform rows over 10^5 keys: 0.3% of m).
# So the tolerance is SHARD_MASS_REL_TOL·M + n·(2^-25 in fp16), n the keys: 2^-7 is twice bf16's worst
# coherent rounding and leaves 2^-8 for the other two. A shard whose keys miss less than that of the row's mass
# is projected as a full row: its dq then loses the shard's true dS sum, at most about 2^-7·Σ_j|dS_ij| along
# the mean key — the size of an uncorrected BF16 backward's leak bound 2u·Σ|dS| (math.md §3, §8).

#: relative tolerance of the shard test (above)
SHARD_MASS_REL_TOL = 2.0 ** -7
#: the largest rounding error of one fp16 subnormal (half its spacing 2^-24)
FP16_SUBNORMAL_ERROR = 2.0 ** -25


def shard_mass_tolerance(dtype: torch.dtype, n_keys: int) -> Tuple[float, float]:
    """(relative, absolute) tolerance of the shard test for P rounded to ``dtype`` (fp32: unrounded) over rows of
    at most ``n_keys`` keys: a row is a shard when |m − M| > relative·M + absolute (comment above)."""
    return SHARD_MASS_REL_TOL, (FP16_SUBNORMAL_ERROR * n_keys if dtype == torch.float16 else 0.0)
