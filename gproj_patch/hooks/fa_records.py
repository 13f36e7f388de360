"""FA4's forwards leave their call's record; the backward finds it through the LSE both of them see. Also the
argument reading every flash-attn path shares (``Binder``, ``arg``, ``problem_of``).

FA4 has no backward op to decide at (its backward is a Python function), so its plan is made at the forward:
FA4's autograd Functions save the LSE ``_flash_attn_fwd`` returned and hand it to ``_flash_attn_bwd``. The
wrapped forward binds the call's arguments, makes the complete ``CallRecord`` now — ``Problem`` (scale, causal,
window, softcap, varlen offsets, learnable sink) and ``Context`` (mode, options, the layer whose scope is open)
— and files it under the LSE (``remember``); the backward reads it back (``find``) and runs exactly it. Under
``auto`` a layer settled on the original backward files only its layer (``forward_record``): its plan is
"original" without a sample, so no record is made. (FA2/FA3 file nothing: their backward op decides from its own
arguments, ``flash_attn.op_backward``.)

Filed under the LSE's *storage*, not the tensor object. FA4 (4.0.0b36) returns ``(out, lse)`` from its
Function and saves ``lse``, one of its own outputs; autograd saves an output as a new tensor object sharing its
storage (unpacked as yet another one), so the object the forward returned dies as soon as the caller keeps only
``out`` — a record tied to it died before the backward.
The storage survives: the saved tensor holds it until the backward has run (or the graph is freed), and torch
keeps one Python object per storage while it lives. So an entry is keyed by (device, address of the LSE), holds a
weak reference to that storage object, is found only when the backward's LSE lives in that very storage with the
same shape, and is dropped by a ``weakref.finalize`` on the storage — after the backward, with a retained graph
after its last backward, with a graph freed unused — unless an entry filed later holds its address by then.

A backward whose forward was not seen (it ran before ``enable()``) gets a record made from its own arguments,
with that reason logged once (``recorded=False``).
"""
from __future__ import annotations

import functools
import inspect
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..runtime import config, telemetry
from ..dispatch.plan import ForwardTensors, make_plan, settled_original
from ..dispatch.record import CallRecord, Problem, forward_layer, make_context

SINK_DTYPE = torch.float32  # the sink as the GProj tiers take it (exact for FA4's fp16/bf16/fp32 sinks)
NO_RECORD_REASON = ("flash-attn: no forward record for this backward (forward ran before enable()); options and "
                    "layer taken at the backward")


@dataclass(frozen=True, eq=False)
class ForwardRecord:
    """What a flash-attn forward leaves for its backward: the call's complete record, or (``settled``) only its
    layer — ``auto`` found the layer settled on the original backward at the forward (``plan.settled_original``),
    so no record or plan was made: the backward runs the library's own."""
    call: Optional[CallRecord]
    recorded: bool = True  # False: no forward was seen (made at the backward from its arguments; sink unknown)
    settled: Optional[str] = None  # the layer, when the forward planned "original" without a record

    @property
    def context(self):
        return self.call.context


@dataclass(frozen=True, eq=False)
class _Entry:
    storage: "weakref.ref"     # the LSE's storage object (alive as long as any tensor holds the storage)
    shape: Tuple[int, ...]
    record: ForwardRecord


_lock = threading.Lock()
#: bounded cache: one entry per LSE storage alive (a forward's, until its backward ran or its graph was freed);
#: ``weakref.finalize`` on the storage drops it (``live_records()``). Not cleared by ``reset()``: a backward
#: still to run needs its forward's record.
_records: Dict[Tuple[str, int], _Entry] = {}
#: bounded cache: distinct callbacks to run once no record is alive (the hook's deferred restores); a callback
#: is held once however often ``when_no_records`` is asked, and the list empties when the last record dies
_when_empty: List[Callable[[], None]] = []


