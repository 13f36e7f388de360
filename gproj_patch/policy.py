"""The ``auto`` and ``audit`` policies: which backward tier each attention call gets, per layer, with hysteresis.

The dispatcher (``backends/dispatch.py``) calls, for modes "auto" and "audit",

    tier = policy.decide(q=q, k=k, lse=lse, scale=scale, layer=layer, mode=mode, dtype=q.dtype)
    ...  # run the tier's backward
    policy.after_backward(layer=layer, tier=tier, grads=(dq, dk, dv), fp32_grads=callable)   # audit only

``tier`` is one of ``"original"`` (the fused backward unchanged), ``"gproj"``, ``"fp32"`` (FP32 with projection).

Rule (``auto``). On a *sampled* call the detector (``detector.py``) predicts

    leak_dq = 2·u·R_k · a      a = 1 / max(1 − p_sink, 1/max_amplification)   (sink amplification, optional)
    leak_dk = 2·u·R_q                                                           (GProj's residual dk error)

(worst (batch, head) of the call) and the layer moves between tiers with separate enter/exit thresholds:

    fp32      if leak_dk ≥ fp32_enter,  or the layer is in fp32 and leak_dk ≥ fp32_exit
    gproj     else if leak_dq ≥ gproj_enter, or the layer is above "original" and leak_dq ≥ gproj_exit
    original  otherwise

Defaults (BF16 numbers; FP16's u is 8× smaller): gproj_enter = 1 %, gproj_exit = 0.5 % (R_k ≥ 1.28 enters,
R_k < 0.64 leaves); fp32_enter = 10 %, fp32_exit = 5 % (R_q ≥ 12.8 enters). Calibration (fp64 emulation of a
BF16 backward that rounds dS, S = 512, D = 64, random q, v, dO; ``docs/README_training.md`` has the table): the
measured dq error of the uncorrected backward is ≈ 0.2 × 2·u·R_k (the rounding errors add like a random walk;
coherent rounding such as the four-key witness reaches the full 2·u·R_k), on top of a ≈ 0.17 % floor every BF16
backward has — so at the 1 % threshold the leak is ≈ 0.25 %, inside the 0.5 % budget. GProj stayed at the floor
for query offsets up to R_q = 8 (predicted 6 %) and failed (≈ 100 %) at R_q = 64 with sharp attention, hence
fp32_enter = 10 %. Between samples a layer keeps its tier, so a layer cannot flap faster than once per
``sample_every`` steps, and only when its statistics cross the whole band between the exit and enter thresholds.

Sampling. A layer is measured on its first call and then on the first call of every ``sample_every``-th step
(default 20); other calls cost one dict lookup and never touch the tensors (no device sync). Steps come from
``set_step`` (the Trainer callback passes ``global_step``) or, without it, are counted as backward passes
(autograd graph tasks).

Layer identity: the name the dispatcher passes (the HF module name, via ``layer_tracking``), else
``"call<i>"`` — the i-th attention backward within the current backward pass (reverse forward order).

``audit``: the same tier choice; on sampled calls ``after_backward`` also evaluates the FP32-with-projection
gradient and records the relative discrepancy ‖g − g_fp32‖ / ‖g_fp32‖ of dq, dk, dv for the layer.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from . import config as _patch_config

TIERS = ("original", "gproj", "fp32")
MODES = ("auto", "audit")
_RANK = {t: i for i, t in enumerate(TIERS)}
_log = logging.getLogger("gproj_patch.policy")


@dataclass(frozen=True)
class PolicyConfig:
    sample_every: int = 20
    gproj_enter: float = 0.01
    gproj_exit: float = 0.005
    fp32_enter: float = 0.10
    fp32_exit: float = 0.05
    sink_amplification: bool = True
    max_amplification: float = 100.0
    max_rows: int = 256  # detector.DEFAULT_MAX_ROWS (this module imports torch lazily: startup validates it)

    def __post_init__(self):
        if not isinstance(self.sample_every, int) or isinstance(self.sample_every, bool) or self.sample_every < 1:
            raise ValueError(f"sample_every must be an integer >= 1, got {self.sample_every!r}")
        if not isinstance(self.max_rows, int) or isinstance(self.max_rows, bool) or self.max_rows < 2:
            raise ValueError(f"max_rows must be an integer >= 2, got {self.max_rows!r}")
        for name in ("gproj_enter", "gproj_exit", "fp32_enter", "fp32_exit"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0.0 <= v < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0 (a relative error, 0.005 = 0.5%), got {v!r}")
        if self.gproj_exit > self.gproj_enter:
            raise ValueError(f"gproj_exit ({self.gproj_exit}) must not exceed gproj_enter ({self.gproj_enter})")
        if self.fp32_exit > self.fp32_enter:
            raise ValueError(f"fp32_exit ({self.fp32_exit}) must not exceed fp32_enter ({self.fp32_enter})")
        if not (isinstance(self.max_amplification, (int, float)) and self.max_amplification >= 1.0):
            raise ValueError(f"max_amplification must be >= 1, got {self.max_amplification!r}")


OPTION_NAMES = tuple(f.name for f in fields(PolicyConfig))

#: Environment variables read by ``options_from_env`` (strings parsed to the option's type).
ENV_OPTIONS = {
    "GPROJ_SAMPLE_EVERY": "sample_every",
    "GPROJ_AUTO_ENTER": "gproj_enter",
    "GPROJ_AUTO_EXIT": "gproj_exit",
    "GPROJ_FP32_ENTER": "fp32_enter",
    "GPROJ_FP32_EXIT": "fp32_exit",
    "GPROJ_SINK_AMPLIFICATION": "sink_amplification",
    "GPROJ_DETECTOR_ROWS": "max_rows",
}


def _parse(env: str, option: str, text: str) -> Any:
    kind = type(getattr(PolicyConfig(), option))
    try:
        if kind is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        return kind(text.strip())
    except ValueError:
        expect = {bool: "0 or 1", int: "an integer", float: "a number"}[kind]
        raise ValueError(f"{env}={text!r}: expected {expect} (policy option {option!r})") from None


def options_from_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Policy options set in the environment (see ``ENV_OPTIONS``); raises ValueError on a malformed value."""
    environ = os.environ if environ is None else environ
    out = {opt: _parse(env, opt, environ[env]) for env, opt in ENV_OPTIONS.items() if environ.get(env, "") != ""}
    replace(PolicyConfig(), **out)  # range checks, with the option's name in the message
    return out


