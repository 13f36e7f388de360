"""GPROJ_PATCH=1 start-up hook: the real .pth file, run by a fresh interpreter's `site`, in subprocesses.

The .pth is placed in a temporary *user* site directory (PYTHONUSERBASE), which `site` processes exactly like
site-packages, so these tests do not depend on how the package was installed. test_wheel_ships_the_pth
checks that a wheel built from this checkout carries the same file at its root.
"""
import ast
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

from gproj_patch.integrations import startup
from tests.helpers.paths import REPO
from tests.helpers.startup import run_python as _run

ROOT = REPO


def test_pth_line_is_the_one_setup_py_ships():
    tree = ast.parse((ROOT / "setup.py").read_text())
    consts = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name) and t.id in ("PTH_LINE", "PTH_NAME")}
    assert consts == {"PTH_LINE": startup.PTH_LINE, "PTH_NAME": startup.PTH_NAME}
    assert startup.PTH_LINE.startswith("import ") and "\n" not in startup.PTH_LINE  # site exec()s such lines


def test_flag_on_enables_after_torch_import(userbase):
    r = _run(userbase, """
        import sys
        import gproj_patch.integrations.startup as s
        before = ("torch" in sys.modules, s.status()["state"])
        import torch, gproj_patch
        print(before, s.status()["state"], gproj_patch.is_enabled(), gproj_patch.patch.ENABLED.config.mode)
    """, GPROJ_PATCH="1", GPROJ_MODE="auto")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "(False, 'waiting for torch') enabled True auto"


@pytest.mark.parametrize("value", ["", "0", "off"])
def test_flag_off_does_nothing(userbase, value):
    r = _run(userbase, """
        import sys
        import gproj_patch.integrations.startup as s
        import torch, gproj_patch
        print(s.status()["state"], gproj_patch.is_enabled())
    """, GPROJ_PATCH=value)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "off False"


def test_unset_flag_never_imports_the_package(userbase):
    r = _run(userbase, "import sys; print(sorted(m for m in sys.modules if m.startswith(('gproj', 'torch'))))")
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