# ---- a call's arguments by name, as ``inspect`` binds them ---------------------------------------------------
_REQUIRED = object()  # a template's slot for a parameter without a default
_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class Binder:
    """``signature.bind(*args, **kwargs)`` with its defaults applied, as a dict in signature order, from a
    template of the parameters instead of ``inspect``'s general binding (~35 µs a call on a CPU for FA4's 41
    parameters, on every hooked forward and backward). A signature with positional-only parameters, ``*args`` or
    ``**kwargs``, and a call the template cannot bind (too many positional arguments, an unknown or repeated name,
    a required argument missing) go through ``inspect``: the same dict, or its TypeError."""

    def __init__(self, signature: inspect.Signature):
        self.signature = signature
        params = signature.parameters
        self.simple = all(p.kind in _BY_NAME for p in params.values())
        self.positional = tuple(n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.template = {n: _REQUIRED if p.default is inspect.Parameter.empty else p.default
                         for n, p in params.items()}
        self.names = frozenset(self.template)
        # per count n of positional arguments: the names they fill, and the required names left for keywords
        # (set operations instead of a Python loop over every keyword and parameter on each call)
        required = frozenset(n for n, d in self.template.items() if d is _REQUIRED)
        self.filled = tuple(frozenset(self.positional[:n]) for n in range(len(self.positional) + 1))
        self.left = tuple(required - filled for filled in self.filled)

    def __call__(self, args: tuple, kwargs: dict) -> dict:
        n = len(args)
        if self.simple and n <= len(self.positional):
            names = kwargs.keys()
            if names <= self.names and names.isdisjoint(self.filled[n]) and self.left[n] <= names:
                b = dict(self.template)  # a copy in signature order; assigning existing keys keeps that order
                b.update(zip(self.positional, args))
                b.update(kwargs)
                return b
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)


# ---- the problem of a call, from flash-attn's argument names (FA4's forward; a backward op's, or FA4's) ---------

def arg(b: dict, *names, default=None):
    """The first of ``names`` that ``b`` holds and is not None (flash-attn spells some arguments two ways)."""
    for n in names:
        if n in b and b[n] is not None:
            return b[n]
    return default


def problem_of(b: dict, sink: Optional[torch.Tensor]) -> Problem:
    """The math of a flash-attn call from its named arguments (FA2/FA3/FA4 share the names): causal is
    bottom-right aligned, an unset window side (FA4: None) is -1, the default scale is head dim^-1/2 (what every
    release computes when ``softmax_scale`` is None), and a causal call's right window is the causal bound."""
    q = arg(b, "q")
    causal = bool(arg(b, "causal", "is_causal", default=False))
    wl, wr = int(arg(b, "window_size_left", default=-1)), int(arg(b, "window_size_right", default=-1))
    if causal and wr > 0:
        wr = -1
    scale = arg(b, "softmax_scale")
    return Problem(scale=float(scale) if scale is not None else q.shape[-1] ** -0.5, causal=causal,
                   causal_align="bottom_right", window=(wl, wr), softcap=float(arg(b, "softcap", default=0.0)),
                   cu_seqlens_q=arg(b, "cu_seqlens_q"), cu_seqlens_k=arg(b, "cu_seqlens_k"),
                   max_seqlen_q=arg(b, "max_seqlen_q"), max_seqlen_k=arg(b, "max_seqlen_k"),
                   sink=None if sink is None else _sink_values(sink))


def _sink_values(sink: torch.Tensor) -> torch.Tensor:
    """The sink's values, detached; a floating sink as ``SINK_DTYPE``, any other kept as given so that the
    backward's check refuses it by its type."""
    return sink.detach().to(SINK_DTYPE) if sink.is_floating_point() else sink.detach()


def mismatch(recorded: Problem, given: Problem) -> Optional[str]:
    """Why a backward's own arguments contradict the record filed under its LSE (None: they agree). They agree
    whenever flash-attn's Functions made both; a contradiction means the record is not this call's."""
    for name in ("scale", "causal", "window", "softcap"):
        if getattr(recorded, name) != getattr(given, name):
            return (f"flash-attn forward record and backward arguments disagree on {name} "
                    f"({getattr(recorded, name)!r} vs {getattr(given, name)!r}): original backward")
    if (recorded.cu_seqlens_q is None) != (given.cu_seqlens_q is None):
        return "flash-attn forward record and backward arguments disagree on varlen: original backward"
    return None


def to_bhsd(x: torch.Tensor, varlen: bool) -> torch.Tensor:
    """flash-attn's (B, S, H, D) — varlen (total, H, D) — as the backends' (B, H, S, D) view."""
    return x.unsqueeze(0).transpose(1, 2) if varlen else x.transpose(1, 2)


def planned(record: CallRecord, b: dict, out: Optional[torch.Tensor], lse: Optional[torch.Tensor]) -> CallRecord:
    """``record`` with its backward plan (``plan.make_plan``), from the call's q, k, v, output and LSE; the
    library's own backward is always there to run (``has_original``)."""
    varlen = arg(b, "cu_seqlens_q") is not None
    q, k, v = (to_bhsd(arg(b, n), varlen) for n in ("q", "k", "v"))
    o = None if out is None else to_bhsd(out, varlen)
    return make_plan(record, ForwardTensors(q, k, v, o, lse), has_original=True)


