"""GPROJ_PATCH=1 start-up and the deferred "gproj" registration hold for any import order.

The first half runs fresh interpreters with the real .pth (see tests/integrations/test_startup.py) and a different first statement
each; every one must end with the SDPA seam installed, the start-up state "enabled", and — where Transformers' modeling code
was imported — "gproj" registered. The second half checks the after-import mechanism itself
(``gproj_patch.runtime.import_hooks``) in this process, on throw-away modules written to a temporary directory.
"""
import importlib
import importlib.util
import json
import logging
import sys
import textwrap

import pytest

from gproj_patch.runtime import import_hooks
from tests.helpers.startup import run_python as _run
from tests.helpers.paths import REPO

CHECK = """
import json, sys
was_imported = {m: m in sys.modules for m in ("torch", "transformers.modeling_utils")}
import torch
import torch.nn.functional as F
import gproj_patch.integrations.startup as s
from gproj_patch.hooks import sdpa as seam
patched = seam.is_installed()
registered = None
if "transformers.modeling_utils" in sys.modules:
    from transformers.modeling_utils import AttentionInterface
    registered = "gproj" in AttentionInterface._global_mapping
print("RESULT", json.dumps([was_imported["torch"], s.status()["state"], patched, registered]))
"""


def _order(userbase, first, then=""):
    r = _run(userbase, textwrap.dedent(first) + textwrap.dedent(then) + CHECK, timeout=240, GPROJ_PATCH="1",
             HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, r.stdout + r.stderr
    return json.loads(lines[0][len("RESULT "):]), r


def test_import_torch_first(userbase):
    (torch_first, state, patched, registered), _ = _order(userbase, "")
    assert (state, patched, registered) == ("enabled", True, None)


def test_find_spec_torch_before_import(userbase):
    (torch_first, state, patched, _), _ = _order(userbase, """
        import importlib.util, sys
        assert importlib.util.find_spec("torch") is not None and "torch" not in sys.modules
        import gproj_patch.integrations.startup as s
        assert s.status()["state"] == "waiting for torch", s.status()
    """)
    assert (torch_first, state, patched) == (False, "enabled", True)




def test_import_transformers_first(userbase):
    """torch is first imported from inside transformers.modeling_utils: enable() runs while that module is
    half executed, so "gproj" must wait for the end of its import."""
    (_, state, patched, registered), _ = _order(userbase, "import transformers\n",
                                                "import transformers.modeling_utils\n")
    assert (state, patched, registered) == ("enabled", True, True)


def test_from_transformers_import_automodel_first_then_train(userbase):
    """The usual HF script: its first line imports from Transformers (which probes torch, then imports it)."""
    (torch_first, state, patched, registered), r = _order(userbase, """
        from transformers import AutoModelForCausalLM, LlamaConfig
    """, """
        import torch, gproj_patch
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="gproj", dtype=torch.bfloat16)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        st = gproj_patch.stats()
        print("CALLS", sum(st[t] for t in ("gproj", "fp32", "original")))
    """)
    assert (torch_first, state, patched, registered) == (True, "enabled", True, True)
    assert "CALLS 2" in r.stdout  # one corrected backward per layer went through the hook


def test_accelerate_imported_first(userbase):
    (torch_first, state, patched, _), _ = _order(userbase, "import accelerate\nfrom accelerate import Accelerator\n")
    assert (torch_first, state, patched) == (True, "enabled", True)


def test_deferred_registration_survives_a_probe(userbase):
    (_, state, patched, registered), _ = _order(userbase, """
        import importlib.util, sys
        import torch
        assert importlib.util.find_spec("transformers.modeling_utils") is not None
        assert "transformers.modeling_utils" not in sys.modules
        import transformers.modeling_utils
    """)
    assert (state, patched, registered) == ("enabled", True, True)


# ------------------------------------------------------------------------------------------- the mechanism
@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Write throw-away modules under a fresh sys.path entry; forget them (and any pending hook) afterwards.
    The package's own hooks may be pending throughout ("transformers.modeling_utils" until Transformers'
    modeling code is imported: the "gproj" name, ``patch.py``); the tests must leave exactly those."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []
    before = import_hooks.pending()

    def write(relpath, code=""):
        path = tmp_path / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(code))
        importlib.invalidate_caches()
        names.append(relpath.replace("/__init__.py", "").replace(".py", "").replace("/", "."))
        return path

    yield write
    for name in names:
        sys.modules.pop(name, None)
    assert import_hooks.pending() == before, "a test left a hook pending"


