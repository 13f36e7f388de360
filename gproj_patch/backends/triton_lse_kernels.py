"""Triton kernel of the natural-log LSE of α·q·kᵀ (a forward without V), launched by ``triton_lse.attention_lse``
for callers that have an attention output but not its LSE (the torch.compile path of the SDPA hook).

Loaded like ``triton_kernels.py`` (compiled for CUDA, interpreted for CPU tensors; ``triton_bwd.kernel_module``): do
not import it directly.
"""
import triton
import triton.language as tl

#: ln 2: a base-2 log-sum-exp times LN2 is the natural-log one
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maxf(a, b):
    return tl.maximum(a, b)


@triton.jit
def _lse_fwd(Q, K, LSE,
             sq_b, sq_h, sq_s, sq_d,
             sk_b, sk_h, sk_s, sk_d,
             sl_b, sl_h, sl_s,
             GROUP, SQ, SK, HEAD_DIM, scale_log2,
             CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Natural-log LSE of α·q·kᵀ (SDPA's top-left causal or dense), online over key tiles: a forward
    without V, for callers that have the output but no LSE (the torch.compile path of the SDPA hook)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = (h // GROUP).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    md = offs_d < HEAD_DIM
    q = tl.load(Q + b * sq_b + h.to(tl.int64) * sq_h + offs_m[:, None] * sq_s + offs_d[None, :] * sq_d,
                mask=(offs_m[:, None] < SQ) & md[None, :], other=0.0)
    K_base = K + b * sk_b + hk * sk_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    hi = SK
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K_base + offs_n[:, None] * sk_s + offs_d[None, :] * sk_d,
                    mask=(offs_n[:, None] < SK) & md[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2  # α·q·kᵀ in base 2 (scale_log2 = α·log2 e)
        vis = offs_n[None, :] < SK
        if CAUSAL:  # SDPA's top-left causal mask: key j visible from row i iff j ≤ i
            vis = vis & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(vis, s, float("-inf"))
        # online log-sum-exp: running max m_i, and l_i = Σ 2^(s − m_i) rescaled when the max grows
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _maxf))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no -inf − -inf
        l_i = l_i * tl.math.exp2(m_i - m_safe) + tl.reduce(tl.math.exp2(s - m_safe[:, None]), 1, _add)
        m_i = m_new
    # LSE = (m + log2 l)·ln 2; -inf for a row that saw no key
    lse = tl.where(l_i > 0.0, (m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(LSE + b * sl_b + h.to(tl.int64) * sl_h + offs_m * sl_s, lse, mask=offs_m < SQ)