def next_tier(current: str, leak_dq: float, leak_dk: float, cfg: PolicyConfig) -> str:
    """The hysteresis rule (pure function; see the module docstring)."""
    if leak_dk >= cfg.fp32_enter or (current == "fp32" and leak_dk >= cfg.fp32_exit):
        return "fp32"
    if leak_dq >= cfg.gproj_enter or (_RANK[current] > 0 and leak_dq >= cfg.gproj_exit):
        return "gproj"
    return "original"


def effective_leaks(summary: Mapping[str, float], cfg: PolicyConfig) -> tuple:
    """(leak_dq with sink amplification, leak_dk) from a detector summary."""
    amp = 1.0
    p = summary.get("p_sink", float("nan"))
    if cfg.sink_amplification and p == p:
        amp = 1.0 / max(1.0 - p, 1.0 / cfg.max_amplification)
    return summary["leak_dq"] * amp, summary["leak_dk"]


@dataclass
class LayerRecord:
    name: str
    tier: str = "original"
    calls: Dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    samples: int = 0
    sampled_bucket: Optional[int] = None
    last_sampled_step: Optional[int] = None
    stats: Dict[str, float] = field(default_factory=dict)
    transitions: int = 0
    audit: Dict[str, float] = field(default_factory=dict)
    audit_pending: bool = False

    def as_dict(self) -> Dict[str, Any]:
        return {"tier": self.tier, "calls": dict(self.calls), "samples": self.samples,
                "last_sampled_step": self.last_sampled_step, "transitions": self.transitions,
                "stats": dict(self.stats), "audit": dict(self.audit)}


