"""Counters of backward calls per tier and of fallback reasons; each reason is logged once per shape class.

``stats()`` returns ``{"gproj": n, "fp32": n, "original": n, "forward": {...}, "fallback_reasons": {reason: n}}``.
A *fallback* is any call that did not run the GProj kernel in a mode that asked for it, or that kept the
original path although the patch was on (e.g. an attention mask that requires grad); its reason is counted
every time and logged through ``logging.getLogger("gproj_patch")`` the first time a (reason, shape class) pair
is seen. The shape class is (source, device type, dtype, head dim, GQA or not): coarse on purpose.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Optional, Tuple

logger = logging.getLogger("gproj_patch")

TIERS = ("gproj", "fp32", "original")

_lock = threading.Lock()
_backward = Counter()
_forward = Counter()
_reasons = Counter()
_logged = set()


def shape_class(source: str, q=None, k=None) -> Tuple:
    if q is None:
        return (source,)
    gqa = k is not None and k.dim() == q.dim() and k.shape[-3] != q.shape[-3]
    return (source, q.device.type, str(q.dtype).replace("torch.", ""), int(q.shape[-1]), "gqa" if gqa else "mha")


def _note_reason(reason: str, cls: Tuple, tier: str) -> None:
    _reasons[reason] += 1
    key = (reason, cls)
    if key not in _logged:
        _logged.add(key)
        logger.warning("gproj_patch: %s -> %s tier for %s (logged once per reason and shape class)",
                       reason, tier, "/".join(map(str, cls)))


def record_backward(tier: str, reason: Optional[str] = None, cls: Tuple = ()) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}")
    with _lock:
        _backward[tier] += 1
        if reason:
            _note_reason(reason, cls, tier)


def record_forward(path: str, reason: Optional[str] = None, cls: Tuple = ()) -> None:
    """A forward call that went through a hook: ``path`` is "patched" or "original"."""
    with _lock:
        _forward[path] += 1
        if reason:
            _note_reason(reason, cls, "original" if path == "original" else path)


def stats() -> dict:
    with _lock:
        out = {t: _backward.get(t, 0) for t in TIERS}
        out["forward"] = dict(_forward)
        out["fallback_reasons"] = dict(_reasons)
        return out


def reset() -> None:
    """Zero every counter and forget which reasons were logged."""
    with _lock:
        _backward.clear()
        _forward.clear()
        _reasons.clear()
        _logged.clear()
