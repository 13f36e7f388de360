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
import threading
from typing import Dict, Optional

from . import config as _config
from . import telemetry as _telemetry
from .layer_context import current_layer, layer_scope, new_step

__version__ = "0.1.0"
__all__ = ["enable", "disable", "is_enabled", "stats", "reset_stats", "attention", "Handle", "current_layer",
           "layer_scope", "new_step"]

_lock = threading.RLock()
_state: Optional[dict] = None  # {"config", "installed", "owner", "log_level"} while enabled
_logger = logging.getLogger("gproj_patch")


def _installers():
    from .integrations import flash_attn, sdpa, transformers
    return {"sdpa": sdpa, "flash_attn": flash_attn, "transformers": transformers}


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


def enable(mode: Optional[str] = None, targets=None, **options) -> Handle:
    """Turn the patch on. Arguments override the environment (GPROJ_MODE, GPROJ_TARGETS, GPROJ_TIER,
    GPROJ_LOG_LEVEL, GPROJ_DETERMINISTIC), which overrides the defaults (mode "gproj", every target).

    Calling it again while enabled changes nothing and returns a non-owning handle.
    """
    global _state
    cfg = _config.resolve(mode=mode, targets=targets, **options)
    with _lock:
        if _state is not None:
            if cfg != _state["config"] and (mode is not None or targets is not None or options):
                _logger.warning("gproj_patch.enable(): already enabled with %s; the new options are ignored "
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
        if explicit or previous_level == logging.NOTSET:  # keep a level the application set itself
            _logger.setLevel(cfg.log_level)
        _config._set_active(cfg)
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
        _config._set_active(None)
        _state = None


def is_enabled() -> bool:
    return _state is not None


def stats() -> dict:
    """Backward calls per tier ("gproj", "fp32", "original"), forward calls through the hooks, and every fallback
    reason with its count."""
    return _telemetry.stats()


def reset_stats() -> None:
    _telemetry.reset()


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` with the corrected backward, whether or not
    ``enable()`` was called (options: the enabled ones, else the environment's GPROJ_* and the defaults).
    Same forward output as SDPA."""
    from .autograd import sdpa
    return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa, cfg=_config.active() or _config.resolve())
