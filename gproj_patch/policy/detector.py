"""Large-key regime detector: cheap statistics of one attention call, computed from tensors the backward has.

Why these statistics (docs/math.md §3). A fused low-precision backward multiplies t = low(dS) instead of dS;
the row sums ρ_i = Σ_j t_ij are no longer zero, so α·ρ_i·μ_k leaks into dq (μ_k: the mean key). The true dq
only sees the keys' *deviation* from their mean, so the relative leak grows with

    R_k = ‖mean key‖ / key spread,        spread = RMS over keys of ‖k_j − mean key‖   (per (batch, KV head))

and is predicted as ``2·u·R_k`` (u = 2⁻⁸ BF16, 2⁻¹¹ FP16; ``spec.unit_roundoff``). The same ratio for the
queries, R_q, drives the *non-gauge* channel: a large common query offset enters dk legitimately, and the row
projection of GProj does not remove the column errors of t, so GProj's dk error is predicted as ``2·u·R_q``.

Reported per (batch, head) — key statistics per KV head, query and LSE statistics per query head:

``r_k``, ``r_q``
    the offset ratios above.
``leak_dq`` = 2·u·r_k, ``leak_dk`` = 2·u·r_q
    predicted relative gradient errors of an uncorrected low-precision backward (dq) and of GProj (dk).
``logit_bound`` = scale · max_i ‖q_i‖₂ · max_j ‖k_j‖₂
    a Cauchy–Schwarz bound on |s_ij|: large values mean exp() is steep and scores are far apart.
``lse_gap`` = mean_i (LSE_i − scale·q_i·k̄)   (nats; k̄ = mean key)
    the LSE minus the mean score of the row. By Jensen it is ≥ log(#visible keys) for every row; it equals
    log(Sk) for uniform dense attention and grows as attention sharpens. Compare with ``log(Sk)``.
``p_sink`` = mean_i exp(scale·q_i·k_0 − LSE_i)
    the exact attention weight on key 0, averaged over rows: a lower bound of p_max at the usual sink
    position (BOS). Near 1 means a sink, where the true dq is small and the relative leak is amplified by
    roughly 1/(1 − p_sink). (Key 0 is visible from every row under both causal alignments; with a sliding
    window it may not be, and this over-estimates.)

Rows whose LSE is −inf (they see no key) are excluded from the row averages.

Cost. The statistics read at most ``max_rows`` evenly strided rows of q and k per (batch, head) (all rows when
S ≤ max_rows, the default 256), so the work is O(B·H·max_rows·D) — independent of the sequence length, against
the backward's O(B·H·Sq·Sk·D). Sampled rows give statistical estimates of the means and spreads (relative error
~1/sqrt(max_rows·D) on the spread); in the large-key regime the offset dominates and the estimate is tight.
On CUDA, ``compute`` is two Triton launches (``backends/detector_kernel.py``: one program per (batch, query
head) reading the sampled rows of q, k and the LSE in place, then a one-program reduction to the summary
values) and one non-blocking copy of those 7 values into pinned host memory; ``summary()`` waits for that copy's
CUDA event only, not for the device. H200 (B=2, H=16, S=4096, D=128, BF16; ``python -m benchmarks.auto``
measures it): 0.023 ms of GPU time (3 % of the 0.76 ms causal cuDNN backward), 0.16 ms wall per sampled
call, most of it Triton's Python launch path; the path it replaces (gathers + a CUDA graph of ~40 torch kernels +
``.tolist()``) took 0.28 ms wall.
Inputs the kernel does not take (``detector_kernel_supported``: head dim > 256, no Triton, ...) and CPU tensors
use the torch arithmetic ``_statistics`` on gathered rows (replayed as a CUDA graph on CUDA, option
``detector_graph``); there ``summary()`` is one blocking transfer.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from ..backends.spec import normalize_lse, unit_roundoff
from ..runtime.state import STATE

DEFAULT_MAX_ROWS = 256
_log = logging.getLogger("gproj_patch")
_TINY = 1e-30

#: Names of the per-call summary values, in the order ``summary()`` returns them.
SUMMARY_KEYS = ("r_k", "r_q", "leak_dq", "leak_dk", "logit_bound", "lse_gap", "p_sink", "log_sk")


@dataclass
class AttentionStats:
    """Per-(batch, head) statistics of one attention call (fp32 tensors on the input's device)."""

    r_k: torch.Tensor          # (B, Hkv)
    r_q: torch.Tensor          # (B, Hq)
    leak_dq: torch.Tensor      # (B, Hkv)   2·u·r_k
    leak_dk: torch.Tensor      # (B, Hq)    2·u·r_q
    logit_bound: torch.Tensor  # (B, Hq)
    lse_gap: torch.Tensor      # (B, Hq)    nats
    p_sink: torch.Tensor       # (B, Hq)
    u: float
    sk: int
    worst: Optional[torch.Tensor] = None  # the summary values (SUMMARY_KEYS[:7]) already reduced on the device
    host: Optional[torch.Tensor] = None   # kernel path: ``worst`` being copied (non-blocking) into pinned memory
    ready: Optional[Any] = None           # ... and the CUDA event recorded after that copy

    def summary(self) -> Dict[str, float]:
        """Worst case (max) over (batch, head) of every statistic, except ``lse_gap`` (mean over heads). Waits for
        the pinned copy's event (kernel path) or makes one blocking transfer."""
        if self.ready is not None:
            self.ready.synchronize()
            vals = self.host.tolist()
        else:
            worst = self.worst if self.worst is not None else _worst(
                self.r_k, self.r_q, self.leak_dq, self.leak_dk, self.logit_bound, self.lse_gap, self.p_sink)
            vals = worst.tolist()
        out = dict(zip(SUMMARY_KEYS, vals))
        out["log_sk"] = math.log(self.sk)
        return out


def _worst(r_k, r_q, leak_dq, leak_dk, logit_bound, lse_gap, p_sink) -> torch.Tensor:
    return torch.stack([r_k.max(), r_q.max(), leak_dq.max(), leak_dk.max(), logit_bound.max(),
                        _nanmean(lse_gap), _nanmax(p_sink)])


def _nanmean(x: torch.Tensor) -> torch.Tensor:
    return torch.nanmean(x) if x.numel() else x.new_zeros(())


def _nanmax(x: torch.Tensor) -> torch.Tensor:
    x = torch.nan_to_num(x, nan=0.0)
    return x.max() if x.numel() else x.new_zeros(())


ROW_INDEX_CACHE_SIZE = 256
#: bounded cache: at most ROW_INDEX_CACHE_SIZE index tensors, one per (S, max_rows, device); emptied when full
_ROW_INDEX: Dict[tuple, torch.Tensor] = {}


def _row_index(s: int, max_rows: Optional[int], device) -> Optional[torch.Tensor]:
    """Evenly strided row indices (first and last included), cached per (S, max_rows, device)."""
    if max_rows is None or s <= max_rows:
        return None
    key = (s, max_rows, str(device))
    idx = _ROW_INDEX.get(key)
    if idx is None:
        if len(_ROW_INDEX) >= ROW_INDEX_CACHE_SIZE:
            _ROW_INDEX.clear()
        idx = _ROW_INDEX[key] = torch.linspace(0, s - 1, max_rows, device=device).round().long()
    return idx


def offset_ratio(x: torch.Tensor) -> tuple:
    """(mean over dim 2, ‖mean‖ / RMS‖x − mean‖) of a (B, H, S, D) fp32 tensor; two-pass, no cancellation.
    A constant set (spread 0) with a nonzero mean gives a huge finite ratio (‖mean‖ / 1e-30)."""
    mean = x.mean(dim=2)                                                               # (B, H, D)
    spread = torch.linalg.vector_norm(x - mean.unsqueeze(2), dim=(-2, -1)) * x.shape[2] ** -0.5  # (B, H)
    return mean, torch.linalg.vector_norm(mean, dim=-1) / spread.clamp_min(_TINY)


def _statistics(qs: torch.Tensor, ks: torch.Tensor, k0: torch.Tensor, lse_s: Optional[torch.Tensor],
                alpha: float, group: int, u: float):
    """The arithmetic of ``compute`` on already-sampled rows: a pure tensor function (replayed as a CUDA graph on CUDA).

    qs (B, Hq, rq, D), ks (B, Hkv, rk, D), k0 (B, Hkv, D) any float dtype; lse_s (B, Hq, rq) or None (the LSE
    statistics are then NaN). Returns (r_k, r_q, leak_dq, leak_dk, logit_bound, lse_gap, p_sink, worst)."""
    qs, ks = qs.float(), ks.float()
    kmean, r_k = offset_ratio(ks)
    _, r_q = offset_ratio(qs)
    qmax = torch.linalg.vector_norm(qs, dim=-1).amax(-1)   # (B, Hq)
    kmax = torch.linalg.vector_norm(ks, dim=-1).amax(-1)   # (B, Hkv)
    if group > 1:
        kmax = kmax.repeat_interleave(group, dim=1)
    logit_bound = qmax * kmax * alpha
    if lse_s is None:
        lse_gap = torch.full_like(logit_bound, float("nan"))
        p_sink = torch.full_like(logit_bound, float("nan"))
    else:
        lse_s = lse_s.float()
        refs = torch.stack([kmean, k0.float()], dim=2)                              # (B, Hkv, 2, D)
        if group > 1:
            refs = refs.repeat_interleave(group, dim=1)
        scores = torch.matmul(qs, refs.transpose(-1, -2)) * alpha                   # (B, Hq, rq, 2)
        dead = ~torch.isfinite(lse_s)
        lse_gap = (lse_s - scores[..., 0]).masked_fill(dead, float("nan")).nanmean(-1)
        p_sink = torch.exp((scores[..., 1] - lse_s).clamp_max(0.0)).masked_fill(dead, float("nan")).nanmean(-1)
    leak_dq, leak_dk = 2 * u * r_k, 2 * u * r_q
    worst = _worst(r_k, r_q, leak_dq, leak_dk, logit_bound, lse_gap, p_sink)
    return r_k, r_q, leak_dq, leak_dk, logit_bound, lse_gap, p_sink, worst


# The CUDA fallback (inputs the Triton kernel does not take, or after it failed). The ~40 small kernels of
# ``_statistics`` cost more in launches than in work. Measured on the H200 (B·H = 32, D = 128): eager 1.26 ms a call,
# torch.compile 0.58 ms, one replay of a CUDA graph of the same arithmetic 0.24 ms (copies and the one transfer
# included), against a 0.84 ms attention backward. The sampled shapes are fixed (max_rows), so one graph per input
# signature is captured and replayed.
# The option detector_graph (GPROJ_DETECTOR_GRAPH=0) opts out; a failed capture falls back to eager for good (logged once).
_GRAPH_CACHE_SIZE = 16


class _GraphedStatistics:
    """A CUDA graph of ``_statistics`` on static input buffers; its outputs packed into one buffer."""

    def __init__(self, inputs, consts):
        self.inputs = [t.detach().clone() if t is not None else None for t in inputs]
        self.lock = threading.Lock()
        side = torch.cuda.Stream(device=self.inputs[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture (allocator, lazy init)
                _statistics(*self.inputs, *consts)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            outs = _statistics(*self.inputs, *consts)
            self.packed = torch.cat([o.reshape(-1) for o in outs])
        self.shapes = [o.shape for o in outs]

    def __call__(self, inputs):
        with self.lock:
            for static, t in zip(self.inputs, inputs):
                if static is not None:
                    static.copy_(t)
            self.graph.replay()
            flat = self.packed.clone()
        return tuple(part.view(shape) for part, shape in
                     zip(flat.split([int(torch.Size(sh).numel()) for sh in self.shapes]), self.shapes))


#: bounded cache: at most _GRAPH_CACHE_SIZE captured graphs, one per input signature; emptied when full
_GRAPHS: Dict[tuple, "_GraphedStatistics"] = {}


def _run_statistics(inputs, consts, use_graph: bool = True):
    first = inputs[0]
    if (not use_graph or first.device.type != "cuda" or STATE.detector_graph_failed
            or torch.cuda.is_current_stream_capturing()):
        return _statistics(*inputs, *consts)
    key = tuple((tuple(t.shape), t.dtype) if t is not None else None for t in inputs) + (first.device, consts)
    graphed = _GRAPHS.get(key)
    if graphed is None:
        try:
            graphed = _GraphedStatistics(inputs, consts)
        except Exception as exc:
            STATE.detector_graph_failed = True
            _log.warning("capturing the detector as a CUDA graph failed (%s: %s); it runs eagerly",
                         type(exc).__name__, exc)
            return _statistics(*inputs, *consts)
        if len(_GRAPHS) >= _GRAPH_CACHE_SIZE:
            _GRAPHS.clear()
        _GRAPHS[key] = graphed
    return graphed(inputs)


_MAX_LOGGED_REASONS = 64  # reasons name shapes: stop logging new ones past this many


def _kernel_statistics(q, k, lse, qidx, kidx, alpha: float, u: float) -> Optional[AttentionStats]:
    """The CUDA path: ``backends/detector_kernel.py`` (two launches), then the 7 summary values copied without
    blocking into pinned memory, with an event to wait on. None when the kernel does not take these inputs (the
    reason logged once) or has failed before (then the caller's torch path runs)."""
    from ..backends.detector_kernel import detector_kernel_supported, launch_head_statistics
    supported, reason = detector_kernel_supported(q, k, lse)
    if not supported:
        logged = STATE.detector_logged
        if reason not in logged and len(logged) < _MAX_LOGGED_REASONS:
            logged.add(reason)
            _log.info("the detector's Triton kernel does not take these inputs (%s): torch arithmetic", reason)
        return None
    if STATE.detector_kernel_failed:
        return None
    with torch.cuda.device(q.device):
        try:
            out = launch_head_statistics(q, k, lse, scale=alpha, u=u, q_index=qidx, k_index=kidx)
        except Exception as exc:  # e.g. a compiler failure on this GPU: the torch path from now on, said once
            STATE.detector_kernel_failed = True
            _log.warning("the detector's Triton kernel failed (%s: %s); it runs as torch arithmetic",
                         type(exc).__name__, exc)
            return None
        host = ready = None
        if not torch.cuda.is_current_stream_capturing():
            host = torch.empty(out.worst.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(out.worst, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
    return AttentionStats(r_k=out.r_k, r_q=out.r_q, leak_dq=out.leak_dq, leak_dk=out.leak_dk,
                          logit_bound=out.logit_bound, lse_gap=out.lse_gap, p_sink=out.p_sink, u=u,
                          sk=k.shape[2], worst=out.worst, host=host, ready=ready)


def compute(q: torch.Tensor, k: torch.Tensor, lse: Optional[torch.Tensor], scale: Optional[float] = None, *,
            dtype: Optional[torch.dtype] = None, max_rows: Optional[int] = DEFAULT_MAX_ROWS,
            use_graph: bool = True) -> AttentionStats:
    """Statistics of one call. q (B, Hq, Sq, D), k (B, Hkv, Sk, D), lse (B, Hq, Sq) natural log (or any layout
    ``spec.normalize_lse`` reads; None skips the LSE statistics). ``dtype`` selects u (default q.dtype).
    On CUDA the Triton kernel where ``detector_kernel_supported``; otherwise the torch arithmetic, where
    ``use_graph`` replays it as a captured CUDA graph on CUDA (option ``detector_graph``)."""
    with torch.no_grad():
        B, Hq, Sq, D = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        alpha = D ** -0.5 if scale is None else float(scale)
        dt = q.dtype if dtype is None else dtype
        u = unit_roundoff(dt) if dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64) else 2.0 ** -8

        qidx = _row_index(Sq, max_rows, q.device)
        kidx = _row_index(Sk, max_rows, k.device)
        lse_n = None if lse is None else normalize_lse(lse, B, Hq, Sq)
        if q.device.type == "cuda":
            stats = _kernel_statistics(q, k, lse_n, qidx, kidx, alpha, u)
            if stats is not None:
                return stats
        qs = q if qidx is None else q.index_select(2, qidx)
        ks = k if kidx is None else k.index_select(2, kidx)
        lse_s = lse_n if lse_n is None or qidx is None else lse_n.index_select(2, qidx.to(lse_n.device))
        out = _run_statistics((qs, ks, k[:, :, 0, :], lse_s), (alpha, Hq // Hkv, u), use_graph)
        r_k, r_q, leak_dq, leak_dk, logit_bound, lse_gap, p_sink, worst = out
        return AttentionStats(r_k=r_k, r_q=r_q, leak_dq=leak_dq, leak_dk=leak_dk, logit_bound=logit_bound,
                              lse_gap=lse_gap, p_sink=p_sink, u=u, sk=Sk, worst=worst)
