"""The one runtime state of the patch: counters, step and call numbering, per-layer policy records.

Everything a process accumulates while the patch runs lives in ``STATE`` (one lock); ``reset()`` clears all of
it (``gproj_patch.reset_stats()`` calls it) — including the one memo of the call path, ``router.kernel_reason``'s
answers per (device type, dtypes, head dims, B·H). What is *configuration* — the enabled ``Config``, the policy
overrides of ``policy.configure()`` — is not state and survives a reset.

One step notion. A *step* is one forward-then-backward round: the first attention forward after a backward ran
starts a new step (or ``new_step()`` / ``set_step(n)`` say so explicitly; the Trainer callback passes
``global_step``). Within a step, attention calls that no ``layer_scope`` names are numbered ``call0``, ``call1``,
... in forward order, so with the usual forward-all / backward-all pattern a layer keeps its id every step. The
policy samples a layer every ``sample_every`` steps of this same counter.

Three homes for what a module keeps between calls (no module re-binds a global at run time; only ``patch.py``,
which owns enable/disable, may have ``global`` statements):

* runtime state — counters, steps, layer records, logged-once sets, per-thread call bookkeeping — lives here, in
  ``STATE``, and ``reset()`` clears it;
* installed-hook bookkeeping — what a hook's ``install()`` saved for ``uninstall()`` to restore (the original
  function, the rebound names, the pending import hook, the report last logged) — is one instance of a small
  ``Installed...`` dataclass per hook, held in one module-level constant of that hook (``INSTALLED`` in
  ``hooks/sdpa.py``, ``flash_attn.py``, ``flex.py``; ``STATUS`` in ``startup.py``; the meta-path finder
  ``_WATCHER`` in ``import_hooks.py``), mutated in place and never re-bound. It is not cleared by ``reset()``: a reset of the statistics must not unhook anything
  (``disable()`` does that);
* a cache that speeds up a pure computation (the detector's row indices and CUDA graphs, flash-attn's forward
  records filed until their backward, the audit's compiled flex) stays in its module with a comment
  ``#: bounded cache: ...`` right above it saying what bounds it, and a test that it stays so bounded.

This module imports nothing from the package (everyone imports it).
"""
from __future__ import annotations

import bisect
import threading
from collections import Counter, OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple


#: compiled forwards whose (context, plan) is kept for their backward: a bound far above the attention calls
#: of one step (each entry is a few hundred bytes, no tensor)
COMPILED_CALLS_MAX = 16384


#: named forward scopes kept per thread for the backward's lookup (``LayerSpans``): far above the attention calls of
#: one step; the oldest half is dropped past it
SPANS_PER_THREAD_MAX = 8192
#: threads whose spans are kept (a pool that made forwards once and died is forgotten first)
SPAN_THREADS_MAX = 64


class LayerSpans:
    """The layer names of named forward scopes, by autograd sequence number, so that a backward that has no
    forward record (the SDPA seam) learns its layer from its autograd node.

    Every autograd node carries the value of its thread's sequence counter when it was made; a scope
    (``layer_scope``, an HF attention module's call, a tracked module) records the counter at its entry and at
    its exit, so the nodes made inside it are exactly those with a number in ``[start, end)`` *on that thread*.
    Counters are per thread: a number is looked up first among the spans of the thread asking (a reentrant
    checkpoint recomputes its forward on the backward's thread), then among the others, and only a single match
    there names the node. Only outermost scopes are recorded (an open scope wins over the ones inside it), so each
    thread's spans are disjoint and recorded in order: a bisection finds the one holding a number."""

    def __init__(self) -> None:
        self.by_thread: "OrderedDict[int, Tuple[List[int], List[int], List[str]]]" = OrderedDict()
        # each thread's outermost scope still open: (start, name); a backward run inside it (``loss.backward()``
        # within the scope) must find the nodes made so far
        self.open: Dict[int, Tuple[int, str]] = {}

    def enter(self, thread: int, start: int, name: str) -> None:
        self.open[thread] = (start, name)

    def exit(self, thread: int, end: int) -> None:
        opened = self.open.pop(thread, None)
        if opened is not None:
            self.add(thread, opened[0], end, opened[1])

    def add(self, thread: int, start: int, end: int, name: str) -> None:
        if end <= start:  # no node was made inside: nothing to name
            return
        entry = self.by_thread.get(thread)
        if entry is None:
            entry = self.by_thread[thread] = ([], [], [])
            while len(self.by_thread) > SPAN_THREADS_MAX:
                self.by_thread.popitem(last=False)
        starts, ends, names = entry
        starts.append(start)
        ends.append(end)
        names.append(name)
        if len(starts) > SPANS_PER_THREAD_MAX:
            half = len(starts) // 2
            del starts[:half], ends[:half], names[:half]

    @staticmethod
    def _find(entry, seq: int) -> Optional[str]:
        starts, ends, names = entry
        i = bisect.bisect_right(starts, seq) - 1
        return names[i] if i >= 0 and seq < ends[i] else None

    def find(self, seq: int, thread: int) -> Optional[str]:
        """The name of the span holding ``seq`` — closed spans first, then open scopes; this thread's before the
        others', whose match counts only when it is the only one — or None."""
        own = self.by_thread.get(thread)
        if own is not None:
            name = self._find(own, seq)
            if name is not None:
                return name
        found = {self._find(entry, seq) for t, entry in list(self.by_thread.items()) if t != thread}
        found.discard(None)
        if found:
            return found.pop() if len(found) == 1 else None
        opened = self.open.get(thread)
        if opened is not None and opened[0] <= seq:
            return opened[1]
        found = {name for t, (start, name) in list(self.open.items()) if t != thread and start <= seq}
        return found.pop() if len(found) == 1 else None

    def clear(self) -> None:
        self.by_thread.clear()
        self.open.clear()


