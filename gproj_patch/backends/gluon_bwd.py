"""Hopper-native (sm_90a) GProj backward written in Gluon: host side.

``gluon_backward(do, q, k, v, o, lse, *, scale, causal, causal_align, window, ...)`` has the signature and the
numerics contract of ``triton_bwd.gproj_backward`` (r = low(P), t = low(dS), λ = ρ/m with both sums in fp32,
dq = α(tK − λ·rK), dk in the fused form α·low(P∘(dP − D − λ))ᵀQ, dv = rᵀdO, D from the saved output, no
atomics, bitwise deterministic) for the cases ``gluon_supported_reason`` accepts; the kernels are in
``gluon_kernels.py`` (TMA ring buffers with mbarriers, asynchronous wgmma, 128-row tiles over two warpgroups).

Covered: bf16/fp16; head dim 64 or 128 (q, k, v alike); dense or causal, top-left or bottom-right; Sq ≠ Sk and
any lengths; MHA, GQA/MQA (dk/dv reduced over the group inside one program, no K/V copies); any batch and
head counts; any strides with a contiguous last dimension, 16-byte-aligned base and strides (TMA); LSE in any
layout ``spec.normalize_lse`` reads. Everything else — sliding window, softcap, varlen, other head dims,
two-product dk, ``correct=False``, GPUs other than sm_90, no Gluon — gets a reason string, and the caller uses
the portable ``tl`` kernel (``triton_bwd.gproj_backward``) instead.

Importing this module needs neither CUDA nor Gluon; ``gluon_supported_reason`` then says what is missing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .spec import default_scale, normalize_lse, validate_qkv

try:  # pragma: no cover - depends on the installed Triton
    import triton
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import gluon_kernels as _gk
    _IMPORT_ERROR: Optional[str] = None
except Exception as exc:  # pragma: no cover - no triton, or a triton without Gluon's Hopper API
    _IMPORT_ERROR = f"no Gluon ({type(exc).__name__}: {exc})"[:200]

#: head dims the kernels are instantiated for
GLUON_HEAD_DIMS = (64, 128)
#: the one compute capability the kernels are written for (TMA, wgmma: sm_90a)
GLUON_CAPABILITY = (9, 0)
#: TMA: base address and every stride but the last must be multiples of this many bytes
TMA_ALIGN_BYTES = 16
#: tests and benchmarks set this to fill dense outputs with NaN before the launch (checks every element is written)
_POISON_OUTPUTS = False
#: apply the mask on every tile instead of only on diagonal/ragged tiles (a debugging fallback; slower)
_ALWAYS_MASK = False
#: launches to run (benchmarks time the kernels one at a time by removing the others; results then invalid)
_RUN = ("pre", "dq", "dkdv")
#: the preprocess launch's rows per program
_PRE_BLOCK_S = 64


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape of one kernel: rows of the loop-invariant operand, rows of the streamed operand, warps
    (two warpgroups at 8), depth of the TMA ring."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: per head dim: the dQ-major kernel (block_m queries resident, block_n keys streamed) and the KV-major kernel
#: (block_n keys resident, block_m queries streamed). Chosen spill-free from the sm_90a resource report
#: (benchmarks/NOTES_gluon.md): dkdv at D=128 spills with 64 query rows a tile, so it streams 32.
CONFIGS = {
    64: {"dq": KernelConfig(128, 64, 8, 2), "dkdv": KernelConfig(64, 128, 8, 2)},
    128: {"dq": KernelConfig(128, 64, 8, 2), "dkdv": KernelConfig(32, 128, 8, 2)},
}

#: the dq kernel's key-tile width checked on the device; block_n = 128 (D=64) crashed there (run 3), not understood
DQ_BLOCK_N_VALIDATED = 64

#: registers / spills of the last launch (for the benchmark's notes)
LAST_KERNELS: dict = {}


def _tma_reason(name: str, x: torch.Tensor) -> Optional[str]:
    """None when a TMA descriptor can address ``x``; else why not."""
    if x.stride(-1) != 1:
        return f"{name}: last dim not contiguous (TMA)"
    item = x.element_size()
    if x.data_ptr() % TMA_ALIGN_BYTES != 0:
        return f"{name}: base not {TMA_ALIGN_BYTES}-byte aligned (TMA)"
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size > 1 and (stride <= 0 or (stride * item) % TMA_ALIGN_BYTES != 0):
            return f"{name}: stride {stride} not a positive multiple of {TMA_ALIGN_BYTES} bytes (TMA)"
    return None


def gluon_supported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           do: Optional[torch.Tensor] = None, causal: bool = False,
                           causal_align: str = "top_left", window: Tuple[int, int] = (-1, -1),
                           softcap: float = 0.0, cu_seqlens_q=None, cu_seqlens_k=None, attn_mask=None,
                           dropout_p: float = 0.0, correct: bool = True, dk_form: Optional[str] = None,
                           **_ignored) -> Optional[str]:
    """None when ``gluon_backward`` runs these inputs; otherwise a short reason (the caller then uses the
    ``tl`` kernel, ``triton_bwd.gproj_backward``)."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if attn_mask is not None:
        return "attn_mask"
    if dropout_p and dropout_p > 0.0:
        return "dropout"
    if not correct:
        return "correct=False (measurement mode of the tl kernel)"
    if dk_form not in (None, "fused"):
        return f"dk_form={dk_form} (gluon has the fused form only)"
    if tuple(window) != (-1, -1):
        return "window"
    if softcap and softcap > 0.0:
        return "softcap"
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return "varlen"
    if causal and causal_align not in ("top_left", "bottom_right"):
        return f"causal_align={causal_align}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype={str(q.dtype).replace('torch.', '')}"
    if k.dtype != q.dtype or v.dtype != q.dtype or (do is not None and do.dtype != q.dtype):
        return "mixed dtypes"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "not 4-D"
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        return "head dims differ"
    if d not in GLUON_HEAD_DIMS:
        return f"head_dim={d} (gluon: {GLUON_HEAD_DIMS})"
    if q.device.type != "cuda":
        return f"device={q.device.type}"
    cap = torch.cuda.get_device_capability(q.device)
    if cap != GLUON_CAPABILITY:
        return f"sm_{cap[0]}{cap[1]} (gluon kernels are sm_90a)"
    for name, x in (("q", q), ("k", k), ("v", v)) + ((("do", do),) if do is not None else ()):
        reason = _tma_reason(name, x)
        if reason is not None:
            return reason
    return None


