"""The gradient audit: attention backwards checked against the fp64 oracle on a named adversarial suite.

* ``check(fn, cases=..., dtype=..., device=...) -> Report``: audit your own attention function (``api.py``);
* ``main``: the command line, ``python -m gproj_patch audit`` / ``gproj-audit`` (``cli.py``);
* the pytest fixture ``gproj_audit`` (``pytest_plugin.py``, registered through the ``pytest11`` entry point).
"""
from __future__ import annotations

from .api import CaseResult, Report, check
from .cli import main

__all__ = ["check", "Report", "CaseResult", "main"]
