"""A tiled model of a fused low-precision (BF16/FP16) attention backward, rounding where FA-style kernels round.

Operands are low-precision values held in fp32 tensors: a product of two BF16 (or FP16) values is exact in
fp32, so fp32 matmuls with fp32 accumulation reproduce the tensor cores up to the order of summation.
For one query block (``block_m`` rows) and one key block (``block_n`` keys):

    S  = α Q Kᵀ (fp32)                [softcap c > 0:  S ← c·tanh(S / c),  τ' = 1 − tanh²]
    P  = exp(S − lse)                 (fp32; masked entries and rows with lse = −inf give 0)
    r  = low(P)                       dv += rᵀ dO
    dP = dO Vᵀ                        D = rowsum(dO ∘ O) from the *saved low-precision* O (FA's preprocess)
    G  = P ∘ (dP − D)                 t = low(G ∘ τ')
    uncorrected:  dq = α Σ_tiles t K,  dk = α Σ_tiles tᵀ Q

GProj (``correct=True``): a first pass over all key tiles of a query block gives ρ = Σ_j t, m = Σ_j r,
Σ_tiles t K and Σ_tiles w K (w = r without softcap); then λ = ρ / m (m = 0 → λ = 0) and

    dq = α (t K − λ · (w K))
    dk two_product = α Σ (tᵀ Q − low(λ ∘ w)ᵀ Q)        (the paper's form; second pass over the key tiles)
    dk fused       = α Σ low((G − λ P) ∘ τ')ᵀ Q          (one product; re-rounds, docs/math.md §5)

t − λ r is never rounded again. Memory is bounded by the tiles plus the (S, D) accumulators: no S×S tensor.

Softcap, corrected form (our choice; documented here and in ``emulated_backward``). The conservation law
Σ_j G_ij = 0 holds for the gradient with respect to the *capped* score, before the tanh derivative τ'
multiplies it; Σ_j G_ij τ'_ij is not zero, so projecting the raw-score gradient would bias it. We therefore
measure the row mass in capped-score units and apply the correction through the same τ':

    ρ = Σ_j t_j / τ'_j   (t_j/τ'_j := G_j where τ'_j = 0, i.e. where tanh saturated in fp32)
    m = Σ_j r_j,   λ = ρ / m,   w = low(r ∘ τ'),   dq = α (t K − λ · w K),   dk = α (tᵀQ − low(λ∘w)ᵀQ)

so the implied capped-score gradient t/τ' − λ r has zero row sum; with c = 0 this is exactly the form above.
With softcap there is no exact gauge symmetry (tanh is not translation-equivariant), so this is a variance
reduction, not a symmetry repair.

Learnable sinks (``sink``, shape (Hq,), ``spec.py``). The saved LSE includes the sink, so P above already
sums to 1 − P_sink over the real keys, and the exact row sum of G is P_sink·D, not 0. The per-row target
T_i = P_sink,i·D_i (fp32, P_sink = exp(s_h − lse), D from the saved O as above) replaces 0:

    λ = (ρ − T) / m            (so the corrected row sum Σ_j (t − λ r) is T; T = 0 without a sink)
    dsink_h = −Σ_{b,i} T_i     (fp32; the same with or without the correction — the sink has no rounded operand)

and everything else is unchanged. Softcap with a sink is refused (``spec.SINK_SOFTCAP_REASON``).

``emulated_forward`` is a matching model of an FA2-style forward (online softmax over key tiles, P̃ rounded to
low precision for the PV product, row sum l from the fp32 P̃, O rounded at the end); the audit uses it to
produce the saved O and LSE, so the "forward channel" (D from a saved O that is not the exact output) is in
the model too. Exponentials are natural ``exp`` of fp32 scores (real kernels use exp2 of pre-scaled scores;
the difference is fp32 rounding).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Dict, Iterator, Optional, Tuple

import torch

from .spec import (MASK_KWARGS, MaskArgs, MaskSpec, default_scale, normalize_lse, segments, validate_cu_seqlens,
                   validate_qkv, validate_sink)

FORMATS = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16})
DK_FORMS = ("two_product", "fused")


@dataclass(frozen=True)
class EmulationOptions:
    """The modelled kernel of ``emulated_backward`` (its keywords besides the mask kwargs): the rounding format,
    GProj on or off, the dk form and the tile sizes. Checked here, before any input is read."""
    fmt: object = "bf16"
    correct: bool = True
    dk_form: str = "two_product"
    block_m: int = 64
    block_n: int = 64

    def __post_init__(self):
        if self.dk_form not in DK_FORMS:
            raise ValueError(f"dk_form must be one of {DK_FORMS}, got {self.dk_form!r}")
        if self.block_m < 1 or self.block_n < 1:
            raise ValueError("block_m and block_n must be positive")


EMULATION_OPTIONS = tuple(f.name for f in fields(EmulationOptions))


@contextlib.contextmanager
def full_fp32():
    """fp32 matmuls at full precision inside: TF32 off on CUDA and autocast off (a backward run inside
    ``torch.autocast`` would otherwise cast these matmuls to BF16); the previous settings are restored."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cuda", "cpu"):
            try:
                on = torch.is_autocast_enabled(device_type)
            except (RuntimeError, TypeError):
                on = False
            if on:
                stack.enter_context(torch.autocast(device_type, enabled=False))
        stack.enter_context(_ieee_matmuls())
        yield


