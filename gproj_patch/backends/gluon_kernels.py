"""Hopper (sm_90a) Gluon kernels of the GProj backward (launched from ``gluon_bwd.py``).

Same numerics contract and the same split as the portable ``tl`` kernels (``triton_kernels.py``):
``_preprocess_kernel`` gives D (from the saved output) and a base-2 LSE (+inf on fully masked rows); then

* ``_dq_kernel`` (dQ-major): one program per (query block, query head, batch). Per key tile:
  S = Q·Kᵀ and dP = dO·Vᵀ (wgmma, operands in shared memory), P = exp2(S·α·log2e − lse2),
  t = low(P∘(dP − D)), r = low(P); then t·K, r·K (wgmma, A from registers) and the row sums ρ = Σt, m = Σr
  as wgmma products with a one-hot (BLOCK_N × 8) matrix (column 0 ones), all accumulated in fp32.
  At the end λ = ρ/m (0 where m = 0), dq = α(tK − λ·rK); λ goes to an fp32 (B·H·Sq) scratch.
* ``_dkdv_kernel`` (KV-major): one program per (key block, KV head, batch); it walks every (query head of the
  GQA group, query tile) pair, so dk and dv are reduced over the group in registers (no atomics, no K/V
  copies, deterministic). Per tile, transposed: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dv += low(Pᵀ)·dO,
  dk += low(Pᵀ∘(dPᵀ − D − λ))·Q (the "fused" dk: t − λr rounded once, never re-rounded); dk ×= α at the end.

Every tile operand streams through TMA (4-D descriptors over the (B, H, S, D) tensors with any 16-byte-aligned
strides; rows past the end read as zeros) into a ``NUM_STAGES``-deep ring of shared-memory buffers, each
with its mbarrier; the tile ``NUM_STAGES − 1`` ahead is requested as soon as the buffer it reuses is free.

Masking. Causal is "key j visible from query i iff j ≤ i + shift" (shift = 0 top-left, Sk − Sq bottom-right).
Only tiles that cross the diagonal (and, in the dq kernel, the ragged last key tile) are masked. Rows past
Sq read lse2 = +inf, so their P is exactly 0; keys past Sk in the dk/dv kernel only touch their own dk/dv rows,
which are never stored.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

#: columns of the one-hot matrix the row sums are multiplied with (the narrowest wgmma N)
SUM_COLS = gl.constexpr(8)
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.constexpr_function
def _mma_layout(ROWS, COLS, num_warps):
    """wgmma accumulator layout of a (ROWS × COLS) tile: warps stacked along the rows, one N = COLS instruction."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, COLS, 16])


@gluon.jit
def _one_hot_smem(dtype: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr):
    """A (ROWS × SUM_COLS) matrix in shared memory with ones in column 0: x·E puts Σ_j x_ij in column 0."""
    blk: gl.constexpr = gl.BlockedLayout([1, SUM_COLS], [32, 1], [num_warps, 1], [1, 0])
    col = gl.arange(0, SUM_COLS, layout=gl.SliceLayout(0, blk))
    row = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blk))
    e = gl.where((row[:, None] >= 0) & (col[None, :] == 0), 1.0, 0.0).to(dtype)
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, SUM_COLS], dtype)
    smem = gl.allocate_shared_memory(dtype, [ROWS, SUM_COLS], layout, e)
    fence_async_shared()  # generic-proxy stores, read next by wgmma (async proxy)
    gl.thread_barrier()
    return smem


