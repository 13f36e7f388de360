"""Run a vendored pytest suite in several arms (patch off, patch on, ...) and compare the outcomes test by test.

Shared by the CPU runner (``tests/integrations/test_external_torch_sdpa.py``) and the GPU entry point
(``python -m benchmarks.external_suites``). Each arm is one pytest subprocess over the same file with
``-p gproj_plugin`` (this directory on ``PYTHONPATH``); the plugin enables the patch when the arm's environment
says ``GPROJ_EXTERNAL_PATCH=1`` and applies the selection given by ``GPROJ_EXTERNAL_*`` (the same in every arm).
Outcomes come from each arm's JUnit XML report.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def outcomes(xml_path) -> dict:
    """``Class::test`` -> (outcome, message, seconds) from a pytest JUnit XML report; outcome is one of
    passed, failed, error, skipped."""
    out = {}
    for case in ET.parse(xml_path).iter("testcase"):
        cls = case.get("classname", "").split(".")[-1]
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                text = child.get("message") or child.text or ""
                message = " ".join(text.split())[:400]
                break
        out[f"{cls}::{case.get('name')}"] = (outcome, message, float(case.get("time") or 0.0))
    return out


def environment(patch: bool, work: Path, tag: str, selection: dict, extra=None) -> dict:
    """The arm's environment: the caller's, minus every GPROJ_* (GPROJ_PATCH=1 would enable the patch in the
    plain arm through the start-up hook; GPROJ_MODE & co. would change what the patched arm tests) and pytest's
    own variables, plus the plugin's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPROJ_") and k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    paths = [str(HERE), str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env.update({
        "PYTHONPATH": os.pathsep.join(paths),
        "GPROJ_EXTERNAL_PATCH": "1" if patch else "0",
        "GPROJ_EXTERNAL_STATS": str(work / f"stats_{tag}.json"),
        "GPROJ_EXTERNAL_SELECTED": str(work / f"selected_{tag}.txt"),
        "PYTHONDONTWRITEBYTECODE": "1",
    })
    env.update({k: str(v) for k, v in selection.items()})
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def command(test_file: Path, work: Path, tag: str, pytest_args=()) -> list:
    """pytest on one file, isolated from this repository's configuration (own empty ini, no conftest)."""
    return [sys.executable, "-m", "pytest", str(test_file), "-c", str(work / "pytest.ini"), "--rootdir",
            str(work), "--noconftest", "-p", "no:cacheprovider", "-p", "gproj_plugin", "-q", "-rfE",
            f"--junitxml={work / f'{tag}.xml'}", *pytest_args]


class ArmFailed(RuntimeError):
    pass


def _partial_outcomes(path: Path) -> dict:
    """The plugin's incremental record (``GPROJ_EXTERNAL_OUTCOMES``), for an arm that left no JUnit report."""
    out = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            outcome, _, name = line.partition("\t")
            if name:
                out[name] = (outcome, "", 0.0)
    return out