def _one_gproj_line(stderr):
    """The stderr's one ``gproj_patch:`` line (the assertion fails on none or more than one)."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("gproj_patch:")]
    assert len(lines) == 1, stderr
    return lines[0]


BAD_SETTINGS = [
    ({"GPROJ_PATCH": "maybe"}, "GPROJ_PATCH='maybe' is neither on (1, true, yes, on: enable at start-up) nor off"),
    ({"GPROJ_PATCH": "1", "GPROJ_DETECTOR_GRAPH": "maybe"}, "GPROJ_DETECTOR_GRAPH='maybe': expected a boolean"),
    ({"GPROJ_PATCH": "1", "GPROJ_MODE": "fast"}, "GPROJ_MODE must be one of gproj, fp32, off, auto, audit"),
    ({"GPROJ_PATCH": "1", "GPROJ_TARGETS": "nope"}, "GPROJ_TARGETS: unknown target(s) 'nope'; known: sdpa"),
    ({"GPROJ_PATCH": "1", "GPROJ_SAMPLE_EVERY": "0"}, "GPROJ_SAMPLE_EVERY must be an integer >= 1; got 0"),
    ({"GPROJ_PATCH": "1", "GPROJ_LOG_LEVEL": "-5"}, "GPROJ_LOG_LEVEL must be one of DEBUG, INFO, WARNING, WARN, "
                                                    "ERROR, CRITICAL or an int >= 0; got '-5'"),
    ({"GPROJ_PATCH": "1", "GPROJ_AUTO_ENTER": "high"}, "GPROJ_AUTO_ENTER='high': expected a number"),
]


@pytest.mark.parametrize("env,needle", BAD_SETTINGS)
def test_a_bad_setting_leaves_the_program_running_with_one_line(userbase, env, needle):
    """A start-up hook never takes a process down: the program runs, exits with its own status, and stderr has
    one line naming the variable; the patch stays off and the hook does not import torch."""
    r = _run(userbase, """
        import sys
        import gproj_patch.integrations.startup as s
        print("user code ran", "torch" in sys.modules, s.status()["state"])
        sys.exit(3)
    """, **env)
    assert r.returncode == 3, r.stderr
    assert r.stdout.strip() == "user code ran False failed"
    line = _one_gproj_line(r.stderr)
    assert needle in line and "the patch stays off" in line, line
    if env["GPROJ_PATCH"] != "maybe":  # the flag's own value, as set, not a fixed "1"
        assert line.startswith("gproj_patch: GPROJ_PATCH=1 but the environment is invalid"), line


def test_a_bad_setting_names_the_flag_as_it_was_set(userbase):
    r = _run(userbase, "print(1)", GPROJ_PATCH="yes", GPROJ_MODE="fast")
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr
    assert _one_gproj_line(r.stderr).startswith("gproj_patch: GPROJ_PATCH=yes but the environment is invalid")


def test_pip_runs_under_a_bad_setting(userbase):
    r = _run(userbase, None, cmd=[sys.executable, "-m", "pip", "--version"], GPROJ_PATCH="1", GPROJ_MODE="fast")
    assert r.returncode == 0 and r.stdout.startswith("pip "), r.stderr
    assert "GPROJ_MODE" in _one_gproj_line(r.stderr)


def test_enable_failing_at_torch_import_leaves_the_program_running(userbase):
    """Valid at start-up, invalid when torch is imported (the program changed it): enable() raises inside
    ``import torch``; the import completes, the patch stays off, status() keeps the message."""
    r = _run(userbase, """
        import os
        os.environ["GPROJ_MODE"] = "fast"
        import torch
        import gproj_patch
        import gproj_patch.integrations.startup as s
        print(torch.ones(2).sum().item(), s.status()["state"], gproj_patch.is_enabled(), s.status()["handle"])
        print(s.status()["error"])
    """, GPROJ_PATCH="on")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "2.0 failed False None"
    line = _one_gproj_line(r.stderr)
    assert line == "gproj_patch: " + out[1]
    assert out[1].startswith("GPROJ_PATCH=on but gproj_patch.enable() failed, so the patch stays off: ValueError: "
                             "GPROJ_MODE must be one of"), out[1]


@pytest.mark.parametrize("env", [e for e, _needle in BAD_SETTINGS[:3]])
def test_startup_check_still_fails_on_a_bad_setting(userbase, env):
    r = _run(userbase, None, cmd=[sys.executable, "-m", "gproj_patch", "startup", "--check"], **env)
    assert r.returncode == startup.EXIT_CODE, r.stdout + r.stderr
    assert "environment: INVALID: GPROJ_" in r.stdout, r.stdout
    _one_gproj_line(r.stderr)  # the hook's own line, once


def test_startup_check_passes_on_a_valid_setting(userbase):
    r = _run(userbase, None, cmd=[sys.executable, "-m", "gproj_patch", "startup", "--check"], GPROJ_PATCH="1",
             GPROJ_MODE="auto")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hook state in this process: waiting for torch" in r.stdout and "environment: valid" in r.stdout
    assert "gproj_patch:" not in r.stderr


def test_startup_usage_names_the_command_that_ran(capsys):
    from gproj_patch.__main__ import main
    with pytest.raises(SystemExit):
        main(["startup", "--help"])
    assert capsys.readouterr().out.startswith("usage: python -m gproj_patch startup ")


def test_torch_already_imported_enables_immediately():
    code = """
        import os, torch, gproj_patch
        import gproj_patch.integrations.startup as s
        os.environ["GPROJ_PATCH"] = "1"
        h = s.process_startup()
        print(s.status()["state"], gproj_patch.is_enabled(), h is s.process_startup())
        gproj_patch.disable()
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPROJ_")}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                       cwd=str(ROOT), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "enabled True True"