def _descriptor(x: torch.Tensor, block_rows: int) -> "TensorDescriptor":
    """4-D TMA descriptor over (B, H, S, D) with (1, 1, block_rows, D) boxes; rows past S read as zeros.
    Strides of size-1 dims are never used; they are replaced by an aligned value TMA accepts."""
    shape = list(x.shape)
    strides = list(x.stride())
    for i in range(len(shape) - 2, -1, -1):
        if shape[i] == 1:
            strides[i] = strides[i + 1] * shape[i + 1]
    block = [1, 1, block_rows, shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor(x, shape, strides, block, layout)


def _out_like(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    if out.stride(-1) != 1:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if _POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


def gluon_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, *, scale: Optional[float] = None, causal: bool = False,
                   causal_align: str = "top_left", window: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                   cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                   max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                   correct: bool = True, deterministic: bool = False, dk_form: Optional[str] = None,
                   _config: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GProj backward (dq, dk, dv) in the input dtype; same contract as ``triton_bwd.gproj_backward``.

    Raises ValueError when ``gluon_supported_reason`` is not None. Always deterministic (no atomics);
    ``deterministic`` is accepted and changes nothing. ``_config`` ({"dq": KernelConfig, "dkdv": ...}) overrides
    the tile configs (benchmarks).
    """
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    reason = gluon_supported_reason(q, k, v, do=do, causal=causal, causal_align=causal_align, window=window,
                                    softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                    correct=correct, dk_form=dk_form)
    if reason is not None:
        raise ValueError(f"gluon_backward cannot run these inputs: {reason}")
    validate_qkv(q, k, v, ("o", o), ("do", do), check_finite=False)
    if o.dtype != q.dtype or o.stride(-1) != 1:
        o = o.to(q.dtype).contiguous()  # the preprocess reads rows of O with unit stride
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    lse = normalize_lse(lse, B, H, SQ)
    alpha = default_scale(D, scale)
    dq, dk, dv = _out_like(q), _out_like(k), _out_like(v)
    if B == 0 or H == 0 or SQ == 0 or SK == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv

    delta = torch.empty((B * H, SQ), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    lam = torch.empty_like(delta)
    if "pre" in _RUN:
        _gk._preprocess_kernel[(triton.cdiv(SQ, _PRE_BLOCK_S), B * H)](
            o, do, lse, delta, lse2, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1),
            do.stride(2), *lse.stride(), H, SQ, BLOCK_S=_PRE_BLOCK_S, HEAD_DIM=D, num_warps=4)

    cfg = dict(CONFIGS[D])
    cfg.update(_config or {})
    cq, ck = cfg["dq"], cfg["dkdv"]
    if cq.block_n != DQ_BLOCK_N_VALIDATED:
        raise ValueError(f"dq block_n={cq.block_n}: only {DQ_BLOCK_N_VALIDATED} is validated (128 hit an illegal "
                         "address on the H200, benchmarks/NOTES_gluon.md)")
    shift = SK - SQ if (causal and causal_align == "bottom_right") else 0
    group = H // HKV
    common = dict(H=H, GROUP=group, SQ=SQ, SK=SK, shift=shift, scale=alpha, scale_log2=alpha * math.log2(math.e),
                  CAUSAL=bool(causal), ALWAYS_MASK=bool(_ALWAYS_MASK))

    kq = kk = None
    if "dq" in _RUN:
        kq = _gk._dq_kernel[(triton.cdiv(SQ, cq.block_m), H, B)](
            _descriptor(q, cq.block_m), _descriptor(k, cq.block_n), _descriptor(v, cq.block_n),
            _descriptor(do, cq.block_m), dq, delta, lse2, lam, dq.stride(0), dq.stride(1), dq.stride(2),
            **common, NUM_STAGES=cq.num_stages, num_warps=cq.num_warps)
    if "dkdv" in _RUN:
        kk = _gk._dkdv_kernel[(triton.cdiv(SK, ck.block_n), HKV, B)](
            _descriptor(q, ck.block_m), _descriptor(k, ck.block_n), _descriptor(v, ck.block_n),
            _descriptor(do, ck.block_m), dk, dv, delta, lse2, lam,
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            **common, NUM_STAGES=ck.num_stages, num_warps=ck.num_warps)
    LAST_KERNELS.clear()
    for name, kern in (("dq", kq), ("dkdv", kk)):
        LAST_KERNELS[name] = dict(regs=getattr(kern, "n_regs", None), spills=getattr(kern, "n_spills", None))
    return dq, dk, dv
