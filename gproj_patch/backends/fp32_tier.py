"""The FP32 attention tier (the fallback): forward and backward recomputed in FP32, with the GProj projection.

Inputs may be BF16/FP16 (taken at their exact values) or FP32; results are fp32 (callers cast back).
Work is chunked over queries: one chunk holds (B', Hq, chunk, Sk) fp32 blocks, the chunk length chosen so a
handful of such blocks fit ``memory_budget`` bytes (default 256 MiB on a CPU; on CUDA an eighth of the free
device memory, at most 2 GiB, because tall chunks keep the fp32 GEMMs efficient), so memory is O(chunk·Sk) per (b, h),
never S×S for large S. TF32 is disabled for these matmuls (IEEE fp32 through the per-backend
``fp32_precision`` settings inside the call, restored afterwards; ``emulation.full_fp32``).

Backward of one query chunk (full key rows, so the softmax is exact in fp32 without a saved LSE):

    S = α Q Kᵀ [softcap: c·tanh(S/c), τ' = 1 − tanh²] [+ attn_mask],   P = softmax(S),   Z = dropout keep/(1−p)
    O = (P∘Z) V   (recomputed fp32 output),   D = rowsum(dO ∘ O),   dP = (dO Vᵀ) ∘ Z,   G = P ∘ (dP − D)
    λ = Σ_j G / Σ_j P                         (project=True; λ = 0 for rows that see no key)
    dq = α (G' K − λ · P' K),   dk = α (G'ᵀ Q − (λ P')ᵀ Q),   dv = (P∘Z)ᵀ dO
    with G' = G ∘ τ', P' = P ∘ τ' under softcap (the projection acts on the capped-score gradient, where the
    zero row sum holds), G' = G, P' = P otherwise.

Learnable sink (``sink``, shape (Hq,), ``spec.py``): s_h joins each row's softmax denominator (max and sum)
with no value row, so Σ_j P = 1 − P_sink and the exact Σ_j G = P_sink·D; the projection restores that target,
λ = (Σ_j G − P_sink·D) / Σ_j P, and dsink_h = −Σ_{b,i} P_sink·D (fp32, the same with ``project=False``). The
backward then returns (dq, dk, dv, dsink); the forward's LSE includes the sink (rows that see no key: LSE =
s_h, output 0). Dropout multiplies only the real keys' probabilities, as the sink has no value. Softcap with
a sink is refused (ValueError).

The projection is in the non-materialized form of GProj (the two products are never merged into one
rounded G − λP). ``project=False`` gives plain FP32 attention, which leaks in the sink regime (docs/math.md §9).

``attn_mask``: bool (True = attend) or additive float, broadcastable to (B, Hq, Sq, Sk) as in SDPA (added
after softcap); not combined with varlen. Rows that see no key: output 0, LSE = −inf, zero gradients
(SDPA would give NaN there).

Dropout: the keep mask is a deterministic function of (dropout_seed, batch, head, query position, key
position) — a counter-based integer hash, so it is identical in forward and backward and independent of the
chunking. It is NOT the RNG stream of any fused kernel: gradients match a fused kernel's only in
distribution, not sample by sample. ``dropout_p > 0`` requires ``dropout_seed``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from .emulation import full_fp32, tile_scores
from .spec import (MASK_KWARGS, MaskArgs, MaskSpec, Varlen, default_scale, expand_attn_mask, normalize_lse,
                   segments, shard_mass_tolerance, split_keywords, validate_attn_mask, validate_cu_seqlens,
                   validate_qkv, validate_sink)

DEFAULT_MEMORY_BUDGET = 256 << 20
CUDA_MEMORY_BUDGET_CAP = 2 << 30


def _default_budget(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_MEMORY_BUDGET
    free, _total = torch.cuda.mem_get_info(device)
    return max(DEFAULT_MEMORY_BUDGET, min(CUDA_MEMORY_BUDGET_CAP, free // 8))
_BLOCKS_PER_CHUNK = 10  # fp32 (chunk × Sk) temporaries alive at once in the backward, roughly
_MASK32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors (constants < 2^31 so products stay inside int64)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x46CA68BB) & _MASK32
    x = x ^ (x >> 16)
    return x


def dropout_keep(seed: int, batch: int, heads: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                 p: float) -> torch.Tensor:
    """Deterministic keep mask (heads, rows, cols) for global query positions ``rows`` and keys ``cols``."""
    h = _mix(torch.full_like(heads, (int(seed) * 0x2545F491 + batch * 0x3C6EF372) & _MASK32) ^ heads)
    h = _mix(h[:, None] ^ (rows[None, :] * 0x1B873593))
    h = _mix(h[:, :, None] ^ (cols[None, None, :] * 0x5BD1E995))
    return h.to(torch.float64) >= p * 4294967296.0


@dataclass(frozen=True, eq=False)
class _Pass:
    """What one FP32 pass over the query chunks (``_walk``) needs besides q, k, v; made once per call by
    ``_prepare`` from the public function's arguments."""
    alpha: float
    spec: MaskSpec
    varlen: Varlen
    attn_mask: Optional[torch.Tensor]
    dropout_p: float
    dropout_seed: Optional[int]
    sink: Optional[torch.Tensor]
    budget: int
    chunk_size: Optional[int]
    lse: Optional[torch.Tensor] = None  # (B, Hq, Sq) fp32: P taken relative to this LSE (a shard's call)


