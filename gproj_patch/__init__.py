"""gproj_patch: correct BF16/FP16 attention gradients (GProj) while keeping the fused forward.

    import gproj_patch
    gproj_patch.enable()                  # SDPA, flash-attn and HF "gproj" attention get the corrected backward
    with gproj_patch.enable(mode="fp32"):  # or as a context manager
        ...
    gproj_patch.stats()                   # {"gproj": n, "fp32": n, "original": n, "fallback_reasons": {...}, ...}
    gproj_patch.attention(q, k, v, is_causal=True)   # SDPA semantics, corrected backward, with or without enable()
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional

from . import config as _config
from . import state as _state_module
from . import telemetry as _telemetry
from .import_hooks import call_after_import as _call_after_import
from .layer_context import current_layer, layer_scope, new_step

if TYPE_CHECKING:  # annotations only: the package does not import torch at import time
    import torch

__version__ = "0.2.0"
__all__ = ["enable", "disable", "is_enabled", "stats", "reset_stats", "attention", "Handle", "current_layer",
           "layer_scope", "new_step"]

def _register_kernel_op() -> None:
    """Define ``torch.ops.gproj.attention_backward`` (the GProj kernel as an op). This package never imports
    torch itself at import time (the GPROJ_PATCH=1 start-up hook imports it in every process): the op is
    defined now if torch is loaded, else right after torch is imported."""
    from .backends import ops  # noqa: F401


_call_after_import("torch", _register_kernel_op)

_lock = threading.RLock()
_state: Optional[dict] = None  # {"config", "installed", "owner", "log_level"} while enabled
_logger = logging.getLogger("gproj_patch")


class _LastResort(logging.Handler):
    """What ``logging.lastResort`` does, for this package's records only: write them to stderr when no handler
    of the application would, with the ``gproj_patch: `` prefix. The messages carry no prefix themselves: an
    application's formatter shows the logger name, and the prefix would then appear twice."""

    def __init__(self):
        super().__init__(logging.NOTSET)  # the logger's level (GPROJ_LOG_LEVEL) decides what is shown
        self.setFormatter(logging.Formatter("gproj_patch: %(message)s"))

    def emit(self, record):
        logger = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self and record.levelno >= h.level for h in logger.handlers):
                return
            logger = logger.parent if logger.propagate else None
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging's rule: a handler never raises
            self.handleError(record)


_logger.addHandler(_LastResort())


def _installers():
    from .integrations import flash_attn, flex, hf_eager, sdpa, transformers
    return {"sdpa": sdpa, "flash_attn": flash_attn, "transformers": transformers, "hf_eager": hf_eager,
            "flex": flex}


class Handle:
    """Returned by ``enable()``. ``handle.disable()`` or leaving its ``with`` block turns the patch off if this
    handle is the one that turned it on (a second ``enable()`` is a no-op and its handle does nothing on exit)."""

    def __init__(self, cfg: _config.Config, installed: Dict[str, str], owner: bool):
        self.config = cfg
        self.installed = dict(installed)  # target -> "installed" | "skipped: <why>"
        self.owner = owner

    def disable(self) -> None:
        if self.owner:
            with _lock:
                if _state is not None and _state["owner"] is self:
                    disable()

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    def __repr__(self) -> str:
        return f"Handle(mode={self.config.mode!r}, installed={self.installed}, owner={self.owner})"


def enable(mode: Optional[str] = None, targets: Optional[Iterable[str]] = None, **options: Any) -> Handle:
    """Turn the patch on. Arguments override the environment (GPROJ_MODE, GPROJ_TARGETS, GPROJ_TIER,
    GPROJ_KV_MAJOR, GPROJ_LOG_LEVEL and the policy's GPROJ_* variables, ``config.py``), which overrides the defaults (mode
    "gproj", every target). Every option is validated here (ValueError naming it).

    Calling it again while enabled changes nothing and returns a non-owning handle.
    """
    global _state
    cfg = _config.resolve(mode=mode, targets=targets, **options)
    with _lock:
        if _state is not None:
            if cfg != _state["config"] and (mode is not None or targets is not None or options):
                _logger.warning("enable(): already enabled with %s; the new options are ignored "
                                "(call disable() first)", _state["config"])
            return Handle(_state["config"], _state["installed"], owner=False)
        installers = _installers()
        installed: Dict[str, str] = {}
        done = []
        try:
            for target in cfg.targets:
                installed[target] = installers[target].install()
                done.append(target)
        except BaseException:
            for target in reversed(done):
                installers[target].uninstall()
            raise
        previous_level = _logger.level
        explicit = "log_level" in options or _config.ENV["log_level"] in os.environ
        for var, why in _config.OBSOLETE_ENV.items():
            if var in os.environ:
                _logger.warning("%s: %s", var, why)
        if explicit or previous_level == logging.NOTSET:  # keep a level the application set itself
            _logger.setLevel(cfg.log_level)
        _config.set_active(cfg)
        handle = Handle(cfg, installed, owner=True)
        _state = {"config": cfg, "installed": installed, "owner": handle, "log_level": previous_level}
        return handle


def disable() -> None:
    """Turn the patch off and restore every patched object (by identity). A no-op when not enabled."""
    global _state
    with _lock:
        if _state is None:
            return
        installers = _installers()
        for target in reversed(list(_state["installed"])):
            installers[target].uninstall()
        _logger.setLevel(_state["log_level"])
        _config.set_active(None)
        _state = None


def is_enabled() -> bool:
    return _state is not None


def stats() -> dict:
    """Backward calls per tier that ran ("gproj", "fp32", "original"; each hooked backward counted once),
    forward calls through the hooks, every fallback reason with its count, the KV-major kernel of each backward
    that ran the GProj kernel (``"kv_major"``: "gluon" on sm_90 where it applies, else "tl";
    ``"kv_major_reasons"``: why not the Gluon one), and — in ``auto``/``audit`` — each layer's tier and last
    detector summary under ``"layers"``."""
    from . import policy
    out = _telemetry.stats()
    out["layers"] = {name: {"tier": rec["tier"], "policy_tier": rec["policy_tier"], "stats": rec["stats"]}
                     for name, rec in policy.stats().items()}
    return out


def reset_stats() -> None:
    """Clear the whole runtime state: counters, fallback reasons, steps, layer records (``state.reset``)."""
    _state_module.reset()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with the corrected backward, whether or not
    ``enable()`` was called (options: the enabled ones, else the environment's GPROJ_* and the defaults).
    Same forward output as SDPA."""
    import torch.nn.functional as F
    from torch.overrides import has_torch_function

    from .ops.sdpa import sdpa
    if has_torch_function((q, k, v) if attn_mask is None else (q, k, v, attn_mask)):
        # a subclass or mode that handles SDPA (CausalBias, ...) gets the call as an SDPA call
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa, cfg=_config.active() or _default_config())


_env_config = {}


def _default_config() -> "_config.Config":
    """The environment's options (parsed once per distinct environment) for ``attention()`` without enable()."""
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("GPROJ_") or k == "TRITON_INTERPRET"))
    cfg = _env_config.get(key)
    if cfg is None:
        cfg = _env_config[key] = _config.resolve()
    return cfg