@gluon.jit
def _alloc_operands(dtype: gl.constexpr, RES_ROWS: gl.constexpr, STREAM_ROWS: gl.constexpr,
                    HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Shared memory of one program: a resident pair of (RES_ROWS × D) tiles with its mbarrier, and a ring of
    NUM_STAGES streamed pairs of (STREAM_ROWS × D) tiles with one mbarrier a slot."""
    res_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([RES_ROWS, HEAD_DIM], dtype)
    ring_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([STREAM_ROWS, HEAD_DIM], dtype)
    res_a = gl.allocate_shared_memory(dtype, [1, RES_ROWS, HEAD_DIM], res_layout)
    res_b = gl.allocate_shared_memory(dtype, [1, RES_ROWS, HEAD_DIM], res_layout)
    ring_a = gl.allocate_shared_memory(dtype, [NUM_STAGES, STREAM_ROWS, HEAD_DIM], ring_layout)
    ring_b = gl.allocate_shared_memory(dtype, [NUM_STAGES, STREAM_ROWS, HEAD_DIM], ring_layout)
    res_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ring_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(res_bar.index(0), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ring_bars.index(i), count=1)
    return res_a, res_b, ring_a, ring_b, res_bar, ring_bars


@gluon.jit
def _release(res_bar, ring_bars, NUM_STAGES: gl.constexpr):
    mbarrier.invalidate(res_bar.index(0))
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ring_bars.index(i))


@gluon.jit
def _issue_pair(desc_a, desc_b, bars, smem_a, smem_b, stage, b, h, row0):
    """Request the (BLOCK × D) tiles at row ``row0`` of head h, batch b from both tensors into ring slot
    ``stage``; its mbarrier completes when both have landed."""
    bar = bars.index(stage)
    mbarrier.expect(bar, 2 * desc_a.block_type.nbytes)
    shape4: gl.constexpr = desc_a.block_type.shape
    tma.async_copy_global_to_shared(desc_a, [b, h, row0, 0], bar, smem_a.index(stage).reshape(shape4))
    tma.async_copy_global_to_shared(desc_b, [b, h, row0, 0], bar, smem_b.index(stage).reshape(shape4))


@gluon.jit
def _preprocess_kernel(O, DO, LSE, Delta, LSE2,
                       so_b, so_h, so_s, sdo_b, sdo_h, sdo_s, sl_b, sl_h, sl_s,
                       H, SQ, BLOCK_S: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
    """D_i = Σ_d dO_id·O_id in fp32 from the saved output, and lse2 = LSE·log2(e) with −inf rows made +inf
    (their P is then exactly 0), both written to (B·H, Sq) fp32 rows."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [num_warps, 1], [1, 0])
    pid_s = gl.program_id(0)
    bh = gl.program_id(1)
    b = (bh // H).to(gl.int64)
    h = (bh % H).to(gl.int64)
    offs_s = pid_s * BLOCK_S + gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, blk))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk))
    inside = offs_s < SQ
    rows = offs_s.to(gl.int64)[:, None]
    m2 = inside[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = gl.load(O + b * so_b + h * so_h + rows * so_s + offs_d[None, :], mask=m2, other=0.0)
    do = gl.load(DO + b * sdo_b + h * sdo_h + rows * sdo_s + offs_d[None, :], mask=m2, other=0.0)
    delta = gl.sum(o.to(gl.float32) * do.to(gl.float32), axis=1)
    lse = gl.load(LSE + b * sl_b + h * sl_h + offs_s * sl_s, mask=inside, other=0.0)
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    out = bh.to(gl.int64) * SQ + offs_s
    gl.store(Delta + out, delta, mask=inside)
    gl.store(LSE2 + out, lse2, mask=inside)


@gluon.jit
def _mask_dq(p, offs_m, start_n, SK, shift, CAUSAL: gl.constexpr):
    """Zero P of keys past the end and, under causal, of keys right of the diagonal (j > i + shift)."""
    offs_n = start_n + gl.arange(0, p.shape[1], layout=gl.SliceLayout(0, p.type.layout))
    vis = offs_n[None, :] < SK
    if CAUSAL:
        vis = vis & (offs_n[None, :] <= offs_m[:, None] + shift)
    return gl.where(vis, p, 0.0)


@gluon.jit
def _dq_tile(acc, racc, sacc_t, sacc_r, q_s, do_s, k_s, v_s, e_s, lse2, delta, offs_m, start_n, masked, SK, shift,
             scale_log2, CAUSAL: gl.constexpr, ALWAYS_MASK: gl.constexpr, BLOCK_N: gl.constexpr,
             num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_s.shape[0]
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    acc_layout: gl.constexpr = acc.type.layout
    sum_layout: gl.constexpr = sacc_t.type.layout
    dtype: gl.constexpr = q_s.dtype

    s = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    dp = warpgroup_mma(do_s, v_s.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                       use_acc=False, is_async=True)
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))

    p = gl.exp2(s * scale_log2 - lse2[:, None])
    # masking is a runtime branch around elementwise code only (never around a wgmma)
    if ALWAYS_MASK:
        p = _mask_dq(p, offs_m, start_n, SK, shift, CAUSAL)
    else:
        if masked:
            p = _mask_dq(p, offs_m, start_n, SK, shift, CAUSAL)
    t = (p * (dp - delta[:, None])).to(dtype)
    r = p.to(dtype)

    t_a = gl.convert_layout(t, gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    r_a = gl.convert_layout(r, gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    t_s = gl.convert_layout(t, gl.DotOperandLayout(operand_index=0, parent=sum_layout, k_width=2))
    r_s = gl.convert_layout(r, gl.DotOperandLayout(operand_index=0, parent=sum_layout, k_width=2))
    acc = warpgroup_mma(t_a, k_s, acc, is_async=True)
    racc = warpgroup_mma(r_a, k_s, racc, is_async=True)
    sacc_t = warpgroup_mma(t_s, e_s, sacc_t, is_async=True)
    sacc_r = warpgroup_mma(r_s, e_s, sacc_r, is_async=True)
    acc, racc, sacc_t, sacc_r, t_a, r_a, t_s, r_s = warpgroup_mma_wait(
        num_outstanding=0, deps=(acc, racc, sacc_t, sacc_r, t_a, r_a, t_s, r_s))
    return acc, racc, sacc_t, sacc_r


@gluon.jit
def _dq_kernel(q_desc, k_desc, v_desc, do_desc, DQ, Delta, LSE2, LAM,
               sdq_b, sdq_h, sdq_s,
               H, GROUP, SQ, SK, shift, scale, scale_log2,
               CAUSAL: gl.constexpr, ALWAYS_MASK: gl.constexpr, NUM_STAGES: gl.constexpr,
               num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype

    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # heavy (late, causal) blocks first
    h = gl.program_id(1)
    b = gl.program_id(2)
    hk = h // GROUP
    m0 = pid_m * BLOCK_M

    acc_layout: gl.constexpr = _mma_layout(BLOCK_M, HEAD_DIM, num_warps)
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    sum_layout: gl.constexpr = _mma_layout(BLOCK_M, SUM_COLS, num_warps)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    # shared memory: the query tile and its dO (once), a ring of K/V tiles, the one-hot row-sum matrix
    q_s, do_s, k_s, v_s, q_bar, kv_bars = _alloc_operands(dtype, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES)
    e_s = _one_hot_smem(dtype, BLOCK_N, num_warps)

    # key tiles [0, full_hi) are visible to every row of the block; [full_hi, hi) need the mask
    hi = SK
    full_hi = (SK // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = gl.minimum(hi, m0 + BLOCK_M + shift)
        full_hi = gl.minimum(full_hi, ((m0 + shift + 1) // BLOCK_N) * BLOCK_N)
    hi = gl.maximum(hi, 0)
    full_hi = gl.maximum(full_hi, 0)
    n_tiles = gl.cdiv(hi, BLOCK_N)

    _issue_pair(q_desc, do_desc, q_bar, q_s, do_s, 0, b, h, m0)
    for i in gl.static_range(NUM_STAGES - 1):
        if i < n_tiles:
            _issue_pair(k_desc, v_desc, kv_bars, k_s, v_s, i, b, hk, i * BLOCK_N)

    offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    row = (b * H + h).to(gl.int64) * SQ + offs_m
    lse2 = gl.load(LSE2 + row, mask=offs_m < SQ, other=float("inf"))
    delta = gl.load(Delta + row, mask=offs_m < SQ, other=0.0)

    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    racc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    sacc_t = gl.zeros([BLOCK_M, SUM_COLS], gl.float32, sum_layout)
    sacc_r = gl.zeros([BLOCK_M, SUM_COLS], gl.float32, sum_layout)
    mbarrier.wait(q_bar.index(0), phase=0)
    q_tile = q_s.index(0)
    do_tile = do_s.index(0)

    for j in range(0, n_tiles):
        stage = j % NUM_STAGES
        mbarrier.wait(kv_bars.index(stage), phase=(j // NUM_STAGES) & 1)
        # the slot of tile j − 1 is free once both warpgroups have waited for its products: request
        # tile j + NUM_STAGES − 1 into it
        gl.thread_barrier()
        nxt = j + NUM_STAGES - 1
        if nxt < n_tiles:
            _issue_pair(k_desc, v_desc, kv_bars, k_s, v_s, nxt % NUM_STAGES, b, hk, nxt * BLOCK_N)
        start_n = j * BLOCK_N
        acc, racc, sacc_t, sacc_r = _dq_tile(acc, racc, sacc_t, sacc_r, q_tile, do_tile, k_s.index(stage),
                                             v_s.index(stage), e_s, lse2, delta, offs_m, start_n,
                                             start_n >= full_hi, SK, shift, scale_log2, CAUSAL, ALWAYS_MASK,
                                             BLOCK_N, num_warps)

    _release(q_bar, kv_bars, NUM_STAGES)

    # λ = ρ / m (column 0 of the one-hot products; the other columns are exact zeros)
    rho = gl.convert_layout(gl.sum(sacc_t, axis=1), gl.SliceLayout(1, acc_layout))
    msum = gl.convert_layout(gl.sum(sacc_r, axis=1), gl.SliceLayout(1, acc_layout))
    lam = gl.where(msum > 0.0, rho / gl.where(msum > 0.0, msum, 1.0), 0.0)
    dq = (acc - lam[:, None] * racc) * scale

    offs_ma = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    gl.store(LAM + (b * H + h).to(gl.int64) * SQ + offs_ma, lam, mask=offs_ma < SQ)
    base = DQ + b.to(gl.int64) * sdq_b + h.to(gl.int64) * sdq_h
    gl.store(base + offs_ma.to(gl.int64)[:, None] * sdq_s + offs_d[None, :], dq.to(dtype),
             mask=(offs_ma[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM))


@gluon.jit
def _dkdv_tile(dk, dv, k_s, v_s, q_s, do_s, LSE2, Delta, LAM, row0, offs_n, start_m, masked, SQ, shift,
               scale_log2, ALWAYS_MASK: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_N: gl.constexpr = k_s.shape[0]
    st_layout: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_M, num_warps)
    acc_layout: gl.constexpr = dk.type.layout
    dtype: gl.constexpr = q_s.dtype

    st = warpgroup_mma(k_s, q_s.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout),
                       use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_s, do_s.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout),
                        use_acc=False, is_async=True)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    inside = offs_m < SQ
    lse2 = gl.load(LSE2 + row0 + offs_m, mask=inside, other=float("inf"))
    delta = gl.load(Delta + row0 + offs_m, mask=inside, other=0.0)
    lam = gl.load(LAM + row0 + offs_m, mask=inside, other=0.0)
    st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))

    pt = gl.exp2(st * scale_log2 - lse2[None, :])
    if ALWAYS_MASK:  # causal diagonal tiles; a runtime branch around elementwise code only
        pt = gl.where(offs_n[:, None] <= offs_m[None, :] + shift, pt, 0.0)
    else:
        if masked:
            pt = gl.where(offs_n[:, None] <= offs_m[None, :] + shift, pt, 0.0)
    rt = gl.convert_layout(pt.to(dtype), gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    gt = (pt * (dpt - delta[None, :] - lam[None, :])).to(dtype)  # t − λr before any rounding, rounded once
    gt = gl.convert_layout(gt, gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2))
    dv = warpgroup_mma(rt, do_s, dv, is_async=True)
    dk = warpgroup_mma(gt, q_s, dk, is_async=True)
    dv, dk, rt, gt = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, rt, gt))
    return dk, dv


@gluon.jit
def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, DK, DV, Delta, LSE2, LAM,
                 sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s,
                 H, GROUP, SQ, SK, shift, scale, scale_log2,
                 CAUSAL: gl.constexpr, ALWAYS_MASK: gl.constexpr, NUM_STAGES: gl.constexpr,
               num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype

    pid_n = gl.program_id(0)
    hk = gl.program_id(1)
    b = gl.program_id(2)
    n0 = pid_n * BLOCK_N

    acc_layout: gl.constexpr = _mma_layout(BLOCK_N, HEAD_DIM, num_warps)
    st_layout: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_M, num_warps)

    # shared memory: the key tile and its V (once), a ring of Q/dO tiles
    k_s, v_s, q_s, do_s, kv_bar, q_bars = _alloc_operands(dtype, BLOCK_N, BLOCK_M, HEAD_DIM, NUM_STAGES)

    # query tiles [lo, SQ) see this key block; those before full_lo cross the causal diagonal
    lo = 0
    full_lo = 0
    if CAUSAL:
        lo = (gl.maximum(n0 - shift, 0) // BLOCK_M) * BLOCK_M
        full_lo = gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M
    lo = gl.minimum(lo, SQ)
    m_tiles = gl.cdiv(SQ - lo, BLOCK_M)
    n_tiles = m_tiles * GROUP  # tile j: query head hk·GROUP + j // m_tiles, rows lo + (j % m_tiles)·BLOCK_M

    _issue_pair(k_desc, v_desc, kv_bar, k_s, v_s, 0, b, hk, n0)
    for i in gl.static_range(NUM_STAGES - 1):
        if i < n_tiles:
            _issue_pair(q_desc, do_desc, q_bars, q_s, do_s, i, b, hk * GROUP + i // m_tiles,
                        lo + (i % m_tiles) * BLOCK_M)

    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar.index(0), phase=0)
    k_tile = k_s.index(0)
    v_tile = v_s.index(0)

    for j in range(0, n_tiles):
        stage = j % NUM_STAGES
        mbarrier.wait(q_bars.index(stage), phase=(j // NUM_STAGES) & 1)
        gl.thread_barrier()  # both warpgroups are done with the slot of tile j − 1
        nxt = j + NUM_STAGES - 1
        if nxt < n_tiles:
            _issue_pair(q_desc, do_desc, q_bars, q_s, do_s, nxt % NUM_STAGES, b, hk * GROUP + nxt // m_tiles,
                        lo + (nxt % m_tiles) * BLOCK_M)
        h = hk * GROUP + j // m_tiles
        start_m = lo + (j % m_tiles) * BLOCK_M
        row0 = (b * H + h).to(gl.int64) * SQ
        dk, dv = _dkdv_tile(dk, dv, k_tile, v_tile, q_s.index(stage), do_s.index(stage), LSE2, Delta, LAM, row0,
                            offs_n, start_m, start_m < full_lo, SQ, shift, scale_log2, ALWAYS_MASK,
                            BLOCK_M, num_warps)

    _release(kv_bar, q_bars, NUM_STAGES)

    offs_na = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    keep = (offs_na[:, None] < SK) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_na.to(gl.int64)[:, None]
    gl.store(DK + b.to(gl.int64) * sdk_b + hk.to(gl.int64) * sdk_h + rows * sdk_s + offs_d[None, :],
             (dk * scale).to(dtype), mask=keep)
    gl.store(DV + b.to(gl.int64) * sdv_b + hk.to(gl.int64) * sdv_h + rows * sdv_s + offs_d[None, :],
             dv.to(dtype), mask=keep)
