"""The portable ``tl`` kernels' wgmma state, compiled for sm_90a on this GPU-less machine (CPU, 15–30 s).

ptxas can serialize a kernel's wgmmas silently (info C7511/C7512/C7515, which Triton 3.6 drops; the Gluon KV-major
kernel's builds without retired tiles are, benchmarks/NOTES.md): each ``HGMMA`` then waits for the previous one. This
records, for every shipped bf16 config of both ``tl`` launches at D=64 and D=128 under the default flag set (dense and
causal; corrected, fused dk form), that every ``tl.dot`` lowered to wgmma (``HGMMA``, no ``HMMA`` mma.sync) and that
ptxas kept them async, read twice, independently: the SASS (``WARPGROUP.DEPBAR`` per ``HGMMA``) and ptxas' own log
re-run on the PTX. A Triton or ptxas update that changes either fails here. The kernels are compiled by
``python -m benchmarks.ptx --wgmma`` (the launches' own arguments, Triton's binder), run as a subprocess; the Gluon
KV-major kernel's shipped configs go through the same readers as a control (neither of its shipped builds is serialized,
``test_kv_major.py``: the two readings must agree there too).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from gproj_patch.backends import configs, gluon_bwd  # noqa: E402
from tests.helpers.paths import REPO  # noqa: E402

#: the head dims whose shipped tl configs are recorded
HEAD_DIMS = (64, 128)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """``benchmarks.ptx --wgmma`` rows of the shipped tl configs (default flag sets) and the Gluon kernel."""
    out = tmp_path_factory.mktemp("tl_build") / "rows.json"
    only = "tl" if gluon_bwd.UNAVAILABLE_REASON is not None else "tl,gluon"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "benchmarks.ptx", "--only", only, "--wgmma",
                          "--flags", "default", "--dims", ",".join(map(str, HEAD_DIMS)), "--json", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(out.read_text())


def _tl(rows):
    return [r for r in rows if r["name"].startswith("_bwd_")]


def test_every_shipped_config_is_compiled(rows):
    """One row per (launch, head dim, mask), each with the shipped config of its launch."""
    tl = {r["name"]: r for r in _tl(rows)}
    for d in HEAD_DIMS:
        for kind, kernel in (("dq", "_bwd_dq"), ("dkdv", "_bwd_dkdv")):
            for mask in ("dense", "causal"):
                row = tl[f"{kernel}_d{d}_{mask}"]
                assert row["config"] == "x".join(map(str, configs.TL_CONFIGS[kind][d])), row


def test_tl_dots_lower_to_wgmma(rows):
    """Every product of both launches is a warpgroup MMA (HGMMA), none an mma.sync (HMMA)."""
    for r in _tl(rows):
        assert r["hgmma"] > 0 and r["hmma"] == 0, r


def test_sass_and_ptxas_agree_on_serialization(rows):
    """The SASS reading (a DEPBAR per HGMMA) and ptxas' own C75xx "serialized" line agree on every kernel,
    tl and Gluon."""
    for r in rows:
        assert r["serialized"] == r["ptxas_serialized"], r


def test_shipped_tl_configs_keep_wgmma_async(rows):
    """Recorded state (Triton 3.6's ptxas): no shipped tl config at D=64/128 is serialized, dense or causal (registers
    138–255, spills in several: ``benchmarks.ptx --wgmma`` prints them; benchmarks/NOTES.md). When this fails, the tl
    launches lost their overlapped wgmmas: look at the C75xx reason in the row."""
    for r in _tl(rows):
        assert not r["serialized"] and not r["ptxas_serialized"], r
        assert r["depbar"] < r["hgmma"], r
