"""``benchmarks.step --fresh``: every block in a process of its own, the step times pooled per arm (CPU smoke)."""
import statistics

import pytest

from benchmarks import step


def test_fresh_blocks_each_run_in_their_own_process_and_pool(tmp_path):
    result = step.main(["--smoke", "--fresh", "--out", str(tmp_path)])
    r = result["steps"]["64x2"]
    assert [p["arm"] for p in r["processes"]] == ["unpatched", "gproj", "auto"]
    for arm, times in r["times_ms"].items():
        assert len(times) == 2  # --smoke: one round of 2 timed steps
        assert r["ms"][arm] == statistics.median(times)
    for arm in ("unpatched", "gproj", "auto"):  # each process wrote its own record
        assert (tmp_path / f"fresh_64x2_0_{arm}" / "step.json").exists()


@pytest.mark.parametrize("argv", [["--fresh", "--arms", "gproj,unpatched"], ["--arms", "gproj,gproj"],
                                  ["--arms", "fast"], ["--fresh", "--profile"]])
def test_bad_arms_are_refused(argv):
    with pytest.raises(SystemExit):
        step.parse(argv)
