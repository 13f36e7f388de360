"""Hopper (sm_90a) Gluon kernel of the GProj backward's KV-major launch, warp-specialized (launched from
``gluon_bwd.py``; the dQ-major launch before it is the portable ``tl`` kernel, ``triton_kernels._bwd_dq``, which
writes D, the base-2 LSE and λ of every query row to fp32 (B·H, Sq) scratch).

``_dkdv_kernel``: one CTA per (block of ``2 × KEYS_PER_WG`` keys, KV head, batch), three partitions:

* a **producer** warp: loads this CTA's K and V tiles once, then streams the (query head of the GQA group,
  query tile) pairs the keys see as Q and dO tiles, and the tile's rows of the LSE2, D and λ scratch ((1, BLOCK_M)
  boxes of the (B·H, Sq) buffers, whose row stride TMA needs 16-byte aligned: Sq a multiple of 4), through TMA
  into a ``NUM_STAGES``-deep ring of shared-memory slots.
  Slot s is "ready" (an mbarrier with the TMA byte count) when all five have landed and "empty" (an mbarrier of
  count ``CONSUMERS``) once both consumers are done with it. With ``RELEASE_PAIRS`` the slots go by pairs
  (2p, 2p + 1): one "empty" mbarrier a pair, waited on before the pair's first tile only.
* two **consumer** warpgroups (the default partition and one worker), each owning ``KEYS_PER_WG`` keys and
  their dk, dv accumulators (fp32, registers). Per tile, transposed: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (wgmma, both
  operands in shared memory), P = exp2(Sᵀ·α·log2 e − lse2), dv += low(Pᵀ)·dO, and the "fused" dk += low(Pᵀ∘(dPᵀ −
  D − λ))·Q (t − λr rounded once, never re-rounded; wgmma with A from registers). The dk/dv products of a tile
  are left running while the next tile's Sᵀ and dPᵀ are issued; the consumer releases a slot after the wait
  that retires its last product — every tile, or with ``RELEASE_PAIRS`` a pair of slots every second tile.
  Triton 3.6 syncs the warpgroup (``bar.sync``) before each ``mbarrier.arrive``, and its shared-memory barrier
  analysis adds one before the ready wait and one after the arrive: 3 a tile (sm_90a PTX). Paired, with the
  tile's LSE2 read before the branch that releases, a consumer loop has 1 every second tile; the same products
  in the same order, so bitwise the same results. The two warpgroups run out of step, so one's
  exp2/elementwise phase overlaps the other's products on the tensor cores.
  With ``RETIRE_TILES`` a tile's dk, dv products are retired within the tile (waited on after their issue),
  tile 0 is peeled (its products start the accumulators: use_acc=False) and dPᵀ − D − λ is formed before Pᵀ:
  at D=128 with 64-row tiles the default keeps Sᵀ, dPᵀ, dk, dv and both register operands live at once, more
  than 240 registers, and ptxas then serializes every wgmma (info C7512, a ``WARPGROUP.DEPBAR`` after each
  ``HGMMA``; zeros carried into the loop give C7515). Same products in the same order: bitwise the same.

Masking: causal is "key j visible from query i iff j ≤ i + shift" (shift = 0 top-left, Sk − Sq bottom-right);
only the query tiles that cross a warpgroup's diagonal, and a head's last tile when Sq is not a multiple of the
tile, take the ``where``, as a runtime branch around elementwise code (never around a wgmma). Rows past Sq
are the TMA's zero fill in every box — Q, dO and, the scratch being addressed as (B·H, Sq) rows, LSE2, D, λ
too (never the next head's rows): P = 0 (the ``where``), dPᵀ = 0, D = λ = 0, so they add exactly 0 and a
non-finite row of another head cannot reach this head's dk (as in the tl kernel, a NaN stays in its head).
Keys past Sk only touch their own dk/dv rows, which are never stored. No atomics: dk, dv of a key block are
reduced over the whole GQA group inside one CTA, so results are bitwise deterministic.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

#: keys a consumer warpgroup owns (the wgmma M of one warpgroup)
KEYS_PER_WG = gl.constexpr(64)
#: consumer warpgroups per CTA (default partition + one worker), and the warps of one (a warpgroup)
CONSUMERS = gl.constexpr(2)
CONSUMER_WARPS = gl.constexpr(4)
#: warps and registers per thread of the producer partition (TMA issue only)
PRODUCER_WARPS = gl.constexpr(1)
PRODUCER_REGS = gl.constexpr(24)
#: registers per thread of the worker consumer warpgroup (the default one receives what the launch's maxnreg
#: leaves; ``gluon_bwd`` sets maxnreg so that both get this many)
CONSUMER_REGS = gl.constexpr(240)
#: keys of one CTA: a block of KEYS_PER_WG keys per consumer warpgroup
KEYS_PER_CTA = gl.constexpr(CONSUMERS.value * KEYS_PER_WG.value)
#: warps of one CTA: the consumer warpgroups and the producer's warp, rounded up to whole warpgroups (the warps
#: ``gl.warp_specialize`` allocates: 2·4 + 1 → 12)
TOTAL_WARPS = gl.constexpr(
    -(-(CONSUMERS.value * CONSUMER_WARPS.value + PRODUCER_WARPS.value) // CONSUMER_WARPS.value) * CONSUMER_WARPS.value)


@gluon.constexpr_function
def mma_layout(ROWS, COLS, num_warps):
    """wgmma accumulator layout of a (ROWS × COLS) tile: warps stacked along the rows, one N = COLS instruction."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, COLS, 16])


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, lse2_desc, delta_desc, lam_desc, k_s, v_s, q_s, do_s, lse2_s,
              delta_s, lam_s, kv_bar, ready, empty, b, hk, n0, lo, m_tiles, n_tiles, H, GROUP,
              RELEASE_PAIRS: gl.constexpr):
    """K and V of both consumers once, then the ring: tile j (query head h = hk·GROUP + j // m_tiles, rows
    lo + (j % m_tiles)·BLOCK_M) is Q, dO and the rows' (LSE2, D, λ) from the fp32 (B·H, Sq) scratch."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    NUM_STAGES: gl.constexpr = q_s.shape[0]
    kv_shape: gl.constexpr = k_desc.block_type.shape
    q_shape: gl.constexpr = q_desc.block_type.shape
    row_shape: gl.constexpr = lse2_desc.block_type.shape
    mbarrier.expect(kv_bar.index(0), 2 * CONSUMERS * k_desc.block_type.nbytes)
    for w in gl.static_range(CONSUMERS):
        row = n0 + w * KEYS_PER_WG
        tma.async_copy_global_to_shared(k_desc, [b, hk, row, 0], kv_bar.index(0), k_s.index(w).reshape(kv_shape))
        tma.async_copy_global_to_shared(v_desc, [b, hk, row, 0], kv_bar.index(0), v_s.index(w).reshape(kv_shape))
    for j in range(0, n_tiles):
        stage = j % NUM_STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0: the first lap does not wait
        lap_parity = ((j // NUM_STAGES) & 1) ^ 1
        if RELEASE_PAIRS:
            # slots 2p, 2p + 1 share "empty" mbarrier p (released together): wait before the pair's first tile
            mbarrier.wait(empty.index(stage // 2), lap_parity, pred=stage % 2 == 0)
        else:
            mbarrier.wait(empty.index(stage), lap_parity)
        h = hk * GROUP + j // m_tiles
        row = lo + (j % m_tiles) * BLOCK_M
        bar = ready.index(stage)
        mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 3 * lse2_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, row, 0], bar, q_s.index(stage).reshape(q_shape))
        tma.async_copy_global_to_shared(do_desc, [b, h, row, 0], bar, do_s.index(stage).reshape(q_shape))
        # the scratch as (B·H, Sq) rows: a box past Sq stops at its own head's end (the TMA's zero fill)
        bh = b * H + h
        tma.async_copy_global_to_shared(lse2_desc, [bh, row], bar, lse2_s.index(stage).reshape(row_shape))
        tma.async_copy_global_to_shared(delta_desc, [bh, row], bar, delta_s.index(stage).reshape(row_shape))
        tma.async_copy_global_to_shared(lam_desc, [bh, row], bar, lam_s.index(stage).reshape(row_shape))


@gluon.jit
def _tile(k_tile, v_tile, q_s, do_s, lse2_s, delta_s, lam_s, ready, empty, dk, dv, j, offs_n, lo, m_tiles,
          full_lo, SQ, shift, scale_log2, CAUSAL: gl.constexpr, RELEASE_PAIRS: gl.constexpr,
          RETIRE_TILES: gl.constexpr, FIRST: gl.constexpr):
    """Tile j of the ring: its Sᵀ, dPᵀ, then dv += low(Pᵀ)·dO and dk += low(Pᵀ∘(dPᵀ − D − λ))·Q, issued
    async; returns (dk, dv). ``FIRST`` (the peeled tile 0 of ``RETIRE_TILES``): the products start the
    accumulators (use_acc=False) instead of adding to zeros."""
    NUM_STAGES: gl.constexpr = q_s.shape[0]
    BLOCK_M: gl.constexpr = q_s.shape[1]
    HEAD_DIM: gl.constexpr = q_s.shape[2]
    dtype: gl.constexpr = q_s.dtype
    st_layout: gl.constexpr = mma_layout(KEYS_PER_WG, BLOCK_M, CONSUMER_WARPS)
    acc_layout: gl.constexpr = mma_layout(KEYS_PER_WG, HEAD_DIM, CONSUMER_WARPS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(0, st_layout)  # per query row of an Sᵀ tile

    stage = j % NUM_STAGES
    mbarrier.wait(ready.index(stage), (j // NUM_STAGES) & 1)
    q_tile = q_s.index(stage)
    do_tile = do_s.index(stage)
    st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), gl.zeros([KEYS_PER_WG, BLOCK_M], gl.float32, st_layout),
                       use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)),
                        gl.zeros([KEYS_PER_WG, BLOCK_M], gl.float32, st_layout), use_acc=False, is_async=True)
    start_m = lo + (j % m_tiles) * BLOCK_M
    if FIRST:
        st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
    else:
        # retires this tile's Sᵀ, dPᵀ and the previous tile's dk, dv products (if still running): the previous
        # slot is free once its per-row vectors (generic proxy) are ordered before the next TMA write (async)
        st, dpt, dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt, dk, dv))
    if RELEASE_PAIRS:
        # this tile's LSE2 before the release (its slot stays ours): no shared-memory access right after it
        lse2 = lse2_s.index(stage).load(row_layout)
        # every second tile: tiles j − 2 and j − 1 (slots 2p, 2p + 1) are done, release pair p at once —
        # a runtime branch, so the arrive's warpgroup syncs run only there (a pred would run them always)
        if (j % 2 == 0) & (j > 0):
            fence_async_shared()
            mbarrier.arrive(empty.index(((j - 1) % NUM_STAGES) // 2), count=1)
    else:
        fence_async_shared()
        mbarrier.arrive(empty.index((j + NUM_STAGES - 1) % NUM_STAGES), count=1, pred=j > 0)
        lse2 = lse2_s.index(stage).load(row_layout)
    if RETIRE_TILES:
        # uᵀ = dPᵀ − D − λ (the same two subtractions in the same order) while nothing is in flight: D and λ
        # are dead before Pᵀ and its register operand are formed
        ut = dpt - delta_s.index(stage).load(row_layout)[None, :]
        ut = ut - lam_s.index(stage).load(row_layout)[None, :]

    pt = gl.exp2(st * scale_log2 - lse2[None, :])
    # a runtime branch around elementwise code only: tiles across this warpgroup's causal diagonal, and
    # the last tile of a head (rows past Sq: Sᵀ = 0 and LSE2 = 0 there, zero-filled, so P would be 1)
    if (start_m < full_lo) | (start_m + BLOCK_M > SQ):
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
        vis = offs_m[None, :] < SQ
        if CAUSAL:
            vis = vis & (offs_n[:, None] <= offs_m[None, :] + shift)
        pt = gl.where(vis, pt, 0.0)
    rt = gl.convert_layout(pt.to(dtype), a_layout)
    dv = warpgroup_mma(rt, do_tile, dv, use_acc=not FIRST, is_async=True)
    if RETIRE_TILES:
        gt = pt * ut
    else:
        delta = delta_s.index(stage).load(row_layout)
        lam = lam_s.index(stage).load(row_layout)
        gt = pt * (dpt - delta[None, :] - lam[None, :])
    gt = gl.convert_layout(gt.to(dtype), a_layout)
    dk = warpgroup_mma(gt, q_tile, dk, use_acc=not FIRST, is_async=True)
    if RETIRE_TILES:
        # this tile's dk, dv retired within it: their register operands die here, so the next tile's Sᵀ, dPᵀ
        # never share the registers with them (ptxas then keeps the wgmmas async: no C7512)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        dk = warpgroup_mma_init(dk)
        dv = warpgroup_mma_init(dv)
    return dk, dv


@gluon.jit
def _consumer(k_s, v_s, q_s, do_s, lse2_s, delta_s, lam_s, kv_bar, ready, empty, DK, DV,
              sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s,
              b, hk, n0, lo, m_tiles, n_tiles, SQ, SK, shift, scale, scale_log2,
              CAUSAL: gl.constexpr, RELEASE_PAIRS: gl.constexpr, RETIRE_TILES: gl.constexpr, WG: gl.constexpr):
    """dk, dv of keys [n0 + WG·KEYS_PER_WG, + KEYS_PER_WG) over every tile of the ring; stores them."""
    BLOCK_M: gl.constexpr = q_s.shape[1]
    HEAD_DIM: gl.constexpr = q_s.shape[2]
    dtype: gl.constexpr = q_s.dtype
    st_layout: gl.constexpr = mma_layout(KEYS_PER_WG, BLOCK_M, CONSUMER_WARPS)
    acc_layout: gl.constexpr = mma_layout(KEYS_PER_WG, HEAD_DIM, CONSUMER_WARPS)

    key0 = n0 + WG * KEYS_PER_WG
    offs_n = key0 + gl.arange(0, KEYS_PER_WG, layout=gl.SliceLayout(1, st_layout))
    # query tiles that start before full_lo cross this warpgroup's diagonal (some key right of some row's)
    full_lo = lo
    if CAUSAL:
        full_lo = gl.cdiv(gl.maximum(key0 + KEYS_PER_WG - 1 - shift, 0), BLOCK_M) * BLOCK_M
    k_tile = k_s.index(WG)
    v_tile = v_s.index(WG)
    zero = gl.zeros([KEYS_PER_WG, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar.index(0), 0)
    if RETIRE_TILES:
        # tile 0 peeled (n_tiles ≥ 1, ``_dkdv_kernel``): its products start dk, dv — zeros carried into the
        # loop would make ptxas serialize every wgmma (C7515)
        dk, dv = _tile(k_tile, v_tile, q_s, do_s, lse2_s, delta_s, lam_s, ready, empty, zero, zero, 0, offs_n,
                       lo, m_tiles, full_lo, SQ, shift, scale_log2, CAUSAL, RELEASE_PAIRS, RETIRE_TILES, True)
        first = 1
    else:
        # accumulators carried across iterations with their products in flight
        dk = warpgroup_mma_init(zero)
        dv = warpgroup_mma_init(zero)
        first = 0
    for j in range(first, n_tiles):
        dk, dv = _tile(k_tile, v_tile, q_s, do_s, lse2_s, delta_s, lam_s, ready, empty, dk, dv, j, offs_n,
                       lo, m_tiles, full_lo, SQ, shift, scale_log2, CAUSAL, RELEASE_PAIRS, RETIRE_TILES, False)

    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    offs_na = key0 + gl.arange(0, KEYS_PER_WG, layout=gl.SliceLayout(1, acc_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    keep = (offs_na[:, None] < SK) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_na.to(gl.int64)[:, None]
    # in the outputs' dtype: the inputs' (a backward), or fp32 (a ring's column pass, which adds them over ranks)
    gl.store(DK + b.to(gl.int64) * sdk_b + hk.to(gl.int64) * sdk_h + rows * sdk_s + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=keep)
    gl.store(DV + b.to(gl.int64) * sdv_b + hk.to(gl.int64) * sdv_h + rows * sdv_s + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=keep)


@gluon.jit
def _dkdv_kernel(q_desc, k_desc, v_desc, do_desc, lse2_desc, delta_desc, lam_desc, DK, DV,
                 sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s,
                 H, GROUP, SQ, SK, shift, scale, scale_log2,
                 CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, RELEASE_PAIRS: gl.constexpr,
                 RETIRE_TILES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(k_desc.block_type.shape[2] == KEYS_PER_WG)
    gl.static_assert(num_warps == CONSUMER_WARPS)  # the default partition is one consumer warpgroup
    # "empty" mbarriers: one a slot, or one a pair of slots — then at least two pairs, or the producer would
    # wait for a pair that the consumers release only after reading the tile it is about to load
    if RELEASE_PAIRS:
        gl.static_assert(NUM_STAGES % 2 == 0)
        gl.static_assert(NUM_STAGES >= 4)
    EMPTY_BARRIERS: gl.constexpr = NUM_STAGES // 2 if RELEASE_PAIRS else NUM_STAGES

    pid_n = gl.program_id(0)
    hk = gl.program_id(1)
    b = gl.program_id(2)
    n0 = pid_n * KEYS_PER_CTA

    # query tiles [lo, SQ) see some key of this block (causal: none above the first key's diagonal row)
    lo = pid_n * 0
    if CAUSAL:
        lo = (gl.maximum(n0 - shift, 0) // BLOCK_M) * BLOCK_M
    lo = gl.minimum(lo, SQ)
    m_tiles = gl.cdiv(SQ - lo, BLOCK_M)
    if RETIRE_TILES:
        # the peeled tile 0 needs a tile: a block no query sees streams one zero-filled tile a head (rows from
        # Sq on: P masked to 0, dPᵀ = D = λ = 0), whose products add exact zeros
        m_tiles = gl.maximum(m_tiles, 1)
    n_tiles = m_tiles * GROUP

    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS_PER_WG, HEAD_DIM], dtype)
    ring_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    k_s = gl.allocate_shared_memory(dtype, [CONSUMERS, KEYS_PER_WG, HEAD_DIM], kv_layout)
    v_s = gl.allocate_shared_memory(dtype, [CONSUMERS, KEYS_PER_WG, HEAD_DIM], kv_layout)
    q_s = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], ring_layout)
    do_s = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_DIM], ring_layout)
    # per-row vectors: unswizzled rows of BLOCK_M fp32 (the TMA writes each as a (1, BLOCK_M) box)
    vec_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    lse2_s = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], vec_layout)
    delta_s = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], vec_layout)
    lam_s = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], vec_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [EMPTY_BARRIERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(EMPTY_BARRIERS):
        mbarrier.init(empty.index(i), count=CONSUMERS)

    gl.warp_specialize([
        (_consumer, (k_s, v_s, q_s, do_s, lse2_s, delta_s, lam_s, kv_bar, ready, empty, DK, DV,
                     sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s, b, hk, n0, lo, m_tiles, n_tiles,
                     SQ, SK, shift, scale, scale_log2, CAUSAL, RELEASE_PAIRS, RETIRE_TILES, 0)),
        (_consumer, (k_s, v_s, q_s, do_s, lse2_s, delta_s, lam_s, kv_bar, ready, empty, DK, DV,
                     sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s, b, hk, n0, lo, m_tiles, n_tiles,
                     SQ, SK, shift, scale, scale_log2, CAUSAL, RELEASE_PAIRS, RETIRE_TILES, 1)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, lse2_desc, delta_desc, lam_desc, k_s, v_s, q_s, do_s,
                     lse2_s, delta_s, lam_s, kv_bar, ready, empty, b, hk, n0, lo, m_tiles, n_tiles, H, GROUP,
                     RELEASE_PAIRS)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

    mbarrier.invalidate(kv_bar.index(0))
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
    for i in gl.static_range(EMPTY_BARRIERS):
        mbarrier.invalidate(empty.index(i))
