"""Hopper (sm_90a) Gluon kernel of the GProj backward's dQ-major launch, warp-specialized (launched from
``gluon_dq.py``; the portable kernel it replaces is ``triton_kernels._bwd_dq``, the KV-major launch after it
``gluon_kernels._dkdv_kernel`` or ``triton_kernels._bwd_dkdv``, which read the scratch written here).

``_dq_kernel``: one CTA per (block of ``2 × ROWS_PER_WG`` query rows, query head, batch), three partitions:

* a **producer** warp: loads this CTA's Q, dO and O tiles once (one ``ROWS_PER_WG``-row box per consumer), then
  streams the key tiles the rows see (the KV head of their GQA group) as K and V through TMA into a
  ``NUM_STAGES``-deep ring of shared-memory slots. Slot s is "ready" (an mbarrier with the TMA byte count) when
  both have landed and "empty" (an mbarrier of count ``CONSUMERS``) once both consumers are done with it.
* two **consumer** warpgroups (the default partition and one worker), each owning ``ROWS_PER_WG`` query rows.
  Prologue: D = Σ_d dO∘O (fp32, O and dO from shared memory), the base-2 LSE (−∞ made +∞: every P of a row that
  saw no key is exactly 0), both stored to the fp32 (B·H, Sq) scratch. Per key tile (``_tile``): S = Q·Kᵀ and
  dP = dO·Vᵀ (wgmma, both operands in shared memory), P = exp2(S·α·log2 e − LSE2), r = low(P), rK += r·K (wgmma,
  A from registers) issued before dS = P∘(dP − D) and t = low(dS) are formed, then dq += t·K; the row sums
  ρ = Σ t and m = Σ r of the rounded operands in fp32 registers. The tile's products are left running while
  the next tile's S and dP are issued (rK's only with ``RK_IN_FLIGHT``: at D=128 with 64-key tiles the
  registers do not hold all of them), and the wait that retires them frees the previous slot. The two
  warpgroups run out of step, so one's elementwise phase overlaps the other's products on the tensor cores. At
  the end λ = ρ/m (0 where m = 0), dq = α(tK − λ·rK) stored, λ to scratch.

ptxas (Triton 3.6) pipelines wgmma only when no non-wgmma instruction defines an accumulator register while a
product is in flight, and only when the in-flight set fits the registers; otherwise it serializes every wgmma of
the kernel (info C7515/C7511/C7512, a ``WARPGROUP.DEPBAR`` after each ``HGMMA``). Hence tile 0 is peeled
(``FIRST``: its products start the accumulators with ``use_acc=False`` instead of zero-filled registers, which
LLVM re-materializes on the loop's zero-trip path) and every CTA streams at least one tile; the configs in
``gluon_dq.CONFIGS`` are the ones that compile without serialization or spills (``tests/helpers/dq_launch``).

Masking: causal is "key j visible from query i iff j ≤ i + shift" (shift = 0 top-left, Sk − Sq bottom-right);
the producer streams only the key tiles some row of the CTA sees; only the tiles that cross a warpgroup's
diagonal and the last tile when Sk is not a multiple of it take the ``where``, as a runtime branch around
elementwise code (never around a wgmma). Keys past Sk are the TMA's zero fill (masked: P = 0). Rows past Sq
have Q, dO, O zero and LSE2 = +∞ (P = 0, D = 0): they add nothing and are never stored. No atomics: bitwise
deterministic. Numerics: the tl kernel's contract; only the fp32 summation orders differ (D's, ρ's and m's sums
here are register reductions, the tl kernel's ρ and m are one-hot tensor-core dots; one-hot wgmmas here made
ptxas serialize the kernel).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# the CTA's partitions are the KV-major kernel's (two consumer warpgroups of CONSUMER_WARPS with CONSUMER_REGS
# registers, a producer warp with PRODUCER_REGS: 12 warps, ``gluon_bwd.MAXNREG``), and so is the wgmma layout
from .gluon_kernels import CONSUMER_REGS, CONSUMER_WARPS, CONSUMERS, PRODUCER_REGS, PRODUCER_WARPS, _mma_layout

#: log2(e) = 1/ln 2: a natural-log LSE becomes a base-2 one (the tl kernel's RCP_LN2)
RCP_LN2 = gl.constexpr(1.4426950408889634)
#: query rows a consumer warpgroup owns (the wgmma M of one warpgroup)
ROWS_PER_WG = gl.constexpr(64)
#: query rows of one CTA: a block of ROWS_PER_WG rows per consumer warpgroup
ROWS_PER_CTA = gl.constexpr(CONSUMERS.value * ROWS_PER_WG.value)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, o_desc, q_s, do_s, o_s, k_s, v_s, q_bar, ready, empty,
              b, h, hk, m0, n_tiles):
    """Q, dO and O of both consumers once, then the ring: tile j is K and V rows [j·BLOCK_N, + BLOCK_N) of KV
    head ``hk`` (rows past Sk: the TMA's zero fill)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    NUM_STAGES: gl.constexpr = k_s.shape[0]
    q_shape: gl.constexpr = q_desc.block_type.shape
    kv_shape: gl.constexpr = k_desc.block_type.shape
    mbarrier.expect(q_bar.index(0), 3 * CONSUMERS * q_desc.block_type.nbytes)
    for w in gl.static_range(CONSUMERS):
        row = m0 + w * ROWS_PER_WG
        tma.async_copy_global_to_shared(q_desc, [b, h, row, 0], q_bar.index(0), q_s.index(w).reshape(q_shape))
        tma.async_copy_global_to_shared(do_desc, [b, h, row, 0], q_bar.index(0), do_s.index(w).reshape(q_shape))
        tma.async_copy_global_to_shared(o_desc, [b, h, row, 0], q_bar.index(0), o_s.index(w).reshape(q_shape))
    for j in range(0, n_tiles):
        stage = j % NUM_STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0: the first lap does not wait
        mbarrier.wait(empty.index(stage), ((j // NUM_STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], bar, k_s.index(stage).reshape(kv_shape))
        tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], bar, v_s.index(stage).reshape(kv_shape))


@gluon.jit
def _row_stats(o_s, do_s, q_bar, LSE, DELTA, LSE2, sl_b, sl_h, sl_s, b, h, H, row0, SQ,
               WG: gl.constexpr, row_layout: gl.constexpr, load_layout: gl.constexpr):
    """(D, LSE2) of rows [row0, row0 + ROWS_PER_WG) in ``row_layout``, stored to the scratch (rows < Sq).
    D = Σ_d dO∘O in fp32 from the saved output; LSE2 = LSE·log2 e, +∞ where the LSE is −∞ (a row that saw no
    key) and on rows past Sq."""
    offs_m = row0 + gl.arange(0, ROWS_PER_WG, layout=row_layout)
    inside = offs_m < SQ
    # the LSE (any strides) while the TMA of O and dO is in flight
    lse = gl.load(LSE + b.to(gl.int64) * sl_b + h.to(gl.int64) * sl_h + offs_m.to(gl.int64) * sl_s,
                  mask=inside, other=float("-inf"))
    # base-2 LSE; a row that saw no key (LSE = −∞) gets +∞, so every P = 2^(s − LSE2) of it is exactly 0
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * RCP_LN2)
    mbarrier.wait(q_bar.index(0), 0)
    o = o_s.index(WG).load(load_layout)
    do = do_s.index(WG).load(load_layout)
    # D_i = Σ_d dO_id·O_id (fp32): the row sum of P∘dP, from the saved output (FA's preprocess)
    delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do.to(gl.float32), axis=1), row_layout)
    flat = (b.to(gl.int64) * H + h) * SQ + offs_m
    gl.store(DELTA + flat, delta, mask=inside)
    gl.store(LSE2 + flat, lse2, mask=inside)
    return delta, lse2


