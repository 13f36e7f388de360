"""PyTorch's own SDPA tests, run with the patch off and on: every test that passes without the patch must pass
with it.

The suite is PyTorch's ``test/test_transformers.py`` (provenance, version and the selection:
``tests/external/PROVENANCE.md``), run in two subprocesses of pytest over the same deterministic selection of
its CPU classes: one plain, one with ``gproj_patch.enable()`` for the whole session (``-p gproj_plugin`` with
``GPROJ_EXTERNAL_PATCH=1``; the plugin enables the patch before the test module is imported). The outcomes are
read from the two JUnit XML reports and compared test by test.

Strict both ways: a test outside ``KNOWN_SHIM_FAILURES`` that passes without the patch and not with it fails
this runner, and so does an entry of ``KNOWN_SHIM_FAILURES`` that no longer fails (or is no longer selected):
empty the list as the fixes land.

It also refuses a vacuous comparison: the patched run must show the hook in place from the first to the last
test and corrected backwards actually run (``gproj_patch.stats()``), both runs must have collected the same
tests, and every selected class must have passing tests without the patch.

The vendored file is not part of the repository (``tests/external/PROVENANCE.md`` says why and how to put it
in place); without it, or without ``expecttest`` (PyTorch's testing helpers import it), this runner is skipped
with that reason.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
from tests.helpers.paths import REPO

EXTERNAL = REPO / "tests" / "external"
sys.path.insert(0, str(EXTERNAL))
import harness  # noqa: E402  (tests/external/harness.py)

VENDORED = Path(os.environ.get("GPROJ_TORCH_SDPA_TESTS", EXTERNAL / "vendor" / "torch" / "test_transformers.py"))
# sha256 of the vendored file as documented in PROVENANCE.md (a different file is a different suite).
VENDORED_SHA256 = "0df471a871e2966cfd570fc7adbd9f351b2c709cf4dbe1ebb909980ca0cbfb6a"

# The four SDPA classes of PyTorch's CPU SDPA tests, and TestTransformers (nn.MultiheadAttention / nn.Transformer* on top of
# SDPA: 121 tests, ~10-20 s a run), which is where the patch showed a defect of its own (TorchScript).
CLASSES = ("TestSDPACPU", "TestSDPAFailureModesCPU", "TestSDPACpuOnlyCPU", "TestAttnBiasCPU", "TestTransformersCPU")
# At most this many instances per test function, plus as many among the BF16/FP16 instances that run a
# backward (FOCUS): only ``test_scaled_dot_product_fused_attention_mask_vs_math_cpu`` (3072 instances) and
# ``..._gqa_vs_math_cpu`` (32) are cut. Selection rule: tests/external/gproj_plugin.py, PROVENANCE.md.
SELECTION = {
    "GPROJ_EXTERNAL_CLASSES": ",".join(CLASSES),
    "GPROJ_EXTERNAL_MAX_PER_FUNCTION": 24,
    "GPROJ_EXTERNAL_FOCUS": r"(bfloat16|float16).*train_True",
}
# Both runs go concurrently, one thread each (the same thread count in both: same reduction orders).
_ENV = {"OMP_NUM_THREADS": 1, "MKL_NUM_THREADS": 1, "PYTORCH_PRINT_REPRO_ON_FAILURE": 0}
ARMS = {"off": {"patch": False, "env": _ENV}, "on": {"patch": True, "env": _ENV}}
TIMEOUT_S = 1500

# "Class::test" -> why it fails only with the patch (a shim defect being fixed). Strict: an entry that passes with
# the patch again, or is no longer selected, fails the runner until it is removed here. The last entries (torch.jit
# scripting nn.MultiheadAttention under enable()) were fixed by registering the wrapper as TorchScript's
# aten::scaled_dot_product_attention (tests/hooks/test_transparency.py).
KNOWN_SHIM_FAILURES: dict = {}  # the TorchScript defect (scripting nn.MultiheadAttention) is fixed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not VENDORED.is_file():
        pytest.skip(f"NOT RUN: the vendored PyTorch suite is absent ({VENDORED}); tests/external/PROVENANCE.md "
                    "says where it comes from and why it is not committed")
    try:
        import expecttest  # noqa: F401  (torch.testing._internal.common_utils imports it)
    except ImportError:
        pytest.skip("NOT RUN: expecttest is not installed (torch.testing._internal needs it; "
                    "`pip install expecttest`)")
    sha = hashlib.sha256(VENDORED.read_bytes()).hexdigest()
    assert sha == VENDORED_SHA256, (f"{VENDORED} is not the documented file (sha256 {sha}, expected "
                                    f"{VENDORED_SHA256}, tests/external/PROVENANCE.md)")
    work = tmp_path_factory.mktemp("torch_sdpa")
    try:
        result = harness.run_arms(VENDORED, work, ARMS, SELECTION, TIMEOUT_S)
    except harness.ArmFailed as exc:
        pytest.fail(str(exc))
    report = f"PyTorch SDPA suite ({VENDORED.name}), patch off vs on: " + harness.summary(
        result, CLASSES, known=KNOWN_SHIM_FAILURES)
    print(report)
    if os.environ.get("GPROJ_EXTERNAL_REPORT"):
        Path(os.environ["GPROJ_EXTERNAL_REPORT"]).write_text(report + "\n", encoding="utf-8")
    return result


def test_patched_run_really_ran_through_the_hook(runs):
    on, off = runs["on"]["stats"], runs["off"]["stats"]
    assert off.get("requested") is False, off
    assert on.get("requested") and on.get("enabled_at_start") and on.get("enabled_at_end"), on
    assert on["installed"].get("sdpa") == "installed", on["installed"]  # the seam (it has no forward to count)
    stats = on["stats"]
    assert stats.get("fp32", 0) + stats.get("gproj", 0) > 0, f"no corrected backward ran: {stats}"


def test_both_runs_ran_the_same_selection(runs):
    off, on = runs["off"], runs["on"]
    assert off["selected"] and off["selected"] == on["selected"], "the two runs selected different tests"
    assert set(off["outcomes"]) == set(on["outcomes"]) == set(off["selected"]), "a selected test has no outcome"
    for cls in CLASSES:
        assert any(k.startswith(cls + "::") and v[0] == "passed" for k, v in off["outcomes"].items()), (
            f"{cls}: no test passed even without the patch: the harness, not the patch, is broken")


def test_patch_on_fails_nowhere_it_passes_off(runs):
    regressions = harness.regressions(runs["off"]["outcomes"], runs["on"]["outcomes"])
    unexpected = {k: v for k, v in regressions.items() if k not in KNOWN_SHIM_FAILURES}
    assert not unexpected, "tests that pass without gproj_patch and fail with it:\n" + "\n".join(
        f"  {name}: {outcome}: {message}" for name, (outcome, message, _) in sorted(unexpected.items()))


def test_known_shim_failures_still_fail(runs):
    regressions = harness.regressions(runs["off"]["outcomes"], runs["on"]["outcomes"])
    stale = sorted(name for name in KNOWN_SHIM_FAILURES if name not in regressions)
    assert not stale, ("KNOWN_SHIM_FAILURES entries that no longer fail only with the patch (fixed, or no longer "
                       "selected): remove them:\n" + "\n".join(
                           f"  {name} (with the patch: {runs['on']['outcomes'].get(name, ('not selected',))[0]})"
                           for name in stale))


# The runner's own machinery, on synthetic input (runs without the vendored file).

def test_selection_keeps_every_parameter_value_and_is_deterministic():
    import itertools

    import gproj_plugin

    values = {"dtype": ["bfloat16", "float16", "float32"], "q_len": [11, 514, 1030], "n_head": [1, 3],
              "train": [True, False], "mask_dim": [2, 4]}
    names = ["C::test_f_" + "_".join(f"{k}_{v}" if k != "dtype" else str(v) for k, v in zip(values, combo))
             + "_cpu" for combo in itertools.product(*values.values())] + ["C::test_g_cpu"]
    bases = ["test_f", "test_g"]
    chosen = gproj_plugin.select(names, bases, 8)
    assert chosen == gproj_plugin.select(list(names), bases, 8)  # deterministic
    assert "C::test_g_cpu" in chosen  # every function keeps an instance
    picked = [n for n in chosen if n.startswith("C::test_f_")]
    assert 8 <= len(picked) < len(names) - 1
    for key, vals in values.items():
        for v in vals:
            token = str(v) if key == "dtype" else f"{key}_{v}_"
            assert any(token in n for n in picked), f"{key}={v} never selected: {picked}"
    # the cheapest instances fill the budget: the largest q_len occurs only as often as the cover needs it
    assert sum("q_len_1030_" in n for n in picked) < sum("q_len_11_" in n for n in picked)
    focused = gproj_plugin.select(names, bases, 8, focus=r"(bfloat16|float16).*train_True")
    extra = [n for n in focused if n not in chosen]
    assert extra and all(("bfloat16" in n or "float16" in n) and "train_True" in n for n in extra)
    assert gproj_plugin.select(names, bases, 8, rules={"test_f": {"limit": 0}}) == ["C::test_g_cpu"]


def test_harness_reads_junit_and_finds_what_fails_only_in_the_other_arm(tmp_path):
    def report(path, cases):
        body = "".join(
            f'<testcase classname="test_transformers.C" name="{n}" time="0.1">'
            + {"passed": "", "failed": '<failure message="AssertionError: x">tb</failure>',
               "skipped": '<skipped message="no GPU"/>', "error": '<error message="boom"/>'}[o]
            + "</testcase>" for n, o in cases.items())
        path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite>'
                        "</testsuites>", encoding="utf-8")
        return harness.outcomes(path)

    off = report(tmp_path / "off.xml", {"a": "passed", "b": "passed", "c": "failed", "d": "skipped",
                                        "e": "passed"})
    on = report(tmp_path / "on.xml", {"a": "passed", "b": "failed", "c": "failed", "d": "skipped",
                                      "e": "error"})
    assert off["C::b"][0] == "passed" and on["C::b"] == ("failed", "AssertionError: x", 0.1)
    assert set(harness.regressions(off, on)) == {"C::b", "C::e"}
    del on["C::e"]
    assert set(harness.regressions(off, on)) == {"C::b", "C::e"}  # no outcome is not a pass...
    assert set(harness.regressions(off, on, skip_missing=True)) == {"C::b"}  # ...unless an arm was stopped
