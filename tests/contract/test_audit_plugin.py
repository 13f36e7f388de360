"""Plugin backends of the audit: a user's attention function given as MODULE:FUNCTION, the Python
API ``check(fn) -> Report``, and the ``gproj_audit`` pytest fixture.

The kernels under audit are written here: ``eager_bf16_attention`` is attention as people write it in eager
PyTorch (a BF16 QKᵀ, softmax in fp32 cast back, a BF16 PV; autograd's backward rounds dS to BF16, so it leaks),
and ``gproj_wrapped_attention`` is the same call through ``gproj_patch.attention`` (corrected backward)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import gproj_patch
from gproj_patch.__main__ import main as cli_main
from gproj_patch.audit import Report, check
from gproj_patch.audit.pytest_plugin import gproj_audit  # noqa: F401  (the fixture, also without the entry point)
from tests.helpers.paths import REPO

ROOT = str(REPO)
HERE = os.path.dirname(os.path.abspath(__file__))
CASES = "witness,diffuse,key_offset_128,causal_top_left,window,gqa,varlen"  # a few seconds on a CPU
UNC = "test_audit_plugin:eager_bf16_attention"
FIX = "test_audit_plugin:gproj_wrapped_attention"


def eager_bf16_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def gproj_wrapped_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    return gproj_patch.attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def bshd_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """flash-attn's layout: (B, S, H, D) in and out."""
    out = eager_bf16_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=attn_mask, is_causal=is_causal,
                               scale=scale)
    return out.transpose(1, 2)


def dense_only_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    if attn_mask is not None or is_causal:
        raise NotImplementedError("dense attention only")
    return gproj_wrapped_attention(q, k, v, scale=scale)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cli_doc(tmp_path_factory):
    """The README's command, in a fresh interpreter: both functions given as MODULE:FUNCTION, --strict."""
    path = tmp_path_factory.mktemp("plugin") / "plugin.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "gproj_patch", "audit", "--quick", "--device", "cpu",
                           "--no-progress", "--strict", "--cases", CASES, "--backend", UNC, "--backend", FIX,
                           "--json", str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, json.loads(path.read_text())


def test_module_function_plugin_flags_the_eager_leak_and_passes_the_wrapped_one(cli_doc):
    proc, doc = cli_doc
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # --strict: a criterion failed
    assert doc["backends"] == [UNC, FIX] and doc["plugins"] == [UNC, FIX]  # with --backend: only the plugins
    unc, fix = doc["checks"]["plugins"][UNC], doc["checks"]["plugins"][FIX]
    assert unc["witness_dq0"] == -12.0  # exact value 0 (HF's eager arithmetic gives the same)
    assert (unc["pass_dq"], unc["pass_gauge"], unc["pass_witness"]) == (False, False, False)
    assert fix["witness_dq0"] == 0.0 and (fix["pass_dq"], fix["pass_gauge"], fix["pass_witness"]) == (True,) * 3
    assert fix["worst_dq"] <= fix["dq_max"] == 0.005 and fix["worst_gauge"] <= fix["gauge_max"] == 0.01
    cases = {c["name"]: c for c in doc["cases"]}
    assert cases["key_offset_128"]["results"][UNC]["dq"] > 0.2  # the leak at a 128σ key offset
    for name in ("window", "gqa", "causal_top_left"):  # masks as attn_mask / is_causal, GQA by repeat
        assert cases[name]["results"][FIX]["status"] == "ok" and cases[name]["results"][FIX]["dq"] < 0.005, name
    assert cases["varlen"]["results"][UNC] == {"status": "n/a", "seconds": cases["varlen"]["results"][UNC]["seconds"],
                                              "reason": "varlen packs need cu_seqlens, which the SDPA signature "
                                                        "does not take"}
    assert f"failed: {UNC}: pass_dq, {UNC}: pass_gauge, {UNC}: pass_witness" in proc.stderr


def test_the_wrapped_function_alone_passes_strict(tmp_path, capsys):
    rc = cli_main(["audit", "--quick", "--no-progress", "--strict", "--cases", "witness,key_offset_*",
                   "--backend", FIX])
    out = capsys.readouterr().out
    assert rc == 0 and "3 criteria passed" in out


def test_a_plugin_that_raises_is_na_not_a_crash(tmp_path):
    path = tmp_path / "a.json"
    rc = cli_main(["audit", "--quick", "--no-progress", "--strict", "--cases", "witness,window,causal_top_left",
                   "--backend", "test_audit_plugin:dense_only_attention", "--json", str(path)])
    doc = json.loads(path.read_text())
    res = {c["name"]: c["results"]["test_audit_plugin:dense_only_attention"] for c in doc["cases"]}
    assert rc == 0 and res["witness"]["status"] == "ok"
    assert res["window"]["status"] == "n/a"
    assert res["window"]["reason"] == "raised NotImplementedError: dense attention only"