def _recorder(module_name, seen):
    def callback():
        mod = sys.modules[module_name]
        seen.append(getattr(mod, "VALUE", "no code ran"))
    return callback


def test_probe_then_import_fires_once_after_the_code_ran(modules):
    modules("gp_probe_a.py", "VALUE = 'executed'\n")
    seen = []
    hook = import_hooks.call_after_import("gp_probe_a", _recorder("gp_probe_a", seen))
    for _ in range(3):
        assert importlib.util.find_spec("gp_probe_a") is not None
    assert seen == [] and hook.pending and "gp_probe_a" not in sys.modules
    mod = importlib.import_module("gp_probe_a")
    assert seen == ["executed"] and not hook.pending
    assert type(mod.__loader__) is importlib.machinery.SourceFileLoader
    assert type(mod.__spec__) is importlib.machinery.ModuleSpec and mod.__spec__.loader is mod.__loader__
    # the finder stays exactly while a callback is pending (the package's own, at most): else it is gone
    assert (import_hooks._WATCHER in sys.meta_path) == bool(import_hooks.pending())
    importlib.reload(mod)
    assert seen == ["executed"]


def test_failed_import_stays_pending_and_fires_on_the_next_success(modules):
    path = modules("gp_fails_once.py", "raise RuntimeError('broken on purpose')\n")
    seen = []
    hook = import_hooks.call_after_import("gp_fails_once", _recorder("gp_fails_once", seen))
    with pytest.raises(RuntimeError, match="broken on purpose"):
        importlib.import_module("gp_fails_once")
    assert seen == [] and hook.pending and "gp_fails_once" not in sys.modules
    path.write_text("VALUE = 'fixed'\n")
    importlib.invalidate_caches()
    sys.modules.pop("gp_fails_once", None)
    importlib.import_module("gp_fails_once")
    assert seen == ["fixed"] and not hook.pending


def test_manual_exec_outside_sys_modules_does_not_fire(modules):
    modules("gp_manual.py", "VALUE = 'executed'\n")
    seen = []
    hook = import_hooks.call_after_import("gp_manual", _recorder("gp_manual", seen))
    spec = importlib.util.find_spec("gp_manual")
    private = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(private)
    assert private.VALUE == "executed" and seen == [] and hook.pending
    importlib.import_module("gp_manual")
    assert seen == ["executed"]


def test_namespace_package_fires_and_looks_as_without_the_hook(modules):
    modules("gp_ns_watched/mod.py", "VALUE = 1\n")
    modules("gp_ns_plain/mod.py", "VALUE = 1\n")
    seen = []
    import_hooks.call_after_import("gp_ns_watched", lambda: seen.append(sys.modules["gp_ns_watched"]))
    watched = importlib.import_module("gp_ns_watched")
    plain = importlib.import_module("gp_ns_plain")
    assert seen == [watched]
    assert watched.__file__ is None and plain.__file__ is None
    assert type(watched.__loader__) is type(plain.__loader__) and watched.__spec__.loader is watched.__loader__
    assert watched.__spec__.origin == plain.__spec__.origin and watched.__package__ == "gp_ns_watched"
    assert [p.replace("watched", "plain") for p in watched.__path__] == list(plain.__path__)
    assert importlib.import_module("gp_ns_watched.mod").VALUE == 1