class _Policy:
    def __init__(self):
        self.lock = threading.RLock()
        self.overrides: Dict[str, Any] = {}
        self._config: Optional[PolicyConfig] = None
        self._config_for: Any = None
        self.local = threading.local()
        self.reset()

    @property
    def config(self) -> PolicyConfig:
        """Defaults < environment (``ENV_OPTIONS``) < options given to ``enable()`` < ``configure()``;
        recomputed whenever the patch is enabled anew."""
        active = _patch_config.active()
        if self._config is None or active is not self._config_for:
            with self.lock:
                opts = options_from_env()
                if active is not None:
                    opts.update({k: v for k, v in active.extra if k in OPTION_NAMES})
                opts.update(self.overrides)
                self._config = replace(PolicyConfig(), **opts)
                self._config_for = active
        return self._config

    def configure(self, **options) -> PolicyConfig:
        with self.lock:
            merged = {**self.overrides, **options}
            replace(PolicyConfig(), **merged)  # validate before keeping anything
            self.overrides = merged
            self._config = None
            return self.config

    def reset(self, keep_config: bool = True) -> None:
        with self.lock:
            if not keep_config:
                self.overrides = {}
                self._config = None
            self.records: Dict[str, LayerRecord] = {}
            self.events: List[Dict[str, Any]] = []
            self.explicit_step: Optional[int] = None
            self.implicit_step = 0
            self.graph_task: Optional[int] = None
            self.call_index = 0
            self.detector_failed = False

    # --- steps and layer names -------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        with self.lock:
            if step != self.explicit_step:
                self.call_index = 0
            self.explicit_step = int(step)

    def new_step(self) -> None:
        with self.lock:
            if self.explicit_step is not None:
                self.explicit_step += 1
            else:
                self.implicit_step += 1
            self.call_index = 0

    def step(self) -> int:
        return self.explicit_step if self.explicit_step is not None else self.implicit_step

    def _observe_call(self) -> int:
        """Track backward passes (autograd graph tasks); return this call's index within the pass."""
        import torch
        gt = torch._C._current_graph_task_id() if hasattr(torch._C, "_current_graph_task_id") else -1
        if gt >= 0 and gt != self.graph_task:
            if self.graph_task is not None and self.explicit_step is None:
                self.implicit_step += 1
            self.graph_task = gt
            self.call_index = 0
        i = self.call_index
        self.call_index += 1
        return i

    # --- the dispatcher's entry points -----------------------------------------------------------------
    def decide(self, *, q, k, lse, scale=None, layer=None, mode="auto", dtype=None) -> str:
        if mode not in MODES:
            raise ValueError(f"policy.decide: mode must be one of {MODES}, got {mode!r}")
        with self.lock:
            i = self._observe_call()
            name = layer if layer else f"call{i}"
            rec = self.records.get(name)
            if rec is None:
                rec = self.records[name] = LayerRecord(name)
            step = self.step()
            cfg = self.config
            bucket = step // cfg.sample_every
            sample = rec.sampled_bucket != bucket
            if sample:
                rec.sampled_bucket = bucket  # claim it: a concurrent call of the same layer does not re-sample
        self.local.last_layer = name
        if sample:
            from . import detector
            try:
                summary = detector.compute(q, k, lse, scale, dtype=dtype or q.dtype, max_rows=cfg.max_rows).summary()
            except Exception as exc:  # a statistics failure must not stop training: keep the tier, say so once
                if not self.detector_failed:
                    self.detector_failed = True
                    _log.warning("gproj_patch: the large-key detector failed (%s: %s) on layer %r; "
                                 "layers keep their current tier", type(exc).__name__, exc, name)
                sample = False
        if sample:
            leak_dq, leak_dk = effective_leaks(summary, cfg)
            summary["leak_dq_eff"] = leak_dq
            with self.lock:
                old = rec.tier
                new = next_tier(old, leak_dq, leak_dk, cfg)
                rec.stats = summary
                rec.samples += 1
                rec.last_sampled_step = step
                rec.audit_pending = mode == "audit"
                if new != old:
                    rec.transitions += 1
                    rec.tier = new
                    self.events.append({"layer": name, "step": step, "from": old, "to": new,
                                        "leak_dq": leak_dq, "leak_dk": leak_dk, "r_k": summary["r_k"],
                                        "r_q": summary["r_q"], "p_sink": summary["p_sink"]})
        with self.lock:
            tier = rec.tier
            rec.calls[tier] += 1
        return tier

    def after_backward(self, *, layer=None, tier=None, grads: Sequence[Optional[torch.Tensor]] = (),
                       fp32_grads: Optional[Callable[[], Sequence[Optional[torch.Tensor]]]] = None) -> None:
        name = layer if layer else getattr(self.local, "last_layer", None)
        with self.lock:
            rec = self.records.get(name) if name is not None else None
            if rec is None or not rec.audit_pending or fp32_grads is None:
                return
            rec.audit_pending = False
            step = self.step()
        ref = fp32_grads()
        errs = relative_errors(grads, ref)
        with self.lock:
            rec.audit = {**{f"err_{n}": e for n, e in zip(("dq", "dk", "dv"), errs)},
                         "step": step, "tier_rank": float(_RANK.get(tier, -1))}

    # --- reporting ------------------------------------------------------------------------------------
    def stats(self) -> Dict[str, Dict[str, Any]]:
        with self.lock:
            return {name: rec.as_dict() for name, rec in self.records.items()}

    def pop_events(self) -> List[Dict[str, Any]]:
        with self.lock:
            out, self.events = self.events, []
            return out


