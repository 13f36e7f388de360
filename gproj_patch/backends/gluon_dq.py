"""Hopper-native (sm_90a) dQ-major launch of the GProj backward, in Gluon: host side.

The warp-specialized kernel of ``gluon_dq_kernels.py`` (a TMA producer warp and two consumer warpgroups, as the
KV-major one of ``gluon_bwd``) in place of the portable ``tl`` dQ-major kernel: the same contract (dq = α(Σ t·K −
λ·Σ r·K), λ = (ρ − T)/m with ρ, m summed on the tensor cores) and the same per-row scratch for the KV-major
launch. It covers what the Gluon KV-major launch covers (``gluon_bwd.kv_major_reason``) except the Sq multiple of
4, which only that launch's TMA of the scratch needs: ``dq_major_reason`` is its predicate, ``plan.dq_major_choice``
decides per call at its forward.

Host cost per launch as in ``gluon_bwd``: everything but the tensors' addresses comes from the shape class
(``_launch_class``: grid, scalars, descriptor templates); a call binds its tensors and replays the class's prepared
launch (``launch_cache``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import gluon_bwd
from .configs import DqConfig, gluon_dq_config
from .gluon_bwd import (LAUNCH_CLASS_CACHE_SIZE, LOG2_E, UNAVAILABLE_REASON, bound_descriptor, gluon_reason,
                        tile_template)
from .launch_cache import PREPARED
from .spec import shard_mass_tolerance

if UNAVAILABLE_REASON is None:  # pragma: no cover - depends on the installed Triton
    import triton
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import gluon_dq_kernels as _gq

#: query rows of a consumer warpgroup and of a CTA (two consumer warpgroups), from the kernel's own constants
ROWS_PER_WG: Optional[int] = None
ROWS_PER_CTA: Optional[int] = None
ROWSUM_WIDTH: Optional[int] = None
RHO_COL: Optional[int] = None
MASS_COL: Optional[int] = None
if UNAVAILABLE_REASON is None:
    ROWS_PER_WG = _gq.ROWS_PER_WG.value
    ROWS_PER_CTA = _gq.ROWS_PER_CTA.value
    ROWSUM_WIDTH = _gq.ROWSUM_WIDTH.value
    RHO_COL = _gq.RHO_COL.value
    MASS_COL = _gq.MASS_COL.value




def dq_major_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, do: Optional[torch.Tensor] = None,
                    window: Tuple[int, int] = (-1, -1), softcap: float = 0.0, varlen: bool = False,
                    correct: bool = True) -> Optional[str]:
    """None when the Gluon dQ-major kernel runs this call; otherwise a short reason (the ``tl`` kernel runs it).
    The checks of ``gluon_bwd.gluon_reason`` without the scratch's TMA row alignment (this launch writes the
    scratch with plain stores)."""
    return gluon_reason(q, k, v, do=do, window=window, softcap=softcap, varlen=varlen, correct=correct,
                        scratch_tma=False)


# bounded cache: one small tensor per (device, dtype, tile keys) a process launches
@functools.lru_cache(maxsize=16)
def _one_hot(device: int, dtype: torch.dtype, block_n: int) -> torch.Tensor:
    """(2·block_n, ROWSUM_WIDTH): rows [0, block_n) are the column RHO_COL, rows [block_n, 2·block_n) MASS_COL (t
    times the first gives ρ = Σ t in column RHO_COL; r times the second m = Σ r in MASS_COL)."""
    e = torch.zeros(2 * block_n, ROWSUM_WIDTH, dtype=dtype, device=torch.device("cuda", device))
    e[:block_n, RHO_COL] = 1
    e[block_n:, MASS_COL] = 1
    return e


@dataclass(frozen=True)
class _LaunchClass:
    """Everything a launch takes from its shape class: the grid, the descriptor templates (q, k, v, dO), the
    one-hot columns' descriptor and the scalar and constexpr arguments."""
    grid: Tuple[int, int, int]
    tiles: Tuple["TensorDescriptor", ...]
    one_hot: "TensorDescriptor"
    scalars: dict  # never mutated: each call copies it into its own argument dict


