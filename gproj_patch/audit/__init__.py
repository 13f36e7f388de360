"""The gradient audit: attention backwards checked against the fp64 oracle on a named adversarial suite.

* ``check(fn, cases=..., dtype=..., device=...) -> Report``: audit your own attention function (``api.py``);
* ``main``: the command line, ``python -m gproj_patch audit`` / ``gproj-audit`` (``cli.py``);
* the pytest fixture ``gproj_audit`` (``pytest_plugin.py``, registered through the ``pytest11`` entry point);
* ``DeviceUnavailableError``: raised by ``check`` for a device this machine lacks (``run.py``).

The names are resolved on first use: pytest imports ``gproj_patch.audit.pytest_plugin`` (hence this package) at
the start of every run in an environment with gproj_patch installed, and that must not import torch.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import CaseResult, Report, check
    from .cli import main
    from .run import DeviceUnavailableError

__all__ = ("check", "Report", "CaseResult", "main", "DeviceUnavailableError")
_WHERE = MappingProxyType({"check": "api", "Report": "api", "CaseResult": "api", "main": "cli",
                           "DeviceUnavailableError": "run"})


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)  # sys.modules caches the module
