"""``GProjCallback``: the patch inside an HF ``Trainer``, with per-layer statistics in the Trainer's logs.

    from gproj_patch.integrations.trainer import GProjCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[GProjCallback(mode="auto")])

What it does:

* ``on_init_end`` (the end of ``Trainer.__init__``, before the first forward and before the Trainer compiles
  or wraps the model) and again ``on_train_begin``: ``gproj_patch.enable(mode, **options)`` — a no-op when the
  patch is already on (e.g. ``GPROJ_PATCH=1``) — and ``track_layers(model)`` so layers carry their HF module
  names. It also moves itself to the front of the callback list: ``on_log`` receives one shared ``logs`` dict
  and the reporters (TensorBoard, W&B, ...) read it in list order, so the ``gproj/...`` keys must be added first.
  (``Trainer.log`` appends a copy of ``logs`` to ``state.log_history`` *before* the callbacks run; the callback
  adds its keys to that entry as well.)
* ``on_step_begin``: tells the policy the step (``global_step``) for its every-N-steps sampling.
* ``on_log``: adds ``gproj/<layer>/<stat>`` (tier 0/1/2, r_k, r_q, leak_dq, leak_dq_eff, leak_dk, logit_bound,
  lse_gap, p_sink, audit_err_dq/dk/dv) and ``gproj/layers/<tier>`` (layers per tier) — both only in modes
  auto/audit, the only ones with per-layer records (in the other modes no layer is attributed a tier: zeros
  there would claim that no layer ran any) —, ``gproj/calls/<tier>`` (backward calls per tier since the last
  log) and ``gproj/fallback/<reason>`` counts. Training-step logs only: not the end-of-training summary (its
  deltas would be 0, a false 0 at the last step in TensorBoard) nor evaluation/prediction metrics; deltas not
  logged there carry over to the next training log.
* Warns once per layer (``logging.getLogger("gproj_patch")``) when a layer enters the danger regime — the policy
  moves it off the original backward — and only on the main process (``state.is_world_process_zero``).
"""
from __future__ import annotations

import logging
import re
import sys
from typing import Dict, Optional

from transformers import TrainerCallback

from .. import policy as _policy
from ..runtime.config import TIERS

logger = logging.getLogger("gproj_patch")


#: keys of the logs that are not training-step logs: ``Trainer.train``'s end-of-training summary
#: (``train_runtime``, ...) and the metric dicts of evaluate/predict (``metric_key_prefix`` + "_")
_SUMMARY_KEYS = ("train_runtime",)
_METRIC_PREFIXES = ("eval_", "test_", "predict_")


def _clean(reason: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.:=<>+-]+", "_", reason).strip("_")[:80]


def _is_training_log(logs: Dict[str, float]) -> bool:
    """True for a training-step log (loss, learning rate, ...), where per-window counts belong. Neither the
    summary ``Trainer.train`` logs at its end nor evaluation/prediction metrics close a training window: a
    ``gproj/...`` value there is a second value at that step (for the summary a false 0 at the last step)."""
    if any(key in logs for key in _SUMMARY_KEYS):
        return False
    return not any(key.startswith(_METRIC_PREFIXES) for key in logs)


class GProjCallback(TrainerCallback):
    def __init__(self, mode: Optional[str] = "auto", *, track_layers: bool = True, log_layers: bool = True,
                 warn: bool = True, prefix: str = "gproj/", disable_on_train_end: bool = False, **options):
        """``mode``: "auto" (default), "audit", "gproj", "fp32", "off", or None to take ``GPROJ_MODE``.
        ``options``: passed to ``gproj_patch.enable()`` (policy options such as ``sample_every=10``,
        ``gproj_enter=0.01`` included). Every option is validated here (``ValueError`` naming it), not when the
        Trainer first enables the patch."""
        from ..runtime import config
        config.resolve(mode=mode, **options)  # raises now on a bad or unknown option
        self.mode = mode
        self.options = options
        self.track = track_layers
        self.log_layers = log_layers
        self.warn = warn
        self.prefix = prefix
        self.disable_on_train_end = disable_on_train_end
        self.handle = None
        self.tracking = None
        self.warned: set = set()
        self._last_calls: Dict[str, int] = {}
        self._last_reasons: Dict[str, int] = {}

    # --- setup -----------------------------------------------------------------------------------------
    def _move_to_front(self) -> None:
        """Put this callback first in the Trainer's CallbackHandler (found up the call stack: callbacks are
        not given the handler). Safe while the handler iterates: the ones before us shift right by one."""
        from transformers.trainer_callback import CallbackHandler
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, CallbackHandler):
                cbs = owner.callbacks
                if self in cbs and cbs[0] is not self:
                    cbs.remove(self)
                    cbs.insert(0, self)
                return
            frame = frame.f_back

    def _setup(self, model) -> None:
        from .. import patch as gproj_patch  # enable/stats (the package re-exports them; no upward import)
        if self.handle is None:
            kwargs = dict(self.options)
            if self.mode is not None:
                kwargs["mode"] = self.mode
            self.handle = gproj_patch.enable(**kwargs)
        if self.track and self.tracking is None and model is not None:
            from ..layers.tracking import track_layers
            self.tracking = track_layers(model)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._move_to_front()
        self._setup(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._move_to_front()
        self._setup(model)

    def on_train_end(self, args, state, control, **kwargs):
        self._emit_warnings(state)
        if self.disable_on_train_end and self.handle is not None:
            self.handle.disable()
            self.handle = None
        if self.disable_on_train_end and self.tracking is not None:
            self.tracking.remove()
            self.tracking = None

    # --- per step ----------------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        _policy.set_step(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self._emit_warnings(state)

    def _emit_warnings(self, state) -> None:
        events = _policy.pop_events()
        if not self.warn or not getattr(state, "is_world_process_zero", True):
            return
        for e in events:
            if e["from"] == "original" and e["layer"] not in self.warned:
                self.warned.add(e["layer"])
                logger.warning(
                    "layer %s entered the large-key regime at step %d (R_k=%.3g, predicted dq leak "
                    "%.2g%%, R_q=%.3g, p_sink=%.2f): its backward now runs the %s tier (warned once per layer)",
                    e["layer"], e["step"], e["r_k"], 100 * e["leak_dq"], e["r_q"], e["p_sink"], e.get("ran", e["to"]))

    # --- logging -------------------------------------------------------------------------------------------
    def metrics(self) -> Dict[str, float]:
        """The ``gproj/...`` values this callback adds to a log (counts are deltas since the previous call)."""
        from .. import patch as gproj_patch
        p = self.prefix
        out: Dict[str, float] = {}
        if self.log_layers and _policy.stats():  # per-layer tiers exist only where the policy keeps records
            out.update(_policy.log_dict(prefix=p))
        st = gproj_patch.stats()
        for tier in TIERS:
            n = int(st.get(tier, 0))
            out[f"{p}calls/{tier}"] = float(n - self._last_calls.get(tier, 0))
            self._last_calls[tier] = n
        for reason, n in st.get("fallback_reasons", {}).items():
            key = f"{p}fallback/{_clean(reason)}"
            out[key] = out.get(key, 0.0) + float(n - self._last_reasons.get(reason, 0))
            self._last_reasons[reason] = n
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not _is_training_log(logs):
            return
        extra = self.metrics()
        logs.update(extra)
        # Trainer.log stored a copy of logs in log_history before calling us: complete that entry too.
        hist = getattr(state, "log_history", None)
        if hist and hist[-1].get("step") == state.global_step and set(hist[-1]) - {"step"} == set(logs) - set(extra):
            hist[-1].update(extra)
