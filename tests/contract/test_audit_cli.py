"""The audit's command line as a new user meets it: arguments checked before anything runs
(exit 2, one line), one plain-text table whatever is installed, a quiet stderr, plain-English counts,
``--version``, ``python -m gproj_patch startup``, and a readable plot."""
import json
import subprocess
import sys
import types

import pytest

from gproj_patch import __version__
from gproj_patch.__main__ import main as cli_main
from gproj_patch.audit import cli
from gproj_patch.audit import report as audit_report
from tests.helpers.paths import REPO

ROOT = str(REPO)


@pytest.fixture
def no_run(monkeypatch):
    """Fails the test if the audit starts running a case: the argument must be refused before that."""
    def refuse(*a, **k):
        raise AssertionError("the audit ran before the bad argument was found")
    monkeypatch.setattr(cli, "run_case", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--cases", "witness", "--plot", "p.png"], "--plot needs the key-offset sweep cases"),
    (["--json", "/no/such/dir/a.json"], "directory /no/such/dir does not exist"),
    (["--plot", "/no/such/dir/a.png"], "directory /no/such/dir does not exist"),
    (["--backend", "no_colon"], "expected MODULE:FUNCTION"),
    (["--backend", "no_such_module_xyz:f"], "cannot import no_such_module_xyz"),
    (["--backend", "math:no_such_function"], "math has no attribute 'no_such_function'"),
    (["--backend", "math:pi"], "pi is not callable"),
    (["--backend", "/no/such/file.py:f"], "no file /no/such/file.py"),
    (["--layout", "sbhd"], "invalid choice"),
])
def test_bad_arguments_exit_2_before_the_run(argv, message, no_run, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["audit", "--quick", "--no-progress"] + argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1  # one line, no usage block


def test_plot_without_matplotlib_exits_2(monkeypatch, no_run, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit) as e:
        cli_main(["audit", "--quick", "--cases", "diffuse", "--plot", "p.png"])
    assert e.value.code == 2 and "--plot needs matplotlib" in capsys.readouterr().err


def _table(monkeypatch, capsys, rich_installed: bool) -> str:
    if rich_installed:  # a stand-in rich: if the table used it, the output would change (or fail)
        fake = types.ModuleType("rich")
        fake.console = types.ModuleType("rich.console")
        for name in ("rich", "rich.console", "rich.table"):
            monkeypatch.setitem(sys.modules, name, fake)
    else:
        for name in ("rich", "rich.console", "rich.table"):
            monkeypatch.setitem(sys.modules, name, None)
    assert cli_main(["audit", "--quick", "--no-progress", "--cases", "witness,varlen",
                     "--backends", "emulated-gproj,sdpa-flash,flex-uncorrected"]) == 0
    return capsys.readouterr().out


def test_one_plain_table_with_wrapped_reasons(monkeypatch, capsys):
    without, with_rich = _table(monkeypatch, capsys, False), _table(monkeypatch, capsys, True)
    strip = lambda s: [ln for ln in s.splitlines() if " in " not in ln or "×" not in ln]  # noqa: E731 (timing)
    assert strip(without) == strip(with_rich)
    lines = without.splitlines()
    assert lines[0].split() == ["case", "backend", "dq", "err", "dk", "err", "dv", "err", "gauge", "err", "note"]
    table = lines[:lines.index(next(ln for ln in lines if ln.startswith("uncorrected emulation")))]
    assert max(len(ln) for ln in table) <= 130
    note_col = lines[0].index("note")
    notes = " ".join(ln[note_col:].strip() for ln in table[2:] if len(ln) > note_col)
    assert "SDPA has no varlen (cu_seqlens) interface" in notes  # the whole reason, wrapped, not cut
    assert "PyTorch's flex_attention has no CPU backward" in notes
    assert "2 cases × 3 backends" in without


def test_plain_english_counts(capsys):
    assert cli_main(["audit", "--quick", "--no-progress", "--strict", "--cases", "key_offset_128",
                     "--backends", "emulated-uncorrected"]) == 0
    out = capsys.readouterr().out
    assert "1 case × 1 backend on" in out and "--strict: 1 criterion passed" in out


def test_warnings_of_audited_calls_go_to_the_json_not_stderr(tmp_path):
    """flex without torch.compile warns (a multi-line UserWarning) on the CPU: kept in the JSON, not printed."""
    path = tmp_path / "w.json"
    proc = subprocess.run([sys.executable, "-m", "gproj_patch", "audit", "--quick", "--cases", "diffuse",
                           "--backends", "flex-gproj", "--json", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr and "flex_attention called without torch.compile" not in proc.stderr
    res = json.loads(path.read_text())["cases"][0]["results"]["flex-gproj"]
    assert any("flex_attention called without torch.compile" in w for w in res["warnings"])
    assert "1 result came with warnings" in proc.stdout


def test_version_and_help(capsys):
    for argv in (["--version"], ["audit", "--version"]):
        with pytest.raises(SystemExit) as e:
            cli_main(argv)
        assert e.value.code == 0 and capsys.readouterr().out.strip() == f"gproj_patch {__version__}"
    with pytest.raises(SystemExit):
        cli_main(["audit", "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "--seed SEED" in out and "seed of the suite's random inputs" in out
    assert "--backend MODULE:FUNCTION" in out and "exit status" in out


def test_startup_command_without_runpy_warning(tmp_path):
    """python -m gproj_patch startup --check / --install DIR / --uninstall DIR, no RuntimeWarning."""
    run = lambda *a: subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "gproj_patch",  # noqa
                                     "startup", *a], cwd=ROOT, capture_output=True, text=True, timeout=120)
    check = run("--check")
    assert check.returncode == 0 and "environment: valid" in check.stdout and "Warning" not in check.stderr
    installed = run("--install", str(tmp_path))
    assert installed.returncode == 0 and (tmp_path / "gproj_patch_startup.pth").exists()
    removed = run("--uninstall", str(tmp_path))
    assert removed.returncode == 0 and not (tmp_path / "gproj_patch_startup.pth").exists()


def test_plot_series_are_distinct_and_identical_ones_merged():
    sweep = [{"sweep": True, "key_offset": x, "results": {
        "a": {"status": "ok", "dq": 0.1 * (x + 1)}, "b": {"status": "ok", "dq": 0.1 * (x + 1)},
        "c": {"status": "ok", "dq": 0.2}}} for x in (0.0, 8.0)]
    assert [name for name, _ in audit_report._series(sweep, ["a", "b", "c"], "dq")] == ["a = b", "c"]
    styles = [audit_report._style(i) for i in range(20)]
    assert len(set(styles)) == 20  # no colour-and-marker pair reused (the old cycle repeated after 8)


def test_plot_has_labelled_panels_and_legend_outside(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    saved = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def keep(fig, *a, **k):
        real_savefig(fig, *a, **k)
        renderer = fig.canvas.get_renderer()  # before write_plot closes the figure
        saved.update(fig=fig, legend=fig.legends[0].get_window_extent(renderer),
                     panels=[ax.get_window_extent(renderer) for ax in fig.axes])
    sweep = [{"sweep": True, "key_offset": x, "results": {
        "u": {"status": "ok", "dq": 0.01 * (x + 1), "gauge": 0.02 * (x + 1)},
        "g": {"status": "ok", "dq": 0.001, "gauge": 0.002}}} for x in (0.0, 8.0, 32.0)]
    matplotlib.figure.Figure.savefig = keep
    try:
        audit_report.write_plot(str(tmp_path / "p.png"), sweep, ["u", "g"], "t", dq_bound=0.005, gauge_bound=0.01)
    finally:
        matplotlib.figure.Figure.savefig = real_savefig
    fig = saved["fig"]
    axes = fig.axes
    assert [ax.get_title()[:3] for ax in axes] == ["(a)", "(b)"]
    assert all(ax.get_legend() is None for ax in axes) and len(fig.legends) == 1
    for panel in saved["panels"]:  # the legend overlaps no panel
        assert saved["legend"].y1 <= panel.y0
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["u", "g", "dq bound 0.5%", "gauge bound 1%"]
    plt.close(fig)


def test_log_lines_are_written_through_the_bar(monkeypatch):
    """On a terminal, this package's log lines go through tqdm (the bar is cleared, the line printed, the bar
    redrawn below it), once each — not written over the bar by the last-resort handler."""
    pytest.importorskip("tqdm")
    import io
    import logging

    class Tty(io.StringIO):
        def isatty(self):
            return True
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    items = [types.SimpleNamespace(name=f"case{i}") for i in range(3)]
    for i, _ in enumerate(cli._progress(items, True)):
        if i == 1:
            logging.getLogger("gproj_patch").warning("a fallback, logged once")
    text = err.getvalue()
    assert text.count("gproj_patch: a fallback, logged once") == 1
    before = text[:text.index("gproj_patch: a fallback")]
    assert before.endswith("\r") or before.endswith("\n") or before.endswith("\x1b[A")  # starts its own line
    assert "audit:" in text[text.index("gproj_patch: a fallback"):]  # the bar is drawn again below it


# ------------------------------------------------------------- how criteria, the command's name and warnings read
def test_criteria_that_did_not_run_say_what_they_need(capsys):
    """No "- [None]" for a criterion whose input did not run: it says it did not run and what it needs."""
    assert cli_main(["audit", "--quick", "--no-progress", "--cases", "witness",
                     "--backends", "emulated-uncorrected"]) == 0
    out = capsys.readouterr().out
    assert "None" not in out and ": - " not in out
    assert "uncorrected emulation dq @128σ: not run (needs key_offset_128 with emulated-uncorrected)" in out
    assert "FP32 tier worst gauge-regime dq: not run (needs a gauge-regime case with fp32-tier)" in out


def test_usage_and_errors_name_the_command_as_invoked(monkeypatch, capsys):
    import gproj_patch.audit
    monkeypatch.setattr(sys, "argv", ["/opt/venv/bin/gproj-audit", "--help"])
    with pytest.raises(SystemExit):
        gproj_patch.audit.main()  # the console script's entry point
    assert capsys.readouterr().out.startswith("usage: gproj-audit ")
    with pytest.raises(SystemExit):
        gproj_patch.audit.main(["--dtype", "fp8"])
    assert capsys.readouterr().err.startswith("gproj-audit: error: argument --dtype")
    assert cli.invoked_as(cli.__file__) == "python -m gproj_patch.audit.cli"  # python -m gproj_patch.audit.cli
    assert cli.invoked_as("-c") == "gproj-audit" and cli.invoked_as(r"gproj-audit.exe") == "gproj-audit"
    with pytest.raises(SystemExit):
        cli_main(["audit", "--help"])
    assert capsys.readouterr().out.startswith("usage: python -m gproj_patch audit ")


WARNING_PLUGIN = '''
import warnings
import torch.nn.functional as F


def noisy_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    warnings.warn("noisy_attention: this is the audited call's own advice")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
'''


def test_warnings_are_printed_when_there_is_no_json(tmp_path, capsys):
    """Without --json the audited calls' warnings are shown once each (with where they came from), not said to
    be kept in a JSON that was never written; with --json the line names that file."""
    plugin = tmp_path / "noisy.py"
    plugin.write_text(WARNING_PLUGIN)
    argv = ["audit", "--quick", "--no-progress", "--cases", "witness,key_offset_8", "--backend",
            f"{plugin}:noisy_attention"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "JSON" not in out and "2 results came with warnings from the audited calls" in out
    assert out.count("UserWarning: noisy_attention: this is the audited call's own advice") == 1
    assert "[witness/" in out and "key_offset_8/" in out
    path = tmp_path / "a.json"
    assert cli_main(argv + ["--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"kept in {path}, field 'warnings'" in out and "own advice" not in out
