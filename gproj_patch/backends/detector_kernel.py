"""The large-key detector's statistics (``gproj_patch/policy/detector.py``) as two Triton launches over the sampled rows.

Inputs are read in place: q (B, Hq, Sq, D) and k (B, Hkv, Sk, D) with any strides, and the LSE as
``spec.normalize_lse`` yields it (B, Hq, Sq) fp32 with any strides. Sample row r of a sequence of length S is
``index[r]`` when an index tensor is given (``detector._row_index``: round(linspace(0, S − 1, n))), else row r
itself (all rows). No gather, no copy of q, k or the LSE.

Launch 1, ``_head_statistics``: one program per (batch, query head). It computes the statistics of its KV head
(every program of a GQA group computes the same values from the same rows; the group's first head writes
them), then those of its query head, all in fp32:

* key pass 1: mean key k̄ (sum of the sampled rows / n) and max_j ‖k_j‖²; key pass 2: Σ_j ‖k_j − k̄‖²
  (two passes: the offset ratio reaches 1e3 and more, where Σ‖k‖² − n‖k̄‖² would cancel to noise);
* query pass 1: mean query, max_i ‖q_i‖², and over the live rows (finite LSE) the sums of LSE_i − α q_i·k̄
  and of exp(min(α q_i·k_0 − LSE_i, 0)) (k_0: row 0 of k, always read); query pass 2: Σ_i ‖q_i − q̄‖².

It writes r_k, leak_dq = 2u·r_k per (batch, KV head) and r_q, leak_dk, logit_bound, lse_gap, p_sink per
(batch, query head); lse_gap and p_sink are NaN without an LSE or when every sampled row is dead.

Launch 2, ``_reduce_worst``: one program reduces them to the 7 values of ``detector.SUMMARY_KEYS[:7]``: the
max of r_k, r_q, leak_dq, leak_dk, logit_bound (NaN if any is NaN, as ``Tensor.max``), the NaN-skipping mean
of lse_gap (NaN when all are NaN, as ``torch.nanmean``) and the max of p_sink with NaN read as 0.

No atomics: every output element is written by one program, so results are bitwise deterministic. Everything
lands in one fp32 buffer (``HeadStatistics.buffer``) of 2·B·Hkv + 5·B·Hq + 7 values; ``worst`` is its tail.
"""
import contextlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .compat import triton_interpreter_index_patch
from .configs import block_d

try:  # pragma: no cover - import guard
    import triton
    import triton.language as tl
    _HAS_TRITON = True
except Exception:  # pragma: no cover
    _HAS_TRITON = False

#: floor of a spread in the offset ratio ‖mean‖ / spread (as ``detector.offset_ratio``)
TINY = 1e-30
#: fp32 elements of one (rows, head dim) tile: rows per tile = TILE_ELEMENTS // padded head dim, clamped to
#: [MIN_BLOCK_ROWS, MAX_BLOCK_ROWS] (64 rows at D = 128: four tiles cover the default 256 sampled rows)
TILE_ELEMENTS = 8192
MIN_BLOCK_ROWS, MAX_BLOCK_ROWS = 16, 64
#: warps per program of launch 1 (a 64 x 128 fp32 tile is 32 values a thread) and of launch 2
NUM_WARPS_HEADS, NUM_WARPS_REDUCE = 8, 4
#: per-head values the reduction reads per step
BLOCK_HEADS = 128
#: largest head dim the kernel takes (one tile row holds a whole row of q or k)
MAX_HEAD_DIM = 256
#: the 7 reduced values, in ``detector.SUMMARY_KEYS`` order
N_WORST = 7
#: per-(batch, KV head) outputs: r_k, leak_dq; per-(batch, query head): r_q, leak_dk, logit_bound, lse_gap, p_sink
N_KEY_OUT, N_QUERY_OUT = 2, 5
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class HeadStatistics:
    """The kernel's results: views into one fp32 ``buffer`` on the input's device."""

    r_k: torch.Tensor          # (B, Hkv)
    leak_dq: torch.Tensor      # (B, Hkv)
    r_q: torch.Tensor          # (B, Hq)
    leak_dk: torch.Tensor      # (B, Hq)
    logit_bound: torch.Tensor  # (B, Hq)
    lse_gap: torch.Tensor      # (B, Hq)
    p_sink: torch.Tensor       # (B, Hq)
    worst: torch.Tensor        # (7,)
    buffer: torch.Tensor