# bounded cache: LAUNCH_CLASS_CACHE_SIZE shape classes (least recently used dropped), keys and values small
@functools.lru_cache(maxsize=LAUNCH_CLASS_CACHE_SIZE)
def _launch_class(shapes, strides, sink_stride: Optional[int], mask: Tuple[bool, bool], alpha: float,
                  cfg: DqConfig, device: int, dtype, count_partial: bool = False,
                  partial: bool = False) -> _LaunchClass:
    """The ``_LaunchClass`` of a call from what it depends on (``_class_key``): the (q, k) shapes, the (q, k, v, dO,
    O, LSE, dq) strides, the sink's stride (None: no sink), (causal, bottom-right), α, the config, the device, the
    dtype, whether shard rows are counted, whether it is a ring's row pass (``triton_launch.Launch.partial``)."""
    causal, bottom_right = mask
    q_shape, k_shape = shapes
    q_strides, k_strides, v_strides, do_strides, o_strides, lse_strides, dq_strides = strides
    B, H, SQ, _ = q_shape
    HKV, SK = k_shape[1], k_shape[2]
    tiles = (tile_template(q_shape, q_strides, dtype, ROWS_PER_WG),
             tile_template(k_shape, k_strides, dtype, cfg.block_n),
             tile_template(k_shape, v_strides, dtype, cfg.block_n),
             tile_template(q_shape, do_strides, dtype, ROWS_PER_WG))
    gdtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    rel_tol, abs_tol = shard_mass_tolerance(dtype, SK)
    layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, ROWSUM_WIDTH], gdtype)
    one_hot = TensorDescriptor(_one_hot(device, dtype, cfg.block_n), [2 * cfg.block_n, ROWSUM_WIDTH],
                               [ROWSUM_WIDTH, 1], [cfg.block_n, ROWSUM_WIDTH], layout)
    scalars = dict(so_b=o_strides[0], so_h=o_strides[1], so_s=o_strides[2], so_d=o_strides[3], PARTIAL=partial,
                   sl_b=lse_strides[0], sl_h=lse_strides[1], sl_s=lse_strides[2],
                   ssink=0 if sink_stride is None else sink_stride,
                   sdq_b=dq_strides[0], sdq_h=dq_strides[1], sdq_s=dq_strides[2], sdq_d=dq_strides[3],
                   H=H, GROUP=H // HKV, SQ=SQ, SK=SK, shift=SK - SQ if (causal and bottom_right) else 0,
                   scale=alpha, scale_log2=alpha * LOG2_E, mass_rel_tol=rel_tol, mass_abs_tol=abs_tol,
                   CAUSAL=causal, HAS_SINK=sink_stride is not None, COUNT_PARTIAL=count_partial,
                   NUM_STAGES=cfg.num_stages, OVERLAP=cfg.overlap)
    return _LaunchClass(grid=(triton.cdiv(SQ, ROWS_PER_CTA), H, B), tiles=tiles, one_hot=one_hot,
                        scalars=scalars)


def _class_key(job, cfg: DqConfig) -> tuple:
    """What the launch of ``job`` takes from its shape class (``_launch_class``'s arguments). Refuses a job
    ``dq_major_reason`` would have refused (ValueError)."""
    left, right = job.window
    if left >= 0 or right > 0 or job.varlen or not job.correct or job.softcap > 0:
        raise ValueError("launch_dq: a window, varlen, softcap or uncorrected job (dq_major_reason)")
    q, k = job.q, job.k
    strides = (q.stride(), k.stride(), job.v.stride(), job.do.stride(), job.o.stride(), job.lse.stride(),
               job.dq.stride())
    return ((q.shape, k.shape), strides, None if job.sink is None else job.sink.stride(0),
            (right == 0, job.bottom_right), job.alpha, cfg, q.device.index, q.dtype, job.partial_rows is not None,
            job.partial)


