"""One runtime state, bounded caches, and the imports of the hook/audit/numerics modules.

What is protected:
* no ``global`` statement, and no module-level mutable container unless it is marked ``#: bounded cache:``, in the
  modules listed in ``OWNED`` (runtime state lives in ``state.STATE``; hook bookkeeping in one ``Installed...``
  object per hook);
* ``reset()`` clears the state moved into ``RuntimeState`` and leaves the installed hooks alone;
* each marked cache stays within its bound;
* no private name imported across the package's modules, no private upstream touch-point outside
  ``backends/compat/``, and compat's new touch-points do their job on the installed torch.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

import gproj_patch
from gproj_patch.policy import detector
from gproj_patch.backends import compat
from gproj_patch.hooks import fa_records
from gproj_patch.hooks import flex as flex_hook
from gproj_patch.hooks import sdpa as sdpa_hook
from gproj_patch.runtime.state import STATE, reset

PACKAGE = pathlib.Path(gproj_patch.__file__).parent
#: the modules this rule set covers: the whole package
OWNED = tuple(str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py")))
#: calls that build a mutable container
CONTAINER_CALLS = {"dict", "list", "set", "Counter", "defaultdict", "OrderedDict", "deque", "bytearray", "local",
                   "WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}
CONTAINER_NODES = (ast.Dict, ast.List, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
BOUNDED = "#: bounded cache:"
UPSTREAM = ("torch", "triton", "transformers", "flash_attn")
PRIVATE_UPSTREAM_STRING = re.compile(r"\b(?:torch|triton|transformers|flash_attn)\.(?:\w+\.)*_[a-z]|::_[a-z]")


def _source(rel: str):
    text = (PACKAGE / rel).read_text(encoding="utf-8")
    return text.splitlines(), ast.parse(text)


def _module_statements(tree: ast.Module):
    """Top-level statements, including those under a module-level ``if``/``try``."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", []) +
                        [s for h in getattr(node, "handlers", []) for s in h.body])
        else:
            yield node


def _is_container(value) -> bool:
    if isinstance(value, CONTAINER_NODES):
        return True
    if isinstance(value, ast.Call):
        fn = value.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
        return name in CONTAINER_CALLS
    return False


def _marked_bounded(lines, lineno: int) -> bool:
    """True when the comment block right above line ``lineno`` (1-based) has a ``#: bounded cache:`` line."""
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#"):
        if lines[i].lstrip().startswith(BOUNDED):
            return True
        i -= 1
    return False


def _docstrings(tree) -> set:
    """ids of the Constant nodes that are docstrings (module, class, function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


# ---- one runtime state -----------------------------------------------------------------------------------------

# (no ``global`` statement and module-level containers only as state, constants or bounded caches: the
# package-wide rules in test_rules.py)


def test_reset_leaves_installed_hooks_alone():
    handle = gproj_patch.enable()
    try:
        libraries, ops = list(sdpa_hook.INSTALLED.libraries), sdpa_hook.seam_ops()
        assert libraries and ops
        gproj_patch.reset_stats()
        assert sdpa_hook.INSTALLED.libraries == libraries and sdpa_hook.seam_ops() == ops
    finally:
        handle.disable() if hasattr(handle, "disable") else gproj_patch.disable()
    assert not sdpa_hook.is_installed()


def test_row_index_cache_stays_bounded():
    detector._ROW_INDEX.clear()
    for s in range(300, 300 + detector.ROW_INDEX_CACHE_SIZE + 50):
        detector._row_index(s, 8, torch.device("cpu"))
        assert len(detector._ROW_INDEX) <= detector.ROW_INDEX_CACHE_SIZE
    idx = detector._row_index(1000, 8, torch.device("cpu"))
    assert idx[0] == 0 and idx[-1] == 999 and idx.numel() == 8


class _FakeCudaTensor:
    """Enough of a CUDA tensor for ``_run_statistics``'s cache key (shape, dtype, device)."""
    device = torch.device("cuda", 0)

    def __init__(self, n):
        self.shape, self.dtype = (n,), torch.float32


def test_graph_cache_stays_bounded(monkeypatch):
    captured = []

    class Graphed:
        def __init__(self, inputs, consts):
            captured.append(inputs[0].shape)

        def __call__(self, inputs):
            return "replayed"

    monkeypatch.setattr(detector, "_GraphedStatistics", Graphed)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(STATE, "detector_graph_failed", False)
    monkeypatch.setattr(detector, "_GRAPHS", {})
    for n in range(3 * detector._GRAPH_CACHE_SIZE):
        assert detector._run_statistics((_FakeCudaTensor(n), None, None, None), (0.1, 1, 2 ** -8)) == "replayed"
        assert len(detector._GRAPHS) <= detector._GRAPH_CACHE_SIZE
    assert len(captured) == 3 * detector._GRAPH_CACHE_SIZE  # one capture per new signature
    detector._run_statistics((_FakeCudaTensor(3 * detector._GRAPH_CACHE_SIZE - 1), None, None, None),
                             (0.1, 1, 2 ** -8))
    assert len(captured) == 3 * detector._GRAPH_CACHE_SIZE  # the last one is replayed from the cache


def _record():
    b = {"q": torch.zeros(1, 4, 2, 8), "k": torch.zeros(1, 4, 2, 8), "v": torch.zeros(1, 4, 2, 8), "causal": True}
    return fa_records.make_call_record(b, "flash_attn:dense", None)