def test_wheel_ships_the_pth(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path))
    if r.returncode != 0 and "bdist_wheel" in r.stderr + r.stdout:
        pytest.skip("this interpreter's setuptools cannot build wheels without build isolation")
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("gproj_patch-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(startup.PTH_NAME).decode().strip() == startup.PTH_LINE
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        assert any(line.startswith(startup.PTH_NAME + ",") for line in zf.read(record).decode().splitlines())


def test_install_refuses_a_missing_directory(tmp_path, capsys):
    missing = tmp_path / "no" / "such-site-packages"
    assert startup.main(["--install", str(missing)]) == startup.EXIT_CODE
    err = capsys.readouterr().err
    assert err.startswith("gproj_patch: --install: no such directory") and str(missing) in err
    assert not missing.exists() and not missing.parent.exists()


def test_install_and_uninstall_in_an_existing_directory(tmp_path, capsys):
    pth = tmp_path / startup.PTH_NAME
    assert startup.main(["--install", str(tmp_path)]) == 0 and capsys.readouterr().out.strip() == str(pth)
    assert pth.read_text() == startup.PTH_LINE + "\n"
    assert startup.main(["--uninstall", str(tmp_path)]) == 0 and not pth.exists()
    assert capsys.readouterr().out.strip() == f"removed {pth}"
    assert startup.main(["--uninstall", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"not installed: {pth}"


LOG_SCRIPT = """
import logging, os
{setup}
import torch, gproj_patch
os.environ["TRITON_INTERPRET"] = "1"  # the kernel asked for on CPU: bf16 is inexact there, an INFO fp32-tier line
gproj_patch.enable(mode="gproj", targets="sdpa", log_level="INFO")
gproj_patch.enable(mode="fp32")  # already enabled: a warning
q, k, v = (torch.randn(1, 2, 8, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
torch.nn.functional.scaled_dot_product_attention(q, k, v).float().sum().backward()
"""


@pytest.mark.parametrize("setup", [
    "",  # no logging configuration
    "logging.basicConfig()",  # the logger's name shown by the application's format
])
def test_log_lines_carry_the_prefix_once(userbase, setup):
    r = _run(userbase, LOG_SCRIPT.format(setup=setup))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert any("already enabled" in ln for ln in lines) and any("fp32 tier" in ln for ln in lines), r.stderr
    assert [ln for ln in lines if ln.count("gproj_patch") != 1] == []


# An HF training script: its first line imports Transformers, which probes for torch before importing it.
ACCELERATE_SCRIPT = """
import os
from transformers import AutoModelForCausalLM
import torch
import torch.nn.functional as F
import gproj_patch
from accelerate import Accelerator

acc = Accelerator(cpu=True)
q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()
st = gproj_patch.stats()
from transformers.modeling_utils import AttentionInterface
# one write of the whole line: the two ranks share the pipe (print's separate "\\n" write could interleave)
os.write(1, (f"rank {acc.process_index}/{acc.num_processes} patched={gproj_patch.is_enabled()} "
             f"gproj={'gproj' in AttentionInterface._global_mapping} "
             f"backend={torch.distributed.get_backend() if torch.distributed.is_initialized() else None} "
             f"calls={sum(st.get(t, 0) for t in ('gproj', 'fp32', 'original'))}\\n").encode())
"""


def test_accelerate_launch_patches_every_rank(userbase, tmp_path):
    pytest.importorskip("accelerate")
    script = tmp_path / "train.py"
    script.write_text(ACCELERATE_SCRIPT)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script)]
    r = _run(userbase, None, cmd=cmd, timeout=240, GPROJ_PATCH="1", GPROJ_MODE="gproj",
             ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = sorted(ln for ln in r.stdout.splitlines() if ln.startswith("rank "))
    assert len(lines) == 2, r.stdout + r.stderr
    for i, line in enumerate(lines):
        assert line.startswith(f"rank {i}/2 patched=True gproj=True backend=gloo calls=1"), line