@gluon.jit
def _tile(q_tile, do_tile, k_s, v_s, ready, empty, dq, rk, rho, mass, j, lse2, delta, offs_m, full_hi, SK,
          shift, scale_log2, CAUSAL: gl.constexpr, RK_IN_FLIGHT: gl.constexpr, FIRST: gl.constexpr):
    """Key tile j of a consumer: S, dP, then rK += r·K and dq += t·K issued (wgmma, A from registers) and the
    row sums m += Σ r, ρ += Σ t. dq's product is left in flight into the next tile; rK's too with
    ``RK_IN_FLIGHT``, else it is retired before returning (its operand r's registers then free while the next
    S and dP run). ``FIRST``: tile 0, whose products start the accumulators (``use_acc=False``: no zero-filled
    registers, so ptxas sees no non-wgmma definition of an accumulator while a product is in flight, which
    would make it serialize every wgmma of the kernel)."""
    NUM_STAGES: gl.constexpr = k_s.shape[0]
    BLOCK_N: gl.constexpr = k_s.shape[1]
    HEAD_DIM: gl.constexpr = k_s.shape[2]
    dtype: gl.constexpr = k_s.dtype
    s_layout: gl.constexpr = _mma_layout(ROWS_PER_WG, BLOCK_N, CONSUMER_WARPS)
    acc_layout: gl.constexpr = _mma_layout(ROWS_PER_WG, HEAD_DIM, CONSUMER_WARPS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # per key of an S tile

    stage = j % NUM_STAGES
    mbarrier.wait(ready.index(stage), (j // NUM_STAGES) & 1)
    k_tile = k_s.index(stage)
    v_tile = v_s.index(stage)
    # raw scores S = Q·Kᵀ and dP = dO·Vᵀ (fp32 accumulation)
    s = warpgroup_mma(q_tile, k_tile.permute((1, 0)), gl.zeros([ROWS_PER_WG, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    dp = warpgroup_mma(do_tile, v_tile.permute((1, 0)), gl.zeros([ROWS_PER_WG, BLOCK_N], gl.float32, s_layout),
                       use_acc=False, is_async=True)
    if FIRST:
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
    else:
        # retires this tile's S, dP and every product of the previous tile: the previous slot is then read by no
        # one (only wgmma reads a slot, through the async proxy like the TMA that refills it: no proxy fence)
        if RK_IN_FLIGHT:
            s, dp, dq, rk = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp, dq, rk))
        else:
            s, dp, dq = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp, dq))
        mbarrier.arrive(empty.index((j + NUM_STAGES - 1) % NUM_STAGES), count=1)

    # P = exp(α s − LSE), in base 2
    p = gl.exp2(s * scale_log2 - lse2[:, None])
    start_n = j * BLOCK_N
    # a runtime branch around elementwise code only: tiles across this warpgroup's causal diagonal, and the last
    # tile when it runs past Sk (its keys are the TMA's zero fill)
    if start_n >= full_hi:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=col_layout)
        vis = offs_n[None, :] < SK
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= offs_m[:, None] + shift)
        p = gl.where(vis, p, 0.0)
    # r = low(P): the operand the dV product already rounds; its products issued before dS is formed
    r = p.to(dtype)
    mass += gl.sum(r.to(gl.float32), axis=1)  # m_i += Σ_j r_ij
    rk = warpgroup_mma(gl.convert_layout(r, a_layout), k_tile, rk, use_acc=not FIRST, is_async=True)  # Σ r_ij k_j
    # dS = P∘(dP − D): the gradient w.r.t. the score (zero row sum); t = low(dS), the fused backward's operand
    t = (p * (dp - delta[:, None])).to(dtype)
    rho += gl.sum(t.to(gl.float32), axis=1)  # ρ_i += Σ_j t_ij
    dq = warpgroup_mma(gl.convert_layout(t, a_layout), k_tile, dq, use_acc=not FIRST, is_async=True)  # Σ t_ij k_j
    if not RK_IN_FLIGHT:
        # S, dP, rK, dq and r, t all live at once need more than CONSUMER_REGS registers a thread at D=128 with
        # 64-key tiles (ptxas then serializes every wgmma): rK's product retired here (groups retire in order:
        # dq's, issued last, stays in flight)
        rk = warpgroup_mma_wait(num_outstanding=1, deps=(rk,))
    return dq, rk, rho, mass


