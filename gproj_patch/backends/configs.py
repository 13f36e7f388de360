"""The kernels' tile configs, and the gates that choose among them: one table per launch and kernel, each with
what was tuned and why, then the functions that pick a call's entry.

Read top-down:

1. The padded head dim (``block_d``): every tl kernel tile is a power of two wide, from ``MIN_BLOCK_D`` to
   ``block_d(MAX_HEAD_DIM)``; the tl tables are keyed by it.
2. The tl kernels (``triton_kernels._bwd_dq`` and ``_bwd_dkdv``): ``TL_CONFIGS`` for bf16/fp16, ``TL_CONFIGS_FP32``
   for the FP32 tier's fp32 inputs (with ``FP32_DOT_PRECISION``'s products), ``INTERP_CONFIG`` under Triton's
   interpreter. Gates: ``block_config`` (a table's entry, or the nearest tuned one), ``launch_configs`` (a call's
   pair), ``dot_precision``.
3. The Gluon sm_90a kernels (``gluon_bwd``'s KV-major, ``gluon_dq``'s dQ-major): the ``KernelConfig`` and
   ``DqConfig`` records, ``GLUON_KV_CONFIGS`` and ``GLUON_DQ_CONFIGS`` (one entry per head dim of
   ``GLUON_HEAD_DIMS``, the head dims the kernels are built for), and where each was measured faster than the tl
   launch (``GLUON_KV_FASTER_HEAD_DIMS``, ``GLUON_DQ_FASTER_HEAD_DIMS``). Gates: ``gluon_kv_config``,
   ``gluon_dq_config``, ``gluon_measured_faster``.

Whether a kernel can run a call at all (dtype, mask, strides, the device) is its module's predicate
(``triton_bwd.kernel_unsupported_reason``, ``gluon_bwd.kv_major_reason``, ``gluon_dq.dq_major_reason``); this
module only says which tiles a call gets and, where both kernels can run it, which one is faster. Pure data and
pure functions: no device query, no environment, no triton import (``tests/kernels/test_configs.py`` pins every
choice and checks every entry against the kernels' constraints). The timings behind the tables are in
BENCHMARKS.md and benchmarks/NOTES.md; the sweeps that produce them are ``python -m benchmarks.kernel --sweep``
(tl), ``--fp32-sweep`` (tl, fp32) and ``python -m benchmarks.gluon`` (Gluon).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

# ---- the padded head dim ---------------------------------------------------------------------------------------

#: smallest padded head dim the kernels use (tl.dot needs an inner dimension of at least 16)
MIN_BLOCK_D = 16
#: largest head dim the kernels take
MAX_HEAD_DIM = 256


def block_d(head_dim: int) -> int:
    """The padded head dim of a kernel tile: the next power of two, at least MIN_BLOCK_D."""
    return max(MIN_BLOCK_D, 1 << (head_dim - 1).bit_length())


# ---- the tl kernels --------------------------------------------------------------------------------------------

#: one tl launch's config: (BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M: query rows of a program's tile,
#: BLOCK_N: keys of one (both powers of two, at least 16: ``tl.arange`` and ``tl.dot``)
TlConfig = Tuple[int, int, int, int]
#: the two tl launches, as the tables key them: the dQ-major kernel and the KV-major one
TL_KINDS = ("dq", "dkdv")

#: bf16/fp16 configs per padded head dim, from greedy sweeps on the H200 (``python -m benchmarks.kernel --sweep``;
#: benchmarks/NOTES.md). 128's dq: two warpgroups and three stages (2.248 against 2.290 ms for the whole backward
#: at 4·16·4096·128 causal, 0 B spilled against 16); 128's dkdv: a third stage (2.169 against 2.260 ms, same shape,
#: no spills). 32 and 256 have configs of their own (at 4·16·4096·32 causal ×1.14 faster than the 64 config; at
#: 2·16·4096·256 causal ×1.36 faster than the first guess, dkdv without spills). 16 takes the 32 config.
TL_CONFIGS = {
    "dq": {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 32, 4, 3), 128: (128, 64, 8, 3), 256: (64, 64, 8, 1)},
    "dkdv": {16: (32, 128, 4, 3), 32: (32, 128, 4, 3), 64: (64, 64, 4, 3), 128: (32, 64, 4, 3),
             256: (32, 32, 4, 1)},
}
#: fp32-input configs (the FP32 tier's kernel form, ``FP32_DOT_PRECISION``'s products): 64 and 128 from a sweep at
#: 1·16·4096·D causal ((64, 32) best of four for both kernels at both: 3.55 and 12.6 ms, against 13.8 and 33.9 for
#: the best IEEE configs, ``python -m benchmarks.kernel --fp32-sweep``); 256 not swept (small tiles: fp32 operands
#: fill the registers); 16 and 32 take 64's
TL_CONFIGS_FP32 = {
    "dq": {16: (64, 32, 4, 2), 32: (64, 32, 4, 2), 64: (64, 32, 4, 2), 128: (64, 32, 4, 2), 256: (16, 16, 4, 1)},
    "dkdv": {16: (64, 32, 4, 2), 32: (64, 32, 4, 2), 64: (64, 32, 4, 2), 128: (64, 32, 4, 2), 256: (16, 16, 4, 1)},
}
#: tile rows and keys under Triton's interpreter (CPU tensors): the smallest tile ``tl.dot`` takes, for speed;
#: warps and stages mean nothing there
INTERP_BLOCK = 16
INTERP_CONFIG: TlConfig = (INTERP_BLOCK, INTERP_BLOCK, 4, 1)
#: ``tl.dot`` input precision of fp32 inputs (the FP32 tier's kernel form): "tf32x3", each operand split into a
#: TF32 head and tail and three tensor-core products summed in fp32 (≈ 2^-21 relative per product, fp32-level);
#: Triton's "ieee" runs on the FMA units at ~10 TFLOP/s on the H200, slower than cuBLAS's fp32 GEMMs of the
#: chunked tier. Under the interpreter every precision is plain fp32.
FP32_DOT_PRECISION = "tf32x3"
#: ``tl.dot`` input precision of bf16/fp16 inputs: Triton's default (irrelevant for bf16/fp16 operands)
LOW_DOT_PRECISION = "tf32"


def block_config(kind: str, block_d: int, fp32: bool = False) -> TlConfig:
    """The config of tl kernel ``kind`` ("dq" | "dkdv") for a padded head dim (``TL_CONFIGS``, or
    ``TL_CONFIGS_FP32`` for fp32 inputs).

    Its own entry when there is one; otherwise the nearest tuned config by the rule "the smallest tuned block_d
    above, else the largest tuned": tiles sized for a wider head need at least the registers and shared memory
    this one does, so they fit; never a KeyError."""
    table = (TL_CONFIGS_FP32 if fp32 else TL_CONFIGS)[kind]
    if block_d in table:
        return table[block_d]
    wider = [d for d in table if d > block_d]
    return table[min(wider)] if wider else table[max(table)]


def launch_configs(head_dim: int, dtype: torch.dtype, interpret: bool,
                   config: Optional[dict] = None) -> Tuple[TlConfig, TlConfig]:
    """(dQ-major, KV-major) configs of a tl launch: ``config``'s ({"dq"|"dkdv": ...}, tests and benchmarks) where
    given, else ``block_config``'s; ``INTERP_CONFIG`` under the interpreter."""
    if interpret:
        return INTERP_CONFIG, INTERP_CONFIG
    cfg, bd, fp32 = config or {}, block_d(head_dim), dtype == torch.float32
    return cfg.get("dq") or block_config("dq", bd, fp32), cfg.get("dkdv") or block_config("dkdv", bd, fp32)


