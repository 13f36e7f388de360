"""The ``auto`` and ``audit`` policies: which backward tier each attention call gets, per layer, with hysteresis.

The router (``router.py``) calls, for modes "auto" and "audit",

    tier = policy.decide(record, q=q, k=k, lse=lse)       # once per call, by plan.make_plan
    ...  # the backward runs the planned tier
    policy.after_backward(record, tier=tier, grads=(dq, dk, dv), fp32_grads=callable)   # audit only

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
BF16 backward that rounds dS, S = 512, D = 64, random q, v, dO; the README has the table): the
measured dq error of the uncorrected backward is ≈ 0.2 × 2·u·R_k (the rounding errors add like a random walk;
coherent rounding such as the four-key witness reaches the full 2·u·R_k), on top of a ≈ 0.17 % floor every BF16
backward has — so at the 1 % threshold the leak is ≈ 0.25 %, inside the 0.5 % budget. GProj stayed at the floor
for query offsets up to R_q = 8 (predicted 6 %) and failed (≈ 100 %) at R_q = 64 with sharp attention, hence
fp32_enter = 10 %. Between samples a layer keeps its tier, so a layer cannot flap faster than once per
``sample_every`` steps, and only when its statistics cross the whole band between the exit and enter thresholds.

Sampling. A layer is measured on its first call and then on the first call of every ``sample_every``-th step
(default 20); other calls cost one dict lookup and never touch the tensors (no device sync). Steps are the
package's one step counter (``state.py``): ``set_step`` (the Trainer callback passes ``global_step``), else one
step per forward-then-backward round.

Layer identity: the name in the call's record, taken at its forward (the HF module name via
``layer_tracking``, ``"<Class>.<idx>"`` on the HF "gproj" path, else ``"call<i>"``, the i-th attention forward
of the step). The policy options are the record's too (``config.PolicyConfig``, fixed at the forward).
All records live in the package's runtime state (``state.STATE.layers``); ``gproj_patch.reset_stats()`` clears
them.

``audit``: the same tier choice; on sampled calls ``after_backward`` also evaluates the FP32-with-projection
gradient and records the relative discrepancy ‖g − g_fp32‖ / ‖g_fp32‖ of dq, dk, dv for the layer.
"""
from __future__ import annotations

import logging
import math
from types import MappingProxyType
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ..runtime import config as _config
from ..runtime.config import POLICY_OPTION_NAMES as OPTION_NAMES, TIERS, PolicyConfig
from ..runtime.state import STATE

MODES = _config.POLICY_MODES
_RANK = MappingProxyType({t: i for i, t in enumerate(TIERS)})  # a tier's position in TIERS: 0 original .. 2 fp32
_log = logging.getLogger("gproj_patch.policy")


class _Overrides:
    """``configure()``'s options, applied on top of the enabled options for calls made after it: configuration,
    not state (``reset(keep_config=False)`` clears it, ``reset_stats()`` does not). One instance, never re-bound."""

    def __init__(self) -> None:
        self.options: Dict[str, Any] = {}


OVERRIDES = _Overrides()