def run_arms(test_file: Path, work: Path, arms: dict, selection: dict, timeout_s: float,
             concurrent: bool = True, pytest_args=(), cwd=None, partial_ok: bool = False) -> dict:
    """Run every arm (``tag -> {"patch": bool, "env": {...}}``) on ``test_file``; return, per tag, its outcomes,
    the plugin's record (``stats``), the selected ids, its wall seconds, whether it completed, and the tail of
    its output.

    At the deadline (``timeout_s`` for all arms together; run one after the other, each arm gets an equal
    share of the time left) a running arm gets SIGINT (pytest then stops and still writes its report), then
    SIGKILL 30 s later. Without ``partial_ok`` that raises ``ArmFailed``; with it, the arm's outcomes are those
    it finished (``complete`` False). An arm that ends with a pytest exit code other
    than 0 or 1 (usage or collection error, crash) raises ``ArmFailed`` in any case."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    procs, logs, started, ended, stopped = {}, {}, {}, {}, set()
    deadline = time.monotonic() + timeout_s

    def start(tag, spec):
        logs[tag] = open(work / f"{tag}.log", "w", encoding="utf-8")
        started[tag] = time.monotonic()
        env = environment(spec.get("patch", False), work, tag, selection, spec.get("env"))
        env["GPROJ_EXTERNAL_OUTCOMES"] = str(work / f"outcomes_{tag}.tsv")
        procs[tag] = subprocess.Popen(command(test_file, work, tag, pytest_args), cwd=cwd or work,
                                      stdout=logs[tag], stderr=subprocess.STDOUT, env=env)

    def stop(tags):
        for tag in tags:
            stopped.add(tag)
            procs[tag].send_signal(signal.SIGINT)
        grace = time.monotonic() + 30
        for tag in tags:
            try:
                procs[tag].wait(timeout=max(0.1, grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                procs[tag].kill()
                procs[tag].wait()

    def finish(tag):
        ended[tag] = time.monotonic()
        logs[tag].close()

    pending = []
    for index, (tag, spec) in enumerate(arms.items()):
        start(tag, spec)
        pending.append(tag)
        if not concurrent:  # each arm gets an equal share of the time left
            own = time.monotonic() + (deadline - time.monotonic()) / (len(arms) - index)
            while procs[tag].poll() is None and time.monotonic() < own:
                time.sleep(0.5)
            if procs[tag].poll() is None:
                stop([tag])
            finish(tag)
            pending.remove(tag)
    while pending:
        for tag in list(pending):
            if procs[tag].poll() is not None:
                finish(tag)
                pending.remove(tag)
        if pending and time.monotonic() >= deadline:
            stop(pending)
            for tag in pending:
                finish(tag)
            pending = []
        time.sleep(0.5 if pending else 0)
    if stopped and not partial_ok:
        raise ArmFailed(f"arm(s) {sorted(stopped)} ran past {timeout_s:.0f} s (logs in {work})")

    result = {}
    for tag in arms:
        rc = procs[tag].returncode
        log = (work / f"{tag}.log").read_text(encoding="utf-8", errors="replace")
        xml = work / f"{tag}.xml"
        if tag not in stopped and (rc not in (0, 1) or not xml.is_file()):
            raise ArmFailed(f"arm {tag!r} did not complete (pytest exit code {rc}); its output ends with:\n"
                            f"{log[-4000:]}")
        got = outcomes(xml) if xml.is_file() else {}
        for name, value in _partial_outcomes(work / f"outcomes_{tag}.tsv").items():
            got.setdefault(name, value)
        stats_file = work / f"stats_{tag}.json"
        selected_file = work / f"selected_{tag}.txt"
        result[tag] = {
            "outcomes": got,
            "complete": tag not in stopped,
            "returncode": rc,
            "stats": json.loads(stats_file.read_text(encoding="utf-8")) if stats_file.is_file() else {},
            "selected": selected_file.read_text(encoding="utf-8").split() if selected_file.is_file() else None,
            "wall_s": round(ended[tag] - started[tag], 1),
            "log_tail": log[-3000:],
        }
    return result


def regressions(base: dict, other: dict, skip_missing: bool = False) -> dict:
    """Tests that passed in ``base`` and did not pass in ``other`` (outcome maps): name -> other's outcome. A
    test without an outcome in ``other`` counts as not passed, unless ``skip_missing`` (an arm stopped at its
    deadline: only the tests both arms finished are compared)."""
    return {name: other.get(name, ("missing", "no outcome in this arm", 0.0))
            for name, (outcome, _, _) in base.items()
            if outcome == "passed" and other.get(name, ("missing",))[0] != "passed"
            and not (skip_missing and name not in other)}


def _in_group(test_id: str, group: str) -> bool:
    """``Class::test[...]`` ids belong to their class; module-level ``::test_name[...]`` ids to their function
    (flash-attention's tests have no classes)."""
    if test_id.startswith(group + "::"):
        return True
    return test_id.startswith("::") and test_id[2:].split("[")[0] == group


def summary(result: dict, classes, base: str = "off", known=None) -> str:
    """A plain-text table: per class and arm the counts and seconds, then every test that passes in ``base``
    and not in another arm, then the tests that fail in ``base`` itself."""
    known = known or {}
    tags = list(result)
    lines = [f"{len(result[base]['selected'] or result[base]['outcomes'])} selected tests; wall s: "
             + ", ".join(f"{t} {result[t]['wall_s']}" for t in tags)]
    for tag in tags:
        if not result[tag].get("complete", True):
            lines.append(f"  arm {tag!r} was stopped at the deadline after {len(result[tag]['outcomes'])} tests: "
                         "only the tests every compared arm finished are compared")
    for cls in classes:
        row = []
        for tag in tags:
            mine = [v for k, v in result[tag]["outcomes"].items() if _in_group(k, cls)]
            counts = {o: sum(1 for v in mine if v[0] == o) for o in ("passed", "failed", "error", "skipped")}
            row.append(f"{tag}: " + " ".join(f"{n} {o}" for o, n in counts.items() if n)
                       + f" ({sum(v[2] for v in mine):.1f} s)")
        lines.append(f"  {cls:28s} " + " | ".join(row))
    for tag in tags:
        if tag == base:
            continue
        partial = not (result[tag].get("complete", True) and result[base].get("complete", True))
        reg = regressions(result[base]["outcomes"], result[tag]["outcomes"], skip_missing=partial)
        both = set(result[base]["outcomes"]) & set(result[tag]["outcomes"])
        lines.append(f"  finished in both {base!r} and {tag!r} (compared): {len(both)}")
        lines.append(f"  pass with {base!r}, not with {tag!r}: {len(reg)}")
        for name, (outcome, message, _) in sorted(reg.items()):
            mark = " [known]" if name in known else ""
            lines.append(f"    {name}: {outcome}: {message}{mark}")
    failing = sorted(k for k, v in result[base]["outcomes"].items() if v[0] in ("failed", "error"))
    lines.append(f"  fail in {base!r} itself (not compared): {len(failing)}")
    lines.extend(f"    {name}: {result[base]['outcomes'][name][1]}" for name in failing)
    for tag in tags:
        stats = result[tag]["stats"].get("stats")
        if stats is not None:
            lines.append(f"  gproj_patch.stats() in {tag!r}: {json.dumps(stats, sort_keys=True)}")
    return "\n".join(lines)