def dot_precision(dtype: torch.dtype) -> str:
    """The tl kernels' ``tl.dot`` input precision for inputs of ``dtype``."""
    return FP32_DOT_PRECISION if dtype == torch.float32 else LOW_DOT_PRECISION


# ---- the Gluon kernels -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelConfig:
    """The Gluon KV-major launch's config: query rows of one streamed Q/dO tile, the depth of the TMA ring, and how
    the consumers hand slots back: one slot every tile, or (``release_pairs``) two slots every second tile — half
    the mbarrier arrives and the warpgroup syncs Gluon puts around each; needs an even ring of at least 4 slots.
    ``retire_tiles``: each tile's dk, dv products retired within the tile (tile 0 peeled to start the
    accumulators, dPᵀ − D − λ formed before Pᵀ) — at D=128 with 64-row tiles ptxas otherwise serializes every wgmma
    for want of registers (info C7512, silent in Triton 3.6; ``tests/helpers/kernel_build.wgmma_serialized``). Same
    numerics either way (the same products in the same order: bitwise equal results)."""
    block_m: int
    num_stages: int
    release_pairs: bool = False
    retire_tiles: bool = False

    def __post_init__(self):
        if self.release_pairs and (self.num_stages % 2 != 0 or self.num_stages < 4):
            raise ValueError(f"release_pairs needs an even ring of at least 4 slots, got {self.num_stages}")