def options_from_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Policy options set in the environment, validated (ValueError naming the variable)."""
    cfg = _config.policy_options(environ)
    return {name: getattr(cfg, name) for name in OPTION_NAMES if getattr(cfg, name) != getattr(PolicyConfig(), name)}


def effective_config(base: PolicyConfig) -> PolicyConfig:
    """``base`` (the enabled options) with the ``configure()`` overrides applied."""
    return replace(base, **OVERRIDES.options) if OVERRIDES.options else base


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
    """One layer's policy state. ``tier`` is the policy's choice (what the hysteresis acts on); ``ran`` the tier
    that actually ran last (the choice "gproj" runs the FP32 tier where the kernel does not apply, e.g. on CPU).
    Reports name ``ran``."""
    name: str
    tier: str = "original"
    ran: Optional[str] = None
    calls: Dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})  # tiers that ran
    samples: int = 0
    sampled_bucket: Optional[int] = None
    last_sampled_step: Optional[int] = None
    stats: Dict[str, float] = field(default_factory=dict)
    transitions: int = 0
    audit: Dict[str, float] = field(default_factory=dict)
    audit_pending: bool = False
    unran: List[Dict[str, Any]] = field(default_factory=list)  # its events in STATE.events still without "ran"

    def as_dict(self) -> Dict[str, Any]:
        return {"tier": self.ran or self.tier, "policy_tier": self.tier, "calls": dict(self.calls), "samples": self.samples,
                "last_sampled_step": self.last_sampled_step, "transitions": self.transitions,
                "stats": dict(self.stats), "audit": dict(self.audit)}


def _sample(record, q, k, lse, rec: LayerRecord, step: int) -> Optional[Dict[str, float]]:
    """Run the detector on this call; None (tier kept, said once) if it fails."""
    from . import detector
    cfg = record.context.policy
    try:
        return detector.compute(q, k, lse, record.problem.scale, dtype=q.dtype, max_rows=cfg.max_rows,
                                use_graph=cfg.detector_graph).summary()
    except Exception as exc:  # a statistics failure must not stop training: keep the tier, say so once
        with STATE.lock:
            first, STATE.detector_failed = not STATE.detector_failed, True
        if first:
            _log.warning("the large-key detector failed (%s: %s) on layer %r; layers keep their current tier",
                         type(exc).__name__, exc, rec.name)
        return None


def _capturing(q) -> bool:
    """True while the current CUDA stream is being captured into a graph (``torch.cuda.graph``, inductor's
    cudagraph trees): no host read-back is allowed then."""
    if not getattr(q, "is_cuda", False):
        return False
    import torch
    return torch.cuda.is_current_stream_capturing()


def decide(record, *, q, k, lse) -> str:
    """Tier for the backward of ``record`` ("original", "gproj" or "fp32"; see the module docstring), decided
    once per call (``plan.make_plan``: at a hook's forward, or in the SDPA seam's backward op) on the call's q, k
    and LSE."""
    ctx = record.context
    if ctx.mode not in MODES:
        raise ValueError(f"policy.decide: mode must be one of {MODES}, got {ctx.mode!r}")
    cfg = ctx.policy
    with STATE.lock:
        rec = STATE.layers.get(ctx.layer)
        if rec is None:
            rec = STATE.layers[ctx.layer] = LayerRecord(ctx.layer)
        step = STATE.step()
        bucket = step // cfg.sample_every
        # never while a CUDA graph is being captured: the detector reads its statistics back to the host
        sample = rec.sampled_bucket != bucket and not _capturing(q)
        if sample:
            rec.sampled_bucket = bucket  # claim it: a concurrent call of the same layer does not re-sample
    summary = _sample(record, q, k, lse, rec, step) if sample else None
    with STATE.lock:
        if summary is not None:
            leak_dq, leak_dk = effective_leaks(summary, cfg)
            summary["leak_dq_eff"] = leak_dq
            old = rec.tier
            new = next_tier(old, leak_dq, leak_dk, cfg)
            rec.stats = summary
            rec.samples += 1
            rec.last_sampled_step = step
            rec.audit_pending = ctx.mode == "audit"
            if new != old:
                rec.transitions += 1
                rec.tier = new
                event = {"layer": ctx.layer, "step": step, "from": old, "to": new, "leak_dq": leak_dq,
                         "leak_dk": leak_dk, "r_k": summary["r_k"], "r_q": summary["r_q"], "p_sink": summary["p_sink"]}
                STATE.events.append(event)
                rec.unran.append(event)
        return rec.tier


def settled_tier(layer: str, cfg: PolicyConfig) -> Optional[str]:
    """The tier ``decide`` returns for a call of ``layer`` made now without sampling it: the layer's tier when its
    sample of this step's bucket was taken already; None when ``decide`` must run (the layer's first call, or a
    sample is due). Read without the lock (host time: every call of a settled layer asks): a sample another
    thread takes meanwhile may change the tier right after, as it may right after ``decide`` returns."""
    rec = STATE.layers.get(layer)
    if rec is None or rec.sampled_bucket != STATE.step() // cfg.sample_every:
        return None
    return rec.tier


def _count_ran(layer: str, tier: str) -> Optional[LayerRecord]:
    """Count the tier that ran for ``layer`` (caller holds ``STATE.lock``); the layer's record, None if none."""
    rec = STATE.layers.get(layer)
    if rec is None:
        return None
    rec.calls[tier] += 1
    rec.ran = tier
    for event in rec.unran:  # a transition names the tier that actually ran for it
        event["ran"] = tier
    rec.unran.clear()
    return rec


