"""Which layer an attention call belongs to: ``layer_scope(name)``, else a number within the step.

``layer_scope(name)`` sets the name for the attention calls made inside it. A hook that makes its record at the
forward (FA4, HF eager, flex) takes the open scope's name then, else ``layer_id()`` numbers the forward calls of one
step ``"call0"``, ``"call1"``, ... (``state.RuntimeState.next_call_name``). The SDPA seam has no forward: it runs in
the backward op, and learns its layer from its autograd node (``backward_layer``). Every named scope therefore
also records the span of autograd sequence numbers of the nodes made inside it (``state.LayerSpans``); the
backward of a node made inside takes that name, else ``"sdpa{n}"``, the n-th unnamed SDPA backward of its
backward pass.

HF models get one naming scheme whatever their ``attn_implementation`` (the policy's keys must not change with
it): a call made by an HF attention module is named by ``module_layer(module)`` — the open scope of
``track_layers`` (its module path, e.g. ``"model.layers.3.self_attn"``) when there is one, else
``"<AttentionClass>.<layer_idx>"`` (``module_layer_name``). The registry functions ("sdpa", "flash_attention_*",
"flex_attention", ..., ``hooks/hf_layer_names.py``) run inside that name (``call_in_module_layer``); the
paths that make their records themselves pass ``module_layer_name(module)`` as the call's ``layer`` (HF eager,
"gproj") or ``module_layer(module)`` (HF flex, whose compiled path reads no scope), and an open scope still
wins there (``record.make_context``; under ``torch.compile`` the traced module's name, ``traced_layer()``).
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Iterator, Optional

from ..runtime.state import STATE

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


def _sequence_nr() -> int:
    """This thread's autograd sequence counter (``compat``, imported here: ``import gproj_patch`` imports no
    torch)."""
    from ..backends.compat import autograd_sequence_nr
    return autograd_sequence_nr()


@contextlib.contextmanager
def _named(name: str) -> Iterator[str]:
    """Open ``name`` as the current layer and record the span of autograd nodes made inside it. A scope opened
    while another is open is not recorded as a span: the outer one names them (the same rule as for forwards)."""
    outer = _current.get() is not None
    token = _current.set(name)
    thread = threading.get_ident()
    if not outer:
        STATE.spans.enter(thread, _sequence_nr(), name)
    try:
        yield name
    finally:
        _current.reset(token)
        if not outer:
            STATE.spans.exit(thread, _sequence_nr())


def layer_scope(name: str):
    """Name the attention calls made inside (a context manager): their records at the forward, and the SDPA
    backwards of the autograd nodes made inside."""
    return _named(str(name))


def backward_layer(node) -> Optional[str]:
    """The layer name of the attention backward running for autograd ``node`` (the SDPA seam's): the named scope
    its forward ran in, else None."""
    if node is None or not (STATE.spans.by_thread or STATE.spans.open):  # nothing named: no lookup
        return None
    from ..backends.compat import node_sequence_nr
    return STATE.spans.find(node_sequence_nr(node), threading.get_ident())


def backward_op_layer(node, unnamed: str = "sdpa") -> str:
    """The layer of a call decided in its backward op (the SDPA seam, FA2/FA3's backward ops), which has no
    forward record: the first such call of a new autograd graph task starts a new backward pass (and step, see
    ``state.RuntimeState.backward_pass``); then the named scope ``node``'s forward ran in, else the pass's next
    ``f"{unnamed}{n}"`` (``"sdpa{n}"``; FA2/FA3: ``"flash_attn{n}"``)."""
    from ..backends.compat import graph_task_id
    STATE.backward_pass(graph_task_id(), _enclosing_sequence_nr)
    return backward_layer(node) or STATE.next_backward_call_name(unnamed)


def _enclosing_sequence_nr() -> Optional[int]:
    """The sequence number of the backward node this one runs inside (a reentrant checkpoint's), or None."""
    from ..backends.compat import enclosing_backward_node, node_sequence_nr
    node = enclosing_backward_node()
    return None if node is None else node_sequence_nr(node)


def module_layer_name(module) -> Optional[str]:
    """``"<AttentionClass>.<layer_idx>"`` of an HF attention module, None when it has no ``layer_idx``."""
    idx = getattr(module, "layer_idx", None)
    return None if idx is None else f"{type(module).__name__}.{idx}"


def _compiling() -> bool:
    import torch  # not at module level: ``import gproj_patch`` does not import torch
    return torch.compiler.is_compiling()


def module_layer(module) -> Optional[str]:
    """The name of a call made now by ``module``: the open scope (``track_layers``' module path wins; while
    Dynamo traces, the traced scope), else ``module_layer_name(module)``."""
    scoped = traced_layer() if _compiling() else _current.get()
    return scoped if scoped is not None else module_layer_name(module)


def call_in_module_layer(module, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with ``module_layer(module)`` open as the layer of the attention calls it makes.
    Nothing is opened when a scope is already open (it wins) or the module has no name; while Dynamo traces,
    the traced scope (a list) replaces the ContextVar (whose ``set`` is a graph break). The call itself is
    untouched: same arguments, same result, same exceptions."""
    compiling = _compiling()
    scoped = traced_layer() if compiling else _current.get()
    name = None if scoped is not None else module_layer_name(module)
    if name is None:
        return fn(*args, **kwargs)
    if compiling:
        enter_traced_layer(name)
        try:
            return fn(*args, **kwargs)
        finally:
            exit_traced_layer()
    with _named(name):
        return fn(*args, **kwargs)


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
