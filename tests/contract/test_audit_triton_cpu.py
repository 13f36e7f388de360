"""The audit's Triton rows on a CPU: the GProj kernel runs through Triton's interpreter under the variables the
README documents (GPROJ_TIER=triton, TRITON_INTERPRET=1 — the rule ``enable()`` applies), in fp16 only: the
interpreter's bf16 is wrong (DESIGN §3), so bf16 lists the rows as not run, with that reason, instead of
reporting the interpreter's numbers as the kernel's."""
import pytest
import torch

from gproj_patch.__main__ import main as cli_main
from gproj_patch.audit import cases
from gproj_patch.audit import run as audit_run
from gproj_patch.audit.backends import available_backends
from gproj_patch.backends.spec import unit_roundoff

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
TRITON = ("triton-uncorrected", "triton-gproj")
INTERPRETED = [{"GPROJ_TIER": "triton", "TRITON_INTERPRET": "1"}, {"GPROJ_TIER": "triton"}, {"TRITON_INTERPRET": "1"}]


@pytest.fixture
def environ(monkeypatch):
    """Sets the given variables (and clears the other one), as a user's shell would."""
    def set_(variables):
        for name in ("GPROJ_TIER", "TRITON_INTERPRET"):
            monkeypatch.delenv(name, raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
    return set_


def _small_key_offset_case() -> cases.Case:
    """The suite's key-offset regime (keys offset 128σ beyond their spread) at one head of 32 tokens: the
    interpreted kernel runs it in about a second per row."""
    def build(d, quick):
        return cases._standard(d, 1, 1, 1, 32, 32, key_offset=128.0), {}, {}
    return cases.Case("key_offset_128_small", build, True, 128.0, "key offset 128σ, S = 32, one head")


@pytest.mark.parametrize("variables", INTERPRETED, ids=["both", "tier", "interpret"])
def test_triton_rows_are_available_on_cpu_fp16_under_the_variables(variables, environ):
    environ(variables)
    backends, skipped = available_backends(CPU, torch.float16)
    assert [b.name for b in backends if b.name.startswith("triton")] == list(TRITON) and "triton" not in skipped
    inp = cases.get_case("key_offset_128").build(dtype=torch.float16, quick=True)
    assert [b.reason(inp) for b in backends if b.name in TRITON] == [None, None]  # runs, not n/a


def test_bf16_under_the_interpreter_says_why_and_runs_no_triton_row(environ, capsys):
    environ(INTERPRETED[0])
    backends, skipped = available_backends(CPU, torch.bfloat16)
    assert not [b for b in backends if b.name.startswith("triton")]
    assert "bf16" in skipped["triton"] and "--dtype fp16" in skipped["triton"]
    assert cli_main(["audit", "--list"]) == 0
    out = capsys.readouterr().out
    assert "backend  triton" not in out and "computes bf16 wrongly" in out


def test_without_the_variables_the_rows_need_cuda(environ):
    environ({})
    backends, skipped = available_backends(CPU, torch.float16)
    assert not [b for b in backends if b.name.startswith("triton")]
    assert skipped["triton"].startswith("needs CUDA") and "GPROJ_TIER=triton" in skipped["triton"]


def test_a_bad_gproj_tier_is_a_bad_argument(environ, capsys):
    environ({"GPROJ_TIER": "fast"})
    with pytest.raises(SystemExit) as e:
        cli_main(["audit", "--quick", "--device", "cpu", "--dtype", "fp16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "GPROJ_TIER" in err and "fast" in err and len(err.strip().splitlines()) == 1


def test_the_interpreted_kernel_row_is_corrected_where_the_uncorrected_row_leaks(environ):
    """One small fp16 key-offset case through the audit's own Triton rows: GProj within the audit's 1.28·u of
    fp64 (measured 0.026% = 0.54·u), the same kernel without the projection beyond 51.2·u (measured 3.7%),
    and only the uncorrected row moves under a common key translation."""
    environ(INTERPRETED[0])
    backends, _ = available_backends(CPU, torch.float16)
    res = audit_run.run_case(_small_key_offset_case(), [b for b in backends if b.name in TRITON], torch.float16,
                             CPU, True, 0)["results"]
    u = unit_roundoff(torch.float16)
    gproj, unc = res["triton-gproj"], res["triton-uncorrected"]
    assert gproj["status"] == "ok" and unc["status"] == "ok", res
    assert gproj["dq"] <= audit_run.GPROJ_MAX_U * u and gproj["dk"] <= audit_run.GPROJ_MAX_U * u
    assert gproj["gauge"] <= audit_run.GAUGE_MAX_U * u
    assert unc["dq"] >= audit_run.LEAK_MIN_U * u and unc["gauge"] >= audit_run.LEAK_MIN_U * u