if _HAS_TRITON:
    @triton.jit
    def _sample_positions(INDEX, r, n_rows, HAS_INDEX: tl.constexpr):
        """(sequence position, in range) of sample rows ``r``: ``INDEX[r]`` or ``r`` itself (all rows)."""
        in_range = r < n_rows
        if HAS_INDEX:
            pos = tl.load(INDEX + r, mask=in_range, other=0)
        else:
            pos = r
        return pos.to(tl.int64), in_range

    @triton.jit
    def _load_rows(X, stride_s, stride_d, pos, in_range, offs_d, head_dim):
        """(BLOCK_R, BLOCK_D) fp32 tile of the rows at ``pos``, and its validity (other rows and columns read 0)."""
        valid = in_range[:, None] & (offs_d[None, :] < head_dim)
        ptrs = X + pos[:, None] * stride_s + offs_d[None, :].to(tl.int64) * stride_d
        return tl.load(ptrs, mask=valid, other=0.0).to(tl.float32), valid

    @triton.jit
    def _first_pass(X, stride_s, stride_d, INDEX, n_rows, head_dim, LSE, lse_stride_s, n_lse_rows, kmean, k0, alpha,
                    WITH_LSE: tl.constexpr, HAS_INDEX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Pass 1 over the sampled rows of one head: (mean row (BLOCK_D,), max row norm ‖x_i‖₂, lse_gap, p_sink).

        With ``WITH_LSE`` (query heads) the same pass reads LSE_i and averages LSE_i − α x_i·kmean and
        exp(min(α x_i·k0 − LSE_i, 0)) over the live rows (finite LSE; rows r < n_lse_rows, so 0 reads no LSE);
        lse_gap and p_sink are NaN when no row is live (always without ``WITH_LSE``)."""
        offs_d = tl.arange(0, BLOCK_D)
        total = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        max_sq = tl.zeros([BLOCK_R], dtype=tl.float32)
        gap_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
        sink_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
        n_live = tl.zeros([BLOCK_R], dtype=tl.float32)
        for start in range(0, n_rows, BLOCK_R):
            r = start + tl.arange(0, BLOCK_R)
            pos, in_range = _sample_positions(INDEX, r, n_rows, HAS_INDEX=HAS_INDEX)
            x, _ = _load_rows(X, stride_s, stride_d, pos, in_range, offs_d, head_dim)
            total += x
            max_sq = tl.maximum(max_sq, tl.sum(x * x, axis=1))
            if WITH_LSE:
                has_lse = r < n_lse_rows
                lse = tl.load(LSE + pos * lse_stride_s, mask=has_lse, other=float("-inf"))
                live = has_lse & (tl.abs(lse) < float("inf"))  # -inf (sees no key), +inf and NaN rows are dead
                lse = tl.where(live, lse, 0.0)
                score_mean = alpha * tl.sum(x * kmean[None, :], axis=1)   # α x_i·k̄
                score_0 = alpha * tl.sum(x * k0[None, :], axis=1)         # α x_i·k_0
                gap_sum += tl.where(live, lse - score_mean, 0.0)
                sink_sum += tl.where(live, tl.exp(tl.minimum(score_0 - lse, 0.0)), 0.0)
                n_live += live.to(tl.float32)
        mean = tl.sum(total, axis=0) / n_rows
        count = tl.sum(n_live, axis=0)
        lse_gap = tl.where(count > 0, tl.sum(gap_sum, axis=0) / tl.maximum(count, 1.0), float("nan"))
        p_sink = tl.where(count > 0, tl.sum(sink_sum, axis=0) / tl.maximum(count, 1.0), float("nan"))
        return mean, tl.sqrt(tl.max(max_sq, axis=0)), lse_gap, p_sink

    @triton.jit
    def _offset_ratio(X, stride_s, stride_d, INDEX, n_rows, head_dim, mean, tiny,
                      HAS_INDEX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Pass 2: ‖mean‖ / max(spread, tiny), spread = RMS over the sampled rows of ‖x_i − mean‖₂."""
        offs_d = tl.arange(0, BLOCK_D)
        dev_sq = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for start in range(0, n_rows, BLOCK_R):
            pos, in_range = _sample_positions(INDEX, start + tl.arange(0, BLOCK_R), n_rows, HAS_INDEX=HAS_INDEX)
            x, valid = _load_rows(X, stride_s, stride_d, pos, in_range, offs_d, head_dim)
            dev = tl.where(valid, x - mean[None, :], 0.0)
            dev_sq += dev * dev
        spread = tl.sqrt(tl.sum(tl.sum(dev_sq, axis=1), axis=0) / n_rows)
        return tl.sqrt(tl.sum(mean * mean, axis=0)) / tl.maximum(spread, tiny)

    @triton.jit
    def _head_statistics(
            Q, K, LSE, Q_INDEX, K_INDEX, KEY_OUT, QUERY_OUT,
            sq_b, sq_h, sq_s, sq_d, sk_b, sk_h, sk_s, sk_d, sl_b, sl_h, sl_s,
            n_batch, n_heads, n_kv_heads, n_q_rows, n_k_rows, n_lse_rows, head_dim, alpha, two_u, tiny,
            GROUP: tl.constexpr, HAS_Q_INDEX: tl.constexpr, HAS_K_INDEX: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Launch 1, one program per (batch, query head) (module docstring). Writes KEY_OUT (2, B, Hkv) =
        (r_k, leak_dq) and QUERY_OUT (5, B, Hq) = (r_q, leak_dk, logit_bound, lse_gap, p_sink), contiguous."""
        pid = tl.program_id(0).to(tl.int64)   # = b·Hq + h
        b = pid // n_heads
        h = pid % n_heads
        h_kv = h // GROUP
        q_head = Q + b * sq_b + h * sq_h
        k_head = K + b * sk_b + h_kv * sk_h

        offs_d = tl.arange(0, BLOCK_D)
        no_reference = tl.zeros([BLOCK_D], dtype=tl.float32)
        # the KV head (every program of a GQA group computes the same values from the same rows)
        kmean, kmax, _, _ = _first_pass(k_head, sk_s, sk_d, K_INDEX, n_k_rows, head_dim, LSE, sl_s, 0,
                                        no_reference, no_reference, alpha,
                                        WITH_LSE=False, HAS_INDEX=HAS_K_INDEX, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
        r_k = _offset_ratio(k_head, sk_s, sk_d, K_INDEX, n_k_rows, head_dim, kmean, tiny,
                            HAS_INDEX=HAS_K_INDEX, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
        # the query head, its LSE terms against the KV head's mean key and key 0
        k0 = tl.load(k_head + offs_d.to(tl.int64) * sk_d, mask=offs_d < head_dim, other=0.0).to(tl.float32)
        qmean, qmax, lse_gap, p_sink = _first_pass(q_head, sq_s, sq_d, Q_INDEX, n_q_rows, head_dim,
                                                   LSE + b * sl_b + h * sl_h, sl_s, n_lse_rows, kmean, k0, alpha,
                                                   WITH_LSE=True, HAS_INDEX=HAS_Q_INDEX, BLOCK_R=BLOCK_R,
                                                   BLOCK_D=BLOCK_D)
        r_q = _offset_ratio(q_head, sq_s, sq_d, Q_INDEX, n_q_rows, head_dim, qmean, tiny,
                            HAS_INDEX=HAS_Q_INDEX, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)

        n_q = n_batch * n_heads
        tl.store(QUERY_OUT + pid, r_q)
        tl.store(QUERY_OUT + n_q + pid, two_u * r_q)
        tl.store(QUERY_OUT + 2 * n_q + pid, alpha * qmax * kmax)
        tl.store(QUERY_OUT + 3 * n_q + pid, lse_gap)
        tl.store(QUERY_OUT + 4 * n_q + pid, p_sink)
        if h % GROUP == 0:  # the group's first query head writes the KV head's values
            n_kv = n_batch * n_kv_heads
            kv = b * n_kv_heads + h_kv
            tl.store(KEY_OUT + kv, r_k)
            tl.store(KEY_OUT + n_kv + kv, two_u * r_k)

    @triton.jit
    def _max_or_nan(X, n, BLOCK: tl.constexpr):
        """max of X[0:n], NaN when any element is NaN (as ``Tensor.max``)."""
        best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        n_nan = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(X + offs, mask=offs < n, other=float("-inf"))
            is_nan = x != x
            n_nan += is_nan.to(tl.int32)
            best = tl.maximum(best, tl.where(is_nan, float("-inf"), x))
        return tl.where(tl.sum(n_nan, axis=0) > 0, float("nan"), tl.max(best, axis=0))

    @triton.jit
    def _nan_mean(X, n, BLOCK: tl.constexpr):
        """mean of the non-NaN elements of X[0:n], NaN when all are NaN (as ``torch.nanmean``)."""
        total = tl.zeros([BLOCK], dtype=tl.float32)
        count = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(X + offs, mask=offs < n, other=float("nan"))
            is_number = x == x
            total += tl.where(is_number, x, 0.0)
            count += is_number.to(tl.float32)
        n_numbers = tl.sum(count, axis=0)
        return tl.where(n_numbers > 0, tl.sum(total, axis=0) / tl.maximum(n_numbers, 1.0), float("nan"))

    @triton.jit
    def _max_nan_as_zero(X, n, BLOCK: tl.constexpr):
        """max of X[0:n] with NaN read as 0 (``detector._nanmax``)."""
        best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(X + offs, mask=offs < n, other=float("-inf"))
            best = tl.maximum(best, tl.where(x != x, 0.0, x))
        return tl.max(best, axis=0)

    @triton.jit
    def _reduce_worst(KEY_OUT, QUERY_OUT, WORST, n_kv, n_q, BLOCK: tl.constexpr):
        """Launch 2, one program: WORST (7,) = max r_k, max r_q, max leak_dq, max leak_dk, max logit_bound,
        nan-mean lse_gap, max p_sink (NaN as 0) — ``detector.SUMMARY_KEYS[:7]``."""
        tl.store(WORST + 0, _max_or_nan(KEY_OUT, n_kv, BLOCK=BLOCK))
        tl.store(WORST + 1, _max_or_nan(QUERY_OUT, n_q, BLOCK=BLOCK))
        tl.store(WORST + 2, _max_or_nan(KEY_OUT + n_kv, n_kv, BLOCK=BLOCK))
        tl.store(WORST + 3, _max_or_nan(QUERY_OUT + n_q, n_q, BLOCK=BLOCK))
        tl.store(WORST + 4, _max_or_nan(QUERY_OUT + 2 * n_q, n_q, BLOCK=BLOCK))
        tl.store(WORST + 5, _nan_mean(QUERY_OUT + 3 * n_q, n_q, BLOCK=BLOCK))
        tl.store(WORST + 6, _max_nan_as_zero(QUERY_OUT + 4 * n_q, n_q, BLOCK=BLOCK))


def _interpreted() -> bool:
    """True when this module's kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return _HAS_TRITON and type(_head_statistics).__name__ == "InterpretedFunction"


def detector_kernel_supported(q: torch.Tensor, k: torch.Tensor, lse: Optional[torch.Tensor]) -> Tuple[bool, str]:
    """(True, "") when ``head_statistics`` runs these inputs, else (False, a short reason for the fallback).

    q (B, Hq, Sq, D), k (B, Hkv, Sk, D): fp16/bf16/fp32, any strides, D <= MAX_HEAD_DIM, Hq a multiple of Hkv,
    nothing empty; lse None or (B, Hq, Sq) fp32 (``spec.normalize_lse``'s result), any strides; one device:
    CUDA (kernels compiled), or CPU with fp16/fp32 when the kernels were built for the interpreter."""
    if not _HAS_TRITON:
        return False, "no triton"
    if q.dim() != 4 or k.dim() != 4:
        return False, "q or k not 4-D"
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or Hkv == 0 or Hq % Hkv != 0:
        return False, f"q {tuple(q.shape)} and k {tuple(k.shape)} do not form an attention problem"
    if B * Hq == 0 or Sq == 0 or Sk == 0 or D == 0:
        return False, "empty input"
    if D > MAX_HEAD_DIM:
        return False, f"head_dim={D} > {MAX_HEAD_DIM}"
    if q.dtype not in _FLOAT_DTYPES or k.dtype not in _FLOAT_DTYPES:
        return False, f"dtypes {q.dtype}, {k.dtype}"
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (B, Hq, Sq)):
        return False, f"lse {tuple(lse.shape)} {lse.dtype} is not (B, Hq, Sq) fp32 (spec.normalize_lse)"
    if k.device != q.device or (lse is not None and lse.device != q.device):
        return False, "q, k, lse on different devices"
    if q.device.type == "cuda":
        if _interpreted():
            return False, "TRITON_INTERPRET was set when the kernels were built"
        return True, ""
    if q.device.type == "cpu":
        if not _interpreted():
            return False, "cpu tensor (the kernel runs on CPU only under TRITON_INTERPRET=1)"
        if torch.bfloat16 in (q.dtype, k.dtype):
            return False, "bfloat16 under the Triton interpreter (inexact)"
        return True, ""
    return False, f"device={q.device.type}"


def _block_rows(block_d: int) -> int:
    return max(MIN_BLOCK_ROWS, min(MAX_BLOCK_ROWS, TILE_ELEMENTS // block_d))


def head_statistics(q: torch.Tensor, k: torch.Tensor, lse: Optional[torch.Tensor], *, scale: float, u: float,
                    q_index: Optional[torch.Tensor] = None, k_index: Optional[torch.Tensor] = None) -> HeadStatistics:
    """The detector statistics of one call in two launches (module docstring); nothing synchronizes.

    ``q_index`` / ``k_index``: int64 sample positions along Sq / Sk on the input's device (None: all rows).
    ``scale`` is α, ``u`` the unit roundoff of the leaks. Raises ValueError on inputs
    ``detector_kernel_supported`` refuses."""
    supported, reason = detector_kernel_supported(q, k, lse)
    if not supported:
        raise ValueError(f"detector kernel cannot run these inputs: {reason}")
    for name, index in (("q_index", q_index), ("k_index", k_index)):
        if index is not None and (index.dim() != 1 or index.numel() == 0 or index.device != q.device
                                  or index.dtype != torch.int64):
            raise ValueError(f"{name} must be a non-empty 1-D int64 tensor on {q.device}")
    return launch_head_statistics(q, k, lse, scale=scale, u=u, q_index=q_index, k_index=k_index)


def launch_head_statistics(q: torch.Tensor, k: torch.Tensor, lse: Optional[torch.Tensor], *, scale: float,
                           u: float, q_index: Optional[torch.Tensor],
                           k_index: Optional[torch.Tensor]) -> HeadStatistics:
    """``head_statistics`` without its checks, for a caller that has just asked ``detector_kernel_supported``
    itself (the detector, before its fallback) and builds the indices as required (1-D int64, q's device)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    n_q, n_kv = B * Hq, B * Hkv
    buffer = torch.empty(N_KEY_OUT * n_kv + N_QUERY_OUT * n_q + N_WORST, dtype=torch.float32, device=q.device)
    key_out = buffer[:N_KEY_OUT * n_kv]
    query_out = buffer[N_KEY_OUT * n_kv:N_KEY_OUT * n_kv + N_QUERY_OUT * n_q]
    worst = buffer[N_KEY_OUT * n_kv + N_QUERY_OUT * n_q:]
    n_q_rows = Sq if q_index is None else q_index.numel()
    n_k_rows = Sk if k_index is None else k_index.numel()
    # absent optional inputs: a pointer that is never read (no index: HAS_*_INDEX False; no LSE: 0 rows)
    lse_ptr, lse_strides = (buffer, (0, 0, 0)) if lse is None else (lse, lse.stride())
    interpret = q.device.type != "cuda"
    tile_d = block_d(D)
    with (triton_interpreter_index_patch() if interpret else contextlib.nullcontext()):
        _head_statistics[(n_q,)](
            q, k, lse_ptr, buffer if q_index is None else q_index, buffer if k_index is None else k_index,
            key_out, query_out, *q.stride(), *k.stride(), *lse_strides,
            n_batch=B, n_heads=Hq, n_kv_heads=Hkv, n_q_rows=n_q_rows, n_k_rows=n_k_rows,
            n_lse_rows=0 if lse is None else n_q_rows, head_dim=D, alpha=float(scale), two_u=2.0 * float(u),
            tiny=TINY, GROUP=Hq // Hkv, HAS_Q_INDEX=q_index is not None, HAS_K_INDEX=k_index is not None,
            BLOCK_R=_block_rows(tile_d), BLOCK_D=tile_d, num_warps=NUM_WARPS_HEADS)
        _reduce_worst[(1,)](key_out, query_out, worst, n_kv=n_kv, n_q=n_q, BLOCK=BLOCK_HEADS,
                            num_warps=NUM_WARPS_REDUCE)
    key = key_out.view(N_KEY_OUT, B, Hkv)
    query = query_out.view(N_QUERY_OUT, B, Hq)
    return HeadStatistics(r_k=key[0], leak_dq=key[1], r_q=query[0], leak_dk=query[1], logit_bound=query[2],
                          lse_gap=query[3], p_sink=query[4], worst=worst, buffer=buffer)