def _slot_values(job, cls: _LaunchClass, scratch) -> dict:
    """The call's own arguments: its tensors bound into the class's descriptor templates, its pointers."""
    tq, tk, tv, tdo = cls.tiles
    return {"q_desc": bound_descriptor(tq, job.q), "k_desc": bound_descriptor(tk, job.k),
            "v_desc": bound_descriptor(tv, job.v), "do_desc": bound_descriptor(tdo, job.do), "e_desc": cls.one_hot,
            "O": job.o, "LSE": job.lse, "SINK": job.sink if job.sink is not None else scratch.delta, "DQ": job.dq,
            "Delta": scratch.delta, "LSE2": scratch.lse2, "LAM": scratch.lam, "TGT": scratch.target,
            "PARTIAL_ROWS": job.partial_rows if job.partial_rows is not None else scratch.delta}


def dq_arguments(job, scratch, cfg: DqConfig) -> dict:
    """The keyword arguments of ``gluon_dq_kernels._dq_kernel`` (constexprs included) for ``job`` (a
    ``triton_launch.Launch`` that ``dq_major_reason`` accepted) and its ``triton_launch.Scratch``."""
    cls = _launch_class(*_class_key(job, cfg))
    return {**_slot_values(job, cls, scratch), **cls.scalars}


def launch_dq(job, scratch, config: Optional[DqConfig] = None):
    """The dQ-major launch of ``job`` (``dq_arguments``): dq, and D, LSE2, λ (T with a sink) in ``scratch``.
    Returns the compiled kernel. A shape class launched before replays its prepared launch (``launch_cache``)."""
    cfg = config or gluon_dq_config(job.q.shape[-1])
    key = _class_key(job, cfg)
    cls = _launch_class(*key)
    fn = _gq._dq_kernel

    def slots() -> dict:
        return _slot_values(job, cls, scratch)

    def arguments() -> dict:
        return {**slots(), **cls.scalars, "num_warps": gluon_bwd.NUM_WARPS, "maxnreg": gluon_bwd.MAXNREG}

    return PREPARED.launch(fn, ("gluon_dq", id(fn)) + key, cls.grid, job.q.device.index, slots, arguments)


def checked_kernels(q, k, v, do, mask, varlen, options) -> Tuple[str, str]:
    """The (dQ-major, KV-major) kernels of an explicit ``gproj_backward`` call from its ``KernelOptions``: "tl"
    unless "gluon" is asked for (None and "tl" are the portable kernels); "gluon" where that launch's predicate
    (``dq_major_reason``, ``gluon_bwd.kv_major_reason``) allows it, ValueError otherwise. No speed preference
    here: choosing per call is the plan's (``plan.dq_major_choice``, ``plan.kv_major_choice``)."""
    asked = {"dq_major": options.dq_major, "kv_major": options.kv_major}
    for name, kernel in asked.items():
        if kernel not in ("tl", "gluon", None):
            raise ValueError(f"{name} must be one of ('tl', 'gluon') or None, got {kernel!r}")
    same_do = do if do.dtype == q.dtype else None
    is_varlen = varlen.cu_seqlens_q is not None or varlen.cu_seqlens_k is not None
    reasons = {}
    if asked["dq_major"] == "gluon":
        reasons["dq_major"] = dq_major_reason(q, k, v, do=same_do, window=mask.window, softcap=mask.softcap,
                                              varlen=is_varlen, correct=options.correct)
    if asked["kv_major"] == "gluon":
        reasons["kv_major"] = gluon_bwd.kv_major_reason(q, k, v, do=same_do, window=mask.window,
                                                        softcap=mask.softcap, varlen=is_varlen,
                                                        correct=options.correct, dk_form=options.dk_form)
    for name, reason in reasons.items():
        if reason is not None:
            raise ValueError(f"{name}='gluon' cannot run these inputs: {reason}")
    return tuple("gluon" if asked[n] == "gluon" else "tl" for n in ("dq_major", "kv_major"))
