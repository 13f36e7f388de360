"""Hopper-native (sm_90a) KV-major launch of the GProj backward, in Gluon: host side.

The GProj backward is two launches (``triton_bwd``): a dQ-major one (dq, λ and the per-row scratch) and a
KV-major one (dk, dv). On an sm_90 GPU the KV-major launch can be the warp-specialized Gluon kernel of
``gluon_kernels.py`` (a TMA producer warp and two consumer warpgroups; the portable ``tl`` kernel reaches about
half of the tensor pipe there); the dQ-major launch stays the ``tl`` kernel. Same
numerics contract: dv = Σ low(P)ᵀ dO, dk = α·Σ low(P∘(dP − D − λ))ᵀ Q (the fused form), fp32 accumulation,
no atomics, bitwise deterministic.

``kv_major_reason(...)`` is the predicate: None when the Gluon kernel takes the call, else why not; the call's
plan (``plan.kv_major_choice``) decides at its forward, and ``stats()["kv_major"]`` counts which ran.
Covered: bf16/fp16; head dim 64 or 128; dense or causal, top-left or bottom-right; Sq ≠ Sk and any lengths;
MHA, GQA/MQA (dk/dv reduced over the group in one CTA, no K/V copies); any batch and head counts; any strides
with a contiguous last dimension and 16-byte-aligned base and strides (TMA); Sq a multiple of 4; with or without a learnable sink
(the KV-major launch only reads λ). Not covered: sliding windows, softcap, varlen, the two-product dk form,
``correct=False``, fp32 inputs, other head dims, GPUs other than sm_90, a Triton without Gluon.

Host cost per launch: everything but the tensors' addresses depends on the call's shape class (shapes,
strides, dtype, mask, config), cached (``_launch_class``: grid, scalars, the TMA descriptors validated once by
Gluon's constructor); a call binds its tensors into those templates (``bound_descriptor``) and replays the class's
prepared launch (``launch_cache``: Triton's launcher called directly, no argument binding).

``gluon_entry.gluon_backward`` (``gproj_backward(..., kv_major="gluon")``) runs it explicitly (tests, benchmarks; ValueError where
``kv_major_reason`` refuses the call). This module imports nothing from ``triton_bwd`` (no import cycle).

Importing this module needs neither CUDA nor Gluon; ``kv_major_reason`` then says what is missing
(``UNAVAILABLE_REASON``: also a Triton release the kernel was not checked against, ``compat.gluon_unsupported_reason``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from typing import Optional, Tuple

import torch

from .compat import gluon_unsupported_reason
from .configs import GLUON_HEAD_DIMS, KernelConfig, gluon_kv_config
from .launch_cache import PREPARED

#: why the Gluon kernel cannot run in this process at all (None when it can): a Triton release it was not
#: checked against (``compat.GLUON_CHECKED_TRITON``), or Gluon's Hopper API missing
UNAVAILABLE_REASON: Optional[str] = gluon_unsupported_reason()
if UNAVAILABLE_REASON is None:
    try:  # pragma: no cover - depends on the installed Triton
        import triton
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from . import gluon_kernels as _gk
    except Exception as exc:  # pragma: no cover - a triton without Gluon's Hopper API
        UNAVAILABLE_REASON = f"no Gluon ({type(exc).__name__}: {exc})"[:200]

#: the one compute capability the kernel is written for (TMA, wgmma, setmaxnreg: sm_90a)
GLUON_CAPABILITY = (9, 0)
#: TMA: base address and every stride but the last must be multiples of this many bytes
TMA_ALIGN_BYTES = 16
#: the KV-major kernel loads each tile's per-row (LSE2, D, λ) from the fp32 (B·H, Sq) scratch with TMA, which
#: needs the row stride (Sq·4 bytes) a multiple of 16 bytes: Sq a multiple of 4 (Sq = 333, then read as a flat
#: buffer, raised "illegal instruction" on the H200). Lifting it needs a scratch whose row stride is
#: padded to 4 (``triton_launch.allocate_scratch`` and the tl kernels' scratch indexing)
SCRATCH_ROW_ALIGN = 4
#: an SM's register file (32-bit registers), and the threads of a warp
SM_REGISTERS = 65536
WARP_SIZE = 32
#: the launch's shape, read from the kernel's own constants (``gluon_kernels``) so that the two cannot disagree;
#: None where the kernel cannot be imported (``UNAVAILABLE_REASON``: then nothing launches it).
#: BLOCK_N: keys per CTA (``KEYS_PER_CTA``: two consumer warpgroups of ``KEYS_PER_WG``); NUM_WARPS: warps of the
#: default partition (one consumer warpgroup, ``CONSUMER_WARPS``); TOTAL_WARPS: the CTA's warps (two consumer
#: warpgroups and the producer's warp, rounded up to a warpgroup: 12); MAXNREG: registers per thread at launch,
#: the largest multiple of 8 with TOTAL_WARPS × WARP_SIZE threads × it ≤ SM_REGISTERS (168; the partitions then
#: re-balance with setmaxnreg to ``CONSUMER_REGS`` for each consumer and ``PRODUCER_REGS`` for the producer)
KEYS_PER_WG: Optional[int] = None
BLOCK_N: Optional[int] = None
NUM_WARPS: Optional[int] = None
TOTAL_WARPS: Optional[int] = None
MAXNREG: Optional[int] = None
if UNAVAILABLE_REASON is None:
    KEYS_PER_WG = _gk.KEYS_PER_WG.value
    BLOCK_N = _gk.KEYS_PER_CTA.value
    NUM_WARPS = _gk.CONSUMER_WARPS.value
    TOTAL_WARPS = _gk.TOTAL_WARPS.value
    MAXNREG = SM_REGISTERS // (TOTAL_WARPS * WARP_SIZE) // 8 * 8
#: shared memory a CTA may use on sm_90 (227 KB)
SMEM_LIMIT_BYTES = 227 * 1024


@functools.lru_cache(maxsize=64)
def _capability(index: Optional[int]) -> Tuple[int, int]:
    """The compute capability of CUDA device ``index`` (a property of the hardware: bounded cache, one entry a
    device), asked once instead of at every planned call."""
    return torch.cuda.get_device_capability(index)


def _tma_reason(name: str, x: torch.Tensor) -> Optional[str]:
    """None when a TMA descriptor can address ``x``; else why not."""
    if x.data_ptr() % TMA_ALIGN_BYTES != 0:
        return f"{name}: base not {TMA_ALIGN_BYTES}-byte aligned (TMA)"
    return tma_strides_reason(name, x)


def tma_strides_reason(name: str, x: torch.Tensor) -> Optional[str]:
    """None when ``x``'s strides suit a TMA descriptor (a unit last stride, the others positive multiples of 16
    bytes; size-1 dims never read); else why not. The base address is ``bound_descriptor``'s care."""
    if x.stride(-1) != 1:
        return f"{name}: last dim not contiguous (TMA)"
    item = x.element_size()
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size > 1 and (stride <= 0 or (stride * item) % TMA_ALIGN_BYTES != 0):
            return f"{name}: stride {stride} not a positive multiple of {TMA_ALIGN_BYTES} bytes (TMA)"
    return None