def test_forward_records_stay_bounded_by_live_lses():
    before = fa_records.live_records()
    lses = [torch.zeros(1, 2, 4) for _ in range(5)]
    for lse in lses:
        fa_records.remember(lse, fa_records.ForwardRecord(_record()))
    assert fa_records.live_records() == before + 5
    assert fa_records.find(lses[0]) is not None
    del lses, lse
    assert fa_records.live_records() == before


def test_deferred_restores_are_held_once():
    assert fa_records.live_records() == 0
    lse, ran = torch.zeros(1, 2, 4), []

    def restore():
        ran.append(1)
    fa_records.remember(lse, fa_records.ForwardRecord(_record()))
    for _ in range(10):
        fa_records.when_no_records(restore)
    assert len(fa_records._when_empty) == 1 and not ran
    del lse
    assert ran == [1] and not fa_records._when_empty


def test_compiled_original_flex_cache_holds_one(monkeypatch):
    originals = [lambda *a, **k: i for i in range(4)]
    current = {"fn": originals[0]}
    monkeypatch.setattr(flex_hook, "original_flex", lambda: current["fn"])
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=False: ("compiled", fn))
    monkeypatch.setattr(flex_hook, "_COMPILED_ORIGINAL", [])
    for fn in originals + originals[:1]:
        current["fn"] = fn
        assert flex_hook._compiled_original() == ("compiled", fn)
        assert len(flex_hook._COMPILED_ORIGINAL) == 1


# ---- imports ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rel", OWNED)
def test_no_private_name_imported_across_modules(rel):
    _, tree = _source(rel)
    bad = [f"{rel}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {a.name}"
           for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
           and (node.level > 0 or (node.module or "").startswith("gproj_patch"))
           for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("rel", [r for r in OWNED if not r.startswith("backends/compat/")])
def test_private_upstream_touch_points_only_in_compat(rel):
    _, tree = _source(rel)
    docstrings, bad = _docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts = _dotted(node).split(".")
            if parts[0] in UPSTREAM and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
                bad.append(f"{rel}:{node.lineno}: {'.'.join(parts)}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in UPSTREAM:
            names = (node.module or "").split(".") + [a.name for a in node.names]
            if any(p.startswith("_") and not p.startswith("__") for p in names):
                bad.append(f"{rel}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if PRIVATE_UPSTREAM_STRING.search(node.value):
                bad.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not bad, "private upstream names outside backends/compat/:\n" + "\n".join(sorted(set(bad)))


def test_compat_fa4_interface(monkeypatch):
    from tests.helpers import fa4_standin
    monkeypatch.delitem(__import__("sys").modules, "flash_attn.cute.interface", raising=False)
    if compat.fa4_interface() is None:  # not installed here: the stand-in takes its place
        iface = fa4_standin.load(monkeypatch)
        assert compat.fa4_interface() is iface
    assert hasattr(compat.fa4_interface(), compat.FA4_BACKWARD)


def test_compat_dynamo_module_name():
    import importlib
    assert importlib.import_module(compat.dynamo_module_name()) is torch._dynamo


def test_enable_does_not_import_dynamo_and_flex_marks_its_trace_constants_when_it_is():
    """Dynamo's import (~1 s) is not part of ``enable()`` (every torch process under ``GPROJ_PATCH=1`` would pay
    it); the flex hook's two trace-time constants get Dynamo's marker as soon as Dynamo is imported (what
    ``torch._dynamo.assume_constant_result`` itself sets), before anything can be traced."""
    import subprocess
    import sys
    code = (
        "import sys, torch, gproj_patch\n"
        "gproj_patch.enable()\n"
        "from gproj_patch.hooks import flex\n"
        "assert 'torch._dynamo' not in sys.modules, 'enable() imported Dynamo'\n"
        "marked = lambda: [getattr(f, '_dynamo_marked_constant', False) for f in (flex._mask_grid, flex._note_trace_reason)]\n"
        "assert marked() == [False, False]\n"
        "import torch._dynamo\n"
        "probe = torch._dynamo.assume_constant_result(lambda: 0)\n"
        "assert [f.__dict__.keys() >= probe.__dict__.keys() for f in (flex._mask_grid, flex._note_trace_reason)] == [True, True], probe.__dict__\n"
        "assert marked() == [True, True]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "GPROJ_PATCH": "0"})
    assert done.returncode == 0, done.stderr[-3000:]


def test_compiled_calls_channel_stays_bounded_and_survives_reset(monkeypatch):
    """The compiled hooks' per-call channel (context and plan from the forward op to the backward op) keeps at
    most COMPILED_CALLS_MAX entries, oldest dropped, and reset() keeps it (a backward after a reset still finds
    its forward's plan)."""
    from gproj_patch.runtime import state as state_module
    monkeypatch.setattr(state_module, "COMPILED_CALLS_MAX", 8)
    numbers = [STATE.file_compiled_call(("entry", i)) for i in range(20)]
    assert len(STATE.compiled_calls) == 8
    assert STATE.compiled_call(numbers[-1]) == ("entry", 19)
    with pytest.raises(KeyError):
        STATE.compiled_call(numbers[0])
    reset()
    assert STATE.compiled_call(numbers[-1]) == ("entry", 19)


def test_environment_configs_of_attention_stay_bounded(monkeypatch):
    """``attention()`` without enable() resolves the environment's options once per distinct environment,
    at most _ENV_CONFIGS_MAX of them."""
    from gproj_patch import patch
    monkeypatch.setattr(patch, "_env_config", {})
    for i in range(3 * patch._ENV_CONFIGS_MAX):
        monkeypatch.setenv("GPROJ_SAMPLE_EVERY", str(i + 1))
        assert patch._default_config().policy.sample_every == i + 1
        assert len(patch._env_config) <= patch._ENV_CONFIGS_MAX
