"""Which layer an attention call belongs to: ``layer_scope(name)``, else ``call{n}`` within the step.

``layer_scope(name)`` sets the name for the attention calls made inside it (``track_layers`` and the HF
integration set module names themselves). Without a scope, ``layer_id()`` numbers the forward calls of one step
``"call0"``, ``"call1"``, ... (``state.RuntimeState.next_call_name``). The name is taken once, at the call's
forward, into its record; the backward never asks again.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

from .state import STATE

_current: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("gproj_layer", default=None)


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
    return name if name is not None else STATE.next_call_name()


def backward_ran() -> None:
    """Called by every hooked backward: the next forward starts a new step."""
    STATE.backward_ran()


def new_step() -> None:
    """Start a new step now (restart ``call{n}`` numbering; advance the step the policy samples on)."""
    STATE.new_step()
