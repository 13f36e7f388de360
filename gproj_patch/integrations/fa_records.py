"""flash-attn forwards leave a record; the backward finds it through the LSE tensor both of them see.

flash-attn's autograd Functions save the LSE their forward op returned and hand that same tensor to the backward
op. ``remember(lse, source, sink=...)`` (called by the wrapped forward) files the call's context — and the
learnable sink the forward was given, if any — under the LSE's storage; ``record_for(lse, source)`` (called by
the backward) reads it back as a ``ForwardRecord``. The sink matters: the LSE of a forward with a sink includes
it, and a backward that does not pass the sink itself (FA4 before its sink backward, flash-attention #2706)
must still correct towards the sink's row-sum target. An entry lives exactly as long as its LSE:
a ``weakref.finalize`` drops it when the tensor is freed (after the backward, or with the graph), so nothing of a
call outlives it. A backward whose forward was not seen (it ran before ``enable()``, or the forward op is not
one the hook wraps) gets a context made at the backward, with that reason logged once.

``FunctionProxy`` replaces a module-level function (FA4's ``_flash_attn_fwd`` / ``_flash_attn_bwd``) while
forwarding every attribute read and write to it, so code that keeps state on the function object
(FA4's ``compile_cache``) sees the original.
"""
from __future__ import annotations

import functools
import inspect
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import telemetry
from ..record import Context, make_context



@dataclass(frozen=True, eq=False)
class ForwardRecord:
    """What a flash-attn forward leaves for its backward: the context, and the learnable sink it was given."""
    context: Context
    sink: Optional[torch.Tensor] = None  # detached (Hq,) sink logits the forward's LSE includes, or None
    recorded: bool = True                # False: no forward was seen (context made at the backward, sink unknown)


_lock = threading.Lock()
_records: Dict[Tuple[str, int], Tuple["weakref.ref", ForwardRecord]] = {}
NO_RECORD_REASON = ("flash-attn: no forward record for this backward (forward ran before enable() or through an "
                    "unwrapped op); options and layer taken at the backward")


def _key(lse: torch.Tensor) -> Tuple[str, int]:
    return (str(lse.device), lse.data_ptr())


_when_empty: List[Callable[[], None]] = []  # run once no record is alive (the hook's deferred restores)


def _drop(key) -> None:
    with _lock:
        _records.pop(key, None)
        ready = [] if _records else _when_empty[:]
        if ready:
            _when_empty.clear()
    for fn in ready:
        fn()


def when_no_records(fn: Callable[[], None]) -> None:
    """Run ``fn`` now if no forward record is alive, else when the last one is freed (after its backward):
    ``disable()`` keeps the corrected backward reachable for forwards made while the patch was on."""
    with _lock:
        if _records:
            _when_empty.append(fn)
            return
    fn()


def remember(lse: Optional[torch.Tensor], source: str, sink: Optional[torch.Tensor] = None) -> None:
    """File the context (and ``sink``) of a forward that returned ``lse`` (nothing to file without an LSE: no
    backward). The sink is held detached: its values, not its graph."""
    if not isinstance(lse, torch.Tensor) or lse.numel() == 0:
        return
    record = ForwardRecord(context=make_context(source),
                           sink=sink.detach() if isinstance(sink, torch.Tensor) else None)
    key = _key(lse)
    with _lock:
        _records[key] = (weakref.ref(lse), record)
    weakref.finalize(lse, _drop, key)


def find(lse: Optional[torch.Tensor]) -> Optional[ForwardRecord]:
    """The record the forward of this backward filed, or None."""
    if isinstance(lse, torch.Tensor):
        with _lock:
            entry = _records.get(_key(lse))
        if entry is not None and entry[0]() is not None:
            return entry[1]
    return None


def record_for(lse: Optional[torch.Tensor], source: str) -> ForwardRecord:
    """The record the forward of this backward filed (else one made now, ``recorded=False``, reason logged)."""
    found = find(lse)
    if found is not None:
        return found
    q_class = telemetry.shape_class(source)
    telemetry.note_reason(NO_RECORD_REASON, q_class)
    return ForwardRecord(context=make_context(source, layer=source), recorded=False)


def live_records() -> int:
    """How many forward records are alive (tests: nothing of a call outlives its backward)."""
    with _lock:
        return len(_records)


def lse_of(result) -> Optional[torch.Tensor]:
    """The LSE in a flash-attn forward's result: FA2/FA3 (out, lse, ...), FA4 (out, lse)."""
    if isinstance(result, (tuple, list)) and len(result) >= 2 and isinstance(result[1], torch.Tensor):
        return result[1]
    return None


def argument_reader(fn: Callable, name: str) -> Optional[Callable[[tuple, dict], object]]:
    """A reader of argument ``name`` from a call's (args, kwargs) of ``fn`` (None when ``fn`` has no such
    parameter or no readable signature). Reads by keyword, else by position; never binds the whole call."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params]
    if name not in names:
        return None
    param = params[names.index(name)]
    index = names.index(name) if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD) else None

    def read(args: tuple, kwargs: dict):
        if name in kwargs:
            return kwargs[name]
        if index is not None and index < len(args):
            return args[index]
        return None
    return read


def recording(forward: Callable, source: str, sink_of: Optional[Callable[[tuple, dict], object]] = None) -> Callable:
    """``forward`` that files a record for each call (the result is returned untouched); ``sink_of(args,
    kwargs)`` reads the call's learnable sink (FA4's ``learnable_sink``) into the record."""
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        result = forward(*args, **kwargs)
        remember(lse_of(result), source, sink=None if sink_of is None else sink_of(args, kwargs))
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
