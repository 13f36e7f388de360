"""Triton kernels of the GProj backward (launched from ``triton_launch.py``; the math: ``triton_bwd``'s docstring).

* ``_bwd_dq``: dQ-major, one program per (query block, query head, batch or sequence). First its rows' D_i =
  rowsum(dO_i ∘ O_i) from the saved output (fp32) and the LSE in base 2, -inf rows made +inf (every P of a fully
  masked row exactly 0), both written to fp32 (B·H·S) scratch for the KV-major kernel; with a learnable sink
  (``HAS_SINK``) also T_i = P_sink,i·D_i, P_sink = 2^(s_h·log2 e − LSE2_i): the exact row sum of dS, and −T_i is
  row i's share of the sink's gradient. Then t·K (t = low(dS)), r·K (r = low(P)) and the row sums ρ = Σt,
  m = Σr (on the tensor cores, a dot with a one-hot column); it writes dq = α(tK − λ·rK) and λ = (ρ − T)/m (λ = 0
  on shard rows, ``spec.shard_mass_tolerance``). ``PARTIAL`` (a ring's row pass, ``ring.py``): the key shard's
  sums A = α tK, B = α rK, ρ, m instead.
* ``_bwd_dkdv``: KV-major, one program per (key block, KV head, batch or sequence), looping over the query heads
  of its GQA group (dk/dv reduced inside one program: no atomics, no copy of K/V, deterministic). dv = Σ r·dO;
  dk = α(tᵀQ − low(λr)ᵀQ) ("two_product") or α·low(P∘(dP − D − λ))ᵀQ ("fused").

``DOT_PRECISION``: the ``tl.dot`` input precision, "tf32" (Triton's default; irrelevant for bf16/fp16 operands)
or ``configs.FP32_DOT_PRECISION`` for the FP32 tier's fp32 inputs ("tf32x3": fp32-level, on the tensor cores).
Masks (causal in both alignments, window) are a window (left, right) around the diagonal ``i + shift``; causal is
right = 0. A program walks its tiles in three ranges, masked edge / unmasked interior / masked edge, through one
loop per kernel (``_dq_tiles``, ``_dkdv_tiles``); constexpr flags are passed by keyword at every call. The
per-tile steps both kernels share (the problem's segment, tile loads and stores, P from the raw scores under a
softcap) are in ``triton_tiles.py``. The launches' arguments: ``triton_launch.kernel_arguments``. ``triton_bwd``
loads this module twice when needed, compiled (CUDA) and interpreted (``TRITON_INTERPRET=1``, CPU tensors), each
time with its ``triton_tiles`` in the same mode (``compat.load_interpreted_module``); do not import it directly.
"""
import triton
import triton.language as tl

from .triton_tiles import load_pair, load_rows, probs, segment, store_tile

#: log2(e) = 1/ln 2: exp(x) = 2^(x·RCP_LN2), and a natural-log LSE becomes a base-2 one
RCP_LN2 = tl.constexpr(1.4426950408889634)
#: columns of the dQ-major row-sum accumulator (tl.dot's smallest N): column 0 gathers ρ = Σ t, column 1 m = Σ r
ROWSUM_WIDTH = tl.constexpr(16)
RHO_COL = tl.constexpr(0)
MASS_COL = tl.constexpr(1)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _rowsum(x):
    # tl.reduce with our own combine function, not the standard library's sum: that one is a triton.jit
    # function, compiled or interpreted depending on how triton was first imported, while this module is
    # loaded in both modes (see triton_bwd.kernel_module).
    return tl.reduce(x, 1, _add)


@triton.jit
def _total(x):
    # the sum of a vector (tl.reduce with our combine function, as ``_rowsum``)
    return tl.reduce(x, 0, _add)


