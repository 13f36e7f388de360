"""Options of the patch and of the ``auto``/``audit`` policy, with their environment variables.

Precedence, per option: keyword argument of ``enable()`` (or ``GProjCallback``) > environment variable >
default. Every value that is used is checked when ``resolve()`` runs — at ``enable()`` / callback construction,
never at the first backward — and a bad one raises ``ValueError`` naming the option (or the variable) and the
accepted values. An environment variable is read only for options not given as keywords, so a keyword wins
even over an invalid environment value. Unknown keywords raise.

| option              | variable                  | values                                           | default |
|---------------------|---------------------------|--------------------------------------------------|---------|
| mode                | GPROJ_MODE                | gproj, fp32, off, auto, audit                    | gproj   |
| targets             | GPROJ_TARGETS             | non-empty comma list of the registered targets   | all     |
|                     |                           | (runtime/hooks.py: sdpa, flash_attn, transformers, |       |
|                     |                           | hf_eager, flex, context_parallel)                |         |
| tier                | GPROJ_TIER                | auto (kernel where supported, else FP32 tier),   | auto    |
|                     |                           | triton (kernel or error), fp32 (FP32 tier)       |         |
| kv_major            | GPROJ_KV_MAJOR            | auto (the Gluon KV-major launch where supported  | auto    |
|                     |                           | and faster: sm_90, D=64/128), tl (never Gluon)   |         |
| dq_major            | GPROJ_DQ_MAJOR            | auto (the Gluon dQ-major launch where supported  | auto    |
|                     |                           | and faster: sm_90, D=128), tl (never Gluon)      |         |
| log_level           | GPROJ_LOG_LEVEL           | DEBUG, INFO, WARNING, ERROR or an int >= 0       | WARNING |
| sample_every        | GPROJ_SAMPLE_EVERY        | int >= 1: detector sampling period in steps      | 20      |
| gproj_enter / _exit | GPROJ_AUTO_ENTER / _EXIT  | predicted dq leak that moves a layer to / from   | 0.01 /  |
|                     |                           | GProj (exit <= enter)                            | 0.005   |
| fp32_enter / _exit  | GPROJ_FP32_ENTER / _EXIT  | predicted GProj dk error for the FP32 tier       | 0.10 / 0.05 |
| sink_amplification  | GPROJ_SINK_AMPLIFICATION  | bool: scale the dq prediction by 1/(1 − p_sink)  | true    |
| max_amplification   | —                         | number >= 1: cap of that factor                  | 100     |
| max_rows            | GPROJ_DETECTOR_ROWS       | int >= 2: rows per (batch, head) the detector reads | 256  |
| detector_graph      | GPROJ_DETECTOR_GRAPH      | bool: replay the detector as a CUDA graph        | true    |

Booleans accept 1/0, true/false, yes/no, on/off. ``GPROJ_DETERMINISTIC`` (0.1) is gone: every tier is bitwise
deterministic (no atomics), so the option changed nothing.

This module imports nothing from the package but the registry of target names, ``runtime/hooks.py`` (which imports
nothing): config is read by everyone.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from . import hooks as _hooks

MODES = ("gproj", "fp32", "off", "auto", "audit")
POLICY_MODES = ("auto", "audit")
#: the tiers a backward can run, the one definition every layer imports (this module imports only the target
#: registry). The order is the ``auto`` policy's rank, least to most precise (and slowest): 0 "original" (the
#: caller's own backward, uncorrected), 1 "gproj" (the GProj kernel), 2 "fp32" (FP32 attention with the
#: projection); the policy's hysteresis and the 0/1/2 it logs per layer read that position.
TIERS = ("original", "gproj", "fp32")
TIER_OPTIONS = ("auto", "triton", "fp32")
#: the kernel tier's KV-major and dQ-major launches: "auto" (``plan.kv_major_choice`` / ``plan.dq_major_choice``
#: choose per call), "tl"
KV_MAJOR_OPTIONS = DQ_MAJOR_OPTIONS = ("auto", "tl")
_LEVELS = MappingProxyType({"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
                            "WARN": logging.WARNING, "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL})
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_TARGET_ALIASES = MappingProxyType({"flash-attn": "flash_attn", "flashattn": "flash_attn", "fa": "flash_attn",
                                    "flex_attention": "flex", "eager": "hf_eager"})


def _choice(name: str, value, allowed) -> str:
    if not isinstance(value, str) or value.strip().lower() not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value.strip().lower()


def parse_targets(name: str, value) -> Tuple[str, ...]:
    """The named targets in the registry's order (``runtime/hooks.HOOKS``, read at each call)."""
    known = _hooks.TARGETS
    if isinstance(value, str):
        items = [t.strip().lower() for t in value.split(",") if t.strip()]
    else:
        try:
            items = [str(t).strip().lower() for t in value]
        except TypeError:
            raise ValueError(f"{name} must be a comma list or a sequence of {', '.join(known)}; got {value!r}") \
                from None
    items = [_TARGET_ALIASES.get(t, t) for t in items]
    bad = [t for t in items if t not in known]
    if bad:
        raise ValueError(f"{name}: unknown target(s) {', '.join(map(repr, bad))}; known: {', '.join(known)}")
    if not items:
        raise ValueError(f"{name} is empty: name at least one of {', '.join(known)} (or do not enable the patch)")
    return tuple(t for t in known if t in items)


