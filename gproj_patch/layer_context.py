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
    """The name of the open ``layer_scope`` (eager code), else None."""
    return _current.get()


def traced_layer() -> Optional[str]:
    """While ``torch.compile`` traces a tracked module (``enter_traced_layer``): its name, else None."""
    return STATE.traced_layers[-1] if STATE.traced_layers else None


def enter_traced_layer(name: str) -> None:
    """``layer_scope``'s counterpart while Dynamo traces: ``ContextVar.set`` is a graph break, a list is not.
    The name becomes a constant of the compiled graph (the compiled ops receive it as an argument)."""
    STATE.traced_layers.append(name)


def exit_traced_layer() -> None:
    if STATE.traced_layers:
        STATE.traced_layers.pop()


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
