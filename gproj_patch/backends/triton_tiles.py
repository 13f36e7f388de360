"""The per-tile steps both Triton ``tl`` kernels of the backward share (``triton_kernels._bwd_dq`` and
``_bwd_dkdv``): the rows and keys of one problem (a batch entry or a varlen sequence), loads and stores of
(rows × head dim) tiles with the ragged edges masked, and P = exp(score − LSE) from a tile of raw scores, with
the softcap's tanh and its derivative.

Loaded with ``triton_kernels.py``, in the same mode (compiled for CUDA or interpreted for CPU tensors): the kernel
file's relative import of this file resolves inside the package ``compat.load_interpreted_module`` makes for that
mode, so the helpers a kernel calls are always ``@triton.jit`` functions of its own mode. Do not import it
directly.
"""
import triton
import triton.language as tl

#: −2/ln 2: e^(−2|y|) = 2^(|y|·NEG_2_RCP_LN2), the exponential in tanh|y| = (1 − e^(−2|y|)) / (1 + e^(−2|y|))
NEG_2_RCP_LN2 = tl.constexpr(-2.8853900817779268)
#: below this |y| (1/16), tanh's series y − y³/3 + 2y⁵/15 replaces the exp2 form (its 1 − e^(−2|y|) cancels)
TANH_SERIES_BELOW = tl.constexpr(0.0625)
#: the series' coefficients: tanh y = y·(1 − y²·(TANH_C3 − y²·TANH_C5)) + O(y⁷)
TANH_C3 = tl.constexpr(0.3333333333333333)  # 1/3
TANH_C5 = tl.constexpr(0.13333333333333333)  # 2/15


@triton.jit
def segment(CU_Q, CU_K, z, SQ, SK, VARLEN: tl.constexpr):
    """(batch, q_start, q_len, k_start, k_len) of problem z: a batch entry, or one varlen sequence."""
    if VARLEN:
        q_start = tl.load(CU_Q + z).to(tl.int32)
        q_len = tl.load(CU_Q + z + 1).to(tl.int32) - q_start
        k_start = tl.load(CU_K + z).to(tl.int32)
        k_len = tl.load(CU_K + z + 1).to(tl.int32) - k_start
        b = z * 0
    else:
        q_start = z * 0
        q_len = SQ + z * 0
        k_start = z * 0
        k_len = SK + z * 0
        b = z
    return b.to(tl.int64), q_start, q_len, k_start, k_len


@triton.jit
def load_rows(A, sa_s, sa_d, offs, n, offs_d, HEAD_DIM, EVEN: tl.constexpr):
    """A (len(offs), BLOCK_D) tile of rows ``offs`` (rows >= n and columns >= HEAD_DIM read as 0)."""
    if EVEN:
        a = tl.load(A + offs[:, None] * sa_s + offs_d[None, :] * sa_d)
    else:
        a = tl.load(A + offs[:, None] * sa_s + offs_d[None, :] * sa_d,
                    mask=(offs[:, None] < n) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    return a


@triton.jit
def load_pair(A, B, sa_s, sa_d, sb_s, sb_d, offs, n, offs_d, HEAD_DIM, EVEN: tl.constexpr):
    """Two tiles of the same rows (``load_rows``)."""
    a = load_rows(A, sa_s, sa_d, offs, n, offs_d, HEAD_DIM, EVEN=EVEN)
    b = load_rows(B, sb_s, sb_d, offs, n, offs_d, HEAD_DIM, EVEN=EVEN)
    return a, b


@triton.jit
def store_tile(P, x, s_s, s_d, offs, n, offs_d, HEAD_DIM, EVEN: tl.constexpr):
    """``x`` stored in P's dtype to rows ``offs`` (rows >= n and columns >= HEAD_DIM left alone)."""
    if EVEN:
        tl.store(P + offs[:, None] * s_s + offs_d[None, :] * s_d, x.to(P.dtype.element_ty))
    else:
        tl.store(P + offs[:, None] * s_s + offs_d[None, :] * s_d, x.to(P.dtype.element_ty),
                 mask=(offs[:, None] < n) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def probs(s, lse2b, scale_log2, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """P = exp(score − lse) from the raw dot s = q·k (fp32), and τ' = 1 − tanh² under a softcap.

    Softcap: score = c·tanh(α s / c); ``cap_in`` = α / c, ``cap_out`` = c·log2(e). tanh from exp2 (no
    overflow), with a short series for |y| < 1/16 where 1 − e^{−2|y|} would cancel."""
    if SOFTCAP:
        y = s * cap_in  # y = α s / c
        ay = tl.abs(y)
        e = tl.math.exp2(ay * NEG_2_RCP_LN2)  # e^(−2|y|) ∈ (0, 1]: no overflow
        th = (1.0 - e) / (1.0 + e)  # tanh |y|
        y2 = ay * ay
        th = tl.where(ay < TANH_SERIES_BELOW, ay * (1.0 - y2 * (TANH_C3 - y2 * TANH_C5)), th)
        th = tl.where(y < 0.0, -th, th)  # tanh is odd
        p = tl.math.exp2(th * cap_out - lse2b)  # P = exp(c·tanh y − LSE), in base 2
        tau = 1.0 - th * th  # τ' = d tanh / dy: the chain rule from the capped score to s
    else:
        p = tl.math.exp2(s * scale_log2 - lse2b)  # P = exp(α s − LSE), in base 2
        tau = p  # unused
    return p, tau