@dataclass(frozen=True)
class DqConfig:
    """The Gluon dQ-major launch's config: keys of one streamed K/V tile, the depth of the TMA ring, and
    ``overlap``: each consumer's exp2 under its own dP product and dS under its r products
    (``gluon_dq_kernels._tile``; the same numerics)."""
    block_n: int
    num_stages: int
    overlap: bool = False


#: head dims both Gluon kernels are built for (each has an entry in both Gluon tables)
GLUON_HEAD_DIMS = (64, 128)
#: KV-major, per head dim, spill-free on sm_90a (Triton 3.6's ptxas, ``python -m benchmarks.ptx --gluon``), each
#: tile's products retired within it (unserialized wgmma). D=128: KV launch ×0.853–0.864 of the 64-row, 2-slot
#: kernel without it at four D=128 shapes on the H200, bitwise equal results. D=64: 128-row tiles, a 3-slot ring,
#: ×0.876–0.894 of the tl launch (the 64-row 2-slot build without retired tiles, whose wgmmas ptxas serializes, was
#: ×1.16–1.18)
GLUON_KV_CONFIGS = {64: KernelConfig(128, 3, retire_tiles=True), 128: KernelConfig(64, 2, retire_tiles=True)}
#: dQ-major, per head dim, timed on the H200 against 64/32-key tiles and 2/3-slot rings (``python -m
#: benchmarks.gluon --launch dq``). ``overlap``: ×0.92 of the plain build at 4K causal and 8K full, ×0.95–1.0 at 16K
#: and GQA, bitwise the same. The D=128 build spills (an 80-byte stack frame with ``overlap``, 128–144 without:
#: Σ t·K and Σ r·K hold 128 registers); a 32-key tile spills nothing and was slower
GLUON_DQ_CONFIGS = {64: DqConfig(64, 2, overlap=True), 128: DqConfig(64, 2, overlap=True)}
#: head dims where the Gluon KV-major launch is the default: faster than the tl KV-major kernel on the H200 at every
#: shape timed with ``GLUON_KV_CONFIGS`` (D=128 ×0.82–0.91 of the tl launch; D=64 with 128-row retired tiles ×0.894
#: causal, ×0.876 full — its 64-row build without them was ×1.16–1.18)
GLUON_KV_FASTER_HEAD_DIMS = (64, 128)
#: head dims where the Gluon dQ-major launch is the default: faster than the tl dQ-major launch at every shape timed
#: on the H200 (D=128: the launch alone ×0.86–0.95 with ``overlap``; the routing's backward ×0.96–0.99 of the tl-dQ
#: one with the plain build, ×0.93–0.95 with ``overlap``). D=64 is not shown to be: the launch alone ×0.98, the
#: backward +2% (plain build)
GLUON_DQ_FASTER_HEAD_DIMS = (128,)
#: the Gluon launches by their kernel option's name ("kv_major" | "dq_major")
GLUON_LAUNCHES = ("kv_major", "dq_major")


def gluon_kv_config(head_dim: int) -> KernelConfig:
    """The Gluon KV-major launch's config for ``head_dim`` (one of ``GLUON_HEAD_DIMS``: KeyError otherwise, which
    ``gluon_bwd.kv_major_reason`` refuses first)."""
    return GLUON_KV_CONFIGS[head_dim]


def gluon_dq_config(head_dim: int) -> DqConfig:
    """The Gluon dQ-major launch's config for ``head_dim`` (one of ``GLUON_HEAD_DIMS``: KeyError otherwise, which
    ``gluon_dq.dq_major_reason`` refuses first)."""
    return GLUON_DQ_CONFIGS[head_dim]


def gluon_measured_faster(launch: str, head_dim: int) -> bool:
    """Whether the Gluon kernel of ``launch`` ("kv_major" | "dq_major") was measured faster than the tl kernel at
    ``head_dim``: where it was not, the tl kernel runs a call even where Gluon could (``plan.kv_major_choice``,
    ``plan.dq_major_choice``)."""
    if launch not in GLUON_LAUNCHES:
        raise ValueError(f"launch must be one of {GLUON_LAUNCHES}, got {launch!r}")
    return head_dim in (GLUON_KV_FASTER_HEAD_DIMS if launch == "kv_major" else GLUON_DQ_FASTER_HEAD_DIMS)