@gluon.jit
def _consumer(q_s, do_s, o_s, k_s, v_s, q_bar, ready, empty, LSE, DQ, DELTA, LSE2, LAM,
              sl_b, sl_h, sl_s, sdq_b, sdq_h, sdq_s, b, h, m0, n_tiles, H, SQ, SK, shift, scale, scale_log2,
              CAUSAL: gl.constexpr, RK_IN_FLIGHT: gl.constexpr, WG: gl.constexpr):
    """dq and λ of query rows [m0 + WG·ROWS_PER_WG, + ROWS_PER_WG) over every key tile of the ring (at least
    one); stores them (and D, LSE2 first, ``_row_stats``)."""
    BLOCK_N: gl.constexpr = k_s.shape[1]
    HEAD_DIM: gl.constexpr = k_s.shape[2]
    s_layout: gl.constexpr = _mma_layout(ROWS_PER_WG, BLOCK_N, CONSUMER_WARPS)
    acc_layout: gl.constexpr = _mma_layout(ROWS_PER_WG, HEAD_DIM, CONSUMER_WARPS)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per query row of an S tile
    out_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)  # per query row of the dq tile

    row0 = m0 + WG * ROWS_PER_WG
    offs_m = row0 + gl.arange(0, ROWS_PER_WG, layout=row_layout)
    # key tiles that start at or after full_hi cross this warpgroup's diagonal or run past the last key
    full_hi = (SK // BLOCK_N) * BLOCK_N
    if CAUSAL:
        full_hi = gl.minimum(full_hi, (gl.maximum(row0 + shift + 1, 0) // BLOCK_N) * BLOCK_N)
    delta, lse2 = _row_stats(o_s, do_s, q_bar, LSE, DELTA, LSE2, sl_b, sl_h, sl_s, b, h, H, row0, SQ,
                             WG, row_layout, acc_layout)
    q_tile = q_s.index(WG)
    do_tile = do_s.index(WG)
    # never read: tile 0's products have use_acc=False
    zero = gl.zeros([ROWS_PER_WG, HEAD_DIM], gl.float32, acc_layout)
    rho = gl.zeros([ROWS_PER_WG], gl.float32, row_layout)  # ρ_i = Σ_j t_ij
    mass = gl.zeros([ROWS_PER_WG], gl.float32, row_layout)  # m_i = Σ_j r_ij
    # tile 0 peeled: it starts the accumulators Σ t·K (dq) and Σ r·K (rk)
    dq, rk, rho, mass = _tile(q_tile, do_tile, k_s, v_s, ready, empty, zero, zero, rho, mass, 0,
                              lse2, delta, offs_m, full_hi, SK, shift, scale_log2, CAUSAL, RK_IN_FLIGHT, True)
    for j in range(1, n_tiles):
        dq, rk, rho, mass = _tile(q_tile, do_tile, k_s, v_s, ready, empty, dq, rk, rho, mass, j, lse2,
                                  delta, offs_m, full_hi, SK, shift, scale_log2, CAUSAL, RK_IN_FLIGHT, False)
    dq, rk = warpgroup_mma_wait(num_outstanding=0, deps=(dq, rk))

    rho = gl.convert_layout(rho, out_layout)
    mass = gl.convert_layout(mass, out_layout)
    # λ_i = ρ_i / m_i: the multiple of r_i that carries the row sum t_i should not have (0: no mass)
    lam = gl.where(mass > 0.0, rho / gl.where(mass > 0.0, mass, 1.0), 0.0)
    offs_ma = row0 + gl.arange(0, ROWS_PER_WG, layout=out_layout)
    gl.store(LAM + (b.to(gl.int64) * H + h) * SQ + offs_ma, lam, mask=offs_ma < SQ)
    # the projection t − λ·r, applied to the fp32 products (Σ t·K − λ·Σ r·K), never rounded again
    dq = (dq - lam[:, None] * rk) * scale
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    keep = (offs_ma[:, None] < SQ) & (offs_d[None, :] < HEAD_DIM)
    gl.store(DQ + b.to(gl.int64) * sdq_b + h.to(gl.int64) * sdq_h + offs_ma.to(gl.int64)[:, None] * sdq_s
             + offs_d[None, :], dq.to(k_s.dtype), mask=keep)


@gluon.jit
def _dq_kernel(q_desc, k_desc, v_desc, do_desc, o_desc, LSE, DQ, DELTA, LSE2, LAM,
               sl_b, sl_h, sl_s, sdq_b, sdq_h, sdq_s,
               H, GROUP, SQ, SK, shift, scale, scale_log2,
               CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, RK_IN_FLIGHT: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(q_desc.block_type.shape[2] == ROWS_PER_WG)  # one Q/dO/O box a consumer warpgroup
    gl.static_assert(q_desc.block_type.shape[3] == HEAD_DIM)
    # the ready/expect byte counts: dO and O boxes like Q's, V's like K's
    gl.static_assert(do_desc.block_type.shape[2] == ROWS_PER_WG)
    gl.static_assert(o_desc.block_type.shape[2] == ROWS_PER_WG)
    gl.static_assert(v_desc.block_type.shape[2] == BLOCK_N)
    gl.static_assert(v_desc.block_type.shape[3] == HEAD_DIM)
    gl.static_assert(num_warps == CONSUMER_WARPS)  # the default partition is one consumer warpgroup
    gl.static_assert(BLOCK_N % 16 == 0)  # the K of the t·K and r·K wgmmas: whole k-steps of 16

    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # heavy (late, causal) blocks first
    h = gl.program_id(1)
    b = gl.program_id(2)
    hk = h // GROUP
    m0 = pid_m * ROWS_PER_CTA

    # key tiles [0, hi) some row of [m0, min(m0 + ROWS_PER_CTA, Sq)) sees (causal: up to the last row's diagonal)
    hi = SK + pid_m * 0
    if CAUSAL:
        hi = gl.maximum(gl.minimum(hi, gl.minimum(m0 + ROWS_PER_CTA, SQ) + shift), 0)
    # at least one tile (a CTA whose rows see no key streams tile 0 fully masked: its rows get dq = 0, λ = 0)
    n_tiles = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)

    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS_PER_WG, HEAD_DIM], dtype)
    ring_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_s = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS_PER_WG, HEAD_DIM], tile_layout)
    do_s = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS_PER_WG, HEAD_DIM], tile_layout)
    o_s = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS_PER_WG, HEAD_DIM], tile_layout)
    k_s = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], ring_layout)
    v_s = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], ring_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)

    gl.warp_specialize([
        (_consumer, (q_s, do_s, o_s, k_s, v_s, q_bar, ready, empty, LSE, DQ, DELTA, LSE2, LAM,
                     sl_b, sl_h, sl_s, sdq_b, sdq_h, sdq_s, b, h, m0, n_tiles, H, SQ, SK, shift, scale, scale_log2,
                     CAUSAL, RK_IN_FLIGHT, 0)),
        (_consumer, (q_s, do_s, o_s, k_s, v_s, q_bar, ready, empty, LSE, DQ, DELTA, LSE2, LAM,
                     sl_b, sl_h, sl_s, sdq_b, sdq_h, sdq_s, b, h, m0, n_tiles, H, SQ, SK, shift, scale, scale_log2,
                     CAUSAL, RK_IN_FLIGHT, 1)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, o_desc, q_s, do_s, o_s, k_s, v_s, q_bar, ready, empty,
                     b, h, hk, m0, n_tiles)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

    mbarrier.invalidate(q_bar.index(0))
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
