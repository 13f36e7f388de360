"""The audit CLI (python -m gproj_patch audit) and the named suite (gproj_patch.audit.cases)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from gproj_patch.audit import backends as audit_backends
from gproj_patch.audit import cli
from gproj_patch.audit import run as audit_run
from gproj_patch.__main__ import main as cli_main
from gproj_patch.audit.cases import CASES, get_case, select_cases
from tests.helpers.paths import REPO


pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = str(REPO)
CASE_FIELDS = {"name", "description", "gauge_regime", "key_offset", "sweep", "format_in_range", "shape", "mask",
               "expected", "results"}
TOP_FIELDS = {"tool", "version", "torch", "device", "dtype", "quick", "seed", "threads", "elapsed_s", "translation_sigma",
              "backends", "skipped_backends", "cases", "checks"}
CHECK_FIELDS = {"unit_roundoff", "uncorrected_dq_min", "gproj_dq_max", "fp32_tier_dq_max",
                "uncorrected_dq_at_128sigma", "gproj_worst_gauge_regime_dq", "gproj_worst_gauge_regime_case",
                "gproj_out_of_range_cases", "fp32_tier_worst_gauge_regime_dq", "fp32_tier_worst_gauge_regime_case",
                "pass_uncorrected_leaks", "pass_gproj", "pass_fp32_tier", "do_layout_max", "do_layout_spread",
                "do_layout_failed", "pass_do_layout"}
CPU_BACKENDS = ["emulated-uncorrected", "emulated-gproj", "emulated-gproj-fused", "fp32-tier", "fp32-plain"]
FUSED = "sdpa-flash"  # PyTorch's fused flash backward, present on the CPU too
EAGER = ["hf-eager-uncorrected", "hf-eager-gproj"]  # HF's eager arithmetic, unpatched and through the hook
FLEX = ["flex-uncorrected", "flex-gproj"]  # compiled flex's own backward (CUDA only: n/a here) and the hook


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """The full --quick audit, run once through ``python -m`` (the README's entry point)."""
    d = tmp_path_factory.mktemp("audit")
    path, png = d / "quick.json", d / "quick.png"
    proc = subprocess.run([sys.executable, "-m", "gproj_patch", "audit", "--quick", "--device", "cpu",
                           "--no-progress", "--json", str(path), "--plot", str(png)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(path.read_text()), proc.stdout, png


def test_json_has_documented_fields(quick_report):
    doc, _, _ = quick_report
    assert TOP_FIELDS <= set(doc)
    assert doc["backends"] == CPU_BACKENDS + [FUSED] + EAGER + FLEX and doc["dtype"] == "bf16" and doc["quick"] is True
    assert {"sdpa-efficient", "sdpa-cudnn", "fa2", "fa3", "fa4", "triton"} <= set(doc["skipped_backends"])
    assert [c["name"] for c in doc["cases"]] == [c.name for c in CASES]
    for c in doc["cases"]:
        assert CASE_FIELDS <= set(c)
        assert set(c["shape"]) == {"B", "Hq", "Hkv", "Sq", "Sk", "D"}
        for b in CPU_BACKENDS:
            r = c["results"][b]
            assert r["status"] == "ok", (c["name"], b, r)
            assert {"dq", "dk", "dv", "gauge", "dq_abs", "dk_abs", "dv_abs", "seconds"} <= set(r)
        r = c["results"][FUSED]
        assert r["status"] in ("ok", "n/a") and (r["status"] == "ok" or r["reason"])
    assert CHECK_FIELDS <= set(doc["checks"])
    assert doc["elapsed_s"] < 60  # --help says "about 10 s on a 2-core CPU" (measured 9 s); 6x for a busy CI


def test_quick_done_criteria(quick_report):
    """The suite's done criteria: uncorrected dq error ≥ 20 % at 128σ; GProj ≤ 0.5 % on every gauge-regime case."""
    doc, out, _ = quick_report
    cases = {c["name"]: c for c in doc["cases"]}
    assert cases["key_offset_128"]["results"]["emulated-uncorrected"]["dq"] >= 0.20
    for c in doc["cases"]:
        if c["gauge_regime"]:
            for b in ("emulated-gproj", "emulated-gproj-fused"):
                assert c["results"][b]["dq"] <= 0.005, (c["name"], b)
            assert c["results"]["fp32-tier"]["dq"] <= 1e-3, c["name"]
    assert not cases["query_offset_32"]["gauge_regime"]
    ch = doc["checks"]
    assert (ch["uncorrected_dq_min"], ch["gproj_dq_max"], ch["fp32_tier_dq_max"]) == (0.2, 0.005, 1e-3)  # BF16
    assert ch["gproj_out_of_range_cases"] == [] and all(c["format_in_range"] for c in doc["cases"])
    assert [n for n, v in ch.items() if n.startswith("pass_") and v is not True] == []
    sink = cases["sink_offset_64"]["results"]
    assert sink["fp32-plain"]["dq"] > 0.5 and sink["fp32-tier"]["dq"] < 1e-4
    wit = cases["witness"]["results"]
    assert wit["emulated-uncorrected"]["witness_dq0"] == -24.0 and wit["emulated-gproj"]["witness_dq0"] == 0.0
    if wit[FUSED]["status"] == "ok":  # a real fused BF16 backward shows the same leak
        assert wit[FUSED]["witness_dq0"] == -24.0
    unc = [cases[f"key_offset_{x}"]["results"]["emulated-uncorrected"]["gauge"] for x in (8, 32, 128, 512)]
    assert unc == sorted(unc) and cases["key_offset_512"]["results"]["emulated-gproj"]["gauge"] < 0.01
    assert "PASS" in out and "FAIL" not in out
    # every CPU backend that can run dense attention gives the same gradients for both dO layouts, both orders
    assert set(ch["do_layout_spread"]) == set(CPU_BACKENDS + [FUSED] + EAGER + ["flex-gproj"])
    assert ch["do_layout_failed"] == [] and max(ch["do_layout_spread"].values()) <= ch["do_layout_max"]
    for name in ("do_layout_bhsd_bshd", "do_layout_bshd_bhsd"):
        layouts = [r["layout"] for r in cases[name]["results"]["fp32-tier"]["do_layouts"]]
        assert layouts == name.split("_")[2:]


def test_plot_written(quick_report):
    _, _, png = quick_report
    pytest.importorskip("matplotlib")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_subset_in_process(tmp_path, capsys):
    path = tmp_path / "sub.json"
    rc = cli_main(["audit", "--quick", "--cases", "witness,key_offset_8", "--backends", "emulated-*",
                   "--dtype", "fp16", "--json", str(path), "--no-progress"])
    assert rc == 0
    doc = json.loads(path.read_text())
    assert [c["name"] for c in doc["cases"]] == ["witness", "key_offset_8"]  # in the order asked
    assert doc["backends"] == ["emulated-uncorrected", "emulated-gproj", "emulated-gproj-fused"]
    wit = doc["cases"][0]["results"]
    assert wit["emulated-uncorrected"]["witness_dq0"] == -0.75 and wit["emulated-gproj"]["witness_dq0"] == 0.0
    assert "witness" in capsys.readouterr().out


def test_list(capsys):
    assert cli_main(["audit", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(c.name in out for c in CASES) and "fp32-tier" in out


@pytest.mark.parametrize("argv", [
    ["audit", "--dtype", "fp8"],
    ["audit", "--cases", "no_such_case"],
    ["audit", "--backends", "no_such_backend"],
    ["audit", "--device", "not-a-device"],
    ["audit", "--device", "tpu"],
    ["audit", "--plot", "out.txt", "--cases", "witness"],
    ["audit", "--seed", "x"],
    ["audit", "--threads", "-1"],
    ["frobnicate"],
    [],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_requested_without_cuda(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["audit", "--device", "cuda"])
    assert e.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


def test_backend_errors_are_reported_not_raised():
    def boom(inp, k, saved):
        raise RuntimeError("kernel exploded")

    def na(inp):
        return "cannot express this"

    res = audit_run.run_case(get_case("witness"), [audit_backends.Backend("boom", boom), audit_backends.Backend("na", boom, na)],
                         torch.bfloat16, torch.device("cpu"), True, 0)
    assert res["results"]["boom"]["status"] == "error" and "kernel exploded" in res["results"]["boom"]["reason"]
    assert res["results"]["na"] == {"status": "n/a", "reason": "cannot express this",
                                    "seconds": res["results"]["na"]["seconds"]}


# ----------------------------------------------------------------------------------------------- the suite
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_case_builds(dtype):
    for case in CASES:
        inp = case.build(seed=3, dtype=dtype, quick=True)
        B, Hq, Sq, D = inp.q.shape
        assert inp.k.shape[0] == B and inp.k.shape == inp.v.shape and inp.do.shape == inp.q.shape
        assert Hq % inp.k.shape[1] == 0 and inp.q.dtype == dtype
        assert all(torch.isfinite(x).all() for x in (inp.q, inp.k, inp.v, inp.do))
        again = case.build(seed=3, dtype=dtype, quick=True)
        assert torch.equal(inp.q, again.q) and torch.equal(inp.k, again.k)  # reproducible


def test_case_metadata():
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names)
    for required in ("diffuse", "key_offset_8", "key_offset_32", "key_offset_128", "key_offset_512",
                     "sink_offset_64", "repeated_max", "query_offset_32", "causal_top_left",
                     "causal_bottom_right", "singleton_keys", "odd_lengths", "long", "gqa", "varlen", "witness"):
        assert required in names
    assert not get_case("query_offset_32").gauge_regime and get_case("sink_offset_64").gauge_regime
    assert [c.key_offset for c in CASES if c.sweep] == [0.0, 8.0, 32.0, 128.0, 512.0]
    varlen = get_case("varlen").build(quick=True)
    lens = (varlen.mask["cu_seqlens_q"][1:] - varlen.mask["cu_seqlens_q"][:-1]).tolist()
    assert 0 in lens and 1 in lens
    c = get_case("causal_top_left").build(quick=True)
    assert c.q.shape[2] != c.k.shape[2] and c.mask["causal_align"] == "top_left"
    assert get_case("singleton_keys").build(quick=True).k.shape[2] == 1


def test_repeated_maxima_are_exact():
    inp = get_case("repeated_max").build(quick=True)
    s = inp.q.float() @ inp.k.float().transpose(-1, -2)
    assert torch.equal(s[..., 0], s[..., 1]) and torch.equal(s[..., 0], s[..., 3])
    assert bool((s.argmax(-1) < 4).float().mean() > 0.95)


def test_select_cases():
    assert [c.name for c in select_cases("key_offset_*")] == [f"key_offset_{x}" for x in (8, 32, 128, 512)]
    assert len(select_cases(None)) == len(CASES)
    with pytest.raises(ValueError, match="no case"):
        select_cases("nope")
    with pytest.raises(ValueError, match="unknown case"):
        get_case("nope")


def test_json_is_strict_with_non_finite_errors():
    doc = audit_run.finite_json({"a": [float("inf"), 1.0, float("nan")], "b": {"c": float("-inf")}})
    assert json.loads(json.dumps(doc, allow_nan=False)) == {"a": ["inf", 1.0, "nan"], "b": {"c": "-inf"}}


# ------------------------------------------------------------------------- criteria, --strict, progress output
def test_fp16_criteria_hold_on_this_cpu(tmp_path):
    """FP16's bounds are BF16's multiples of u = 2^-11; the quick suite meets them (sink: out of FP16's range)."""
    path = tmp_path / "fp16.json"
    rc = cli_main(["audit", "--quick", "--dtype", "fp16", "--backends", "emulated-*,fp32-tier", "--no-progress",
                   "--strict", "--json", str(path)])
    doc = json.loads(path.read_text())
    ch = doc["checks"]
    assert rc == 0, ch
    assert ch["unit_roundoff"] == 2.0 ** -11
    assert (ch["uncorrected_dq_min"], ch["gproj_dq_max"], ch["fp32_tier_dq_max"]) == (0.025, 0.000625, 1e-3)
    assert (ch["pass_uncorrected_leaks"], ch["pass_gproj"], ch["pass_fp32_tier"]) == (True, True, True)
    assert ch["gproj_out_of_range_cases"] == ["sink_offset_64"]
    sink = next(c for c in doc["cases"] if c["name"] == "sink_offset_64")
    assert not sink["format_in_range"]
    # why it is left out: GProj cannot bring back probabilities FP16 flushed to zero, the FP32 tier can
    assert sink["results"]["emulated-gproj"]["dq"] > 10 * ch["gproj_dq_max"]
    assert sink["results"]["fp32-tier"]["dq"] <= ch["fp32_tier_dq_max"]


def test_the_sink_case_is_out_of_fp16_range_only():
    case = get_case("sink_offset_64")
    inp = case.build(dtype=torch.float16, quick=True)
    scores = (inp.q.double() @ inp.k.double().transpose(-1, -2)) * inp.q.shape[-1] ** -0.5
    rest = torch.softmax(scores, dim=-1)[..., 1:]  # every key but the sink
    assert float((rest.to(torch.float16) == 0).double().mean()) > 0.9
    assert bool((rest.to(torch.bfloat16) != 0).all())
    assert not case.in_range(torch.float16) and case.in_range(torch.bfloat16)
    assert [c.name for c in CASES if not c.in_range(torch.float16)] == ["sink_offset_64"]


def test_strict_fails_when_an_fp16_criterion_fails(monkeypatch, capsys):
    """An "emulated-gproj" that does not correct (the uncorrected emulation under that name) fails --strict."""
    real = cli.available_backends

    def uncorrecting(device, dtype):
        backends, skipped = real(device, dtype)
        return [audit_backends.Backend(b.name, audit_backends._emulated(False)) if b.name == "emulated-gproj" else b
                for b in backends], skipped

    monkeypatch.setattr(cli, "available_backends", uncorrecting)
    rc = cli_main(["audit", "--quick", "--dtype", "fp16", "--cases", "key_offset_128", "--backends",
                   "emulated-gproj", "--no-progress", "--strict"])
    assert rc == 1
    assert "failed: pass_gproj" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--cases", "query_offset_32"],                                    # no gauge-regime case, no 128σ
    ["--cases", "key_offset_128", "--backends", "fp32-plain"],         # no backend a criterion reads
    ["--cases", "sink_offset_64", "--dtype", "fp16", "--backends", "emulated-*"],  # out of FP16's range
])
def test_strict_exits_3_when_no_criterion_could_run(argv, capsys):
    assert cli_main(["audit", "--quick", "--no-progress", "--strict"] + argv) == 3
    assert "no criterion could run" in capsys.readouterr().err


AUDIT_SMALL = [sys.executable, "-m", "gproj_patch", "audit", "--quick", "--cases", "witness,diffuse", "--backends",
               "emulated-gproj"]


def test_progress_never_shares_a_line_with_the_table_in_a_log():
    """stdout and stderr into one file (a CI log): whole progress lines, no carriage-return bar."""
    proc = subprocess.run(AUDIT_SMALL, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out
    assert "\r" not in out
    lines = out.splitlines()
    assert lines[:2] == ["[1/2] witness", "[2/2] diffuse"]
    assert "attention gradient error vs fp64" in lines[2] or lines[2].startswith("case")


def test_progress_bar_on_a_terminal():
    """stderr a terminal, stdout a file: the bar is drawn on stderr, and nothing of it reaches stdout."""
    pytest.importorskip("tqdm")
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # tqdm draws nothing 0 wide
    proc = subprocess.Popen(AUDIT_SMALL, cwd=ROOT, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        err += chunk
    out = proc.communicate(timeout=120)[0].decode()
    os.close(master)
    assert proc.returncode == 0
    assert b"audit:" in err and b"\r" in err and b"[1/2]" not in err
    assert "\r" not in out and "audit:" not in out and "emulated-gproj" in out


def test_hook_backends_are_corrected_where_the_unpatched_ones_leak(quick_report):
    """The audit's HF-eager and flex rows (CPU): HF's eager arithmetic leaks at a 128σ key offset and on the
    witness; through the eager and flex hooks every gauge case is within 0.5% of fp64 and the witness is 0."""
    doc, _, _ = quick_report
    cases = {c["name"]: c for c in doc["cases"]}
    assert cases["key_offset_128"]["results"]["hf-eager-uncorrected"]["dq"] > 0.05
    assert cases["witness"]["results"]["hf-eager-uncorrected"]["witness_dq0"] == -12.0  # exact value 0
    for name in ("hf-eager-gproj", "flex-gproj"):
        assert cases["witness"]["results"][name]["witness_dq0"] == 0.0, name
        for c in doc["cases"]:
            r = c["results"][name]
            if r["status"] == "ok" and c["gauge_regime"]:
                assert r["dq"] < 5e-3 and r["dk"] < 5e-3 and r["dv"] < 5e-3, (c["name"], name, r)