def kv_major_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, do: Optional[torch.Tensor] = None,
                    window: Tuple[int, int] = (-1, -1), softcap: float = 0.0, varlen: bool = False,
                    correct: bool = True, dk_form: Optional[str] = None) -> Optional[str]:
    """None when the Gluon KV-major kernel runs this call; otherwise a short reason (the ``tl`` kernel runs it).
    For inputs ``triton_bwd.kernel_unsupported_reason`` accepted (4-D q, k, v of one dtype and one head dim:
    not checked again here). Causal masking is not an argument: both alignments are covered."""
    return gluon_reason(q, k, v, do=do, window=window, softcap=softcap, varlen=varlen, correct=correct,
                        dk_form=dk_form, scratch_tma=True)


def gluon_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, do: Optional[torch.Tensor],
                 window: Tuple[int, int], softcap: float, varlen: bool, correct: bool,
                 dk_form: Optional[str] = None, scratch_tma: bool) -> Optional[str]:
    """What both Gluon launches need (``kv_major_reason``; ``gluon_dq.dq_major_reason``): None, or why not.
    ``scratch_tma``: the launch reads the fp32 per-row scratch with TMA (the KV-major one: Sq a multiple of 4)."""
    if UNAVAILABLE_REASON is not None:
        return UNAVAILABLE_REASON
    if not correct:
        return "correct=False (measurement mode of the tl kernel)"
    if dk_form not in (None, "fused"):
        return f"dk_form={dk_form} (gluon has the fused form only)"
    if tuple(window) != (-1, -1):
        return "window"
    if softcap and softcap > 0.0:
        return "softcap"
    if varlen:
        return "varlen"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype={str(q.dtype).replace('torch.', '')}"
    if do is not None and do.dtype != q.dtype:
        return "mixed dtypes"
    d = q.shape[-1]
    if d not in GLUON_HEAD_DIMS:
        return f"head_dim={d} (gluon: {GLUON_HEAD_DIMS})"
    if scratch_tma and q.shape[2] % SCRATCH_ROW_ALIGN != 0:
        return f"Sq={q.shape[2]} not a multiple of {SCRATCH_ROW_ALIGN} (TMA of the fp32 per-row scratch)"
    if q.shape[0] * q.shape[1] * q.shape[2] >= 2 ** 31:
        return "B·H·Sq ≥ 2^31 (TMA coordinates are int32)"
    if q.device.type != "cuda":
        return f"device={q.device.type}"
    cap = _capability(q.device.index)
    if cap != GLUON_CAPABILITY:
        return f"sm_{cap[0]}{cap[1]} (the gluon kernel is sm_90a)"
    for name, x in (("q", q), ("k", k), ("v", v)) + ((("do", do),) if do is not None else ()):
        reason = _tma_reason(name, x)
        if reason is not None:
            return reason
    return None