@contextlib.contextmanager
def _ieee_matmuls():
    """IEEE fp32 matmuls inside, the caller's settings restored after. Through the per-backend settings
    (``torch.backends.<backend>.matmul.fp32_precision``) where this torch has them: the legacy global getter
    raises once an application has used those (PyTorch refuses to read a mix of the two APIs)."""
    backends = [b for b in (getattr(torch.backends.cuda, "matmul", None),
                            getattr(getattr(torch.backends, "mkldnn", None), "matmul", None))
                if b is not None and hasattr(b, "fp32_precision")]
    if not backends:  # torch without the per-backend API
        prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(prev)
        return
    prev = [b.fp32_precision for b in backends]
    for b in backends:
        if b.fp32_precision not in ("ieee", "none"):
            b.fp32_precision = "ieee"
    try:
        yield
    finally:
        for b, p in zip(backends, prev):
            if b.fp32_precision != p:
                b.fp32_precision = p


def _full_fp32(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with full_fp32():
            return fn(*args, **kwargs)
    return wrapper


def low_dtype(fmt) -> torch.dtype:
    """The torch dtype of a rounding format name ("bf16", "fp16") or dtype."""
    if isinstance(fmt, torch.dtype):
        if fmt not in FORMATS.values():
            raise ValueError(f"fmt must be bf16 or fp16, got {fmt}")
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def rounder(fmt):
    """x ↦ x rounded to the format (round to nearest even), returned as fp32."""
    dt = low_dtype(fmt)
    return lambda x: x.to(dt).to(torch.float32)


def _units(B: int, Sq: int, Sk: int, cu_q, cu_k) -> Iterator[Tuple[slice, int, int, int, int]]:
    """(batch slice, q_start, q_len, k_start, k_len): the whole batch at once when dense, else per segment."""
    if cu_q is None:
        yield slice(None), 0, Sq, 0, Sk
        return
    for seg in segments(B, Sq, Sk, cu_q, cu_k):
        yield slice(seg.batch, seg.batch + 1), seg.q_start, seg.q_len, seg.k_start, seg.k_len


def tile_scores(qi, kj, alpha, spec: MaskSpec, i0, j0, ql, kl):
    """Scores α·qi·kjᵀ of one tile (after softcap), τ' = 1 − tanh² (or None) and the visibility of the tile
    (or None when the mask is dense); ``i0``/``j0`` are the tile's offsets inside a sequence of (ql, kl)."""
    s = alpha * torch.matmul(qi, kj.transpose(-1, -2))
    tau = None
    if spec.softcap > 0:
        th = torch.tanh(s / spec.softcap)
        s = spec.softcap * th
        tau = 1.0 - th * th
    vis = None
    if not spec.is_dense:
        rows = torch.arange(i0, i0 + qi.shape[-2], device=qi.device)
        cols = torch.arange(j0, j0 + kj.shape[-2], device=qi.device)
        vis = spec.visible(rows[:, None], cols[None, :], ql, kl)
    return s, tau, vis


def _tile_visible_anywhere(spec: MaskSpec, i0, i1, j0, j1, ql, kl, device) -> bool:
    if spec.is_dense:
        return True
    rows = torch.arange(i0, i1, device=device)
    cols = torch.arange(j0, j1, device=device)
    return bool(spec.visible(rows[:, None], cols[None, :], ql, kl).any())


def _mask_args(kwargs: dict) -> Tuple[MaskArgs, list]:
    """(the mask kwargs among ``kwargs``, the sorted names of the other keywords). The emulation refuses those
    with a ValueError after its input checks (``_prepare``), as it always has, not with Python's TypeError."""
    unknown = sorted(set(kwargs) - set(MASK_KWARGS))
    args = MaskArgs.from_kwargs("emulation", {n: x for n, x in kwargs.items() if n in MASK_KWARGS})
    return args, unknown


def _prepare(q, k, v, extra, fmt, mask: MaskArgs, unknown: list, sink=None):
    validate_qkv(q, k, v, *extra)
    validate_sink(sink, q, softcap=float(mask.softcap))
    cu_q, cu_k = mask.varlen.cu_seqlens_q, mask.varlen.cu_seqlens_k
    validate_cu_seqlens(cu_q, cu_k, q.shape[0], q.shape[2], k.shape[2])
    if unknown:
        raise ValueError(f"unknown mask arguments: {unknown}")
    spec = mask.mask_spec()
    low = rounder(fmt)
    alpha = default_scale(q.shape[-1], mask.scale)
    group = q.shape[1] // k.shape[1]
    kk = low(k).repeat_interleave(group, dim=1)
    vv = low(v).repeat_interleave(group, dim=1)
    return spec, low, alpha, group, low(q), kk, vv, cu_q, cu_k


@_full_fp32
def emulated_forward(q, k, v, *, fmt="bf16", block_n: int = 64, sink: Optional[torch.Tensor] = None,
                     **mask) -> Tuple[torch.Tensor, torch.Tensor]:
    """Model of an FA2-style low-precision forward: (O rounded to ``fmt`` held in fp32, LSE fp32 (B, Hq, Sq)).
    ``mask``: the mask kwargs (``spec.MASK_KWARGS``; another keyword raises ValueError "unknown mask arguments").

    Online softmax over key tiles in fp32; the PV product uses low(P̃) (P̃ = exp(S − running max)), the row
    sum l uses the fp32 P̃; O = low(acc / l). Rows that see no key: O = 0, LSE = −inf. A ``sink`` enters as
    a first tile of one key with no value (running max s_h, l = 1): the LSE includes it, rows that see no key
    get LSE = s_h.
    """
    args, unknown = _mask_args(mask)
    spec, low, alpha, _g, qq, kk, vv, cu_q, cu_k = _prepare(q, k, v, (), fmt, args, unknown, sink=sink)
    B, Hq, Sq, _ = q.shape
    out = torch.zeros(B, Hq, Sq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    for bs, qs, ql, ks, kl in _units(B, Sq, k.shape[2], cu_q, cu_k):
        if ql == 0 or (kl == 0 and sink is None):
            continue
        Q = qq[bs, :, qs:qs + ql]
        if sink is None:
            m = torch.full(Q.shape[:-1], float("-inf"), device=q.device)
            l = torch.zeros(Q.shape[:-1], device=q.device)
        else:  # the sink as a tile of one key with no value row
            m = sink.to(torch.float32).view(-1, 1).expand(Q.shape[:-1]).clone()
            l = torch.ones(Q.shape[:-1], device=q.device)
        acc = torch.zeros(Q.shape[:-1] + (v.shape[-1],), device=q.device)
        for j0 in range(0, kl, block_n):
            j1 = min(kl, j0 + block_n)
            if not _tile_visible_anywhere(spec, 0, ql, j0, j1, ql, kl, q.device):
                continue
            s, _tau, vis = tile_scores(Q, kk[bs, :, ks + j0:ks + j1], alpha, spec, 0, j0, ql, kl)
            if vis is not None:
                s = s.masked_fill(~vis, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            corr = torch.exp(m - m_safe)  # m = -inf → 0
            p = torch.exp(s - m_safe[..., None])
            l = l * corr + p.sum(-1)
            acc = acc * corr[..., None] + torch.matmul(low(p), vv[bs, :, ks + j0:ks + j1])
            m = m_new
        seen = l > 0
        lsafe = torch.where(seen, l, torch.ones_like(l))
        out[bs, :, qs:qs + ql] = torch.where(seen[..., None], low(acc / lsafe[..., None]), torch.zeros_like(acc))
        lse[bs, :, qs:qs + ql] = torch.where(seen, m + torch.log(lsafe), torch.full_like(m, float("-inf")))
    return out, lse


@_full_fp32
def emulated_backward(q, k, v, o, do, lse, *, stats: Optional[Dict[str, torch.Tensor]] = None,
                      sink: Optional[torch.Tensor] = None, **mask_and_options):
    """Emulated low-precision attention backward (see the module docstring); returns fp32 (dq, dk, dv).

    q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), o/do like q, lse in any layout ``spec.normalize_lse`` reads
    (natural log; −inf for rows that see no key). ``mask_and_options``: the mask kwargs (``spec.MASK_KWARGS``;
    another keyword raises ValueError "unknown mask arguments") and the keywords of ``EmulationOptions``: ``fmt`` ("bf16" | "fp16"; inputs are first rounded to it, a no-op
    for tensors of that dtype), ``correct`` (GProj), ``dk_form``, ``block_m``, ``block_n``.
    dk/dv are summed over each query-head group. Rows with lse = −inf get zero gradients.

    ``stats``: if a dict is passed, it receives per-row fp32 tensors (B, Hq, Sq) ``rho`` (Σ_j t), ``m``
    (Σ_j r), ``lam`` (λ), ``target`` (T = P_sink·D; 0 without a sink), and with ``correct=True`` ``resid`` =
    Σ_j (t − λ r) − T summed tile by tile in fp32 (the conservation law after the projection; zero up to fp32
    rounding) and ``abs_t`` = Σ_j |t|.

    ``sink`` (Hq,): the learnable sink the forward's LSE includes (module docstring); the result is then
    (dq, dk, dv, dsink) with dsink (Hq,) fp32. Without it, (dq, dk, dv).
    """
    opt = EmulationOptions(**{n: x for n, x in mask_and_options.items() if n in EMULATION_OPTIONS})
    correct, block_m, block_n = opt.correct, opt.block_m, opt.block_n
    args, unknown = _mask_args({n: x for n, x in mask_and_options.items() if n not in EMULATION_OPTIONS})
    spec, low, alpha, group, qq, kk, vv, cu_q, cu_k = _prepare(q, k, v, (("o", o), ("do", do)), opt.fmt, args,
                                                                unknown, sink=sink)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    lse = normalize_lse(lse, B, Hq, Sq)
    if torch.isnan(lse).any() or torch.isposinf(lse).any():
        raise ValueError("lse contains NaN or +inf")
    oo, dd = low(o), low(do)
    dq = torch.zeros(B, Hq, Sq, D, dtype=torch.float32, device=q.device)
    dk_full = torch.zeros(B, Hq, Sk, D, dtype=torch.float32, device=q.device)
    dv_full = torch.zeros(B, Hq, Sk, v.shape[-1], dtype=torch.float32, device=q.device)
    dsink = torch.zeros(Hq, dtype=torch.float32, device=q.device)
    sink_col = None if sink is None else sink.to(torch.float32).view(-1, 1, 1)
    if stats is not None:
        for name in ("rho", "m", "lam", "target") + (("resid", "abs_t") if correct else ()):
            stats[name] = torch.zeros(B, Hq, Sq, dtype=torch.float32, device=q.device)
    fused = opt.dk_form == "fused"
    for bs, qs, ql, ks, kl in _units(B, Sq, Sk, cu_q, cu_k):
        if ql == 0 or kl == 0:
            continue
        K, V = kk[bs, :, ks:ks + kl], vv[bs, :, ks:ks + kl]
        dK, dV = dk_full[bs, :, ks:ks + kl], dv_full[bs, :, ks:ks + kl]  # views into the accumulators
        for i0 in range(0, ql, block_m):
            i1 = min(ql, i0 + block_m)
            rows = slice(qs + i0, qs + i1)
            Qi, dOi = qq[bs, :, rows], dd[bs, :, rows]
            Di = (dOi * oo[bs, :, rows]).sum(-1, keepdim=True)  # FA preprocess: rowsum(dO ∘ O), fp32
            li = lse[bs, :, rows]
            live = torch.isfinite(li)[..., None]
            li = torch.where(live, li[..., None], torch.zeros_like(li[..., None]))
            target = torch.zeros(Di.shape[:-1], device=q.device)  # T = P_sink·D: the exact row sum of G
            if sink_col is not None:
                psink = torch.where(live, torch.exp(sink_col - li), torch.zeros_like(li))
                target = (psink * Di)[..., 0]
                dsink -= target.sum(dim=(0, 2))
            shape = Qi.shape[:-1]
            rho = torch.zeros(shape, device=q.device)
            msum = torch.zeros(shape, device=q.device)
            abs_t = torch.zeros(shape, device=q.device)
            dq_acc = torch.zeros_like(Qi)
            wk_acc = torch.zeros_like(Qi)

            def tiles():
                for j0 in range(0, kl, block_n):
                    j1 = min(kl, j0 + block_n)
                    if not _tile_visible_anywhere(spec, i0, i1, j0, j1, ql, kl, q.device):
                        continue
                    Kj, Vj = K[:, :, j0:j1], V[:, :, j0:j1]
                    s, tau, vis = tile_scores(Qi, Kj, alpha, spec, i0, j0, ql, kl)
                    keep = live if vis is None else live & vis
                    p = torch.where(keep, torch.exp(s - li), torch.zeros_like(s))
                    r = low(p)
                    g = p * (torch.matmul(dOi, Vj.transpose(-1, -2)) - Di)
                    if tau is None:
                        t, w, mass = low(g), r, None
                    else:
                        t, w = low(g * tau), low(r * tau)
                        mass = torch.where(tau > 0, t / torch.where(tau > 0, tau, torch.ones_like(tau)), g)
                    yield slice(j0, j1), Kj, p, r, g, tau, t, w, mass

            for js, Kj, p, r, g, tau, t, w, mass in tiles():  # pass 1: dq, dv, row sums (dq-major)
                dV[:, :, js] += torch.matmul(r.transpose(-1, -2), dOi)
                rho += (t if mass is None else mass).sum(-1)
                msum += r.sum(-1)
                abs_t += t.abs().sum(-1)
                dq_acc += torch.matmul(t, Kj)
                if correct:
                    wk_acc += torch.matmul(w, Kj)
                if not (correct and fused):
                    dK[:, :, js] += alpha * torch.matmul(t.transpose(-1, -2), Qi)
            lam = torch.where(msum > 0, (rho - target) / torch.where(msum > 0, msum, torch.ones_like(msum)),
                              torch.zeros_like(msum))
            if correct:
                dq[bs, :, rows] = alpha * (dq_acc - lam[..., None] * wk_acc)
                resid = torch.zeros(shape, device=q.device)
                for js, Kj, p, r, g, tau, t, w, mass in tiles():  # pass 2: dk with λ known (kv-major)
                    if fused:
                        corr = g - lam[..., None] * p
                        dK[:, :, js] += alpha * torch.matmul(
                            low(corr if tau is None else corr * tau).transpose(-1, -2), Qi)
                    else:
                        dK[:, :, js] -= alpha * torch.matmul(low(lam[..., None] * w).transpose(-1, -2), Qi)
                    if stats is not None:
                        resid += ((t if mass is None else mass) - lam[..., None] * r).sum(-1)
                if stats is not None:
                    stats["resid"][bs, :, rows] = resid - target
                    stats["abs_t"][bs, :, rows] = abs_t
            else:
                dq[bs, :, rows] = alpha * dq_acc
            if stats is not None:
                stats["rho"][bs, :, rows] = rho
                stats["m"][bs, :, rows] = msum
                stats["lam"][bs, :, rows] = lam
                stats["target"][bs, :, rows] = target
    dk = dk_full.view(B, Hkv, group, Sk, D).sum(2)
    dv = dv_full.view(B, Hkv, group, Sk, -1).sum(2)
    return (dq, dk, dv) if sink is None else (dq, dk, dv, dsink)