def _int_text(text: str) -> Optional[int]:
    """The int an optionally signed run of ASCII digits spells, else None (so that "--5" or "²" get this
    module's message naming the option, not int()'s own)."""
    digits = text[1:] if text[:1] in ("+", "-") else text
    return int(text) if digits.isascii() and digits.isdigit() else None


def parse_log_level(name: str, value) -> int:
    """A level name, or an int >= 0: logging's levels run from NOTSET (0) up; a negative number is no level
    (logging would take it and then let every record through)."""
    level = value
    if isinstance(value, str):
        s = value.strip()
        level = _LEVELS[s.upper()] if s.upper() in _LEVELS else _int_text(s)
    if isinstance(level, int) and not isinstance(level, bool) and level >= 0:
        return level
    raise ValueError(f"{name} must be one of {', '.join(_LEVELS)} or an int >= 0; got {value!r}")


def parse_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name}={value!r}: expected a boolean (1/0, true/false, yes/no, on/off)")


def parse_int(name: str, value) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _int_text(value.strip()) is not None:
        return _int_text(value.strip())
    raise ValueError(f"{name}={value!r}: expected an integer")


def parse_float(name: str, value) -> float:
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: expected a number") from None


#: the range of the four enter/exit thresholds (NaN is outside it: every comparison with it is false)
_THRESHOLD = (lambda v: 0.0 <= v < math.inf, "a finite number >= 0 (a relative error, 0.005 = 0.5%)")
#: each policy option's own range: (whether a value is in it, what the value must be); PolicyConfig checks them
#: under the options' names, policy_options under the keyword or variable that set each value
_RANGES: Mapping[str, Tuple[Callable[[Any], bool], str]] = MappingProxyType({
    "sample_every": (lambda v: v >= 1, "an integer >= 1"),
    "gproj_enter": _THRESHOLD, "gproj_exit": _THRESHOLD, "fp32_enter": _THRESHOLD, "fp32_exit": _THRESHOLD,
    "max_amplification": (lambda v: v >= 1.0, "a number >= 1"),
    "max_rows": (lambda v: v >= 2, "an integer >= 2"),
})
#: (enter, exit) threshold pairs: exit <= enter, the hysteresis of the policy
_PAIRS = (("gproj_enter", "gproj_exit"), ("fp32_enter", "fp32_exit"))


def _check_range(label: str, name: str, value) -> None:
    in_range, what = _RANGES[name]
    if not in_range(value):
        raise ValueError(f"{label} must be {what}; got {value!r}")


def _check_order(value: Callable[[str], Any], said: Callable[[str], str]) -> None:
    """exit <= enter for each pair; ``said(name)`` is how the message names an option and its value."""
    for enter, exit_ in _PAIRS:
        if value(exit_) > value(enter):
            raise ValueError(f"{said(exit_)} must not exceed {said(enter)}")


