"""pytest plugin (entry point ``pytest11``): the ``gproj_audit`` fixture, so a kernel's own CI can hold it to the
audit's conservation-law criteria with a plain ``pytest`` run.

    def test_my_attention_keeps_the_conservation_law(gproj_audit):
        report = gproj_audit(my_attention, dtype="bf16", device="cuda")   # arguments of gproj_patch.audit.check
        assert report.figures["witness_dq0"] == 0.0                      # any further assertion of your own

``gproj_audit(fn, **check_kwargs)`` runs ``gproj_patch.audit.check`` and raises ``AssertionError`` with the
report's plain-English lines (each criterion, its measured figure and bound, the n/a cases) when a criterion
fails or none could run; otherwise it returns the ``Report``. A test that asks for a device this machine lacks
(``device="cuda"`` on a CPU-only machine) is skipped with the reason, as ``pytest.mark.skipif`` on CUDA would:
the test cannot run here, which is not a failure of the kernel it audits. Installed with the package; nothing is imported
(no torch) until the fixture is used, so every pytest run in an environment with gproj_patch stays as fast.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest


def audit_and_assert(fn: Callable, **check_kwargs: Any):
    """``check(fn, **check_kwargs)``; AssertionError (with ``Report.explain()``) unless it passed; a skip of the
    calling test when its device is not on this machine."""
    from .api import check
    from .run import DeviceUnavailableError
    try:
        report = check(fn, **check_kwargs)
    except DeviceUnavailableError as e:
        pytest.skip(f"gproj audit: {e}")
    if not report.passed:
        raise AssertionError("gproj audit did not pass:\n" + report.explain())
    return report


@pytest.fixture
def gproj_audit() -> Callable:
    """``gproj_audit(fn, cases=..., dtype=..., device=..., layout=...) -> Report``: the audit of ``fn`` (SDPA's
    signature), asserting the conservation-law criteria (module docstring)."""
    return audit_and_assert