def test_bshd_layout_and_path_form(tmp_path):
    """--layout bshd hands (B, S, H, D) tensors; the figures equal the bhsd function's; PATH.py:FUNCTION loads."""
    path = tmp_path / "l.json"
    spec = os.path.join(HERE, "test_audit_plugin.py") + ":bshd_attention"
    assert cli_main(["audit", "--quick", "--no-progress", "--cases", "witness,gqa", "--layout", "bshd",
                     "--backend", spec, "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    direct = check(eager_bf16_attention, cases="witness,gqa", device="cpu")
    for c, mine in zip(doc["cases"], direct.cases):
        r = c["results"][spec]
        assert (r["dq"], r["dk"], r["dv"], r["gauge"]) == (mine.dq, mine.dk, mine.dv, mine.gauge), c["name"]
    assert doc["layout"] == "bshd" and doc["checks"]["plugins"][spec]["witness_dq0"] == -12.0


def test_fp16_plugin_audit():
    rep = check(gproj_wrapped_attention, cases=["witness", "key_offset_128"], dtype=torch.float16, device="cpu")
    assert rep.dtype == "fp16" and rep.figures["dq_max"] == 1.28 * 2.0 ** -11 and rep.passed
    bad = check(eager_bf16_attention, cases=["witness"], dtype="fp16", device="cpu")
    assert bad.figures["witness_dq0"] == -0.375 and not bad.passed  # α·K0·ε/2 with FP16's witness


# -------------------------------------------------------------------------------------------------- Python API
def test_check_returns_a_report(tmp_path):
    good = check(gproj_wrapped_attention, cases="witness,diffuse,key_offset_*", dtype="bf16", device="cpu")
    bad = check(eager_bf16_attention, cases="witness,diffuse,key_offset_*", device=torch.device("cpu"))
    assert isinstance(good, Report) and good.passed and not bad.passed
    assert [c.name for c in good.cases] == ["witness", "diffuse", "key_offset_8", "key_offset_32", "key_offset_128",
                                            "key_offset_512"]
    assert bad.criteria == {"pass_dq": False, "pass_gauge": False, "pass_witness": False, "pass_do_layout": None}
    assert bad.cases[0].witness_dq0 == -12.0 and good.cases[0].witness_dq0 == 0.0
    assert "FAILED" in bad.explain() and "witness dq[0,0,0,0]: -12.0" in bad.explain()
    doc = json.loads(bad.to_json())
    assert doc["passed"] is False and doc["cases"][4]["dq"] > 0.2 and doc["figures"]["witness_dq0"] == -12.0
    pytest.importorskip("matplotlib")
    good.plot(str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_check_rejects_bad_arguments_before_running():
    with pytest.raises(ValueError, match="dtype"):
        check(eager_bf16_attention, dtype="fp8")
    with pytest.raises(ValueError, match="layout"):
        check(eager_bf16_attention, layout="sbhd")
    with pytest.raises(ValueError, match="no case"):
        check(eager_bf16_attention, cases="nope")
    with pytest.raises(ValueError, match="callable"):
        check("not a function")


def test_no_criterion_ran_is_not_a_pass():
    rep = check(eager_bf16_attention, cases="varlen,softcap", device="cpu")  # both n/a for the SDPA signature
    assert rep.criteria == {"pass_dq": None, "pass_gauge": None, "pass_witness": None, "pass_do_layout": None}
    assert not rep.passed


def test_explain_says_why_a_criterion_did_not_run():
    """Criteria whose cases did not run read as such, with the reason — no "- [None]" or "bound ±-"."""
    text = check(eager_bf16_attention, cases="varlen", device="cpu").explain()  # a gauge-regime case, n/a here
    assert "None" not in text and "±-" not in text and ": - " not in text
    lines = text.splitlines()
    assert lines[0].endswith("no criterion could run")
    assert lines[1] == ("  dq error, worst gauge-regime case: not run: no gauge-regime case the format can hold "
                        "ran (see the n/a lines)")
    assert "witness dq[0,0,0,0]: not run: the witness case was not selected" in text
    assert "n/a varlen: varlen packs need cu_seqlens" in text
    text = check(eager_bf16_attention, cases="softcap", device="cpu").explain()  # not a gauge-regime case
    assert "dq error, worst gauge-regime case: not run: no gauge-regime case was selected" in text


# -------------------------------------------------------------------------------------------- the pytest fixture
def test_fixture_passes_a_corrected_kernel(gproj_audit):
    report = gproj_audit(gproj_wrapped_attention, cases="witness,key_offset_128,window", device="cpu")
    assert report.passed and report.figures["witness_dq0"] == 0.0


def test_fixture_fails_a_leaking_kernel(gproj_audit):
    with pytest.raises(AssertionError, match=r"gproj audit did not pass:(.|\n)*FAILED(.|\n)*witness dq\[0,0,0,0\]: -12.0"):
        gproj_audit(eager_bf16_attention, cases="witness,key_offset_128", device="cpu")
    with pytest.raises(AssertionError, match="no criterion could run"):
        gproj_audit(eager_bf16_attention, cases="varlen", device="cpu")


def test_fixture_through_pytest_plugin_loading(tmp_path):
    """A kernel's own CI: a test file that only names the fixture, run by pytest with the plugin loaded by name
    (what the pytest11 entry point does for an installed package); one test passes, one fails."""
    (tmp_path / "test_kernel.py").write_text(
        "from test_audit_plugin import eager_bf16_attention, gproj_wrapped_attention\n"
        "def test_good(gproj_audit):\n"
        "    gproj_audit(gproj_wrapped_attention, cases='witness', device='cpu')\n"
        "def test_bad(gproj_audit):\n"
        "    gproj_audit(eager_bf16_attention, cases='witness', device='cpu')\n")
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "gproj_patch.audit.pytest_plugin",
                           "-p", "no:cacheprovider", str(tmp_path / "test_kernel.py")], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.stdout, proc.stdout[-3000:]
    assert "witness dq[0,0,0,0]: -12.0" in proc.stdout
