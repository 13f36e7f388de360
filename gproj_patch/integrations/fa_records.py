"""flash-attn forwards leave a record; the backward finds it through the LSE tensor both of them see.

flash-attn's autograd Functions save the LSE their forward op returned and hand that same tensor to the backward
op. ``remember(lse, context)`` (called by the wrapped forward) files the call's context under the LSE's storage;
``context_for(lse, source)`` (called by the backward) reads it back. An entry lives exactly as long as its LSE:
a ``weakref.finalize`` drops it when the tensor is freed (after the backward, or with the graph), so nothing of a
call outlives it. A backward whose forward was not seen (it ran before ``enable()``, or the forward op is not
one the hook wraps) gets a context made at the backward, with that reason logged once.

``FunctionProxy`` replaces a module-level function (FA4's ``_flash_attn_fwd`` / ``_flash_attn_bwd``) while
forwarding every attribute read and write to it, so code that keeps state on the function object
(FA4's ``compile_cache``) sees the original.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch

from .. import telemetry
from ..record import Context, make_context

_lock = threading.Lock()
_records: Dict[Tuple[str, int], Tuple["weakref.ref", Context]] = {}
NO_RECORD_REASON = ("flash-attn: no forward record for this backward (forward ran before enable() or through an "
                    "unwrapped op); options and layer taken at the backward")


def _key(lse: torch.Tensor) -> Tuple[str, int]:
    return (str(lse.device), lse.data_ptr())


def _drop(key) -> None:
    with _lock:
        _records.pop(key, None)


def remember(lse: Optional[torch.Tensor], source: str) -> None:
    """File the context of a forward that returned ``lse`` (nothing to file without an LSE: no backward)."""
    if not isinstance(lse, torch.Tensor) or lse.numel() == 0:
        return
    context = make_context(source)
    key = _key(lse)
    with _lock:
        _records[key] = (weakref.ref(lse), context)
    weakref.finalize(lse, _drop, key)


def context_for(lse: Optional[torch.Tensor], source: str) -> Context:
    """The context the forward of this backward recorded (else one made now, reason logged)."""
    if isinstance(lse, torch.Tensor):
        with _lock:
            entry = _records.get(_key(lse))
        if entry is not None and entry[0]() is not None:
            return entry[1]
    q_class = telemetry.shape_class(source)
    telemetry.note_reason(NO_RECORD_REASON, q_class)
    return make_context(source, layer=source)


def live_records() -> int:
    """How many forward records are alive (tests: nothing of a call outlives its backward)."""
    with _lock:
        return len(_records)


def lse_of(result) -> Optional[torch.Tensor]:
    """The LSE in a flash-attn forward's result: FA2/FA3 (out, lse, ...), FA4 (out, lse)."""
    if isinstance(result, (tuple, list)) and len(result) >= 2 and isinstance(result[1], torch.Tensor):
        return result[1]
    return None


def recording(forward: Callable, source: str) -> Callable:
    """``forward`` that files a record for each call (the result is returned untouched)."""
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        result = forward(*args, **kwargs)
        remember(lse_of(result), source)
        return result
    wrapped.__gproj_patched__ = True
    return wrapped


class FunctionProxy:
    """Stands in for a module function: calls go to ``call``; every other attribute is the original's."""

    def __init__(self, original: Callable, call: Callable):
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_call", call)
        object.__setattr__(self, "__wrapped__", original)
        object.__setattr__(self, "__gproj_patched__", True)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_original"), name)

    def __setattr__(self, name, value):
        setattr(self._original, name, value)

    def __delattr__(self, name):
        delattr(self._original, name)

    def __repr__(self):
        return f"<gproj_patch proxy of {self._original!r}>"