def make_call_record(b: dict, source: str, sink: Optional[torch.Tensor], result=None,
                     layer: Optional[str] = None, cfg: Optional[config.Config] = None) -> CallRecord:
    """The record and plan of a forward running now: its problem from the arguments, the context active now
    (``layer``: the name ``forward_layer`` gave the call, else taken now; ``cfg``: the options, else the active
    ones), the plan from its tensors (``result``: the forward's return value, output first)."""
    out = result[0] if isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor) else None
    context = make_context(source, layer, cfg, named=layer is not None)
    return planned(CallRecord(problem_of(b, sink), context), b, out, lse_of(result))


def forward_record(b: dict, source: str, sink: Optional[torch.Tensor], result) -> ForwardRecord:
    """What a forward running now files for its backward: its layer only where ``auto`` has the layer settled
    on the original backward and the call has no learnable sink (whose checks need the record's problem), else
    the complete record (``make_call_record``)."""
    cfg = config.active() or config.resolve()
    layer = forward_layer()
    if sink is None and settled_original(cfg, layer, has_original=True):
        return ForwardRecord(None, settled=layer)
    return ForwardRecord(make_call_record(b, source, sink, result, layer=layer, cfg=cfg))


# ---- filing and finding -------------------------------------------------------------------------------------

def _key(lse: torch.Tensor) -> Tuple[str, int]:
    return (str(lse.device), lse.data_ptr())


def _fileable(lse) -> bool:
    """Only a plain, non-empty tensor with real memory has an address and a storage to key by (a fake or
    meta LSE, under tracing, has neither; nothing to file without an LSE: no backward)."""
    return type(lse) is torch.Tensor and lse.numel() > 0 and lse.device.type != "meta"


def _drop(key, entry: _Entry) -> None:
    """The storage of ``entry``'s LSE was freed: drop it, unless an entry filed later holds the key now."""
    with _lock:
        if _records.get(key) is entry:
            del _records[key]
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
            if fn not in _when_empty:
                _when_empty.append(fn)
            return
    fn()


def remember(lse, record: ForwardRecord) -> None:
    """File ``record`` under the storage of ``lse``, the LSE its forward returned."""
    if not _fileable(lse):
        return
    storage = lse.untyped_storage()
    key, entry = _key(lse), _Entry(weakref.ref(storage), tuple(lse.shape), record)
    with _lock:
        _records[key] = entry
    weakref.finalize(storage, _drop, key, entry)


def find(lse) -> Optional[ForwardRecord]:
    """The record the forward of this backward filed, or None: the entry at the LSE's address, whose storage is
    alive and is this LSE's storage, filed for this shape."""
    if not _fileable(lse):
        return None
    with _lock:
        entry = _records.get(_key(lse))
    if entry is None or entry.shape != tuple(lse.shape):
        return None
    storage = entry.storage()
    if storage is None or storage is not lse.untyped_storage():
        return None
    return entry.record


def unrecorded(b: dict, source: str, sink: Optional[torch.Tensor]) -> ForwardRecord:
    """The record of a backward whose forward filed none, made now from its arguments ``b`` (the layer is the
    source: nothing names it now), the reason logged once per shape class."""
    telemetry.note_reason(NO_RECORD_REASON, telemetry.shape_class(source))
    # the one record and plan made at a backward: no forward of this call was seen (it ran before enable())
    record = CallRecord(problem_of(b, sink), make_context(source, layer=source))
    return ForwardRecord(planned(record, b, arg(b, "out", "o"), arg(b, "softmax_lse", "lse")), recorded=False)


def live_records() -> int:
    """How many forward records are alive (tests: nothing of a call outlives its backward)."""
    with _lock:
        return len(_records)


def lse_of(result) -> Optional[torch.Tensor]:
    """The LSE in a flash-attn forward's result: FA2/FA3 (out, lse, ...), FA4 (out, lse, p, row_max, o_lo)."""
    if isinstance(result, (tuple, list)) and len(result) >= 2 and isinstance(result[1], torch.Tensor):
        return result[1]
    return None


def recording(forward: Callable, signature: inspect.Signature, source_of: Callable[[dict], str],
              sink_name: Optional[str] = None) -> Callable:
    """``forward`` that files each call's ``forward_record`` under the LSE it returns (the result is returned
    untouched).
    The call's arguments are bound against ``signature`` (defaults applied); ``source_of(arguments)`` names the
    source (dense or varlen); ``sink_name`` is the forward's learnable-sink argument (FA4), if it has one.
    A forward without q (FA4's MLA path, whose backward the hook does not replace) files nothing."""
    bind = Binder(signature)

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        result = forward(*args, **kwargs)
        lse = lse_of(result)
        if _fileable(lse):
            b = bind(args, kwargs)
            if arg(b, "q") is not None:
                sink = arg(b, sink_name) if sink_name else None
                remember(lse, forward_record(b, source_of(b), sink if isinstance(sink, torch.Tensor) else None,
                                             result))
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