class RuntimeState:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        # layer names of the tracked modules whose forward is being traced by torch.compile (innermost last);
        # pushed and popped by layer_tracking's hooks while Dynamo traces them, so always empty between traces.
        # A plain list: Dynamo traces its append/pop (a ContextVar.set is a graph break) and reads the name as a
        # constant of the graph. Kept by identity (reset() clears it in place).
        self.traced_layers: List[str] = []
        # the compiled flex hook (hooks/flex.py): each forward op files its call's context
        # and plan under a call number that travels through the graph to its backward op. A bounded channel, not
        # statistics: kept by reset() (a backward after a reset still finds its forward's plan); bounded by
        # COMPILED_CALLS_MAX (oldest dropped: forwards whose backward never runs); holds no tensor
        self.compiled_calls: "OrderedDict[int, Any]" = OrderedDict()
        self.compiled_call_count = 0
        self.reset()

    def reset(self) -> None:
        with self.lock:
            # backward calls per tier, forward calls per path, fallback reasons (telemetry.py)
            self.backward: Counter = Counter()
            self.forward: Counter = Counter()
            self.reasons: Counter = Counter()
            # the kernel tier's KV-major launch per call ("gluon" / "tl") and why not the Gluon kernel
            self.kv_major: Counter = Counter()
            self.kv_major_reasons: Counter = Counter()
            # the same for the dQ-major launch
            self.dq_major: Counter = Counter()
            self.dq_major_reasons: Counter = Counter()
            self.logged: set = set()  # (reason, shape class) pairs already logged
            # steps and call numbering
            self.explicit_step: Optional[int] = None
            self.implicit_step = 0
            self.call_index = 0
            self.backward_seen = False
            self.forward_task = -1  # autograd's graph task of the last hooked forward (-1: outside a backward)
            # the SDPA seam, which sees only backwards: the graph task of its last call, whether a hooked forward
            # began the current step (then the next backward pass belongs to it), its unnamed calls' numbering
            self.backward_task: Optional[int] = None
            self.enclosing_seq: Optional[int] = None  # the enclosing backward's node of the last nested pass
            self.step_from_forward = False
            self.backward_call_index = 0
            # layer names of named forward scopes, for backwards without a forward record (layers/scope.py)
            self.spans = LayerSpans()
            # the rows the kernels found to be shards of a row (not projected), one counter per device, added to
            # on the device (no sync); read by stats()
            self.partial_rows: Dict[str, Any] = {}
            # policy (policy.py): one LayerRecord per layer name, tier transitions, detector failure flag
            self.layers: Dict[str, Any] = {}
            self.events: List[Dict[str, Any]] = []
            self.detector_failed = False
            # detector.py: its Triton kernel or its CUDA-graph capture failed on this process's GPU (the torch path
            # runs instead; a reset tries again), and the unsupported-input reasons already logged
            self.detector_kernel_failed = False
            self.detector_graph_failed = False
            self.detector_logged: set = set()
            # plan.kernel_reason's answers per key (device type, dtypes, head dims, B·H): cleared with the rest
            self.kernel_reasons: Dict[tuple, Optional[str]] = {}
            # plan._kernel_plan's KernelPlans per key (options, device, dtypes, shapes, strides, TMA alignment,
            # mask flags): the Gluon predicates' answers, asked once per key
            self.kernel_plans: Dict[tuple, Any] = {}
            self.traced_layers.clear()

    # --- steps ------------------------------------------------------------------------------------------
    def step(self) -> int:
        return self.explicit_step if self.explicit_step is not None else self.implicit_step

    def set_step(self, step: int) -> None:
        with self.lock:
            if step != self.explicit_step:
                self.call_index = 0
                self.backward_seen = False
            self.explicit_step = int(step)

    def new_step(self) -> None:
        with self.lock:
            if self.explicit_step is not None:
                self.explicit_step += 1
            else:
                self.implicit_step += 1
            self.call_index = 0
            self.backward_call_index = 0
            self.backward_seen = False

    def forward_started(self, task: int = -1) -> None:
        """Every hooked attention forward calls this: the first one after a backward starts a new step. ``task``:
        autograd's graph task the forward runs in (-1: outside a backward). A forward inside a backward is a
        checkpoint's recomputation: it starts a step only after forwards that ran inside another backward (a
        reentrant checkpoint's recomputations are its only hooked forwards), never after forwards that ran
        outside one (a non-reentrant checkpoint's step began there)."""
        new_step = task == -1 or (self.forward_task != -1 and task != self.forward_task)
        if self.backward_seen and new_step:
            with self.lock:
                if self.backward_seen:
                    if self.explicit_step is None:
                        self.implicit_step += 1
                    self.call_index = 0
                    self.backward_call_index = 0
                    self.backward_seen = False
                    self.step_from_forward = True
        self.forward_task = task

    def backward_pass(self, task: int, outer: Callable[[], Optional[int]]) -> None:
        """Every seam backward calls this with its autograd graph task; the first call of a new task starts a new
        backward pass, and a new pass a new step — unless a hooked forward already started one since the last
        pass (a model that mixes SDPA with FA4/HF-eager calls advances once). The first pass of the process (or
        after a reset) is step 0.

        A pass nested in another backward (a reentrant activation checkpoint runs one per block, inside the
        step's backward: ``outer()`` is the sequence number of the enclosing backward's node, None when not
        nested) belongs to the enclosing pass: the enclosing nodes of one backward run in decreasing sequence
        order, while a new step's forward makes higher numbers — a higher one than the last is a new step."""
        if task == self.backward_task:
            return
        with self.lock:
            if task == self.backward_task:
                return
            first = self.backward_task is None
            self.backward_task = task
            enclosing = outer()
            if enclosing is not None:
                last, self.enclosing_seq = self.enclosing_seq, enclosing
                if last is not None and enclosing < last:
                    return  # another block of the same enclosing backward
            self.backward_call_index = 0
            if self.step_from_forward or first:
                self.step_from_forward = False
                return
            if self.explicit_step is None:
                self.implicit_step += 1
            self.call_index = 0
            self.backward_seen = False

    def next_backward_call_name(self, prefix: str = "sdpa") -> str:
        """``{prefix}{n}``: the n-th unnamed backward decided in its backward op in this pass (backward order: the
        last layer first; one count for every library, so names stay unique in a model that mixes them)."""
        with self.lock:
            n = self.backward_call_index
            self.backward_call_index += 1
        return f"{prefix}{n}"

    def next_call_name(self) -> str:
        """``call{n}``: the n-th unnamed attention forward of this step."""
        self.forward_started(self.forward_task)
        with self.lock:
            n = self.call_index
            self.call_index += 1
        return f"call{n}"

    def backward_ran(self) -> None:
        self.backward_seen = True

    # --- compiled calls ---------------------------------------------------------------------------------
    def file_compiled_call(self, entry: Any) -> int:
        """File a compiled forward's (context, plan) entry; returns its call number."""
        with self.lock:
            self.compiled_call_count += 1
            n = self.compiled_call_count
            self.compiled_calls[n] = entry
            while len(self.compiled_calls) > COMPILED_CALLS_MAX:
                self.compiled_calls.popitem(last=False)
            return n

    def compiled_call(self, n: int) -> Any:
        """The entry filed under call number ``n`` (KeyError when dropped: reset(), or over the bound)."""
        with self.lock:
            return self.compiled_calls[n]


STATE = RuntimeState()


def reset() -> None:
    """Clear every counter, step, layer record and event (configuration is kept)."""
    STATE.reset()