def _check(q, k, v, attn_mask, dropout_p, dropout_seed, varlen: Varlen, extra=(), check_finite=True, sink=None,
           softcap=0.0):
    cu_q, cu_k = varlen.cu_seqlens_q, varlen.cu_seqlens_k
    validate_qkv(q, k, v, *extra, check_finite=check_finite)
    validate_sink(sink, q, softcap=float(softcap))
    validate_cu_seqlens(cu_q, cu_k, q.shape[0], q.shape[2], k.shape[2])
    if not (0.0 <= float(dropout_p) < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed (the mask is regenerated from it in the backward)")
    validate_attn_mask(attn_mask, q, k, varlen=cu_q is not None)


def _chunk_len(rows_per_block: int, kl: int, budget: int, chunk_size: Optional[int]) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError("chunk_size must be positive")
        return int(chunk_size)
    return max(1, budget // (4 * _BLOCKS_PER_CHUNK * max(1, rows_per_block * kl)))


def _visible_key_range(spec: MaskSpec, c0: int, c1: int, ql: int, kl: int, device) -> Tuple[int, int]:
    """[lo, hi): the keys that some query of rows [c0, c1) may see (all of them when the mask is dense)."""
    if spec.is_dense:
        return 0, kl
    cols = spec.visible(torch.arange(c0, c1, device=device)[:, None], torch.arange(kl, device=device)[None, :],
                        ql, kl).any(0).nonzero()
    if cols.numel() == 0:
        return 0, 0
    return int(cols[0]), int(cols[-1]) + 1


class _Chunk:
    __slots__ = ("bs", "rows", "keys", "q", "k", "v", "p", "z", "tau", "lse", "psink")


def _softmax(s, sink_col):
    """(P, LSE, P_sink or None) of scores ``s`` (…, rows, keys), the sink column (1, Hq, 1, 1) in the
    denominator; rows whose maximum (sink included) is −inf get P = 0, LSE = −inf, P_sink = 0."""
    m = s.amax(-1, keepdim=True)
    if sink_col is not None:
        m = torch.maximum(m, sink_col)
    dead = torch.isneginf(m)
    m_safe = torch.where(dead, torch.zeros_like(m), m)
    e = torch.exp(s - m_safe)
    l = e.sum(-1, keepdim=True)
    esink = None
    if sink_col is not None:
        esink = torch.exp(sink_col - m_safe)
        l = l + esink
    l_safe = torch.where(dead, torch.ones_like(l), l)
    p = torch.where(dead, torch.zeros_like(e), e / l_safe)
    lse = torch.where(dead, m, m + torch.log(l_safe)).squeeze(-1)
    psink = None if esink is None else torch.where(dead, torch.zeros_like(l), esink / l_safe)
    return p, lse, psink


def _walk(q, k, v, run: _Pass) -> Iterator[_Chunk]:
    """Yield the fp32 probabilities of each query chunk (full key rows) with what the backward needs."""
    attn_mask, dropout_p, dropout_seed, sink = run.attn_mask, run.dropout_p, run.dropout_seed, run.sink
    alpha, spec, cu_q, cu_k = run.alpha, run.spec, run.varlen.cu_seqlens_q, run.varlen.cu_seqlens_k
    B, Hq, Sq, _ = q.shape
    Sk = k.shape[2]
    group = Hq // k.shape[1]
    full = (B, Hq, Sq, Sk)
    amask = None
    if attn_mask is not None:
        amask = expand_attn_mask(attn_mask, full)
    units = ([(slice(None), 0, Sq, 0, Sk)] if cu_q is None else
             [(slice(s.batch, s.batch + 1), s.q_start, s.q_len, s.k_start, s.k_len)
              for s in segments(B, Sq, Sk, cu_q, cu_k)])
    heads = torch.arange(Hq, device=q.device, dtype=torch.int64)
    sink_col = None if sink is None else sink.to(torch.float32).view(1, Hq, 1, 1)
    for bs, qs, ql, ks, kl in units:
        if ql == 0 or kl == 0:
            continue
        K = k[bs, :, ks:ks + kl].to(torch.float32).repeat_interleave(group, dim=1)
        V = v[bs, :, ks:ks + kl].to(torch.float32).repeat_interleave(group, dim=1)
        nb = K.shape[0]
        step = _chunk_len(nb * Hq, kl, run.budget, run.chunk_size)
        for c0 in range(0, ql, step):
            c1 = min(ql, c0 + step)
            rows = slice(qs + c0, qs + c1)
            lo, hi = _visible_key_range(spec, c0, c1, ql, kl, q.device)
            if lo >= hi:
                continue  # no query of this chunk sees a key: output 0, LSE -inf, zero gradients
            keys = slice(ks + lo, ks + hi)
            Q = q[bs, :, rows].to(torch.float32)
            Kc, Vc = K[:, :, lo:hi], V[:, :, lo:hi]
            s, tau, vis = tile_scores(Q, Kc, alpha, spec, c0, lo, ql, kl)
            if amask is not None:
                mb = amask[bs, :, rows, keys]
                s = s.masked_fill(~mb, float("-inf")) if mb.dtype == torch.bool else s + mb.to(torch.float32)
            if vis is not None:
                s = s.masked_fill(~vis, float("-inf"))
            if run.lse is None:
                p, lse, psink = _softmax(s, sink_col)
            else:  # P relative to the given LSE (its keys may be one shard of the row); ±inf rows: P = 0
                lse = run.lse[bs, :, rows]
                p = torch.exp(s - torch.where(torch.isfinite(lse), lse, float("inf"))[..., None])
                psink = None
            ch = _Chunk()
            ch.bs, ch.rows, ch.keys, ch.q, ch.k, ch.v, ch.p, ch.tau = bs, rows, keys, Q, Kc, Vc, p, tau
            ch.lse, ch.psink = lse, psink
            ch.z = None
            if dropout_p > 0:
                bidx = list(range(B))[bs]
                z = torch.stack([dropout_keep(dropout_seed, b, heads,
                                              torch.arange(qs + c0, qs + c1, device=q.device),
                                              torch.arange(ks + lo, ks + hi, device=q.device), dropout_p)
                                 for b in bidx])
                ch.z = z.to(torch.float32) / (1.0 - dropout_p)
            yield ch


def _prepare(q, mask: MaskArgs, attn_mask, dropout_p, dropout_seed, chunk_size, memory_budget, sink,
             lse=None) -> _Pass:
    """The pass of one call, after ``_check``: the validated mask, the scale and the memory budget."""
    spec = mask.mask_spec()
    alpha = default_scale(q.shape[-1], mask.scale)
    budget = _default_budget(q.device) if memory_budget is None else memory_budget
    return _Pass(alpha, spec, mask.varlen, attn_mask, dropout_p, dropout_seed, sink, budget, chunk_size, lse)


def fp32_forward(q, k, v, *, attn_mask=None, dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                 chunk_size: Optional[int] = None, memory_budget: Optional[int] = None, check_finite: bool = True,
                 sink: Optional[torch.Tensor] = None, **mask) -> Tuple[torch.Tensor, torch.Tensor]:
    """FP32 attention output (B, Hq, Sq, Dv) fp32 and natural-log LSE (B, Hq, Sq) fp32 (−inf: no key seen).

    ``mask``: the mask kwargs (``spec.MASK_KWARGS``). ``check_finite=False`` lets inf/NaN inputs propagate (the
    hooks: a GradScaler must see an overflow, not an exception). ``sink`` (Hq,): learnable sink logits in the
    denominator (module docstring); the LSE includes them, and a row that sees no key gets LSE = s_h."""
    args = MaskArgs.from_kwargs("fp32_forward", mask)
    _check(q, k, v, attn_mask, dropout_p, dropout_seed, args.varlen, check_finite=check_finite, sink=sink,
           softcap=args.softcap)
    B, Hq, Sq, _ = q.shape
    out = torch.zeros(B, Hq, Sq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    # after the outputs: on CUDA the budget reads the free memory, and the chunking must not change
    run = _prepare(q, args, attn_mask, dropout_p, dropout_seed, chunk_size, memory_budget, sink)
    if sink is not None:  # rows the walk skips (no visible key) have LSE = s_h
        for seg in segments(B, Sq, k.shape[2], args.varlen.cu_seqlens_q, args.varlen.cu_seqlens_k):
            lse[seg.batch, :, seg.q_start:seg.q_start + seg.q_len] = sink.to(torch.float32)[:, None]
    with full_fp32():
        for ch in _walk(q, k, v, run):
            pd = ch.p if ch.z is None else ch.p * ch.z
            out[ch.bs, :, ch.rows] = torch.matmul(pd, ch.v)
            lse[ch.bs, :, ch.rows] = ch.lse
    return out, lse


def given_lse_chunks(q, k, v, lse, *, scale: Optional[float] = None, causal: bool = False,
                     memory_budget: Optional[int] = None) -> Iterator[_Chunk]:
    """The query chunks of (q, k, v) (``spec.py`` layout, top-left causal or dense) with fp32 P = exp(α q·kᵀ − LSE)
    over the visible keys, LSE (B, Hq, Sq) fp32 given (rows whose LSE is ±inf: P = 0); each chunk's ``bs``,
    ``rows``, ``keys`` index the inputs, its ``q``, ``k``, ``v`` are fp32 (K/V repeated over each GQA group).
    What the FP32 form of a ring's passes walks (``ring.py``); run it inside ``emulation.full_fp32()``."""
    run = _prepare(q, MaskArgs(scale=scale, causal=causal), None, 0.0, None, None, memory_budget, None, lse)
    return _walk(q, k, v, run)


#: ``fp32_backward``'s keywords for a backward of the forward's own P (a shard's call): its LSE, its output and
#: the shard-row counter (taken from its ``**mask`` keywords, like the mask kwargs)
GIVEN_FORWARD_KWARGS = ("lse", "out", "partial_rows")


def fp32_backward(q, k, v, do, *, attn_mask=None, dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                  project: bool = True, chunk_size: Optional[int] = None, memory_budget: Optional[int] = None,
                  check_finite: bool = True, sink: Optional[torch.Tensor] = None, **mask):
    """(dq, dk, dv) fp32 of ⟨do, attention(q, k, v)⟩, recomputed in FP32; GProj projection unless project=False.

    ``mask``: the mask kwargs (``spec.MASK_KWARGS``) and, together or not at all, ``lse`` and ``out``
    (``GIVEN_FORWARD_KWARGS``): the forward's natural-log LSE (any layout ``spec.normalize_lse`` reads) and its
    output. With them P is taken relative to that LSE and D = rowsum(dO ∘ out) from that output, as a fused
    backward does, so a call over one shard of a row's keys (ring attention's per-shard call with the merged LSE
    and output) gets the gradient of its part of the attention; rows whose keys' mass Σ_j P_ij misses 1 by more
    than ``spec.shard_mass_tolerance`` are such shards and are not projected (their true dS sum is not 0), and
    ``partial_rows`` (an int32 tensor of one element) gets their count added (rows whose LSE is ±inf are not
    counted). Not with a sink (its path recomputes the forward). dk/dv are summed over each query-head group
    (GQA). Rows that see no key get zero gradients.
    ``check_finite=False`` lets inf/NaN propagate into the gradients (as a fused backward does) instead of raising.
    ``sink`` (Hq,): learnable sink logits (module docstring); the result is then (dq, dk, dv, dsink), dsink (Hq,)
    fp32.
    """
    mask, given = split_keywords("fp32_backward", mask, MASK_KWARGS, GIVEN_FORWARD_KWARGS)
    args = MaskArgs.from_kwargs("fp32_backward", mask)
    _check(q, k, v, attn_mask, dropout_p, dropout_seed, args.varlen, extra=(("do", do),), check_finite=check_finite,
           sink=sink, softcap=args.softcap)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    lse, out = _given_forward(given, sink, q)
    dq = torch.zeros(B, Hq, Sq, D, dtype=torch.float32, device=q.device)
    dk_full = torch.zeros(B, Hq, Sk, D, dtype=torch.float32, device=q.device)
    dv_full = torch.zeros(B, Hq, Sk, v.shape[-1], dtype=torch.float32, device=q.device)
    dsink = torch.zeros(Hq, dtype=torch.float32, device=q.device)
    mass = None if lse is None else torch.zeros(B, Hq, Sq, dtype=torch.float32, device=q.device)
    rel_tol, abs_tol = shard_mass_tolerance(torch.float32, Sk)
    # after the accumulators: on CUDA the budget reads the free memory, and the chunking must not change
    run = _prepare(q, args, attn_mask, dropout_p, dropout_seed, chunk_size, memory_budget, sink, lse)
    alpha = run.alpha
    with full_fp32():
        for ch in _walk(q, k, v, run):
            dO = do[ch.bs, :, ch.rows].to(torch.float32)
            p = ch.p
            pd = p if ch.z is None else p * ch.z
            dP = torch.matmul(dO, ch.v.transpose(-1, -2))
            if ch.z is not None:
                dP = dP * ch.z
            o_rows = torch.matmul(pd, ch.v) if out is None else out[ch.bs, :, ch.rows].to(torch.float32)
            Dr = (dO * o_rows).sum(-1, keepdim=True)
            g = p * (dP - Dr)
            target = torch.zeros_like(Dr) if ch.psink is None else ch.psink * Dr  # exact Σ_j G: P_sink·D
            if ch.psink is not None:
                dsink -= target.sum(dim=(0, 2, 3))
            dv_full[ch.bs, :, ch.keys] += torch.matmul(pd.transpose(-1, -2), dO)
            gt = g if ch.tau is None else g * ch.tau
            dqc = torch.matmul(gt, ch.k)
            dkc = torch.matmul(gt.transpose(-1, -2), ch.q)
            msum = p.sum(-1, keepdim=True)
            if mass is not None:
                mass[ch.bs, :, ch.rows] = msum.squeeze(-1)
            if project:
                rho = g.sum(-1, keepdim=True)
                lam = torch.where(msum > 0, (rho - target) / torch.where(msum > 0, msum, 1.0), torch.zeros_like(msum))
                if mass is not None:  # a shard of the row (its keys' mass short of 1): not projected
                    lam = torch.where((msum - 1.0).abs() > rel_tol + abs_tol, torch.zeros_like(lam), lam)
                pt = p if ch.tau is None else p * ch.tau
                dqc = dqc - lam * torch.matmul(pt, ch.k)
                dkc = dkc - torch.matmul((lam * pt).transpose(-1, -2), ch.q)
            dq[ch.bs, :, ch.rows] = alpha * dqc
            dk_full[ch.bs, :, ch.keys] += alpha * dkc
    if mass is not None and given.get("partial_rows") is not None:
        given["partial_rows"].add_(_shard_rows(mass, lse, args.varlen, rel_tol + abs_tol))
    dk = dk_full.view(B, Hkv, group, Sk, D).sum(2)
    dv = dv_full.view(B, Hkv, group, Sk, -1).sum(2)
    return (dq, dk, dv) if sink is None else (dq, dk, dv, dsink)


def _given_forward(given: dict, sink, q) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(LSE as (B, Hq, Sq) fp32, output) of ``fp32_backward``'s ``GIVEN_FORWARD_KWARGS`` (None, None without);
    ValueError where they cannot be used."""
    lse, out, counter = given.get("lse"), given.get("out"), given.get("partial_rows")
    if (lse is None) != (out is None):
        raise ValueError("fp32_backward: lse and out are given together (P from the LSE, D from the output)")
    if counter is not None and not (isinstance(counter, torch.Tensor) and counter.numel() == 1
                                    and counter.dtype == torch.int32 and counter.device == q.device):
        raise ValueError("partial_rows must be an int32 tensor of one element on q's device")
    if lse is None:
        return None, None
    if sink is not None:
        raise ValueError("fp32_backward: a sink recomputes the forward (no lse/out with a sink)")
    B, Hq, Sq, _ = q.shape
    if not isinstance(out, torch.Tensor) or out.shape[:3] != (B, Hq, Sq) or out.device != q.device:
        raise ValueError(f"fp32_backward: out must be (B, Hq, Sq, Dv) = ({B}, {Hq}, {Sq}, ·) on q's device")
    return normalize_lse(lse, B, Hq, Sq), out


def _shard_rows(mass: torch.Tensor, lse: torch.Tensor, varlen: Varlen, tol: float) -> torch.Tensor:
    """How many rows with a finite LSE have a positive mass of their keys here, more than ``tol`` from 1: the shard
    rows the walk left unprojected. A row with no mass here (it sees no key of this call, e.g. a row a boolean mask
    hides entirely, whose LSE PyTorch's CPU kernel leaves finite) has zero gradients here: nothing is left
    unprojected. Rows outside every varlen sequence are not rows."""
    rows = torch.isfinite(lse) & (mass > 0) & ((mass - 1.0).abs() > tol)
    if varlen.cu_seqlens_q is not None:
        inside = torch.zeros_like(rows)
        for seg in segments(lse.shape[0], lse.shape[2], 0, varlen.cu_seqlens_q, varlen.cu_seqlens_k):
            inside[seg.batch, :, seg.q_start:seg.q_start + seg.q_len] = True
        rows = rows & inside
    return rows.sum().to(torch.int32).reshape(1)