@triton.jit
def _row_stats(O_base, so_s, so_d, do, LSE_base, sl_s, SINK, ssink, h, Delta, LSE2, TGT, row, offs_m, q_len,
               offs_d, HEAD_DIM, HAS_SINK: tl.constexpr, EVEN: tl.constexpr):
    """(D, base-2 LSE, T) of the rows ``offs_m``, also stored to scratch at ``row`` for the KV-major kernel.

    D = rowsum(dO ∘ O) in fp32 from the saved output; LSE2 = LSE·log2 e, +inf where the LSE is -inf (rows that
    saw no key) and on rows past the end; T = P_sink·D with a sink (P_sink = 0 where LSE2 = +inf), else 0."""
    inside = offs_m < q_len
    o = load_rows(O_base, so_s, so_d, offs_m, q_len, offs_d, HEAD_DIM, EVEN=EVEN)
    # D_i = Σ_d dO_id·O_id (fp32): the row sum of P∘dP, from the saved output (FA's preprocess)
    delta = _rowsum(o.to(tl.float32) * do.to(tl.float32))
    # base-2 LSE; a row that saw no key (LSE = -inf) gets +inf, so every P = 2^(s − LSE2) of it is exactly 0
    lse = tl.load(LSE_base + offs_m * sl_s, mask=inside, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * RCP_LN2)
    tl.store(Delta + row, delta, mask=inside)
    tl.store(LSE2 + row, lse2, mask=inside)
    if HAS_SINK:
        # T_i = P_sink,i·D_i, P_sink = 2^(s_h·log2 e − LSE2_i): the exact row sum of dS with a sink
        sink2 = tl.load(SINK + h * ssink).to(tl.float32) * RCP_LN2
        target = tl.math.exp2(sink2 - lse2) * delta  # lse2 = +inf (row saw nothing, not even the sink): 0
        tl.store(TGT + row, target, mask=inside)
    else:
        target = delta * 0.0
    return delta, lse2, target