@dataclass(frozen=True)
class PolicyConfig:
    """Options of the ``auto``/``audit`` policy (``policy.py`` explains the rule and the calibration)."""
    sample_every: int = 20
    gproj_enter: float = 0.01
    gproj_exit: float = 0.005
    fp32_enter: float = 0.10
    fp32_exit: float = 0.05
    sink_amplification: bool = True
    max_amplification: float = 100.0
    max_rows: int = 256
    detector_graph: bool = True

    def __post_init__(self):
        for name in _RANGES:
            _check_range(name, name, getattr(self, name))
        _check_order(lambda name: getattr(self, name), lambda name: f"{name} ({getattr(self, name)})")


POLICY_OPTION_NAMES = tuple(f.name for f in fields(PolicyConfig))


@dataclass(frozen=True)
class Config:
    mode: str = "gproj"
    targets: Tuple[str, ...] = field(default_factory=lambda: _hooks.TARGETS)  # every registered target
    tier: str = "auto"
    kv_major: str = "auto"
    dq_major: str = "auto"
    log_level: int = logging.WARNING
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    #: CPU fp16 tensors may run the GProj kernel through Triton's interpreter: tier "triton" (keyword or
    #: GPROJ_TIER), or TRITON_INTERPRET set when the options were resolved (``enable()``). Decided here, once,
    #: so that no backward reads the environment.
    cpu_kernel: bool = False


@dataclass(frozen=True)
class _Option:
    env: Optional[str]
    parse: Callable[[str, Any], Any]
    #: an empty variable is an (invalid) value, not "unset": GPROJ_TARGETS="" names no target and raises
    empty_is_value: bool = False


_CORE: Mapping[str, _Option] = MappingProxyType({
    "mode": _Option("GPROJ_MODE", lambda n, v: _choice(n, v, MODES)),
    "targets": _Option("GPROJ_TARGETS", parse_targets, empty_is_value=True),
    "tier": _Option("GPROJ_TIER", lambda n, v: _choice(n, v, TIER_OPTIONS)),
    "kv_major": _Option("GPROJ_KV_MAJOR", lambda n, v: _choice(n, v, KV_MAJOR_OPTIONS)),
    "dq_major": _Option("GPROJ_DQ_MAJOR", lambda n, v: _choice(n, v, DQ_MAJOR_OPTIONS)),
    "log_level": _Option("GPROJ_LOG_LEVEL", parse_log_level),
})
_POLICY: Mapping[str, _Option] = MappingProxyType({
    "sample_every": _Option("GPROJ_SAMPLE_EVERY", parse_int),
    "gproj_enter": _Option("GPROJ_AUTO_ENTER", parse_float),
    "gproj_exit": _Option("GPROJ_AUTO_EXIT", parse_float),
    "fp32_enter": _Option("GPROJ_FP32_ENTER", parse_float),
    "fp32_exit": _Option("GPROJ_FP32_EXIT", parse_float),
    "sink_amplification": _Option("GPROJ_SINK_AMPLIFICATION", parse_bool),
    "max_amplification": _Option(None, parse_float),
    "max_rows": _Option("GPROJ_DETECTOR_ROWS", parse_int),
    "detector_graph": _Option("GPROJ_DETECTOR_GRAPH", parse_bool),
})
OPTION_NAMES = tuple(_CORE) + tuple(_POLICY)
#: every environment variable the patch reads (besides GPROJ_PATCH, the start-up switch)
ENV = MappingProxyType({name: opt.env for name, opt in {**_CORE, **_POLICY}.items() if opt.env})
OBSOLETE_ENV = MappingProxyType(
    {"GPROJ_DETERMINISTIC": "every tier is bitwise deterministic (no atomics); the variable is ignored"})


def _pick(options: Dict[str, _Option], explicit: Mapping[str, Any], environ: Mapping[str, str]) -> Dict[str, Any]:
    """{option: parsed value} of the options given, each from its keyword, else its variable."""
    return {name: value for name, (value, _source) in _pick_sourced(options, explicit, environ).items()}