def test_registered_while_the_module_is_being_imported_waits_for_its_end(modules):
    """The start-up case: torch imported from inside transformers.modeling_utils, whose hook is registered
    by the torch callback while modeling_utils' code is still running."""
    modules("gp_outer.py", "import gp_inner\nVALUE = 'outer finished'\n")
    modules("gp_inner.py", "VALUE = 'inner'\n")
    seen = []

    def on_inner():
        seen.append("inner")
        assert "gp_outer" in sys.modules and not import_hooks.imported("gp_outer")
        import_hooks.call_after_import("gp_outer", _recorder("gp_outer", seen))

    import_hooks.call_after_import("gp_inner", on_inner)
    importlib.import_module("gp_outer")
    assert seen == ["inner", "outer finished"] and import_hooks.imported("gp_outer")
    assert type(sys.modules["gp_outer"].__spec__) is importlib.machinery.ModuleSpec


def test_several_callbacks_cancel_and_order(modules):
    modules("gp_multi.py", "VALUE = 'v'\n")
    seen = []
    first = import_hooks.call_after_import("gp_multi", lambda: seen.append("first"))
    withdrawn = import_hooks.call_after_import("gp_multi", lambda: seen.append("withdrawn"))
    import_hooks.call_after_import("gp_multi", lambda: seen.append("second"))
    withdrawn.cancel()
    importlib.import_module("gp_multi")
    assert seen == ["first", "second"] and not first.pending
    import_hooks.call_after_import("gp_multi", lambda: seen.append("now"))  # already imported: runs at once
    assert seen[-1] == "now"


def test_a_failing_callback_does_not_fail_the_import(modules, caplog):
    modules("gp_cb_raises.py", "VALUE = 'ok'\n")
    seen = []

    def boom():
        raise ValueError("callback exploded")

    import_hooks.call_after_import("gp_cb_raises", boom)
    import_hooks.call_after_import("gp_cb_raises", _recorder("gp_cb_raises", seen))
    with caplog.at_level(logging.ERROR, logger="gproj_patch"):
        assert importlib.import_module("gp_cb_raises").VALUE == "ok"
    assert seen == ["ok"] and "gp_cb_raises" in sys.modules
    assert any("callback exploded" in (r.exc_text or "") or r.exc_info for r in caplog.records)


class _FrontFinder:
    """A finder ahead of the watcher that serves one name itself (the watcher never sees that import)."""

    def __init__(self, name):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is not self and finder is not import_hooks._WATCHER and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    return spec
        return None


def test_import_that_bypasses_the_watcher_fires_at_the_next_import(modules):
    modules("gp_bypass.py", "VALUE = 'bypassed'\n")
    modules("gp_after_bypass.py", "")
    seen = []
    hook = import_hooks.call_after_import("gp_bypass", _recorder("gp_bypass", seen))
    front = _FrontFinder("gp_bypass")
    sys.meta_path.insert(0, front)
    try:
        importlib.import_module("gp_bypass")
        assert seen == [] and hook.pending  # not seen yet: another finder served it
        importlib.import_module("gp_after_bypass")
    finally:
        sys.meta_path.remove(front)
    assert seen == ["bypassed"] and not hook.pending


@pytest.mark.parametrize("first", ["gproj_patch.backends.gluon_bwd", "gproj_patch.backends.triton_bwd",
                                   "gproj_patch.dispatch.router", "gproj_patch.backends.spec",
                                   "gproj_patch.backends.launch_cache", "gproj_patch.backends.compat",
                                   "gproj_patch.backends.compat.errors"])
def test_backend_module_imported_before_torch_registers_the_op(first):
    """Importing a backend module first — torch then comes in through it, and torch's after-import hook loads
    ``backends/ops.py`` (and with it ``triton_bwd``) while that module is half initialized — must still register
    ``torch.ops.gproj.attention_backward`` with no failed callback (a module-level gluon_bwd ↔ triton_bwd import
    made the hook fail for ``gluon_bwd`` first; ``spec``, ``launch_cache`` and ``compat``, which ``triton_bwd``
    imports by name, made it fail until the op waited for the end of the running import)."""
    import os
    import subprocess
    root = str(REPO)
    code = f"import {first}\nimport torch\nprint('OP', hasattr(torch.ops.gproj, 'attention_backward'))"
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GPROJ_PATCH", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "OP True" in r.stdout and "failed" not in r.stderr, r.stdout + r.stderr
