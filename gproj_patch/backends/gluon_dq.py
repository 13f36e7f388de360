"""Hopper-native (sm_90a) dQ-major launch of the GProj backward, in Gluon: host side.

The GProj backward is two launches (``triton_launch``): a dQ-major one (dq, λ and the per-row scratch D, LSE2,
λ the KV-major launch reads) and a KV-major one (dk, dv). On an sm_90 GPU the dQ-major launch can be the
warp-specialized Gluon kernel of ``gluon_dq_kernels.py`` (a TMA producer warp and two consumer warpgroups of 64
query rows), the counterpart of the KV-major one of ``gluon_kernels.py``. Same numerics contract as the ``tl``
kernel ``triton_kernels._bwd_dq``: dq = α(Σ t·K − λ·Σ r·K), t = low(dS), r = low(P), λ = ρ/m from the row sums of
the rounded operands, fp32 accumulation, D from the saved output, LSE2 = +∞ on rows that saw no key, no
atomics, bitwise deterministic; only fp32 summation orders differ (D, ρ, m are register reductions here).

``dq_major_reason(...)`` is the predicate: None when the Gluon kernel can take the call, else why not.
Covered: bf16/fp16; head dim 64 or 128; dense or causal, top-left or bottom-right; Sq ≠ Sk and any lengths
(Sq, Sk ≥ 1: the scratch is written with plain stores, no Sq alignment); MHA, GQA/MQA; any batch and head
counts; q, k, v, do, o with a contiguous last dimension and 16-byte-aligned base and strides (TMA). Not
covered: a learnable sink (the target T and λ = (ρ − T)/m stay in the tl kernel), sliding windows, softcap,
varlen, ``correct=False``, fp32 inputs, other head dims, GPUs other than sm_90, a Triton without Gluon.

``launch_dq(job, scratch)`` runs it for a ``triton_launch.Launch`` into a ``triton_launch.Scratch``; wiring it
into the launch/plan is not done here (tests and ``benchmarks/gluon_dq_check.py`` call it directly). Importing
this module needs neither CUDA nor Gluon (``gluon_bwd.UNAVAILABLE_REASON`` then says what is missing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# the CTA shape (warps, maxnreg) is the KV-major launch's: both kernels have its partitions (gluon_dq_kernels)
from .gluon_bwd import (GLUON_CAPABILITY, MAXNREG, NUM_WARPS, SMEM_LIMIT_BYTES, UNAVAILABLE_REASON,  # noqa: F401
                        _bound, _tile_template, _tma_reason)

if UNAVAILABLE_REASON is None:  # pragma: no cover - depends on the installed Triton
    import triton

    from . import gluon_dq_kernels as _gk

#: head dims the kernel is instantiated for
DQ_HEAD_DIMS = (64, 128)
#: the launch's rows, read from the kernel's own constants so that the two cannot disagree (None where the kernel
#: cannot be imported): ROWS_PER_WG, query rows of one consumer warpgroup (the Q/dO/O TMA box); BLOCK_M, query
#: rows per CTA (two warpgroups). Warps and maxnreg: ``gluon_bwd.NUM_WARPS`` / ``MAXNREG`` (the same partitions)
ROWS_PER_WG: Optional[int] = None
BLOCK_M: Optional[int] = None
if UNAVAILABLE_REASON is None:
    ROWS_PER_WG = _gk.ROWS_PER_WG.value
    BLOCK_M = _gk.ROWS_PER_CTA.value
#: log2(e): the kernel works in base 2 (scale_log2 = α·log2 e)
LOG2_E = math.log2(math.e)


@dataclass(frozen=True)
class DqConfig:
    """Keys of one streamed K/V tile (the N of S = Q·Kᵀ and the K of t·K), the depth of the TMA ring, and
    whether the r·K product stays in flight into the next tile like t·K's (else it is retired at the end of
    its tile: fewer live registers). Same numerics either way (the same products in the same order)."""
    block_n: int
    num_stages: int
    rk_in_flight: bool = True


#: per head dim: compiled for sm_90a with Triton 3.6's ptxas without spills and without serialized wgmma
#: (``tests/helpers/dq_launch.compile_report``; benchmarks/NOTES_gluon.md). D=128: 32-key tiles, the only size where
#: both products (t·K, r·K) stay in flight (64-key tiles hold only t·K's, and spill 76 B); D=64: 64-key tiles
#: (128-key ones spill 208 B and serialize). Not yet timed against each other on the H200.
CONFIGS = {64: DqConfig(64, 3), 128: DqConfig(32, 3)}


def dq_major_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, do: Optional[torch.Tensor] = None,
                    o: Optional[torch.Tensor] = None, sink: Optional[torch.Tensor] = None,
                    window=(-1, -1), softcap: float = 0.0, varlen: bool = False,
                    correct: bool = True) -> Optional[str]:
    """None when the Gluon dQ-major kernel can run this call; otherwise a short reason (the ``tl`` kernel runs
    it). For inputs ``triton_bwd.kernel_unsupported_reason`` accepted (4-D q, k, v of one dtype and one head
    dim: not checked again here). Causal masking is not an argument: both alignments are covered."""
    if UNAVAILABLE_REASON is not None:
        return UNAVAILABLE_REASON
    if not correct:
        return "correct=False (measurement mode of the tl kernel)"
    if sink is not None:
        return "sink (the tl dQ-major kernel computes its target T)"
    if tuple(window) != (-1, -1):
        return "window"
    if softcap and softcap > 0.0:
        return "softcap"
    if varlen:
        return "varlen"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype={str(q.dtype).replace('torch.', '')}"
    if any(x is not None and x.dtype != q.dtype for x in (do, o)):
        return "mixed dtypes"
    d = q.shape[-1]
    if d not in DQ_HEAD_DIMS:
        return f"head_dim={d} (gluon dq: {DQ_HEAD_DIMS})"
    if q.shape[2] == 0 or k.shape[2] == 0:
        return "no query or no key (the tl kernel writes the zeros)"
    if q.device.type != "cuda":
        return f"device={q.device.type}"
    cap = torch.cuda.get_device_capability(q.device)
    if cap != GLUON_CAPABILITY:
        return f"sm_{cap[0]}{cap[1]} (the gluon kernel is sm_90a)"
    for name, x in (("q", q), ("k", k), ("v", v), ("do", do), ("o", o)):
        reason = None if x is None else _tma_reason(name, x)
        if reason is not None:
            return reason
    return None


def _descriptor(x: torch.Tensor, block_rows: int):
    """4-D TMA descriptor over (B, H, S, D) with (1, 1, block_rows, D) boxes, rows past S read as zeros
    (``gluon_bwd``'s template bound to ``x``)."""
    return _bound(_tile_template(x.shape, x.stride(), x.dtype, block_rows), x)


def dq_arguments(job, scratch, cfg: DqConfig) -> dict:
    """The keyword arguments of ``gluon_dq_kernels._dq_kernel`` (constexprs included) for ``job`` (a
    ``triton_launch.Launch`` that ``dq_major_reason`` accepted) writing dq and ``scratch`` (a
    ``triton_launch.Scratch``: its delta, lse2 and lam, fp32 (B·H, Sq)). Pure host work: the CPU compile check
    (``tests/kernels/test_gluon_dq.py``) compiles from it."""
    q, k, dq, lse = job.q, job.k, job.dq, job.lse
    left, right = job.window
    if left >= 0 or right > 0 or job.varlen or not job.correct or job.sink is not None or job.softcap > 0:
        raise ValueError("launch_dq: a window, varlen, softcap, sink or uncorrected job (dq_major_reason)")
    if dq.stride(-1) != 1:
        raise ValueError("launch_dq: dq needs a contiguous last dim")
    B, H, SQ = q.shape[:3]
    for name, x in (("delta", scratch.delta), ("lse2", scratch.lse2), ("lam", scratch.lam)):
        if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() != B * H * SQ:
            raise ValueError(f"launch_dq: scratch.{name} must be a contiguous fp32 (B·H, Sq) buffer")
    causal = right == 0
    SK = k.shape[2]
    return dict(
        q_desc=_descriptor(q, ROWS_PER_WG), k_desc=_descriptor(k, cfg.block_n), v_desc=_descriptor(job.v, cfg.block_n),
        do_desc=_descriptor(job.do, ROWS_PER_WG), o_desc=_descriptor(job.o, ROWS_PER_WG), LSE=lse, DQ=dq,
        DELTA=scratch.delta, LSE2=scratch.lse2, LAM=scratch.lam,
        sl_b=lse.stride(0), sl_h=lse.stride(1), sl_s=lse.stride(2),
        sdq_b=dq.stride(0), sdq_h=dq.stride(1), sdq_s=dq.stride(2),
        H=H, GROUP=H // k.shape[1], SQ=SQ, SK=SK, shift=SK - SQ if (causal and job.bottom_right) else 0,
        scale=job.alpha, scale_log2=job.alpha * LOG2_E, CAUSAL=causal, NUM_STAGES=cfg.num_stages,
        RK_IN_FLIGHT=cfg.rk_in_flight)


def launch_dq(job, scratch, config: Optional[DqConfig] = None):
    """The dQ-major launch of ``job`` (``dq_arguments``): dq, and D, LSE2, λ into ``scratch``. Returns the
    compiled kernel (``n_regs``, ``n_spills`` for the launch's records)."""
    if UNAVAILABLE_REASON is not None:
        raise RuntimeError(f"launch_dq: {UNAVAILABLE_REASON}")
    B, H, SQ = job.q.shape[:3]
    cfg = config or CONFIGS[job.q.shape[-1]]
    return _gk._dq_kernel[(triton.cdiv(SQ, BLOCK_M), H, B)](
        **dq_arguments(job, scratch, cfg), num_warps=NUM_WARPS, maxnreg=MAXNREG)