def count_ran(layer: str, tier: str) -> None:
    """Count the tier that ran for ``layer`` (a call that had no record: ``settled_tier`` answered for it)."""
    with STATE.lock:
        _count_ran(layer, tier)


def after_backward(record, *, tier: str, grads: Sequence[Optional[Any]] = (), step: Optional[int] = None,
                   fp32_grads: Optional[Callable[[], Sequence[Optional[Any]]]] = None) -> None:
    """Count the tier that ran for the record's layer; in audit mode, on a sampled call, compare ``grads``
    with ``fp32_grads()`` and record the discrepancy under ``step`` (the plan's: the step of the forward)."""
    with STATE.lock:
        rec = _count_ran(record.context.layer, tier)
        if rec is None:
            return
        if not rec.audit_pending or fp32_grads is None or record.context.mode != "audit":
            return
        rec.audit_pending = False
        if step is None:
            step = STATE.step()
    errs = relative_errors(grads[:3], fp32_grads()[:3])
    with STATE.lock:
        rec.audit = {**{f"err_{n}": e for n, e in zip(("dq", "dk", "dv"), errs)},
                     "step": step, "tier_rank": float(_RANK.get(tier, -1))}


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


def configure(**options) -> PolicyConfig:
    """Set policy options (names in ``OPTION_NAMES``) for calls made from now on, on top of the enabled ones;
    unknown names and bad values raise ValueError. Returns the options now in force."""
    merged = {**OVERRIDES.options, **options}
    _config.policy_options({}, **merged)  # validate before keeping anything
    OVERRIDES.options.clear()
    OVERRIDES.options.update(merged)
    return config()


def config() -> PolicyConfig:
    """The policy options a call made now gets."""
    cfg = _config.active() or _config.resolve()
    return effective_config(cfg.policy)


def set_step(step: int) -> None:
    """Declare the current training step (sampling is every ``sample_every`` steps)."""
    STATE.set_step(step)


def new_step() -> None:
    """Advance the step counter by one and restart call numbering (for loops that do not call set_step)."""
    STATE.new_step()


def current_step() -> int:
    return STATE.step()


def stats() -> Dict[str, Dict[str, Any]]:
    """Per-layer records: tier, calls per tier, samples, last statistics, audit discrepancies."""
    with STATE.lock:
        return {name: rec.as_dict() for name, rec in STATE.layers.items()}


def pop_events() -> List[Dict[str, Any]]:
    """Tier transitions since the last call (each a dict with layer, step, from, to — the policy's choice —,
    ran — the tier that then ran —, and the statistics)."""
    with STATE.lock:
        out, STATE.events = STATE.events, []
        for rec in STATE.layers.values():  # popped events are the caller's now: never marked after this
            rec.unran.clear()
        return out


def reset(keep_config: bool = True) -> None:
    """Clear the runtime state (every layer record, event, step and counter: ``state.reset()``);
    ``keep_config=False`` also drops ``configure()`` overrides."""
    if not keep_config:
        OVERRIDES.options.clear()
    STATE.reset()


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