def relative_errors(grads, ref) -> List[float]:
    """‖g − r‖ / ‖r‖ for each pair (fp32; NaN where either is None); one device sync."""
    import torch
    vals = []
    for g, r in zip(grads, ref):
        if g is None or r is None:
            vals.append(torch.tensor(float("nan")))
            continue
        g32, r32 = g.detach().float(), r.detach().float().to(g.device)
        vals.append(((g32 - r32).norm() / r32.norm().clamp_min(1e-30)).cpu())
    return torch.stack(vals).tolist() if vals else []


_POLICY = _Policy()


def configure(**options) -> PolicyConfig:
    """Set policy options (names in ``OPTION_NAMES``); unknown names and bad values raise ValueError."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(f"unknown policy option(s) {unknown}; valid: {list(OPTION_NAMES)}")
    return _POLICY.configure(**options)


def config() -> PolicyConfig:
    return _POLICY.config


def decide(*, q, k, lse, scale=None, layer=None, mode="auto", dtype=None) -> str:
    """Tier for one backward call: "original", "gproj" or "fp32" (see the module docstring)."""
    return _POLICY.decide(q=q, k=k, lse=lse, scale=scale, layer=layer, mode=mode, dtype=dtype)


def after_backward(*, layer=None, tier=None, grads=(), fp32_grads=None) -> None:
    """Audit hook: on a sampled call, compare ``grads`` with ``fp32_grads()`` and record the discrepancy."""
    _POLICY.after_backward(layer=layer, tier=tier, grads=grads, fp32_grads=fp32_grads)


def set_step(step: int) -> None:
    """Declare the current training step (sampling is every ``sample_every`` steps)."""
    _POLICY.set_step(step)


def new_step() -> None:
    """Advance the step counter by one and restart call numbering (for loops that do not call set_step)."""
    _POLICY.new_step()


def current_step() -> int:
    return _POLICY.step()


def stats() -> Dict[str, Dict[str, Any]]:
    """Per-layer records: tier, calls per tier, samples, last statistics, audit discrepancies."""
    return _POLICY.stats()


def pop_events() -> List[Dict[str, Any]]:
    """Tier transitions since the last call (each a dict with layer, step, from, to and the statistics)."""
    return _POLICY.pop_events()


def reset(keep_config: bool = True) -> None:
    """Forget every layer record, event and step counter; ``keep_config=False`` also drops ``configure()``
    overrides (the environment and ``enable()`` options still apply)."""
    _POLICY.reset(keep_config)


_LOG_STATS = ("r_k", "r_q", "leak_dq", "leak_dq_eff", "leak_dk", "logit_bound", "lse_gap", "p_sink")


def log_dict(prefix: str = "gproj/") -> Dict[str, float]:
    """Flat float metrics for loggers: ``{prefix}{layer}/{stat}``, the tier as 0/1/2 (original/gproj/fp32),
    audit errors, and ``{prefix}layers/{tier}`` counts."""
    out: Dict[str, float] = {}
    counts = {t: 0 for t in TIERS}
    for name, rec in stats().items():
        counts[rec["tier"]] += 1
        base = f"{prefix}{name}/"
        out[base + "tier"] = float(_RANK[rec["tier"]])
        for key in _LOG_STATS:
            v = rec["stats"].get(key)
            if v is not None and v == v and abs(v) != math.inf:
                out[base + key] = float(v)
        for key, v in rec["audit"].items():
            if key.startswith("err_") and v == v:
                out[base + "audit_" + key] = float(v)
    for t, n in counts.items():
        out[f"{prefix}layers/{t}"] = float(n)
    return out
