"""Counters of backward calls per tier and of fallback reasons; each reason is logged once per shape class.

``stats()`` returns ``{"gproj": n, "fp32": n, "original": n, "forward": {...}, "fallback_reasons": {reason: n},
"kv_major": {"gluon": n, "tl": n}, "kv_major_reasons": {reason: n}, "dq_major": {...}, "dq_major_reasons": {...}}``
(the last four: which kernel ran the KV-major and the dQ-major launch of each backward that ran the GProj kernel,
and why not the Gluon one).
A *fallback* is any call that did not run the GProj kernel in a mode that asked for it, or that kept the
original path although the patch was on (e.g. an attention mask that requires grad); its reason is counted
every time and logged through ``logging.getLogger("gproj_patch")`` the first time a (reason, shape class) pair
is seen. The shape class is (source, device type, dtype, head dim, GQA or not): coarse on purpose. The line's
level says what it means to the user:

* WARNING — the patch ran a slower corrected tier than the mode asked for (the kernel cannot take a CUDA call;
  the FP32 tier runs instead);
* DEBUG — a call passed to PyTorch's own backward because it cannot be corrected exactly (dropout, a mask that
  needs a gradient, a tensor subclass, ...): PyTorch's behaviour, counted in ``stats()``, not an alarm;
* on a CPU tensor the FP32 tier is the documented backward of mode ``gproj`` (the kernel runs on CUDA, on CPU
  only in Triton's interpreter): the plan gives it no reason at all; a reason it has anyway is INFO.
"""
from __future__ import annotations

import logging
from typing import Optional, Tuple

from .config import TIERS
from .state import STATE

logger = logging.getLogger("gproj_patch")


def shape_class(source: str, q=None, k=None) -> Tuple:
    if q is None:
        return (source,)
    if getattr(q, "is_nested", False) or getattr(k, "is_nested", False):  # nested tensors have no sizes
        return (source, q.device.type, str(q.dtype).replace("torch.", ""), "nested")
    if q.dim() < 3 or (k is not None and k.dim() < 3):  # not (..., H, S, D): no head dim or head count to name
        return (source, q.device.type, str(q.dtype).replace("torch.", ""), f"{q.dim()}-D")
    gqa = k is not None and k.dim() == q.dim() and k.shape[-3] != q.shape[-3]
    return (source, q.device.type, str(q.dtype).replace("torch.", ""), int(q.shape[-1]), "gqa" if gqa else "mha")


def _log_level(tier: str, cls: Tuple) -> int:
    """DEBUG for a pass-through (tier "original"), INFO for the FP32 tier on a CPU tensor (the shape class's
    device), WARNING for the FP32 tier on a CUDA tensor (module docstring)."""
    if tier == "original":
        return logging.DEBUG
    on_cpu = len(cls) > 1 and cls[1] == "cpu"
    return logging.INFO if tier == "fp32" and on_cpu else logging.WARNING


def _note_reason(reason: str, cls: Tuple, tier: str) -> None:
    STATE.reasons[reason] += 1
    key = (reason, cls)
    if key not in STATE.logged:
        STATE.logged.add(key)
        logger.log(_log_level(tier, cls), "%s -> %s tier for %s (logged once per reason and shape class)",
                   reason, tier, "/".join(map(str, cls)))


def note_reason(reason: str, cls: Tuple = ()) -> None:
    """Count (and log once per shape class) a reason that is not itself a tier choice."""
    with STATE.lock:
        STATE.reasons[reason] += 1
        key = (reason, cls)
        if key not in STATE.logged:
            STATE.logged.add(key)
            logger.warning("%s (%s; logged once per reason and shape class)", reason, "/".join(map(str, cls)))


def record_backward(tier: str, reason: Optional[str] = None, cls: Tuple = ()) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}")
    with STATE.lock:
        STATE.backward[tier] += 1
        if reason:
            _note_reason(reason, cls, tier)


def record_pass_through(reason: str, cls: Tuple = ()) -> None:
    """A backward passed to PyTorch's own kernel because it cannot be corrected exactly (the SDPA seam): an
    "original" backward with its reason, logged once per reason and shape class at DEBUG."""
    record_backward("original", reason, cls)


def record_forward(path: str, reason: Optional[str] = None, cls: Tuple = ()) -> None:
    """A forward call that went through a hook: ``path`` is "patched" or "original"."""
    with STATE.lock:
        STATE.forward[path] += 1
        if reason:
            _note_reason(reason, cls, "original" if path == "original" else path)


def record_kernels(kernel) -> None:
    """The launches of a backward that ran the GProj kernel (the kernel tier, or the FP32 tier's kernel form on
    fp32 copies), from its ``record.KernelPlan``: each launch's kernel, "gluon" or "tl" (with why not Gluon)."""
    with STATE.lock:
        STATE.kv_major[kernel.kv_major] += 1
        if kernel.kv_major_reason:
            STATE.kv_major_reasons[kernel.kv_major_reason] += 1
        STATE.dq_major[kernel.dq_major] += 1
        if kernel.dq_major_reason:
            STATE.dq_major_reasons[kernel.dq_major_reason] += 1


#: the reason under which rows found to be shards of a row are reported (``stats()["fallback_reasons"]``)
PARTIAL_ROWS_REASON = ("rows whose keys here are a shard of the row (their probabilities sum to less than the row's "
                       "mass: a ring's per-shard backward with the merged LSE) were left unprojected")


def partial_rows_counter(device):
    """The device's counter of rows the backends found to be shards of a row (an int32 tensor of one element,
    added to on the device: no sync at the backward; read by ``stats()``), or None while a CUDA graph is being
    captured: a tensor the capture did not make an output would live in its pool untracked (cudagraph trees
    refuse that), so captured backwards are not counted (their guard applies all the same)."""
    import torch
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    key = str(device)
    counter = STATE.partial_rows.get(key)
    if counter is None:
        with STATE.lock:
            counter = STATE.partial_rows.get(key)
            if counter is None:
                counter = STATE.partial_rows[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def _partial_rows() -> int:
    """Rows counted as shards on every device so far (reads the counters: one sync per device); their reason is
    logged once, the first time they are seen."""
    total = sum(int(c.item()) for c in list(STATE.partial_rows.values()))
    if total and PARTIAL_ROWS_REASON not in STATE.logged:
        STATE.logged.add(PARTIAL_ROWS_REASON)
        logger.info("%s (%d rows so far; logged once)", PARTIAL_ROWS_REASON, total)
    return total


def stats() -> dict:
    partial = _partial_rows()
    with STATE.lock:
        out = {t: STATE.backward.get(t, 0) for t in TIERS}
        out["forward"] = dict(STATE.forward)
        out["fallback_reasons"] = dict(STATE.reasons)
        out["kv_major"] = dict(STATE.kv_major)
        out["kv_major_reasons"] = dict(STATE.kv_major_reasons)
        out["dq_major"] = dict(STATE.dq_major)
        out["dq_major_reasons"] = dict(STATE.dq_major_reasons)
        out["partial_rows"] = partial
        return out
