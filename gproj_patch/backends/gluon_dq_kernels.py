"""Hopper (sm_90a) Gluon kernel of the GProj backward's dQ-major launch, warp-specialized (launched from
``gluon_dq.py``; the same contract as the portable ``tl`` kernel ``triton_kernels._bwd_dq``, whose docstring has
the math). It writes dq, and D, the base-2 LSE, λ (and T with a sink) of every query row to the fp32 (B·H, Sq)
scratch the KV-major launch reads.

``_dq_kernel``: one CTA per (block of ``2 × ROWS_PER_WG`` query rows, query head, batch), three partitions:

* a **producer** warp: loads the Q and dO tiles of both consumers and the two one-hot columns once, then
  streams the key tiles the block sees as K and V tiles through TMA into a ``NUM_STAGES``-deep ring. Slot s is
  "ready" (an mbarrier with the TMA byte count) when both have landed and "empty" (count ``CONSUMERS``) once
  both consumers are done with it.
* two **consumer** warpgroups (the default partition and one worker), each owning ``ROWS_PER_WG`` query rows
  and their accumulators: Σ t·K, Σ r·K (fp32, registers) and the row sums ρ = Σ t, m = Σ r (columns
  ``RHO_COL``, ``MASS_COL`` of a narrow fp32 accumulator, summed on the tensor cores: t and r times a one-hot
  column, as the tl kernel does, so that ρ and m are its sums). Per key tile: S = Q·Kᵀ and dP = dO·Vᵀ (wgmma,
  both operands in shared memory), P = exp2(S·α·log2 e − LSE2), dS = P∘(dP − D), t = low(dS), r = low(P), then
  the four products with t and r from registers. Each tile's products are retired within the tile (waited on
  after their issue) and tile 0 is peeled (its products start the accumulators): the registers then never hold
  two tiles' operands at once, and ptxas keeps the wgmmas async (as the KV-major kernel's ``RETIRE_TILES``).
  The two warpgroups run out of step, so one's exp2/dS phase overlaps the other's products on the tensor cores.
  A consumer whose rows see fewer key tiles than the block (causal: the first warpgroup's rows end earlier)
  hands the remaining slots back unread. With ``OVERLAP`` a consumer also overlaps its own elementwise work
  with its products (P's exp2 under dP, dS under the two r products; bitwise the same results).

At the end: λ = (ρ − T)/m (0 where m = 0, and on shard rows: m short of the mass 1 − P_sink the LSE gives
the row, ``spec.shard_mass_tolerance``, counted into ``PARTIAL_ROWS`` with ``COUNT_PARTIAL``),
dq = α(Σ t·K − λ·Σ r·K), stored with λ. With ``PARTIAL`` (a ring's row pass, ``backends/ring.py``) instead the
shard's sums A = α Σ t·K, B = α Σ r·K (fp32), ρ and m.

Masking: causal is "key j visible from query i iff j ≤ i + shift" (shift = 0 top-left, Sk − Sq bottom-right);
only key tiles that cross a warpgroup's diagonal or the end of the keys take the ``where`` (a runtime branch
around elementwise code, never around a wgmma). Rows past Sq are the TMA's zero fill with LSE2 = +inf: P = 0,
they add exactly 0 and are never stored; keys past Sk are zero-filled and masked. No atomics: bitwise
deterministic.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from .gluon_kernels import (CONSUMER_REGS, CONSUMER_WARPS, CONSUMERS, PRODUCER_REGS, PRODUCER_WARPS,
                            mma_layout)

#: log2(e) = 1/ln 2: a natural-log LSE becomes a base-2 one
RCP_LN2 = gl.constexpr(1.4426950408889634)
#: query rows a consumer warpgroup owns (the wgmma M of one warpgroup)
ROWS_PER_WG = gl.constexpr(64)
#: query rows of one CTA: a block of ROWS_PER_WG rows per consumer warpgroup
ROWS_PER_CTA = gl.constexpr(CONSUMERS.value * ROWS_PER_WG.value)
#: columns of the row-sum accumulator (a small wgmma N): column RHO_COL gathers ρ = Σ t, MASS_COL m = Σ r
ROWSUM_WIDTH = gl.constexpr(16)
RHO_COL = gl.constexpr(0)
MASS_COL = gl.constexpr(1)


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, e_desc, q_s, do_s, k_s, v_s, e_s, qd_bar, ready, empty,
              b, h, hk, m0, n_tiles):
    """Q, dO of both consumers and the one-hot columns once, then the ring: tile j is keys [j·BLOCK_N, +BLOCK_N)
    of KV head ``hk`` as K and V."""
    NUM_STAGES: gl.constexpr = k_s.shape[0]
    BLOCK_N: gl.constexpr = k_s.shape[1]
    q_shape: gl.constexpr = q_desc.block_type.shape
    kv_shape: gl.constexpr = k_desc.block_type.shape
    mbarrier.expect(qd_bar.index(0), 2 * CONSUMERS * q_desc.block_type.nbytes + 2 * e_desc.block_type.nbytes)
    for w in gl.static_range(CONSUMERS):
        row = m0 + w * ROWS_PER_WG
        tma.async_copy_global_to_shared(q_desc, [b, h, row, 0], qd_bar.index(0), q_s.index(w).reshape(q_shape))
        tma.async_copy_global_to_shared(do_desc, [b, h, row, 0], qd_bar.index(0), do_s.index(w).reshape(q_shape))
    for i in gl.static_range(2):
        tma.async_copy_global_to_shared(e_desc, [i * BLOCK_N, 0], qd_bar.index(0), e_s.index(i))
    for j in range(0, n_tiles):
        stage = j % NUM_STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0: the first lap does not wait
        mbarrier.wait(empty.index(stage), ((j // NUM_STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
        # keys past Sk are the TMA's zero fill (masked by the consumers)
        tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], bar, k_s.index(stage).reshape(kv_shape))
        tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], bar, v_s.index(stage).reshape(kv_shape))


@gluon.jit
def _tile(q_t, do_t, k_s, v_s, e0_t, e1_t, ready, empty, acc, racc, sacc, j, offs_m, lse2, delta, full_hi, SK,
          shift, scale_log2, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, FIRST: gl.constexpr):
    """Key tile j of the ring: S, dP, then Σ t·K, Σ r·K and ρ, m, retired within the tile; returns the three
    accumulators. ``FIRST`` (the peeled tile 0): the products start the accumulators (use_acc=False).
    ``OVERLAP``: the warpgroup's own elementwise work under its products — P's exp2 while dP is on the tensor
    cores, dS while the r products are — the same products, each accumulator's in the same order."""
    NUM_STAGES: gl.constexpr = k_s.shape[0]
    BLOCK_N: gl.constexpr = k_s.shape[1]
    HEAD_DIM: gl.constexpr = k_s.shape[2]
    dtype: gl.constexpr = k_s.dtype
    s_layout: gl.constexpr = mma_layout(ROWS_PER_WG, BLOCK_N, CONSUMER_WARPS)
    acc_layout: gl.constexpr = mma_layout(ROWS_PER_WG, HEAD_DIM, CONSUMER_WARPS)
    sum_layout: gl.constexpr = mma_layout(ROWS_PER_WG, ROWSUM_WIDTH, CONSUMER_WARPS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    a_sum_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=sum_layout, k_width=2)

    stage = j % NUM_STAGES
    mbarrier.wait(ready.index(stage), (j // NUM_STAGES) & 1)
    k_t = k_s.index(stage)
    v_t = v_s.index(stage)
    # raw scores S = Q·Kᵀ and dP = dO·Vᵀ (fp32 accumulation, both operands in shared memory)
    s = warpgroup_mma(q_t, k_t.permute((1, 0)), gl.zeros([ROWS_PER_WG, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    dp = warpgroup_mma(do_t, v_t.permute((1, 0)), gl.zeros([ROWS_PER_WG, BLOCK_N], gl.float32, s_layout),
                       use_acc=False, is_async=True)
    if OVERLAP:
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S only: dP is still running
    else:
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
    # P = 2^(S·α·log2 e − LSE2): the forward's probabilities (0 on rows that saw no key: LSE2 = +inf)
    p = gl.exp2(s * scale_log2 - lse2[:, None])
    # a runtime branch around elementwise code only: tiles across this warpgroup's diagonal or the keys' end
    start_n = j * BLOCK_N
    if start_n + BLOCK_N > full_hi:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        vis = offs_n[None, :] < SK
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= offs_m[:, None] + shift)
        p = gl.where(vis, p, 0.0)
    # dS = P∘(dP − D): the gradient w.r.t. the score, zero row sum; t = low(dS) is the operand a fused backward
    # rounds, r = low(P) the one its dV product rounds
    r = p.to(dtype)
    r_a = gl.convert_layout(r, a_layout)
    if OVERLAP:
        # Σ_j r_ij k_j and m_i += Σ_j r_ij first (one-hot B; its other columns add exact zeros to ρ): they run
        # while dS is formed
        racc = warpgroup_mma(r_a, k_t, racc, use_acc=not FIRST, is_async=True)
        sacc = warpgroup_mma(gl.convert_layout(r, a_sum_layout), e1_t, sacc, use_acc=not FIRST, is_async=True)
        dp = warpgroup_mma_wait(num_outstanding=2, deps=(dp,))  # dP done; the two r products may still run
        t = (p * (dp - delta[:, None])).to(dtype)
        acc = warpgroup_mma(gl.convert_layout(t, a_layout), k_t, acc, use_acc=not FIRST, is_async=True)
        sacc = warpgroup_mma(gl.convert_layout(t, a_sum_layout), e0_t, sacc, use_acc=True, is_async=True)
    else:
        t = (p * (dp - delta[:, None])).to(dtype)
        t_a = gl.convert_layout(t, a_layout)
        # Σ_j t_ij k_j, Σ_j r_ij k_j (fp32), and ρ_i += Σ_j t_ij, m_i += Σ_j r_ij on the tensor cores (one-hot B)
        acc = warpgroup_mma(t_a, k_t, acc, use_acc=not FIRST, is_async=True)
        sacc = warpgroup_mma(gl.convert_layout(t, a_sum_layout), e0_t, sacc, use_acc=not FIRST, is_async=True)
        racc = warpgroup_mma(r_a, k_t, racc, use_acc=not FIRST, is_async=True)
        sacc = warpgroup_mma(gl.convert_layout(r, a_sum_layout), e1_t, sacc, use_acc=True, is_async=True)
    # retired within the tile: the slot's K is read by these products, so it is handed back only after them
    acc, racc, sacc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, racc, sacc))
    acc = warpgroup_mma_init(acc)
    racc = warpgroup_mma_init(racc)
    sacc = warpgroup_mma_init(sacc)
    mbarrier.arrive(empty.index(stage), count=1)
    return acc, racc, sacc


@gluon.jit
def _consumer(q_s, do_s, k_s, v_s, e_s, qd_bar, ready, empty, O, LSE, SINK, DQ, Delta, LSE2, LAM, TGT,
              PARTIAL_ROWS, so_b, so_h, so_s, so_d, sl_b, sl_h, sl_s, ssink, sdq_b, sdq_h, sdq_s, sdq_d,
              b, h, m0, n_tiles, H, SQ, SK, shift, scale, scale_log2, mass_rel_tol, mass_abs_tol,
              CAUSAL: gl.constexpr, HAS_SINK: gl.constexpr, COUNT_PARTIAL: gl.constexpr, PARTIAL: gl.constexpr,
              OVERLAP: gl.constexpr, WG: gl.constexpr):
    """dq and λ of query rows [m0 + WG·ROWS_PER_WG, + ROWS_PER_WG) over the key tiles they see; first their
    rows' D, LSE2 (and T) to the scratch."""
    BLOCK_N: gl.constexpr = k_s.shape[1]
    HEAD_DIM: gl.constexpr = k_s.shape[2]
    dtype: gl.constexpr = k_s.dtype
    s_layout: gl.constexpr = mma_layout(ROWS_PER_WG, BLOCK_N, CONSUMER_WARPS)
    acc_layout: gl.constexpr = mma_layout(ROWS_PER_WG, HEAD_DIM, CONSUMER_WARPS)
    sum_layout: gl.constexpr = mma_layout(ROWS_PER_WG, ROWSUM_WIDTH, CONSUMER_WARPS)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # per query row of an S tile
    acc_rows: gl.constexpr = gl.SliceLayout(1, acc_layout)  # per query row of the dq accumulators
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [CONSUMER_WARPS, 1], [1, 0])

    row0 = m0 + WG * ROWS_PER_WG
    b64 = b.to(gl.int64)
    h64 = h.to(gl.int64)
    scratch_row0 = (b64 * H + h64) * SQ
    mbarrier.wait(qd_bar.index(0), 0)
    q_t = q_s.index(WG)
    do_t = do_s.index(WG)

    # D_i = Σ_d dO_id·O_id (fp32) from the saved output: the row sum of P∘dP (FA's preprocess)
    offs_io = row0 + gl.arange(0, ROWS_PER_WG, layout=gl.SliceLayout(1, io_layout))
    offs_dio = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    o = gl.load(O + b64 * so_b + h64 * so_h + offs_io.to(gl.int64)[:, None] * so_s + offs_dio[None, :] * so_d,
                mask=(offs_io < SQ)[:, None] & (offs_dio < HEAD_DIM)[None, :], other=0.0)
    delta = gl.sum(o.to(gl.float32) * do_t.load(io_layout).to(gl.float32), axis=1)
    delta = gl.convert_layout(delta, row_layout)
    # base-2 LSE; a row that saw no key (LSE = -inf) gets +inf, so every P = 2^(s − LSE2) of it is exactly 0
    offs_m = row0 + gl.arange(0, ROWS_PER_WG, layout=row_layout)
    inside = offs_m < SQ
    lse = gl.load(LSE + b64 * sl_b + h64 * sl_h + offs_m.to(gl.int64) * sl_s, mask=inside, other=float("-inf"))
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * RCP_LN2)
    gl.store(Delta + scratch_row0 + offs_m, delta, mask=inside)
    gl.store(LSE2 + scratch_row0 + offs_m, lse2, mask=inside)
    if HAS_SINK:
        # T_i = P_sink,i·D_i, P_sink = 2^(s_h·log2 e − LSE2_i): the exact row sum of dS with a sink
        sink2 = gl.load(SINK + h * ssink).to(gl.float32) * RCP_LN2
        p_sink = gl.exp2(sink2 - lse2)  # kept through the key loop (T and the row's mass 1 − P_sink from it)
        gl.store(TGT + scratch_row0 + offs_m, p_sink * delta, mask=inside)

    # keys [0, hi) are seen by these rows; tiles [0, full_hi) by every one of them (no mask)
    hi = SK + row0 * 0
    full_hi = SK + row0 * 0
    if CAUSAL:
        hi = gl.minimum(hi, row0 + ROWS_PER_WG + shift)
        full_hi = gl.minimum(full_hi, row0 + shift + 1)
    n_mine = gl.maximum(gl.cdiv(gl.maximum(hi, 0), BLOCK_N), 1)  # ≥ 1: tile 0 is peeled (masked if unseen)

    e0_t = e_s.index(0)
    e1_t = e_s.index(1)
    zero = gl.zeros([ROWS_PER_WG, HEAD_DIM], gl.float32, acc_layout)
    zero_sum = gl.zeros([ROWS_PER_WG, ROWSUM_WIDTH], gl.float32, sum_layout)
    acc, racc, sacc = _tile(q_t, do_t, k_s, v_s, e0_t, e1_t, ready, empty, zero, zero, zero_sum, 0, offs_m, lse2,
                            delta, full_hi, SK, shift, scale_log2, CAUSAL, OVERLAP, True)
    for j in range(1, n_mine):
        acc, racc, sacc = _tile(q_t, do_t, k_s, v_s, e0_t, e1_t, ready, empty, acc, racc, sacc, j, offs_m, lse2,
                                delta, full_hi, SK, shift, scale_log2, CAUSAL, OVERLAP, False)
    NUM_STAGES: gl.constexpr = k_s.shape[0]
    for j in range(n_mine, n_tiles):
        # tiles only the other warpgroup's rows see: wait for each (so that the slot's phases stay in step), hand
        # it back unread
        mbarrier.wait(ready.index(j % NUM_STAGES), (j // NUM_STAGES) & 1)
        mbarrier.arrive(empty.index(j % NUM_STAGES), count=1)

    acc, racc, sacc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, racc, sacc))
    # ρ_i = Σ_j t_ij, m_i = Σ_j r_ij (the one-hot columns: every other column is an exact 0)
    col = gl.arange(0, ROWSUM_WIDTH, layout=gl.SliceLayout(0, sum_layout))
    rho = gl.convert_layout(gl.sum(gl.where(col[None, :] == RHO_COL, sacc, 0.0), axis=1), acc_rows)
    msum = gl.convert_layout(gl.sum(gl.where(col[None, :] == MASS_COL, sacc, 0.0), axis=1), acc_rows)
    offs_ma = row0 + gl.arange(0, ROWS_PER_WG, layout=acc_rows)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    if PARTIAL:
        # a ring's row pass over one key shard (backends/ring.py) stores the shard's sums, which the ring adds up:
        # A = α Σ t·K in DQ (fp32), B = α Σ r·K HEAD_DIM elements after it (DQ a (.., 2, HEAD_DIM) buffer), ρ and
        # m in the λ and T scratch rows (λ is the row's, formed once every shard is in)
        keep = offs_ma < SQ
        tile = DQ + b64 * sdq_b + h64 * sdq_h + offs_ma.to(gl.int64)[:, None] * sdq_s + offs_d[None, :] * sdq_d
        tile_mask = keep[:, None] & (offs_d < HEAD_DIM)[None, :]
        gl.store(tile, acc * scale, mask=tile_mask)
        gl.store(tile + HEAD_DIM * sdq_d, racc * scale, mask=tile_mask)
        gl.store(LAM + scratch_row0 + offs_ma, rho, mask=keep)
        gl.store(TGT + scratch_row0 + offs_ma, msum, mask=keep)
    else:
        if HAS_SINK:  # the exact row sum of dS is the target T = P_sink·D, not 0
            p_sink = gl.convert_layout(p_sink, acc_rows)
            rho = rho - p_sink * gl.convert_layout(delta, acc_rows)
        # λ_i = (ρ_i − T_i) / m_i: the multiple of r_i that carries the row sum t_i should not have (0: no mass)
        lam = gl.where(msum > 0.0, rho / gl.where(msum > 0.0, msum, 1.0), 0.0)
        # a row whose LSE does not give these keys its full mass M = 1 − P_sink (|m − M| beyond low(P)'s rounding,
        # spec.shard_mass_tolerance) is a shard of a row: not projected (λ = 0); rows that saw no key (LSE2 = +inf,
        # or no mass here: their gradients here are 0) are not shards. M is formed here, not kept through the key
        # loop (registers)
        lse2_rows = gl.convert_layout(lse2, acc_rows)
        if HAS_SINK:
            mass = 1.0 - p_sink
            shard = gl.abs(msum - mass) > mass_rel_tol * mass + mass_abs_tol
        else:
            shard = gl.abs(msum - 1.0) > mass_rel_tol + mass_abs_tol
        shard = shard & (lse2_rows < float("inf")) & (msum > 0.0)
        lam = gl.where(shard, 0.0, lam)
        # the projection t − λ·r, applied to the fp32 products (Σ t·K − λ·Σ r·K), never rounded again
        dq = (acc - lam[:, None] * racc) * scale
        keep = offs_ma < SQ
        if COUNT_PARTIAL:  # one atomic per warpgroup: a count, never a gradient (those stay deterministic)
            gl.atomic_add(PARTIAL_ROWS, gl.sum((shard & keep).to(gl.int32), axis=0))
        gl.store(LAM + scratch_row0 + offs_ma, lam, mask=keep)
        gl.store(DQ + b64 * sdq_b + h64 * sdq_h + offs_ma.to(gl.int64)[:, None] * sdq_s + offs_d[None, :] * sdq_d,
                 dq.to(dtype), mask=keep[:, None] & (offs_d < HEAD_DIM)[None, :])