#: log2(e): the kernel works in base 2 (scale_log2 = α·log2 e)
LOG2_E = math.log2(math.e)
#: the public fields of Gluon's host ``TensorDescriptor`` (a plain dataclass in triton 3.6, whose constructor
#: only stores them and validates): a launch's descriptor is its shape class's template, built and validated
#: once by that constructor, with the call's tensor as base (``bound_descriptor``: 0.3 µs instead of 3 µs a
#: descriptor)
DESCRIPTOR_FIELDS = ("base", "shape", "strides", "block_shape", "layout", "padding")
#: entries of the shape-class cache (``_launch_class``): distinct (shapes, strides, dtype, mask, config) a
#: process launches; each entry is a few small templates (no tensor of the call)
LAUNCH_CLASS_CACHE_SIZE = 64


def _fast_descriptors() -> bool:
    """True where ``TensorDescriptor`` has exactly ``DESCRIPTOR_FIELDS`` (else ``bound_descriptor`` takes the
    constructor)."""
    return UNAVAILABLE_REASON is None and tuple(f.name for f in fields(TensorDescriptor)) == DESCRIPTOR_FIELDS


FAST_DESCRIPTORS = _fast_descriptors()


def bound_descriptor(template: "TensorDescriptor", base: torch.Tensor) -> "TensorDescriptor":
    """``template`` (validated at construction) over ``base``: what the constructor would build, checking the one
    thing that varies per call, the base address's TMA alignment. A base off the 16-byte grid (a gradient handed
    to ``backward`` as a view at an odd offset: the plan checked q, k, v at the forward, never dO) is read from an
    aligned copy with the same strides instead of failing the backward."""
    if base.data_ptr() % TMA_ALIGN_BYTES != 0:
        base = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device=base.device).copy_(base)
    if not FAST_DESCRIPTORS:  # pragma: no cover - another TensorDescriptor: its constructor validates again
        return replace(template, base=base)
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape = base, template.shape, template.strides, template.block_shape
    d.layout, d.padding = template.layout, template.padding
    return d


