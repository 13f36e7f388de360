"""The GProj attention backward as Triton kernels (bf16/fp16 inputs, fp32 accumulation).

``gproj_backward(do, q, k, v, o, lse, ...)`` returns (dq, dk, dv) in the input dtype. With r = low(P) (the
operand a fused backward already forms for dV), t = low(dS), ρ_i = Σ_j t_ij, m_i = Σ_j r_ij, λ_i = ρ_i / m_i:

    dq_i = α ( Σ_j t_ij k_j − λ_i Σ_j r_ij k_j )
    dk_j = α ( Σ_i t_ij q_i − Σ_i low(λ_i r_ij) q_i )       (dk_form "two_product", the paper's form)
        or α Σ_i low(P_ij (dP_ij − D_i − λ_i)) q_i          (dk_form "fused": one product, re-rounded)
    dv_j = Σ_i r_ij dO_i

The default is "fused" (``DEFAULT_DK_FORM``): on the H200 suite both forms are within 0.25% of fp64 on every
gauge case, the fused form is one product cheaper (×1.36–1.62 of cuDNN against ×1.51–1.77), and on rows with
P == 1 the two-product form loses the sink key's gradient (dk 47% vs 0.6%: low(t) and low(λr) round to the
same value there). See BENCHMARKS.md.

``t − λr`` is never rounded again: the dq correction is applied to the fp32 accumulators, the two-product dk
subtracts a second product, and the fused dk rounds the fp32 value P∘(dP − D − λ) once (it never rounds a
combination of already-rounded t and r). ``correct=False``
runs the same kernels without the r·K product, the row sums and λ: a standard fused backward, for
measurement.

**Where D comes from.** D_i = Σ_d dO_id O_id is computed (fp32) from the *saved low-precision output*, as
every fused backward does (FA's preprocess). Recomputing it as Σ_j P_ij dP_ij would need a whole extra pass
over the keys before the dq pass. The saved-output D carries a rounding error that is a multiple of p_i
per row (the "forward channel"); the projection removes exactly such multiples, so after GProj it costs
nothing — this is why the cheap form is safe here and is not safe in an uncorrected kernel.

**Structure.** Three launches (``triton_kernels.py``): a preprocess (D and a base-2 LSE, -inf rows made
+inf so that fully masked rows get exactly zero gradients), a dQ-major kernel (dq, and λ written to an fp32
(B·H·S) scratch; the row sums ρ, m are dots with a one-hot matrix so they run on the tensor cores), and a
KV-major kernel (dk, dv, reading λ). Extra memory: three fp32 (B·H·Sq) buffers (D, LSE, λ) — never O(S²).

**Features.** bf16 and fp16; any head dim up to 256 (padded to a power of two inside the kernel; 32, 64, 96,
128, 256 are the supported sizes callers can count on); any lengths, Sq ≠ Sk; ``causal`` with
``causal_align`` "top_left" (SDPA) or "bottom_right" (flash-attn); sliding ``window=(left, right)``; GQA/MQA
(the KV-major program loops over the query heads of its group: dk/dv are reduced in registers, K/V are never
copied); varlen (B = 1 with ``cu_seqlens_q/k``; ``max_seqlen_*`` avoid a device sync); arbitrary strides on
every input, LSE (B, H, S) fp32 any strides (any layout ``spec.normalize_lse`` accepts is read through it).
The kernels use no atomics, so results are bitwise deterministic; ``deterministic=True`` is accepted and
changes nothing.

**Softcap** (c > 0, score = c·tanh(α q·k / c)). The conservation law Σ_j g_ij = 0 holds for the gradient
with respect to the *capped* score, g = P∘(dP − D), before the tanh derivative τ' = 1 − tanh² multiplies it;
the rounded operand is t = low(g∘τ'), whose row sum is not zero even exactly. So the row mass is measured
in capped-score units and the correction goes through the same τ' (the emulation's form, emulation.py):
ρ = Σ_j t_j/τ'_j (g_j where τ'_j = 0; an fp32 ALU row sum, the one reduction not on the tensor cores),
m = Σ r, w = low(r∘τ'), dq = α(tK − λ·wK), dk = α(tᵀQ − low(λw)ᵀQ) or α·low((g − λP)∘τ')ᵀQ. With a softcap
there is no exact gauge symmetry (tanh is not translation-equivariant): this reduces the rounding bias, it
does not restore an invariance. tanh is computed from exp2 (no libdevice, so the interpreter runs it too).

**Not supported** (``kernel_unsupported_reason`` says so; callers fall back to the FP32 tier): ``attn_mask``,
dropout, fp32/fp64 inputs, head dim > 256, bf16 under the Triton interpreter (its bf16 is wrong, DESIGN.md §3).

**CPU.** With ``GPROJ_TIER=triton`` or ``TRITON_INTERPRET=1`` in the environment, CPU fp16 tensors run the same
kernels through Triton's interpreter (slow; meant for CI). The interpreted copy of the kernels is loaded
separately, so this works whatever order triton was imported in.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import threading
from typing import Optional, Tuple

import torch

from .spec import MaskSpec, default_scale, normalize_lse, validate_cu_seqlens, validate_qkv

try:  # pragma: no cover - import guard
    import triton  # noqa: F401
    _HAS_TRITON = True
except Exception:  # pragma: no cover
    _HAS_TRITON = False

DK_FORMS = ("two_product", "fused")
#: dk form used when none is asked for (chosen on the H200 suite, see BENCHMARKS.md)
DEFAULT_DK_FORM = "fused"

# Block configs per padded head dim: (BLOCK_M, BLOCK_N, num_warps, num_stages) for the dq and dkdv kernels.
CONFIGS = {  # chosen by benchmarks/device_check.py --sweep on the H200 (BENCHMARKS.md, NOTES_kernel.md)
    "dq": {32: (64, 32, 4, 3), 64: (64, 32, 4, 3), 128: (64, 64, 4, 2), 256: (64, 32, 8, 1)},
    "dkdv": {32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (32, 64, 4, 2), 256: (32, 64, 8, 1)},
}
_INTERP_BLOCK = 16
#: tests and benchmarks set this to fill dense outputs with NaN before the launch (checks every element is written)
_POISON_OUTPUTS = False
#: launches to run (benchmarks time the kernels one at a time by removing the others; results then invalid)
_RUN = ("pre", "dq", "dkdv")
#: registers / spills of the last compiled launch (for the benchmark's notes)
LAST_KERNELS: dict = {}

_lock = threading.Lock()
_modules = {}


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or \
        os.environ.get("GPROJ_TIER", "").lower() == "triton"


def _kernels(interpret: bool):
    """The kernel module, compiled (CUDA) or interpreted (CPU tensors), each loaded once."""
    key = "interp" if interpret else "cuda"
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
        path = os.path.join(os.path.dirname(__file__), "triton_kernels.py")
        name = f"gproj_patch.backends._triton_kernels_{key}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
        try:
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old
        _modules[key] = mod
        return mod


@contextlib.contextmanager
def _interpreter_patch():
    """Triton 3.6's interpreter converts loop bounds with ``int(ndarray of shape (1,))``, which numpy >= 2.4
    rejects; while our interpreted kernels run, convert through ``.reshape(-1)[0]`` instead."""
    try:
        import triton.runtime.interpreter as ti
        orig = ti._patch_lang_tensor
    except Exception:  # pragma: no cover - other triton versions
        yield
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched
    try:
        yield
    finally:
        ti._patch_lang_tensor = orig


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def kernel_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
                              attn_mask=None, softcap: float = 0.0, **_ignored) -> Optional[str]:
    """None when ``gproj_backward`` handles these inputs; otherwise a short reason for the fallback log."""
    if not _HAS_TRITON:
        return "no triton"
    if attn_mask is not None:
        return "attn_mask"
    if dropout_p and dropout_p > 0.0:
        return "dropout"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype={str(q.dtype).replace('torch.', '')}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "mixed dtypes"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "not 4-D"
    d = q.shape[-1]
    if d > 256 or k.shape[-1] != d or v.shape[-1] != d:
        return f"head_dim={d}" if d > 256 else "head dims differ"
    if d < 1:
        return f"head_dim={d}"
    if q.device.type == "cuda":
        return None
    if q.device.type == "cpu":
        if not _interpret_env():
            return "cpu tensor without GPROJ_TIER=triton/TRITON_INTERPRET=1"
        if q.dtype == torch.bfloat16:
            return "bfloat16 under the Triton interpreter (inexact)"
        return None
    return f"device={q.device.type}"


def gproj_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, *, scale: Optional[float] = None, causal: bool = False,
                   causal_align: str = "top_left", window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                   max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                   correct: bool = True, deterministic: bool = False, dk_form: Optional[str] = None,
                   _config: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GProj backward of attention: (dq, dk, dv) in the input dtype. See the module docstring.

    Shapes follow ``spec.py``: q, o, do (B, Hq, Sq, D); k, v (B, Hkv, Sk, D); any strides; lse the
    forward's natural-log LSE in any layout ``spec.normalize_lse`` reads (normally (B, Hq, Sq) fp32).
    ``dk_form`` ("two_product" | "fused") picks the dk contraction (default ``DEFAULT_DK_FORM``).
    Raises ValueError when ``kernel_unsupported_reason`` is not None.
    """
    mask = MaskSpec(causal=bool(causal), causal_align=causal_align, window=tuple(int(w) for w in window),
                    softcap=float(softcap))
    reason = kernel_unsupported_reason(q, k, v, softcap=softcap)
    if reason is not None:
        raise ValueError(f"gproj_backward cannot run these inputs: {reason}")
    validate_qkv(q, k, v, ("o", o), ("do", do), check_finite=False)
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    if cu_seqlens_q is not None and B != 1:
        raise ValueError(f"varlen inputs must have batch 1, got {B}")
    if cu_seqlens_q is not None and (max_seqlen_q is None or max_seqlen_k is None or q.device.type == "cpu"):
        validate_cu_seqlens(cu_seqlens_q, cu_seqlens_k, B, SQ, SK)  # syncs; skipped on GPU with max_seqlen
    dk_form = DEFAULT_DK_FORM if dk_form is None else dk_form
    if dk_form not in DK_FORMS:
        raise ValueError(f"dk_form must be one of {DK_FORMS}, got {dk_form!r}")
    if o.dtype != q.dtype or do.dtype != q.dtype:
        o = o.to(q.dtype)
        do = do.to(q.dtype)
    lse = normalize_lse(lse, B, H, SQ)
    alpha = default_scale(D, scale)

    interpret = q.device.type != "cuda"
    km = _kernels(interpret)
    varlen = cu_seqlens_q is not None
    if varlen:
        cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
        cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
        nseq = cu_q.numel() - 1
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_q[1:] - cu_q[:-1]).max().item()) if nseq > 0 else 0
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_k[1:] - cu_k[:-1]).max().item()) if nseq > 0 else 0
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        Z, MQ, MK = nseq, max_seqlen_q, max_seqlen_k
    else:
        cu_q = cu_k = torch.zeros(1, dtype=torch.int32, device=q.device)
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        if _POISON_OUTPUTS:
            for x in (dq, dk, dv):
                x.fill_(float("nan"))
        Z, MQ, MK = B, SQ, SK
    if Z == 0:
        return dq, dk, dv

    # window form of the mask: key j visible from query i iff diag-left <= j <= diag+right, diag = i + shift
    left, right = mask.window
    if mask.causal:
        right = 0
    has_l, has_r = left >= 0, right >= 0
    bottom_right = mask.causal_align == "bottom_right"

    BD = _block_d(D)
    cfg = dict(_config or {})
    if interpret:
        bm_q = bn_q = bm_k = bn_k = _INTERP_BLOCK
        w_q = w_k = 4
        st_q = st_k = 1
    else:
        bm_q, bn_q, w_q, st_q = cfg.get("dq") or CONFIGS["dq"][BD]
        bm_k, bn_k, w_k, st_k = cfg.get("dkdv") or CONFIGS["dkdv"][BD]

    delta = torch.empty((B * H, SQ), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    lam = torch.empty_like(delta) if correct else delta  # placeholder pointer when uncorrected

    with (_interpreter_patch() if interpret else contextlib.nullcontext()):
        _launch(km, interpret, do, q, k, v, o, lse, dq, dk, dv, delta, lse2, lam, cu_q, cu_k, varlen, Z, MQ, MK,
                H, HKV, SQ, SK, D, BD, left, right, has_l, has_r, bottom_right, alpha, float(mask.softcap),
                bool(correct), dk_form == "fused", (bm_q, bn_q, w_q, st_q), (bm_k, bn_k, w_k, st_k))
    return dq, dk, dv


def _launch(km, interpret, do, q, k, v, o, lse, dq, dk, dv, delta, lse2, lam, cu_q, cu_k, varlen, Z, MQ, MK,
            H, HKV, SQ, SK, D, BD, left, right, has_l, has_r, bottom_right, alpha, softcap, correct, fused, cq,
            ck):
    bm_q, bn_q, w_q, st_q = cq
    bm_k, bn_k, w_k, st_k = ck
    B = q.shape[0]
    even_d = BD == D
    BS = 16 if interpret else 64
    if "pre" in _RUN:
        km._preprocess[(triton.cdiv(SQ, BS), B * H)](
            o, do, lse, delta, lse2,
            *o.stride(), *do.stride(), *lse.stride(),
            H, SQ, D, BLOCK_S=BS, BLOCK_D=BD, num_warps=4)

    group = H // HKV
    cap = (alpha / softcap, softcap * math.log2(math.e)) if softcap > 0 else (1.0, 1.0)
    common = dict(SOFTCAP=softcap > 0, BOTTOM_RIGHT=bottom_right, HAS_L=has_l, HAS_R=has_r, VARLEN=varlen,
                  CORRECT=correct, EVEN_D=even_d)
    if MQ == 0 or MK == 0:
        return  # every sequence empty on one side: gradients are the zeros already there
    kq = kk = None
    if "dq" in _RUN:
        kq = km._bwd_dq[(triton.cdiv(MQ, bm_q), H, Z)](
            q, k, v, do, dq, delta, lse2, lam, cu_q, cu_k,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
            H, group, SQ, SK, D, left, right, alpha, alpha * math.log2(math.e), *cap,
            EVEN_M=(not varlen) and SQ % bm_q == 0, EVEN_N=(not varlen) and SK % bn_q == 0,
            BLOCK_M=bm_q, BLOCK_N=bn_q, BLOCK_D=BD, num_warps=w_q, num_stages=st_q, **common)
    if "dkdv" in _RUN:
        kk = km._bwd_dkdv[(triton.cdiv(MK, bn_k), HKV, Z)](
            q, k, v, do, dk, dv, delta, lse2, lam, cu_q, cu_k,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
            H, group, SQ, SK, D, left, right, alpha, alpha * math.log2(math.e), *cap,
            FUSED=fused,
            EVEN_M=(not varlen) and SQ % bm_k == 0, EVEN_N=(not varlen) and SK % bn_k == 0,
            BLOCK_M=bm_k, BLOCK_N=bn_k, BLOCK_D=BD, num_warps=w_k, num_stages=st_k, **common)
    if not interpret:
        LAST_KERNELS.clear()
        for name, kern in (("dq", kq), ("dkdv", kk)):
            LAST_KERNELS[name] = dict(regs=getattr(kern, "n_regs", None), spills=getattr(kern, "n_spills", None))


def attention_lse(q: torch.Tensor, k: torch.Tensor, *, scale: Optional[float] = None,
                  causal: bool = False) -> torch.Tensor:
    """Natural-log LSE (B, Hq, Sq) fp32 of α·q·kᵀ — SDPA's semantics (dense, or top-left causal), GQA by head
    group — in one Triton launch (bf16/fp16 operands, fp32 accumulation: the scores the backward recomputes).

    For callers that hold a fused forward's output but not its LSE (inside a ``torch.compile``d graph the SDPA
    hook cannot reach the fused node's saved LSE). Same device rules as ``gproj_backward``.
    """
    reason = kernel_unsupported_reason(q, k, k)
    if reason is not None:
        raise ValueError(f"attention_lse cannot run here: {reason}")
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or Hq % Hkv != 0:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not form an attention problem")
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    interpret = q.device.type != "cuda"
    km = _kernels(interpret)
    block_m, block_n = (16, 16) if interpret else (64, 64)
    grid = (triton.cdiv(Sq, block_m), Hq, B)
    with (_interpreter_patch() if interpret else contextlib.nullcontext()):
        km._lse_fwd[grid](q, k, lse, *q.stride(), *k.stride(), *lse.stride(), Hq // Hkv, Sq, Sk, D,
                          default_scale(D, scale) * 1.4426950408889634, CAUSAL=bool(causal), BLOCK_M=block_m,
                          BLOCK_N=block_n, BLOCK_D=_block_d(D), num_warps=4)
    return lse