def _pick_sourced(options, explicit, environ) -> Dict[str, Tuple[Any, str]]:
    out = {}
    for name, opt in options.items():
        if name in explicit:
            out[name] = (opt.parse(name, explicit[name]), name)
        elif _env_gives(opt, environ):
            out[name] = (opt.parse(opt.env, environ[opt.env]), opt.env)
    return out


def _env_gives(opt: _Option, environ: Mapping[str, str]) -> bool:
    """Whether the environment sets the option: an empty variable is unset unless empty is a value."""
    return bool(opt.env) and (environ.get(opt.env, "") != "" or (opt.empty_is_value and opt.env in environ))


def env_gives(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the environment sets option ``name`` (as ``resolve()`` reads it: GPROJ_LOG_LEVEL="" is unset)."""
    opt = _CORE[name] if name in _CORE else _POLICY[name]
    return _env_gives(opt, os.environ if environ is None else environ)


def policy_options(environ: Optional[Mapping[str, str]] = None, **explicit) -> PolicyConfig:
    """A validated PolicyConfig from keywords > environment > defaults (ValueError on a bad or unknown one)."""
    unknown = sorted(set(explicit) - set(_POLICY))
    if unknown:
        raise ValueError(f"unknown policy option(s) {', '.join(unknown)}; known: {', '.join(_POLICY)}")
    environ = os.environ if environ is None else environ
    picked = _pick_sourced(_POLICY, explicit, environ)
    for name, (value, source) in picked.items():  # each value's own range, naming its keyword or variable
        if name in _RANGES:
            _check_range(source, name, value)
    values = {name: value for name, (value, _source) in picked.items()}
    defaults = PolicyConfig()

    def said(name: str) -> str:  # an enter/exit pair may mix keywords, variables and defaults
        if name in picked:
            return f"{picked[name][1]} ({picked[name][0]})"
        return f"{name} ({getattr(defaults, name)}, the default)"
    _check_order(lambda name: values.get(name, getattr(defaults, name)), said)
    return replace(defaults, **values)


def resolve(mode=None, targets=None, environ: Optional[Mapping[str, str]] = None, **options) -> Config:
    """Build and validate a Config: keywords first, then the environment, then defaults."""
    environ = os.environ if environ is None else environ
    explicit = dict(options)
    if mode is not None:
        explicit["mode"] = mode
    if targets is not None:
        explicit["targets"] = targets
    unknown = sorted(set(explicit) - set(OPTION_NAMES))
    if unknown:
        hint = " ('deterministic' was removed: every tier is deterministic)" if "deterministic" in unknown else ""
        raise ValueError(f"unknown option(s) {', '.join(unknown)}{hint}; known: {', '.join(OPTION_NAMES)}")
    core = _pick(_CORE, explicit, environ)
    policy = policy_options(environ, **{k: v for k, v in explicit.items() if k in _POLICY})
    cpu_kernel = core.get("tier") == "triton" or environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return replace(Config(), **core, policy=policy, cpu_kernel=cpu_kernel)


def from_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The core options set in the environment, parsed (ValueError naming the variable)."""
    return _pick(_CORE, {}, os.environ if environ is None else environ)


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Parse every GPROJ_* variable the patch reads (ValueError naming the first bad one)."""
    resolve(environ=environ)


class _Active:
    """The one holder of the enabled Config (mutated by ``set_active``, never re-bound: no ``global``)."""
    config: Optional[Config] = None


ACTIVE = _Active()


def active() -> Optional[Config]:
    """The Config of the current ``enable()``, or None when the patch is off."""
    return ACTIVE.config


def set_active(cfg: Optional[Config]) -> None:
    """Make ``cfg`` the enabled configuration (None: the patch is off). Called by ``enable()``/``disable()``
    (``gproj_patch/__init__.py``, which owns turning the patch on and off) and by the audit's scoped runs."""
    ACTIVE.config = cfg