@gluon.jit
def _dq_kernel(q_desc, k_desc, v_desc, do_desc, e_desc, O, LSE, SINK, DQ, Delta, LSE2, LAM, TGT, PARTIAL_ROWS,
               so_b, so_h, so_s, so_d, sl_b, sl_h, sl_s, ssink, sdq_b, sdq_h, sdq_s, sdq_d,
               H, GROUP, SQ, SK, shift, scale, scale_log2, mass_rel_tol, mass_abs_tol,
               CAUSAL: gl.constexpr, HAS_SINK: gl.constexpr, COUNT_PARTIAL: gl.constexpr, PARTIAL: gl.constexpr,
               NUM_STAGES: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(q_desc.block_type.shape[2] == ROWS_PER_WG)
    gl.static_assert(num_warps == CONSUMER_WARPS)  # the default partition is one consumer warpgroup

    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # heavy (late, causal) blocks first
    h = gl.program_id(1)
    b = gl.program_id(2)
    hk = h // GROUP
    m0 = pid_m * ROWS_PER_CTA
    # key tiles the block's last rows see (causal: none right of their diagonal); ≥ 1 (each consumer peels one)
    hi = SK + m0 * 0
    if CAUSAL:
        hi = gl.minimum(hi, m0 + ROWS_PER_CTA + shift)
    n_tiles = gl.maximum(gl.cdiv(gl.maximum(hi, 0), BLOCK_N), 1)

    qd_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS_PER_WG, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    e_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROWSUM_WIDTH], dtype)
    q_s = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS_PER_WG, HEAD_DIM], qd_layout)
    do_s = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS_PER_WG, HEAD_DIM], qd_layout)
    k_s = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_s = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    e_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROWSUM_WIDTH], e_layout)
    qd_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(qd_bar.index(0), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)

    gl.warp_specialize([
        (_consumer, (q_s, do_s, k_s, v_s, e_s, qd_bar, ready, empty, O, LSE, SINK, DQ, Delta, LSE2, LAM, TGT,
                     PARTIAL_ROWS, so_b, so_h, so_s, so_d, sl_b, sl_h, sl_s, ssink, sdq_b, sdq_h, sdq_s, sdq_d,
                     b, h, m0, n_tiles, H, SQ, SK, shift, scale, scale_log2, mass_rel_tol, mass_abs_tol, CAUSAL,
                     HAS_SINK, COUNT_PARTIAL, PARTIAL, OVERLAP, 0)),
        (_consumer, (q_s, do_s, k_s, v_s, e_s, qd_bar, ready, empty, O, LSE, SINK, DQ, Delta, LSE2, LAM, TGT,
                     PARTIAL_ROWS, so_b, so_h, so_s, so_d, sl_b, sl_h, sl_s, ssink, sdq_b, sdq_h, sdq_s, sdq_d,
                     b, h, m0, n_tiles, H, SQ, SK, shift, scale, scale_log2, mass_rel_tol, mass_abs_tol, CAUSAL,
                     HAS_SINK, COUNT_PARTIAL, PARTIAL, OVERLAP, 1)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, e_desc, q_s, do_s, k_s, v_s, e_s, qd_bar, ready, empty,
                     b, h, hk, m0, n_tiles)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])

    mbarrier.invalidate(qd_bar.index(0))
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
