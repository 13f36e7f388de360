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

Three homes for what a module keeps between calls (no module re-binds a global at run time; only
``gproj_patch/__init__.py``, which owns enable/disable, has ``global`` statements):

* runtime state — counters, steps, layer records, logged-once sets, per-thread call bookkeeping — lives here, in
  ``STATE``, and ``reset()`` clears it;
* installed-hook bookkeeping — what a hook's ``install()`` saved for ``uninstall()`` to restore (the original
  function, the rebound names, the pending import hook, the report last logged) — is one instance of a small
  ``Installed...`` dataclass per hook, held in one module-level constant of that hook (``INSTALLED`` in
  ``integrations/sdpa.py``, ``flash_attn.py``, ``flex.py``; ``STATUS`` in ``startup.py``; the meta-path finder
  ``_WATCHER`` in ``import_hooks.py``), mutated in place and never re-bound. It is not cleared by ``reset()``: a reset of the statistics must not unhook anything
  (``disable()`` does that);
* a cache that speeds up a pure computation (the detector's row indices and CUDA graphs, flash-attn's forward
  records filed until their backward, the audit's compiled flex) stays in its module with a comment
  ``#: bounded cache: ...`` right above it saying what bounds it, and a test that it stays so bounded.

This module imports nothing from the package (everyone imports it).
"""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Any, Dict, List, Optional


#: compiled forwards whose (context, plan) is kept for their backward: a bound far above the attention calls
#: of one step (each entry is a few hundred bytes, no tensor)
COMPILED_CALLS_MAX = 16384


class RuntimeState:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        # layer names of the tracked modules whose forward is being traced by torch.compile (innermost last);
        # pushed and popped by layer_tracking's hooks while Dynamo traces them, so always empty between traces.
        # A plain list: Dynamo traces its append/pop (a ContextVar.set is a graph break) and reads the name as a
        # constant of the graph. Kept by identity (reset() clears it in place).
        self.traced_layers: List[str] = []
        # compiled hooks (ops/sdpa_compiled.py, ops/flex_compiled.py): each forward op files its call's context
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
            # policy (policy.py): one LayerRecord per layer name, tier transitions, detector failure flag
            self.layers: Dict[str, Any] = {}
            self.events: List[Dict[str, Any]] = []
            self.detector_failed = False
            # detector.py: its Triton kernel or its CUDA-graph capture failed on this process's GPU (the torch path
            # runs instead; a reset tries again), and the unsupported-input reasons already logged
            self.detector_kernel_failed = False
            self.detector_graph_failed = False
            self.detector_logged: set = set()
            # router.kernel_reason's answers per key (device type, dtypes, head dims, B·H): cleared with the rest
            self.kernel_reasons: Dict[tuple, Optional[str]] = {}
            self.traced_layers.clear()
            # integrations/sdpa.py: per thread, how many calls of the SDPA wrapper reached the patched path (a
            # __torch_function__ override that never calls SDPA back is told apart by an unchanged count)
            self.sdpa_reentry = threading.local()

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
                    self.backward_seen = False
        self.forward_task = task

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
