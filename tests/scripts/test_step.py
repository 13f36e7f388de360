"""``python -m benchmarks.step --fresh`` through its CLI, in a subprocess (tests do not import benchmark scripts):
every block in a process of its own, the step times pooled per arm (CPU smoke), and bad ``--arms`` refused."""
import json
import statistics
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO


def _step(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks.step", *args], cwd=str(REPO), capture_output=True,
                          text=True, timeout=600)


def test_fresh_blocks_each_run_in_their_own_process_and_pool(tmp_path):
    done = _step("--smoke", "--fresh", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    r = json.loads((tmp_path / "step.json").read_text())["steps"]["64x2"]
    assert [p["arm"] for p in r["processes"]] == ["unpatched", "gproj", "auto"]
    for arm, times in r["times_ms"].items():
        assert len(times) == 2  # --smoke: one round of 2 timed steps
        assert r["ms"][arm] == statistics.median(times)
        # each process wrote its own record, whose steps are the pooled ones
        own = json.loads((tmp_path / f"fresh_64x2_0_{arm}" / "step.json").read_text())["steps"]["64x2"]
        assert own["times_ms"][arm] == times and list(own["ms"]) == [arm]


@pytest.mark.parametrize("argv", [["--fresh", "--arms", "gproj,unpatched"], ["--arms", "gproj,gproj"],
                                  ["--arms", "fast"], ["--fresh", "--profile"]])
def test_bad_arms_are_refused(argv):
    done = _step(*argv, "--smoke")
    assert done.returncode == 2 and "--" in done.stderr, done.stderr[-1000:]