@triton.jit
def _dq_tiles(acc, racc, sacc, start, end, q, do, lse2, delta, e0, e1, col, offs_m,
              K_base, V_base, sk_s, sk_d, sv_s, sv_d, k_len, shift, win_left, win_right, scale_log2,
              cap_in, cap_out, offs_d, HEAD_DIM, SOFTCAP: tl.constexpr,
              MASK: tl.constexpr, HAS_L: tl.constexpr, HAS_R: tl.constexpr, CORRECT: tl.constexpr,
              EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The key tiles [start, end) of a dQ-major program: acc += t·K, and with ``CORRECT`` racc += r·K (w·K under a
    softcap) and the row sums ρ, m in ``sacc``'s columns RHO_COL, MASS_COL. ``MASK``: the tiles cross the window's
    edge or the end of the keys (``where`` on P); ``EVEN_N``: no tile runs past the last key (unmasked loads)."""
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k, v = load_pair(K_base, V_base, sk_s, sk_d, sv_s, sv_d, offs_n, k_len, offs_d, HEAD_DIM,
                         EVEN=EVEN_N and EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # raw scores q·kᵀ (fp32 accumulation)
        p, tau = probs(s, lse2[:, None], scale_log2, cap_in, cap_out, SOFTCAP=SOFTCAP)
        if MASK:  # key j visible from row i iff j < k_len and diag − left ≤ j ≤ diag + right, diag = i + shift
            vis = offs_n[None, :] < k_len
            diag = offs_m[:, None] + shift
            if HAS_R:
                vis = vis & (offs_n[None, :] <= diag + win_right)
            if HAS_L:
                vis = vis & (offs_n[None, :] >= diag - win_left)
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # dP = dO·Vᵀ
        ds = p * (dp - delta[:, None])  # gradient w.r.t. the (capped) score: zero row sum
        if SOFTCAP:
            t = (ds * tau).to(q.dtype)  # t = low(dS∘τ'): the gradient w.r.t. the raw score, rounded once
        else:
            t = ds.to(q.dtype)  # t = low(dS): the operand a fused backward rounds
        acc = tl.dot(t, k, acc, input_precision=DOT_PRECISION)  # Σ_j t_ij k_j (fp32)
        if CORRECT:
            r = p.to(q.dtype)  # r = low(P): the operand the dV product already rounds
            if SOFTCAP:
                # row mass in capped-score units (t/τ', or the unrounded gradient where τ' = 0); w = low(r τ')
                mass = tl.where(tau > 0.0, t.to(tl.float32) / tl.where(tau > 0.0, tau, 1.0), ds)
                sacc = sacc + tl.where(col[None, :] == RHO_COL, _rowsum(mass)[:, None], 0.0)
                racc = tl.dot((r.to(tl.float32) * tau).to(q.dtype), k, racc, input_precision=DOT_PRECISION)
            else:
                sacc = tl.dot(t, e0, sacc, input_precision=DOT_PRECISION)  # ρ_i += Σ_j t_ij (tensor cores)
                racc = tl.dot(r, k, racc, input_precision=DOT_PRECISION)  # Σ_j r_ij k_j
            sacc = tl.dot(r, e1, sacc, input_precision=DOT_PRECISION)  # m_i += Σ_j r_ij
    return acc, racc, sacc


@triton.jit
def _bwd_dq(Q, K, V, DO, O, LSE, SINK, DQ, Delta, LSE2, LAM, TGT, CU_Q, CU_K, PARTIAL_ROWS,
            sq_b, sq_h, sq_s, sq_d,
            sk_b, sk_h, sk_s, sk_d,
            sv_b, sv_h, sv_s, sv_d,
            sdo_b, sdo_h, sdo_s, sdo_d,
            so_b, so_h, so_s, so_d,
            sl_b, sl_h, sl_s, ssink,
            sdq_b, sdq_h, sdq_s, sdq_d,
            H, GROUP, SQ, SK, HEAD_DIM, win_left, win_right, scale, scale_log2, cap_in, cap_out,
            mass_rel_tol, mass_abs_tol,
            SOFTCAP: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, HAS_L: tl.constexpr, HAS_R: tl.constexpr,
            VARLEN: tl.constexpr, CORRECT: tl.constexpr, HAS_SINK: tl.constexpr, PARTIAL: tl.constexpr,
            COUNT_PARTIAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heavy (late, causal) blocks first
    h = tl.program_id(1)
    z = tl.program_id(2)
    b64, q_start, q_len, k_start, k_len = segment(CU_Q, CU_K, z, SQ, SK, VARLEN=VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 < q_len:
        if BOTTOM_RIGHT:
            shift = k_len - q_len
        else:
            shift = 0
        hk = h // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        Q_base = Q + b64 * sq_b + h.to(tl.int64) * sq_h + q_start.to(tl.int64) * sq_s
        DO_base = DO + b64 * sdo_b + h.to(tl.int64) * sdo_h + q_start.to(tl.int64) * sdo_s
        K_base = K + b64 * sk_b + hk.to(tl.int64) * sk_h + k_start.to(tl.int64) * sk_s
        V_base = V + b64 * sv_b + hk.to(tl.int64) * sv_h + k_start.to(tl.int64) * sv_s
        row = (b64 * H + h) * SQ + q_start + offs_m
        q, do = load_pair(Q_base, DO_base, sq_s, sq_d, sdo_s, sdo_d, offs_m, q_len, offs_d, HEAD_DIM,
                          EVEN=EVEN_M and EVEN_D)
        O_base = O + b64 * so_b + h.to(tl.int64) * so_h + q_start.to(tl.int64) * so_s
        LSE_base = LSE + b64 * sl_b + h.to(tl.int64) * sl_h + q_start.to(tl.int64) * sl_s
        delta, lse2, target = _row_stats(O_base, so_s, so_d, do, LSE_base, sl_s, SINK, ssink, h, Delta, LSE2, TGT,
                                         row, offs_m, q_len, offs_d, HEAD_DIM, HAS_SINK=HAS_SINK,
                                         EVEN=EVEN_M and EVEN_D)

        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)  # Σ t·K
        racc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)  # Σ r·K (Σ w·K under a softcap)
        sacc = tl.full([BLOCK_M, ROWSUM_WIDTH], 0.0, tl.float32)  # ρ in column RHO_COL, m in MASS_COL
        col = tl.arange(0, ROWSUM_WIDTH)
        nn = tl.arange(0, BLOCK_N)
        # one-hot (BLOCK_N × ROWSUM_WIDTH): t·e0 puts Σ_j t_ij in column RHO_COL, r·e1 puts Σ_j r_ij in MASS_COL
        e0 = tl.where((nn[:, None] >= 0) & (col[None, :] == RHO_COL), 1.0, 0.0).to(q.dtype)
        e1 = tl.where((nn[:, None] >= 0) & (col[None, :] == MASS_COL), 1.0, 0.0).to(q.dtype)

        # key range [lo, hi) seen by rows [m0, m0 + BLOCK_M), and the fully visible tiles [full_lo, full_hi)
        lo = z * 0
        hi = k_len
        if HAS_L:
            lo = tl.maximum(m0 + shift - win_left, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        if HAS_R:
            hi = tl.minimum(hi, m0 + BLOCK_M + shift + win_right)
        hi = tl.maximum(hi, lo)
        hi_al = ((hi + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        full_lo = lo
        if HAS_L:
            first = tl.maximum(m0 + BLOCK_M - 1 + shift - win_left, 0)
            full_lo = tl.maximum(full_lo, ((first + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
        full_lo = tl.minimum(full_lo, hi_al)
        full_hi = hi_al
        if HAS_R:
            last = tl.maximum(m0 + shift + win_right + 1, 0)
            full_hi = tl.minimum(full_hi, (last // BLOCK_N) * BLOCK_N)
        if not EVEN_N:
            full_hi = tl.minimum(full_hi, (k_len // BLOCK_N) * BLOCK_N)
        full_hi = tl.maximum(full_hi, full_lo)

        # left edge [lo, full_lo) masked, interior [full_lo, full_hi) unmasked, right edge [full_hi, hi) masked
        acc, racc, sacc = _dq_tiles(acc, racc, sacc, lo, full_lo, q, do, lse2, delta, e0, e1, col, offs_m,
                                    K_base, V_base, sk_s, sk_d, sv_s, sv_d, k_len, shift, win_left, win_right,
                                    scale_log2, cap_in, cap_out, offs_d, HEAD_DIM, SOFTCAP=SOFTCAP, MASK=True,
                                    HAS_L=HAS_L, HAS_R=HAS_R, CORRECT=CORRECT, EVEN_N=False, EVEN_D=EVEN_D,
                                    BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION)
        acc, racc, sacc = _dq_tiles(acc, racc, sacc, full_lo, full_hi, q, do, lse2, delta, e0, e1, col, offs_m,
                                    K_base, V_base, sk_s, sk_d, sv_s, sv_d, k_len, shift, win_left, win_right,
                                    scale_log2, cap_in, cap_out, offs_d, HEAD_DIM, SOFTCAP=SOFTCAP, MASK=False,
                                    HAS_L=HAS_L, HAS_R=HAS_R, CORRECT=CORRECT, EVEN_N=True, EVEN_D=EVEN_D,
                                    BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION)
        acc, racc, sacc = _dq_tiles(acc, racc, sacc, full_hi, hi, q, do, lse2, delta, e0, e1, col, offs_m,
                                    K_base, V_base, sk_s, sk_d, sv_s, sv_d, k_len, shift, win_left, win_right,
                                    scale_log2, cap_in, cap_out, offs_d, HEAD_DIM, SOFTCAP=SOFTCAP, MASK=True,
                                    HAS_L=HAS_L, HAS_R=HAS_R, CORRECT=CORRECT, EVEN_N=False, EVEN_D=EVEN_D,
                                    BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION)

        DQ_base = DQ + b64 * sdq_b + h.to(tl.int64) * sdq_h + q_start.to(tl.int64) * sdq_s
        if CORRECT:
            rho = _rowsum(tl.where(col[None, :] == RHO_COL, sacc, 0.0))  # ρ_i = Σ_j t_ij
            msum = _rowsum(tl.where(col[None, :] == MASS_COL, sacc, 0.0))  # m_i = Σ_j r_ij
        if PARTIAL:
            # a ring's row pass over one key shard (backends/ring.py) stores the shard's sums, which the ring adds
            # up: A = α Σ t·K in DQ (fp32), B = α Σ r·K HEAD_DIM elements after it (DQ a (.., 2, HEAD_DIM)
            # buffer), ρ and m in the λ and T scratch rows (λ is the row's, formed once every shard is in)
            store_tile(DQ_base, acc * scale, sdq_s, sdq_d, offs_m, q_len, offs_d, HEAD_DIM, EVEN=EVEN_M and EVEN_D)
            store_tile(DQ_base + HEAD_DIM * sdq_d, racc * scale, sdq_s, sdq_d, offs_m, q_len, offs_d, HEAD_DIM,
                       EVEN=EVEN_M and EVEN_D)
            tl.store(LAM + row, rho, mask=offs_m < q_len)
            tl.store(TGT + row, msum, mask=offs_m < q_len)
        elif CORRECT:
            if HAS_SINK:  # the exact row sum of dS is the target T = P_sink·D, not 0
                rho = rho - target
            # λ_i = (ρ_i − T_i) / m_i: the multiple of r_i that carries the row sum t_i should not have (0: no mass)
            lam = tl.where(msum > 0.0, rho / tl.where(msum > 0.0, msum, 1.0), 0.0)
            # a row whose LSE does not give these keys its full mass M = 1 − P_sink (|m − M| beyond low(P)'s
            # rounding, spec.shard_mass_tolerance) is a shard of a row (a ring's per-shard call): its keys' dS
            # has a true non-zero sum, so it is not projected (λ = 0: the uncorrected dq and dk); rows that saw
            # no key (LSE2 = +inf, or no mass here: their gradients here are 0) are not shards. M is formed here,
            # not kept through the key loop (registers)
            if HAS_SINK:
                sink2 = tl.load(SINK + h * ssink).to(tl.float32) * RCP_LN2
                mass = 1.0 - tl.math.exp2(sink2 - lse2)
                shard = tl.abs(msum - mass) > mass_rel_tol * mass + mass_abs_tol
            else:
                shard = tl.abs(msum - 1.0) > mass_rel_tol + mass_abs_tol
            shard = shard & (lse2 < float("inf")) & (msum > 0.0)
            lam = tl.where(shard, 0.0, lam)
            if COUNT_PARTIAL:  # one atomic per program: a count, never a gradient (those stay deterministic)
                tl.atomic_add(PARTIAL_ROWS, _total((shard & (offs_m < q_len)).to(tl.int32)))
            # the projection t − λ·r, applied to the fp32 products (Σ t·K − λ·Σ r·K), never rounded again
            dq = (acc - lam[:, None] * racc) * scale
            if EVEN_M:
                tl.store(LAM + row, lam)
            else:
                tl.store(LAM + row, lam, mask=offs_m < q_len)
            store_tile(DQ_base, dq, sdq_s, sdq_d, offs_m, q_len, offs_d, HEAD_DIM, EVEN=EVEN_M and EVEN_D)
        else:
            store_tile(DQ_base, acc * scale, sdq_s, sdq_d, offs_m, q_len, offs_d, HEAD_DIM, EVEN=EVEN_M and EVEN_D)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, start, end, offs_n, Q_base, DO_base, sq_s, sq_d, sdo_s, sdo_d,
                LSE2, Delta, LAM, row0, q_len, k_len, shift, win_left, win_right, scale_log2, cap_in, cap_out,
                offs_d, HEAD_DIM, SOFTCAP: tl.constexpr, COLMASK: tl.constexpr, MASK: tl.constexpr,
                HAS_L: tl.constexpr, HAS_R: tl.constexpr, CORRECT: tl.constexpr, FUSED: tl.constexpr,
                EVEN_M: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The query tiles [start, end) of one query head in a KV-major program, transposed (keys along the rows):
    dv += low(Pᵀ)·dO and dk += the projected tᵀ·Q. ``COLMASK``: zero P on keys past the end; ``MASK``: the
    tiles cross the window's edge or the end of the rows; ``EVEN_M``: no tile runs past the last row."""
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q, do = load_pair(Q_base, DO_base, sq_s, sq_d, sdo_s, sdo_d, offs_m, q_len, offs_d, HEAD_DIM,
                          EVEN=EVEN_M and EVEN_D)
        # the rows' base-2 LSE, D and λ from the dQ-major launch (rows past the end: P = 0, no D, no λ)
        if EVEN_M:
            lse2 = tl.load(LSE2 + row0 + offs_m)
            delta = tl.load(Delta + row0 + offs_m)
            if CORRECT:
                lam = tl.load(LAM + row0 + offs_m)
        else:
            lse2 = tl.load(LSE2 + row0 + offs_m, mask=offs_m < q_len, other=float("inf"))
            delta = tl.load(Delta + row0 + offs_m, mask=offs_m < q_len, other=0.0)
            if CORRECT:
                lam = tl.load(LAM + row0 + offs_m, mask=offs_m < q_len, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # Sᵀ = K·Qᵀ (raw scores, fp32)
        pT, tauT = probs(sT, lse2[None, :], scale_log2, cap_in, cap_out, SOFTCAP=SOFTCAP)
        if COLMASK:  # keys past the end (padding of the last tile): keep their scratch P finite
            pT = tl.where(offs_n[:, None] < k_len, pT, 0.0)
        if MASK:  # key j visible from row i iff i < q_len and diag − left ≤ j ≤ diag + right, diag = i + shift
            diag = offs_m[None, :] + shift
            vis = offs_m[None, :] < q_len
            if HAS_R:
                vis = vis & (offs_n[:, None] <= diag + win_right)
            if HAS_L:
                vis = vis & (offs_n[:, None] >= diag - win_left)
            pT = tl.where(vis, pT, 0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dPᵀ = V·dOᵀ
        rT = pT.to(q.dtype)  # r = low(P)
        dv = tl.dot(rT, do, dv, input_precision=DOT_PRECISION)  # dv_j += Σ_i r_ij dO_i
        if CORRECT and FUSED:
            # the projection in the fused form: P∘(dP − D − λ) = t − λr before any rounding, rounded once
            gT = pT * (dpT - delta[None, :] - lam[None, :])
        else:
            gT = pT * (dpT - delta[None, :])  # dS = P∘(dP − D), the uncorrected gradient (or t of two_product)
        if SOFTCAP:
            gT = gT * tauT  # chain rule through the cap: × τ'
        dk = tl.dot(gT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)  # dk_j += Σ_i low(g_ij) q_i
        if CORRECT and not FUSED:
            # the projection in the two-product form: dk_j −= Σ_i low(λ_i w_ij) q_i, w = low(r τ') or r
            if SOFTCAP:
                wT = (rT.to(tl.float32) * tauT).to(q.dtype)
            else:
                wT = rT
            dk = tl.dot((-(lam[None, :] * wT.to(tl.float32))).to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv(Q, K, V, DO, DK, DV, Delta, LSE2, LAM, CU_Q, CU_K,
              sq_b, sq_h, sq_s, sq_d,
              sk_b, sk_h, sk_s, sk_d,
              sv_b, sv_h, sv_s, sv_d,
              sdo_b, sdo_h, sdo_s, sdo_d,
              sdk_b, sdk_h, sdk_s, sdk_d,
              sdv_b, sdv_h, sdv_s, sdv_d,
              H, GROUP, SQ, SK, HEAD_DIM, win_left, win_right, scale, scale_log2, cap_in, cap_out,
              SOFTCAP: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, HAS_L: tl.constexpr, HAS_R: tl.constexpr,
              VARLEN: tl.constexpr, CORRECT: tl.constexpr, FUSED: tl.constexpr,
              EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    z = tl.program_id(2)
    b64, q_start, q_len, k_start, k_len = segment(CU_Q, CU_K, z, SQ, SK, VARLEN=VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 < k_len:
        if BOTTOM_RIGHT:
            shift = k_len - q_len
        else:
            shift = 0
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        K_base = K + b64 * sk_b + hk.to(tl.int64) * sk_h + k_start.to(tl.int64) * sk_s
        V_base = V + b64 * sv_b + hk.to(tl.int64) * sv_h + k_start.to(tl.int64) * sv_s
        k, v = load_pair(K_base, V_base, sk_s, sk_d, sv_s, sv_d, offs_n, k_len, offs_d, HEAD_DIM,
                         EVEN=EVEN_N and EVEN_D)
        dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
        dv = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)

        # query range [lo, hi) that sees keys [n0, n0 + BLOCK_N), and fully visible row tiles [full_lo, full_hi)
        lo = z * 0
        hi = q_len
        if HAS_R:
            lo = tl.maximum(n0 - shift - win_right, 0)
            lo = (lo // BLOCK_M) * BLOCK_M
        if HAS_L:
            hi = tl.minimum(hi, n0 + BLOCK_N - shift + win_left)
        hi = tl.maximum(hi, lo)
        hi_al = ((hi + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        full_lo = lo
        if HAS_R:
            first = tl.maximum(n0 + BLOCK_N - 1 - shift - win_right, 0)
            full_lo = tl.maximum(full_lo, ((first + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
        full_lo = tl.minimum(full_lo, hi_al)
        full_hi = hi_al
        if HAS_L:
            last = tl.maximum(n0 - shift + win_left + 1, 0)
            full_hi = tl.minimum(full_hi, (last // BLOCK_M) * BLOCK_M)
        if not EVEN_M:
            full_hi = tl.minimum(full_hi, (q_len // BLOCK_M) * BLOCK_M)
        full_hi = tl.maximum(full_hi, full_lo)

        for g in range(0, GROUP):  # the query heads of this KV head's group: dk, dv reduced here, no atomics
            h = hk * GROUP + g
            Q_base = Q + b64 * sq_b + h.to(tl.int64) * sq_h + q_start.to(tl.int64) * sq_s
            DO_base = DO + b64 * sdo_b + h.to(tl.int64) * sdo_h + q_start.to(tl.int64) * sdo_s
            row0 = (b64 * H + h) * SQ + q_start
            # top edge [lo, full_lo) masked, interior [full_lo, full_hi) unmasked, bottom edge [full_hi, hi) masked
            dk, dv = _dkdv_tiles(dk, dv, k, v, lo, full_lo, offs_n, Q_base, DO_base, sq_s, sq_d, sdo_s, sdo_d,
                                 LSE2, Delta, LAM, row0, q_len, k_len, shift, win_left, win_right, scale_log2,
                                 cap_in, cap_out, offs_d, HEAD_DIM, SOFTCAP=SOFTCAP, COLMASK=not EVEN_N,
                                 MASK=True, HAS_L=HAS_L, HAS_R=HAS_R, CORRECT=CORRECT, FUSED=FUSED, EVEN_M=False,
                                 EVEN_D=EVEN_D, BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION)
            dk, dv = _dkdv_tiles(dk, dv, k, v, full_lo, full_hi, offs_n, Q_base, DO_base, sq_s, sq_d, sdo_s, sdo_d,
                                 LSE2, Delta, LAM, row0, q_len, k_len, shift, win_left, win_right, scale_log2,
                                 cap_in, cap_out, offs_d, HEAD_DIM, SOFTCAP=SOFTCAP, COLMASK=not EVEN_N,
                                 MASK=False, HAS_L=HAS_L, HAS_R=HAS_R, CORRECT=CORRECT, FUSED=FUSED, EVEN_M=True,
                                 EVEN_D=EVEN_D, BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION)
            dk, dv = _dkdv_tiles(dk, dv, k, v, full_hi, hi, offs_n, Q_base, DO_base, sq_s, sq_d, sdo_s, sdo_d,
                                 LSE2, Delta, LAM, row0, q_len, k_len, shift, win_left, win_right, scale_log2,
                                 cap_in, cap_out, offs_d, HEAD_DIM, SOFTCAP=SOFTCAP, COLMASK=not EVEN_N,
                                 MASK=True, HAS_L=HAS_L, HAS_R=HAS_R, CORRECT=CORRECT, FUSED=FUSED, EVEN_M=False,
                                 EVEN_D=EVEN_D, BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION)

        dk = dk * scale
        store_tile(DK + b64 * sdk_b + hk.to(tl.int64) * sdk_h + k_start.to(tl.int64) * sdk_s, dk, sdk_s, sdk_d,
                   offs_n, k_len, offs_d, HEAD_DIM, EVEN=EVEN_N and EVEN_D)
        store_tile(DV + b64 * sdv_b + hk.to(tl.int64) * sdv_h + k_start.to(tl.int64) * sdv_s, dv, sdv_s, sdv_d,
                   offs_n, k_len, offs_d, HEAD_DIM, EVEN=EVEN_N and EVEN_D)
