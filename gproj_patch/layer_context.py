"""Which layer an attention call belongs to: a context variable, else a per-step call counter.

``layer_scope(name)`` sets the name for the calls made inside it (the HF integration sets
``"<Class>.<layer_idx>"`` itself). Without a scope, ``layer_id()`` numbers the forward calls of one step
``"call0"``, ``"call1"``, ...: a step starts with the first forward after a backward ran (or after
``new_step()``), so with the usual forward-all / backward-all pattern the same layer gets the same id every step.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Iterator, Optional

_current: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("gproj_layer", default=None)
_lock = threading.Lock()
_count = 0
_backward_seen = False


def current_layer() -> Optional[str]:
    return _current.get()


@contextlib.contextmanager
def layer_scope(name: str) -> Iterator[str]:
    token = _current.set(str(name))
    try:
        yield str(name)
    finally:
        _current.reset(token)


def layer_id() -> str:
    """The current layer name, else the next ``call{n}`` of this step (call once per attention forward)."""
    name = _current.get()
    if name is not None:
        return name
    global _count, _backward_seen
    with _lock:
        if _backward_seen:
            _count, _backward_seen = 0, False
        n = _count
        _count += 1
    return f"call{n}"


def backward_ran() -> None:
    """Called by every corrected backward: the next forward starts a new step."""
    global _backward_seen
    _backward_seen = True


def new_step() -> None:
    global _count, _backward_seen
    with _lock:
        _count, _backward_seen = 0, False