def tile_template(shape, strides, dtype: torch.dtype, block_rows: int) -> "TensorDescriptor":
    """4-D TMA descriptor over (B, H, S, D) with (1, 1, block_rows, D) boxes; rows past S read as zeros. Its
    base is a zero-size stand-in (``bound_descriptor`` puts the call's tensor there). Strides of size-1 dims are
    never used; they are replaced by an aligned value TMA accepts."""
    shape, strides = list(shape), list(strides)
    for i in range(len(shape) - 2, -1, -1):
        if shape[i] == 1:
            strides[i] = strides[i + 1] * shape[i + 1]
    block = [1, 1, block_rows, shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor(torch.empty(0, dtype=dtype), shape, strides, block, layout)


def _row_template(heads: int, sq: int, block_rows: int) -> "TensorDescriptor":
    """2-D TMA descriptor over an fp32 (B·H, Sq) scratch buffer, (1, ``block_rows``) boxes (unswizzled): a box
    past Sq reads zeros, never the next head's rows. Its row stride (Sq·4 bytes) must be 16-byte aligned."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(torch.empty(0, dtype=torch.float32), [heads, sq], [sq, 1], [1, block_rows], layout)


@dataclass(frozen=True)
class _LaunchClass:
    """Everything a launch takes from its shape class: the grid, the descriptor templates (q, k, v, dO; the
    per-row scratch) and the scalar and constexpr arguments."""
    grid: Tuple[int, int, int]
    tiles: Tuple["TensorDescriptor", ...]
    rows: "TensorDescriptor"
    scalars: dict  # never mutated: each call copies it into its own argument dict


# bounded cache: LAUNCH_CLASS_CACHE_SIZE shape classes (least recently used dropped), keys and values small
@functools.lru_cache(maxsize=LAUNCH_CLASS_CACHE_SIZE)
def _launch_class(q_shape, q_strides, k_shape, kv_strides, do_strides, dkdv_strides, dtype, causal: bool,
                  bottom_right: bool, alpha: float, cfg: KernelConfig) -> _LaunchClass:
    """The ``_LaunchClass`` of a call from what it depends on (``_launch_arguments`` passes the tensors' shapes
    and strides; the constructor's checks of the descriptors run here, once per class)."""
    (sdk, sdv, _, _) = dkdv_strides  # and dk's, dv's dtypes: the compiled kernel's pointer types
    if sdk[-1] != 1 or sdv[-1] != 1:
        raise ValueError("launch_dkdv: dk and dv need a contiguous last dim")
    B, H, SQ, _ = q_shape
    HKV, SK = k_shape[1], k_shape[2]
    tiles = (tile_template(q_shape, q_strides, dtype, cfg.block_m),
             tile_template(k_shape, kv_strides[0], dtype, KEYS_PER_WG),
             tile_template(k_shape, kv_strides[1], dtype, KEYS_PER_WG),
             tile_template(q_shape, do_strides, dtype, cfg.block_m))
    scalars = dict(sdk_b=sdk[0], sdk_h=sdk[1], sdk_s=sdk[2], sdv_b=sdv[0], sdv_h=sdv[1], sdv_s=sdv[2],
                   H=H, GROUP=H // HKV, SQ=SQ, SK=SK, shift=SK - SQ if (causal and bottom_right) else 0,
                   scale=alpha, scale_log2=alpha * LOG2_E, CAUSAL=causal, NUM_STAGES=cfg.num_stages,
                   RELEASE_PAIRS=cfg.release_pairs, RETIRE_TILES=cfg.retire_tiles)
    return _LaunchClass(grid=(triton.cdiv(SK, BLOCK_N), HKV, B), tiles=tiles,
                        rows=_row_template(B * H, SQ, cfg.block_m), scalars=scalars)


def _class_key(job, cfg: KernelConfig) -> tuple:
    """What the launch of ``job`` takes from its shape class (``_launch_class``'s arguments): shapes, strides,
    dtype, mask, scale and config. Refuses a job ``kv_major_reason`` would have refused (ValueError)."""
    left, right = job.window
    if left >= 0 or right > 0 or job.varlen or not (job.correct and job.fused):
        raise ValueError("launch_dkdv: a window, varlen, or uncorrected/two-product job (kv_major_reason)")
    q, k = job.q, job.k
    return (q.shape, q.stride(), k.shape, (k.stride(), job.v.stride()), job.do.stride(),
            (job.dk.stride(), job.dv.stride(), job.dk.dtype, job.dv.dtype), q.dtype, right == 0, job.bottom_right,
            job.alpha, cfg)


def _slot_values(job, cls: _LaunchClass, delta: torch.Tensor, lse2: torch.Tensor, lam: torch.Tensor) -> dict:
    """The call's own arguments: its tensors bound into the class's descriptor templates, and dk, dv."""
    rows = cls.rows.shape[0] * cls.rows.shape[1]
    for x in (delta, lse2, lam):  # the contiguous fp32 (B·H, Sq) scratch the row template addresses
        if x.numel() != rows or not x.is_contiguous():
            raise ValueError(f"launch_dkdv: the per-row scratch must be a contiguous (B·H, Sq) buffer of {rows}")
    tq, tk, tv, tdo = cls.tiles
    return {"q_desc": bound_descriptor(tq, job.q), "k_desc": bound_descriptor(tk, job.k),
            "v_desc": bound_descriptor(tv, job.v), "do_desc": bound_descriptor(tdo, job.do),
            "lse2_desc": bound_descriptor(cls.rows, lse2), "delta_desc": bound_descriptor(cls.rows, delta),
            "lam_desc": bound_descriptor(cls.rows, lam), "DK": job.dk, "DV": job.dv}


def dkdv_arguments(job, delta: torch.Tensor, lse2: torch.Tensor, lam: torch.Tensor, cfg: KernelConfig) -> dict:
    """The keyword arguments of ``gluon_kernels._dkdv_kernel`` (constexprs included) for ``job`` (a
    ``triton_launch.Launch`` that ``kv_major_reason`` accepted) and the dQ-major launch's fp32 (B·H, Sq) scratch
    D, base-2 LSE and λ. Pure host work: ``python -m benchmarks.ptx --gluon`` compiles from it on a CPU.
    Per call only the tensors are bound: the rest comes from the shape class's cache (``_launch_class``)."""
    cls = _launch_class(*_class_key(job, cfg))
    return {**_slot_values(job, cls, delta, lse2, lam), **cls.scalars}


def launch_dkdv(job, delta: torch.Tensor, lse2: torch.Tensor, lam: torch.Tensor,
                config: Optional[KernelConfig] = None):
    """The KV-major launch of ``job`` (``dkdv_arguments``): dk, dv. Returns the compiled kernel (its registers and
    spills land in ``triton_bwd.LAST_KERNELS["dkdv"]``). A shape class launched before replays its prepared
    launch (``launch_cache``: the descriptors and dk, dv are the slots; no argument binding), keyed by the class
    and the device."""
    cfg = config or gluon_kv_config(job.q.shape[-1])
    key = _class_key(job, cfg)
    cls = _launch_class(*key)
    fn = _gk._dkdv_kernel

    def slots() -> dict:
        return _slot_values(job, cls, delta, lse2, lam)

    def arguments() -> dict:
        return {**slots(), **cls.scalars, "num_warps": NUM_WARPS, "maxnreg": MAXNREG}

    device = job.q.device.index
    return PREPARED.launch(fn, ("gluon", id(fn), device) + key, cls.grid, device, slots, arguments)
