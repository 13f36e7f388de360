"""Options of the patch and their environment variables.

Precedence: keyword arguments of ``enable()`` > environment variables > defaults. Every value is checked;
a bad value raises ``ValueError`` naming the option (or variable) and the accepted values.

| option          | variable               | values                                              | default |
|-----------------|------------------------|-----------------------------------------------------|---------|
| mode            | GPROJ_MODE             | gproj, fp32, off, auto, audit                       | gproj   |
| targets         | GPROJ_TARGETS          | comma list of sdpa, flash_attn, transformers        | all     |
| tier            | GPROJ_TIER             | auto (kernel where supported, else FP32 tier),      | auto    |
|                 |                        | triton (kernel or error), fp32 (always FP32 tier)   |         |
| log_level       | GPROJ_LOG_LEVEL        | DEBUG, INFO, WARNING, ERROR or an int               | WARNING |
| deterministic   | GPROJ_DETERMINISTIC    | 0/1, true/false, yes/no, on/off                     | false   |
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Tuple

MODES = ("gproj", "fp32", "off", "auto", "audit")
TARGETS = ("sdpa", "flash_attn", "transformers")
TIERS = ("auto", "triton", "fp32")
_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "WARN": logging.WARNING,
           "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")

ENV = {"mode": "GPROJ_MODE", "targets": "GPROJ_TARGETS", "tier": "GPROJ_TIER", "log_level": "GPROJ_LOG_LEVEL",
       "deterministic": "GPROJ_DETERMINISTIC"}


@dataclass(frozen=True)
class Config:
    mode: str = "gproj"
    targets: Tuple[str, ...] = TARGETS
    tier: str = "auto"
    log_level: int = logging.WARNING
    deterministic: bool = False
    extra: Tuple[Tuple[str, object], ...] = field(default=())  # options for other modules (policy), kept as given


def _choice(name: str, value, allowed) -> str:
    if not isinstance(value, str) or value.strip().lower() not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value.strip().lower()


def parse_targets(name: str, value) -> Tuple[str, ...]:
    if isinstance(value, str):
        items = [t.strip().lower() for t in value.split(",") if t.strip()]
    else:
        try:
            items = [str(t).strip().lower() for t in value]
        except TypeError:
            raise ValueError(f"{name} must be a comma list or a sequence of {', '.join(TARGETS)}; got {value!r}") \
                from None
    items = ["flash_attn" if t in ("flash-attn", "flashattn", "fa") else t for t in items]
    bad = [t for t in items if t not in TARGETS]
    if bad:
        raise ValueError(f"{name}: unknown target(s) {', '.join(map(repr, bad))}; known: {', '.join(TARGETS)}")
    return tuple(dict.fromkeys(items))


def parse_log_level(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a logging level name or an int; got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        s = value.strip()
        if s.upper() in _LEVELS:
            return _LEVELS[s.upper()]
        if s.lstrip("-").isdigit():
            return int(s)
    raise ValueError(f"{name} must be one of {', '.join(_LEVELS)} or an int; got {value!r}")


def parse_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be a boolean (1/0, true/false, yes/no, on/off); got {value!r}")


_PARSERS = {
    "mode": lambda n, v: _choice(n, v, MODES),
    "targets": parse_targets,
    "tier": lambda n, v: _choice(n, v, TIERS),
    "log_level": parse_log_level,
    "deterministic": parse_bool,
}


def from_env(environ: Optional[Mapping[str, str]] = None) -> dict:
    """The options set in the environment, parsed (raises ValueError naming the variable)."""
    environ = os.environ if environ is None else environ
    out = {}
    for opt, var in ENV.items():
        if var in environ:
            out[opt] = _PARSERS[opt](var, environ[var])
    return out


def resolve(mode=None, targets=None, environ: Optional[Mapping[str, str]] = None, **options) -> Config:
    """Build a Config: explicit arguments first, then the environment, then defaults.

    Other keyword options are meant for the policy (``gproj_patch.policy.OPTION_NAMES``); they are kept in
    ``Config.extra``, where the policy reads them (and checks their values). Any other name is logged as a
    warning (a typo is not silently ignored).
    """
    values = from_env(environ)
    explicit = dict(options)
    if mode is not None:
        explicit["mode"] = mode
    if targets is not None:
        explicit["targets"] = targets
    extra = {}
    for key, value in explicit.items():
        if key in _PARSERS:
            values[key] = _PARSERS[key](key, value)
        else:
            extra[key] = value
    if extra:
        try:
            from .policy import OPTION_NAMES
        except ImportError:  # pragma: no cover - policy module missing
            OPTION_NAMES = ()
        unknown = sorted(set(extra) - set(OPTION_NAMES))
        if unknown:
            logging.getLogger("gproj_patch").warning(
                "gproj_patch: unknown option(s) %s ignored; known: %s, and the policy options %s",
                ", ".join(unknown), ", ".join(_PARSERS), ", ".join(OPTION_NAMES))
    return replace(Config(), **values, extra=tuple(sorted(extra.items())))


_active: Optional[Config] = None


def active() -> Optional[Config]:
    """The Config of the current ``enable()``, or None when the patch is off."""
    return _active


def _set_active(cfg: Optional[Config]) -> None:
    global _active
    _active = cfg
