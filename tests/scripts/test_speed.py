"""CPU run of ``python -m benchmarks.speed --smoke`` in a subprocess: the plumbing, not the speed.

On the CPU the script gates and times the patched SDPA variants with the GProj kernel through Triton's
interpreter (FP16, tiny shapes), the CPU SDPA kernel standing in for cuDNN; FA4 and Gluon cannot run here and
must read "n/a". The script is run, never imported (tests do not import benchmark scripts).
"""
import json
import math
import os
import subprocess
import sys

import pytest

from gproj_patch.runtime import config
from tests.helpers.adversarial import TARGET
from tests.helpers.paths import REPO

#: the gate's case must be adversarial: the unpatched backward's dq at least this many times the target
LEAK_FACTOR = 5.0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("speed")
    env = {k: v for k, v in os.environ.items() if k not in config.ENV.values()}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed", "--smoke", "--seed", "7", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "speed.json") as f:
        return json.load(f), proc.stdout, out


def test_gate_against_fp64(smoke):
    result, _, _ = smoke
    gate = result["gate"]
    for name in ("sdpa_tl", "sdpa_routed"):  # the patch's kernel, outputs NaN-poisoned, vs the fp64 oracle
        assert gate[name]["status"] == "PASS", gate[name]
        assert all(e <= TARGET for e in gate[name]["err"]), gate[name]
    assert gate["cudnn"]["status"] == "PASS", gate["cudnn"]
    assert gate["cudnn"]["err"][0] > LEAK_FACTOR * TARGET, "the gate's case does not make the unpatched dq leak"
    assert gate["sdpa_gluon"]["status"] == "n/a" and "tl" in gate["sdpa_gluon"]["why"]
    assert gate["fa4"]["status"] == gate["fa4_patched"]["status"] == "n/a"


def test_timing_cells(smoke):
    result, _, _ = smoke
    (row,) = result["timing"]
    cells = row["cells"]
    for name in ("cudnn", "sdpa_tl", "sdpa_routed"):
        cell = cells[name]
        assert cell["status"] == "ok", cell
        assert math.isfinite(cell["fwdbwd"]) and cell["fwdbwd"] > 0 and math.isfinite(cell["bwd"])
    assert set(cells["sdpa_tl"]["kv_major"]) == {"tl"} and cells["sdpa_tl"]["kv_major"]["tl"] > 0
    assert cells["cudnn"]["kv_major"] == {}  # unpatched: the patch's kernel never ran
    for name in ("sdpa_gluon", "fa4", "fa4_patched"):
        assert cells[name]["status"] == "n/a", cells[name]


def test_host_arms(smoke):
    result, _, _ = smoke
    host = result["host_us"]
    assert set(host) == {"unpatched", "gproj", "auto"}
    assert host["gproj"]["tiers"]["gproj"] > 0 and host["unpatched"]["tiers"]["gproj"] == 0
    assert host["auto"]["tiers"]["original"] > 0  # benign keys: the policy keeps the original backward
    assert all(r["serial"] > 0 and r["batched"] > 0 for r in host.values())


def test_table_last_and_files(smoke):
    result, stdout, out = smoke
    lines = stdout.strip().splitlines()
    assert lines[-1].startswith("| GQA 1·2(1)·16·16 causal |"), lines[-3:]
    cells = [c.strip() for c in lines[-1].strip("|").split("|")]
    ratio = result["timing"][0]["cells"]["sdpa_tl"]["fwdbwd"] / result["timing"][0]["cells"]["cudnn"]["fwdbwd"]
    assert cells[3] == format(ratio, ".3f")  # tl/cuDNN, from the JSON's own times
    assert cells[2] == cells[4] == cells[6] == "n/a"  # FA4/cuDNN, gluon/cuDNN, pFA4/FA4
    assert (out / "speed.log").read_text().rstrip().endswith(lines[-1])
