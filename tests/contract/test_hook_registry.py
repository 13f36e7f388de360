"""The registry of hook targets (``runtime/hooks.py``) is the one place a target is named: the options accept its
names, ``enable()`` installs its rows, the README lists them, and a new target is one row plus one module."""
import importlib
import pathlib
import re
import sys
import types

import pytest

import gproj_patch
from gproj_patch import patch
from gproj_patch.runtime import config, hooks

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _off():
    gproj_patch.disable()
    yield
    gproj_patch.disable()


def test_every_row_names_an_installer():
    names = [h.name for h in hooks.HOOKS]
    assert len(set(names)) == len(names) and tuple(names) == hooks.TARGETS
    for hook in hooks.HOOKS:
        module = importlib.import_module(hook.module)
        assert callable(module.install) and callable(module.uninstall), hook.module
        assert hook.seam and hook.reaches


def test_options_accept_exactly_the_registry():
    assert config.resolve().targets == hooks.TARGETS
    # any order in, the registry's order out (the install order)
    assert config.resolve(targets=["flex", "sdpa"]).targets == ("sdpa", "flex")
    with pytest.raises(ValueError, match="unknown target"):
        config.resolve(targets=["sdpa", "xformers"])


def test_readme_lists_the_registry():
    text = (REPO / "README.md").read_text()
    section = text[text.index("## What it reaches"):]
    section = section[:section.index("\n## ", 1)]
    listed = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)
    assert tuple(listed) == hooks.TARGETS


def test_enable_installs_the_selected_rows_only():
    handle = gproj_patch.enable(targets=["flex", "sdpa"])
    try:
        assert list(handle.installed) == ["sdpa", "flex"]
        assert all(v.startswith(("installed", "skipped")) for v in handle.installed.values())
    finally:
        handle.disable()


def test_a_new_target_is_one_row_and_one_module(monkeypatch):
    calls = []
    demo = types.ModuleType("gproj_demo_hook")
    demo.install = lambda: calls.append("install") or "installed"
    demo.uninstall = lambda: calls.append("uninstall")
    monkeypatch.setitem(sys.modules, "gproj_demo_hook", demo)
    row = hooks.HookTarget("demo", "gproj_demo_hook", "nowhere", "nobody")
    monkeypatch.setattr(hooks, "HOOKS", hooks.HOOKS + (row,))
    monkeypatch.setattr(hooks, "TARGETS", hooks.TARGETS + ("demo",))

    handle = gproj_patch.enable(targets=["sdpa", "demo"])
    assert handle.installed == {"sdpa": handle.installed["sdpa"], "demo": "installed"}
    assert calls == ["install"] and patch.is_enabled()
    gproj_patch.disable()
    assert calls == ["install", "uninstall"]
    # a name no row registers is still refused
    with pytest.raises(ValueError, match="unknown target"):
        gproj_patch.enable(targets=["demo2"])


def test_a_failing_install_undoes_the_rows_before_it(monkeypatch):
    calls = []
    bad = types.ModuleType("gproj_bad_hook")

    def boom():
        raise RuntimeError("cannot install")

    bad.install, bad.uninstall = boom, lambda: calls.append("bad uninstall")
    monkeypatch.setitem(sys.modules, "gproj_bad_hook", bad)
    monkeypatch.setattr(hooks, "HOOKS", hooks.HOOKS + (hooks.HookTarget("bad", "gproj_bad_hook", "-", "-"),))
    monkeypatch.setattr(hooks, "TARGETS", hooks.TARGETS + ("bad",))
    from gproj_patch.hooks import sdpa as seam
    with pytest.raises(RuntimeError, match="cannot install"):
        gproj_patch.enable(targets=["sdpa", "bad"])
    assert not patch.is_enabled() and not seam.is_installed() and calls == []
