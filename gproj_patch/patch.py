"""The patch switched on and off: ``enable()`` / ``disable()`` (the one module that owns it), the ``Handle``, the
counters' public view (``stats``, ``reset_stats``) and ``attention()``. ``gproj_patch/__init__.py`` re-exports
these names; modules of the package that need them import this module, never the package itself.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional

from .runtime import config as _config
from .runtime import hooks as _hooks
from .runtime import state as _state_module
from .runtime import telemetry as _telemetry
from .runtime.import_hooks import call_after_import as _call_after_import
from .runtime.import_hooks import imported as _imported

if TYPE_CHECKING:  # annotations only: the package does not import torch at import time
    import torch


def _package_modules_running() -> list:
    """The modules of this package whose import is still executing (in ``sys.modules`` order)."""
    return [name for name in list(sys.modules) if name.startswith("gproj_patch.") and not _imported(name)]


def _register_kernel_op() -> None:
    """Define ``torch.ops.gproj.attention_backward`` (the GProj kernel as an op). This package never imports
    torch itself at import time (the GPROJ_PATCH=1 start-up hook imports it in every process): the op is
    defined now if torch is loaded, else right after torch is imported.

    When a module of this package is what imported torch (``import gproj_patch.backends.spec`` before torch),
    torch's import ends inside that module's: loading ``backends/ops.py`` then would meet it half initialized.
    The op waits for the end of that import instead (and again for the next one still running)."""
    running = _package_modules_running()
    if running:
        _call_after_import(running[-1], _register_kernel_op)
        return
    from .backends import ops  # noqa: F401


_call_after_import("torch", _register_kernel_op)


def _register_hf_name() -> None:
    """Register the HF attention name ``"gproj"`` where it is free, enabled or not (``hooks/
    transformers.py`` says why): a model can then be built with it before ``enable()`` and keeps running after
    ``disable()``. Nothing else changes: no other registry entry, no hook. Runs right after
    ``transformers.modeling_utils`` is imported — or here, at this module's import, when it already is: then
    it waits, as the kernel op does, for the end of the imports of this package still running (this one)."""
    running = _package_modules_running()
    if running:
        _call_after_import(running[-1], _register_hf_name)
        return
    from .hooks import transformers
    transformers.register_name()


_call_after_import("transformers.modeling_utils", _register_hf_name)

_lock = threading.RLock()
_logger = logging.getLogger("gproj_patch")


class _Enabled:
    """While the patch is on: its Config, what each target's install() said, the owning Handle and the log level
    to restore. One instance (``ENABLED``), mutated under ``_lock`` by enable()/disable(), never re-bound."""
    def __init__(self) -> None:
        self.config: Optional[_config.Config] = None
        self.installed: Dict[str, str] = {}
        self.owner: Optional["Handle"] = None
        self.log_level: int = logging.NOTSET

    @property
    def on(self) -> bool:
        return self.config is not None


ENABLED = _Enabled()


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


def _installers() -> Dict[str, Any]:
    """Each registered target's module (``runtime/hooks.HOOKS``), imported on the first enable()."""
    return {hook.name: importlib.import_module(hook.module) for hook in _hooks.HOOKS}


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
                if ENABLED.on and ENABLED.owner is self:
                    disable()

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc) -> None:
        self.disable()

    def __repr__(self) -> str:
        return f"Handle(mode={self.config.mode!r}, installed={self.installed}, owner={self.owner})"


def enable(mode: Optional[str] = None, targets: Optional[Iterable[str]] = None, **options: Any) -> Handle:
    """Turn the patch on. Arguments override the environment (GPROJ_MODE, GPROJ_TARGETS, GPROJ_TIER,
    GPROJ_KV_MAJOR, GPROJ_DQ_MAJOR, GPROJ_LOG_LEVEL and the policy's GPROJ_* variables, ``config.ENV``), which
    overrides the defaults (mode "gproj", every target). Every option is validated here (ValueError naming the
    keyword or the variable that gave the bad value).

    Calling it again while enabled changes nothing and returns a non-owning handle.
    """
    cfg = _config.resolve(mode=mode, targets=targets, **options)
    with _lock:
        if ENABLED.on:
            if cfg != ENABLED.config and (mode is not None or targets is not None or options):
                _logger.warning("enable(): already enabled with %s; the new options are ignored "
                                "(call disable() first)", ENABLED.config)
            return Handle(ENABLED.config, ENABLED.installed, owner=False)
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
        explicit = "log_level" in options or _config.env_gives("log_level")
        for var, why in _config.OBSOLETE_ENV.items():
            if var in os.environ:
                _logger.warning("%s: %s", var, why)
        if explicit or previous_level == logging.NOTSET:  # keep a level the application set itself
            _logger.setLevel(cfg.log_level)
        _config.set_active(cfg)
        handle = Handle(cfg, installed, owner=True)
        ENABLED.config, ENABLED.installed, ENABLED.owner, ENABLED.log_level = cfg, installed, handle, previous_level
        return handle


def disable() -> None:
    """Turn the patch off and restore every patched object (by identity). A no-op when not enabled."""
    with _lock:
        if not ENABLED.on:
            return
        installers = _installers()
        for target in reversed(list(ENABLED.installed)):
            installers[target].uninstall()
        _logger.setLevel(ENABLED.log_level)
        _config.set_active(None)
        ENABLED.config, ENABLED.installed, ENABLED.owner = None, {}, None


def is_enabled() -> bool:
    return ENABLED.on


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
    from .hooks.sdpa import sdpa
    return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa, cfg=_config.active() or _default_config())


#: bounded cache: the options ``attention()`` resolves from the environment without enable(), per distinct set
#: of GPROJ_* / TRITON_INTERPRET values (at most ``_ENV_CONFIGS_MAX``, then started over)
_env_config: Dict[tuple, "_config.Config"] = {}
_ENV_CONFIGS_MAX = 16


def _default_config() -> "_config.Config":
    """The environment's options (parsed once per distinct environment) for ``attention()`` without enable()."""
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("GPROJ_") or k == "TRITON_INTERPRET"))
    cfg = _env_config.get(key)
    if cfg is None:
        if len(_env_config) >= _ENV_CONFIGS_MAX:
            _env_config.clear()
        cfg = _env_config[key] = _config.resolve()
    return cfg
