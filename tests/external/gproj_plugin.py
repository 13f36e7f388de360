"""pytest plugin: run a test suite nobody here wrote with gproj_patch enabled for the whole session.

Load it with ``-p gproj_plugin`` (this directory on ``sys.path``). It does nothing unless
``GPROJ_EXTERNAL_PATCH=1``; then ``gproj_patch.enable()`` runs in ``pytest_configure``, i.e. before any test
module is imported, so a module that binds ``from torch.nn.functional import scaled_dot_product_attention`` at
import time binds the wrapper, exactly as an application that enables the patch first would.

The options are the environment's (``GPROJ_MODE``, ``GPROJ_TIER``, ... as in README.md); the defaults are the
library's. At the end of the session it writes, to the file named by ``GPROJ_EXTERNAL_STATS`` (if set), a JSON
object: whether the patch was on at the start and still on at the end, what ``enable()`` installed, and
``gproj_patch.stats()`` (backward calls per tier, forward calls through the hooks, fallback reasons). The
runner uses it to prove that the "patch on" run really went through the hooks: a wrapper that silently
disabled itself would otherwise turn the comparison into "off against off".

A test that disables the patch (none of the vendored suites does) would be visible as ``enabled_at_end:
false``.

Selection (the same in both runs, so the two runs see the same tests; deselected tests are reported by pytest
as "deselected", never as skipped or passed):

- ``GPROJ_EXTERNAL_CLASSES``: comma list of (instantiated) class names, e.g. ``TestSDPACPU``; tests of other
  classes are deselected.
- ``GPROJ_EXTERNAL_MAX_PER_FUNCTION=N``: for every test function (the ``def test_...`` of the source file) with
  more than N parametrized instances, keep about N of them, chosen deterministically (``_subset``): a greedy
  cover first, so that every value of every parameter occurs at least once (cheapest instances preferred;
  the cover alone may exceed N), then the smallest instances (product of the numbers in the name, ties by
  SHA-256 of the name) up to N. (A fixed
  stride over the collection order aliases: unittest collects the generated names alphabetically, and a
  stride kept ``n_head=1``, ``mask_dim=2`` throughout.) Every function keeps at least one instance.
- ``GPROJ_EXTERNAL_FOCUS=regex``: instances whose name matches form an extra group per function with the same
  limit (the runner focuses on BF16/FP16 instances that run a backward: the ones the patch changes).
- ``GPROJ_EXTERNAL_LIMITS=json``: per-function overrides, ``{"test_x": {"limit": n, "focus": regex,
  "focus_limit": m, "fill": "small"|"hash"}}`` (``limit`` 0 drops the function; see ``select``).
- ``GPROJ_EXTERNAL_FUNCTIONS=a,b``: keep only the tests of these functions (plain pytest suites).
- ``GPROJ_EXTERNAL_PARAMS=json``: ``{"test_fn": {"param": ["value", ...]}}``, filters a plain pytest suite's
  parametrization by value (``callspec.params``, compared as strings).
- ``GPROJ_EXTERNAL_IDS=file``: keep only the tests whose ``Class::name`` is a line of that file.
- ``GPROJ_EXTERNAL_SELECTED=file``: the selected ``Class::name`` list is written there (for the record).
- ``GPROJ_EXTERNAL_OUTCOMES=file``: each finished test is appended there at once (``outcome<TAB>Class::name``).
"""
from __future__ import annotations

import hashlib
import json
import os
import re

_ENV = "GPROJ_EXTERNAL_PATCH"
_STATS_ENV = "GPROJ_EXTERNAL_STATS"
_record: dict = {}


def _base_names(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        names = set(re.findall(r"^\s*def (test_\w+)\(", f.read(), flags=re.M))
    return sorted(names, key=len, reverse=True)  # longest first: the most specific prefix wins


def function_of(name: str, bases: list) -> str:
    """The source function a generated test name (``<base>_<params>_<device>``) was instantiated from."""
    for base in bases:
        if name == base or name.startswith(base + "_"):
            return base
    return name


_VALUE = re.compile(r"\d+|True|False|None")


def _features(name: str) -> set:
    """The runs of 1 to 4 consecutive ``_``-separated tokens of a test name that hold at most one value token
    (a number, True, False, None): each ``param_value`` of the generated name (``q_seq_len_11``, ``bfloat16``,
    ``train_True``) is among them, pairs of neighbouring values are not (covering those would take most of a
    small budget)."""
    tok = name.split("_")
    runs = (tok[i:i + n] for n in range(1, 5) for i in range(len(tok) - n + 1))
    return {"_".join(r) for r in runs if sum(1 for t in r if _VALUE.fullmatch(t)) <= 1}


def _size(name: str) -> int:
    """The product of the numbers in a generated name (``batch_size_12``, ``q_seq_len_1030``, ...; digits glued
    to letters such as ``float16`` or ``kernel0`` are not numbers): a proxy of the work the instance does."""
    size = 1
    for token in re.findall(r"(?<![A-Za-z0-9])\d+", name):
        size *= max(1, int(token))
    return size


def _subset(members: list, limit: int, fill: str = "small", salt: str = "") -> list:
    """At most ``limit`` (at least enough to cover every feature) of ``members``, deterministically. Order: by
    ``_size``, ties by the SHA-256 of the name. First a greedy cover: repeatedly the member with the smallest
    size per feature it adds, until every feature (``_features``: every value of every parameter) occurs
    once; then the smallest remaining members up to ``limit`` (``fill="small"``; ``fill="hash"``: the next
    ones in SHA-256 order instead, sizes ignored). So every parameter value runs at least once, and the rest
    of the budget goes to cheap (or to pseudo-random) instances. ``salt`` prefixes the names before hashing:
    a focus group must not draw the same pseudo-random members as its function's main group."""
    if len(members) <= limit:
        return list(members)

    def digest(m):
        return hashlib.sha256((salt + m).encode()).hexdigest()

    order = sorted(members, key=lambda m: (_size(m), digest(m)))
    feats = {m: _features(m.partition("::")[2]) for m in order}
    universe = set().union(*feats.values())
    chosen, covered = [], set()
    while covered != universe:
        best = min((m for m in order if feats[m] - covered),
                   key=lambda m: _size(m) / len(feats[m] - covered))  # min() keeps the first of equals
        chosen.append(best)
        covered |= feats[best]
    if fill == "hash":
        order = sorted(order, key=digest)
    for m in order:
        if len(chosen) >= limit:
            break
        if m not in chosen:
            chosen.append(m)
    return chosen


def select(names: list, bases: list, limit: int, focus: str = "", rules=None) -> list:
    """The subset of ``names`` (``Class::test`` in collection order) the runs use: per test function at most
    ``limit`` (``_subset``); tests whose name matches the regex ``focus`` form a group of their own with the
    same limit, so that the instances the patch actually changes are not left to chance.

    ``rules`` (``GPROJ_EXTERNAL_LIMITS``, JSON) overrides this per function: ``{"test_x": {"limit": n, "focus":
    regex, "focus_limit": m, "fill": "small"|"hash"}}``; ``limit`` 0 drops the function."""
    rules = rules or {}
    groups: dict = {}
    for full in names:
        cls, _, test = full.partition("::")
        fn = function_of(test, bases)
        rule = rules.get(fn, {})
        n = int(rule.get("limit", limit))
        if n <= 0:
            continue
        fill = rule.get("fill", "small")
        groups.setdefault((cls, fn), (n, fill, "", []))[3].append(full)
        pattern = rule.get("focus", focus)
        if pattern and re.search(pattern, test):
            groups.setdefault((cls, fn, "focus"), (int(rule.get("focus_limit", n)), fill, "focus:", []))[3].append(full)
    keep = set()
    for n, fill, salt, members in groups.values():
        keep.update(_subset(members, n, fill, salt))
    return [n for n in names if n in keep]


def _params_match(item, params: dict) -> bool:
    """``GPROJ_EXTERNAL_PARAMS`` (JSON ``{"test_fn": {"param": ["value", ...]}}``, values compared as ``str``) on
    a plain pytest item's ``callspec``: an item of a listed function is kept if each listed parameter has one
    of the listed values; items of other functions are kept."""
    wanted = params.get(getattr(item, "originalname", None) or "")
    if not wanted:
        return True
    callspec = getattr(item, "callspec", None)
    got = callspec.params if callspec is not None else {}
    return all(name in got and str(got[name]) in {str(v) for v in values} for name, values in wanted.items())


def _scope(name: str) -> str:
    """The class, or for a module-level test the module without ``.py`` (as in the JUnit report's
    ``classname``)."""
    return name[:-3] if name.endswith(".py") else name


def _item_id(item) -> str:
    return f"{_scope(item.parent.name)}::{item.name}" if item.parent is not None else item.name


def pytest_collection_modifyitems(session, config, items):
    classes = os.environ.get("GPROJ_EXTERNAL_CLASSES", "").strip()
    limit = os.environ.get("GPROJ_EXTERNAL_MAX_PER_FUNCTION", "").strip()
    ids_file = os.environ.get("GPROJ_EXTERNAL_IDS", "").strip()
    rules = json.loads(os.environ.get("GPROJ_EXTERNAL_LIMITS", "").strip() or "{}")
    functions = {f.strip() for f in os.environ.get("GPROJ_EXTERNAL_FUNCTIONS", "").split(",") if f.strip()}
    params = json.loads(os.environ.get("GPROJ_EXTERNAL_PARAMS", "").strip() or "{}")
    if not (classes or limit or ids_file or rules or functions or params):
        return
    wanted = [it for it in items
              if not classes or _scope(it.parent.name) in {c.strip() for c in classes.split(",")}]
    if functions:
        wanted = [it for it in wanted if getattr(it, "originalname", None) in functions]
    if params:
        wanted = [it for it in wanted if _params_match(it, params)]
    if ids_file:
        with open(ids_file, encoding="utf-8") as f:
            listed = {line.strip() for line in f if line.strip() and not line.startswith("#")}
        wanted = [it for it in wanted if _item_id(it) in listed]
    if limit or rules:
        bases = []
        for path in {str(it.fspath) for it in wanted}:
            bases.extend(_base_names(path))
        bases = sorted(set(bases), key=len, reverse=True)
        chosen = set(select([_item_id(it) for it in wanted], bases, int(limit or 10 ** 9),
                            os.environ.get("GPROJ_EXTERNAL_FOCUS", ""), rules))
        wanted = [it for it in wanted if _item_id(it) in chosen]
    keep = set(map(id, wanted))
    deselected = [it for it in items if id(it) not in keep]
    items[:] = wanted
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    out = os.environ.get("GPROJ_EXTERNAL_SELECTED")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write("".join(_item_id(it) + "\n" for it in items))


def pytest_runtest_logreport(report):
    """``GPROJ_EXTERNAL_OUTCOMES=file``: one line per finished test (``outcome<TAB>Class::test``), flushed at
    once, so that a run stopped at a deadline still says what it did (the JUnit report is written at the end)."""
    path = os.environ.get("GPROJ_EXTERNAL_OUTCOMES")
    if not path:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = report.outcome if report.when == "call" else ("skipped" if report.skipped else "error")
        parts = report.nodeid.split("::")
        name = f"{_scope(parts[-2].rsplit('/', 1)[-1])}::{parts[-1]}" if len(parts) > 1 else parts[-1]
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{outcome}\t{name}\n")


def _wanted() -> bool:
    value = os.environ.get(_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{_ENV}={os.environ[_ENV]!r}: expected 1/0, true/false, yes/no or on/off")


def pytest_configure(config):
    _record.clear()
    _record["requested"] = _wanted()
    if not _record["requested"]:
        return
    import gproj_patch

    handle = gproj_patch.enable()
    _record["enabled_at_start"] = gproj_patch.is_enabled()
    _record["installed"] = dict(handle.installed)
    _record["mode"] = handle.config.mode
    _record["gproj_patch_file"] = gproj_patch.__file__
    if handle.installed.get("sdpa") != "installed":
        raise RuntimeError(f"gproj_plugin: the SDPA hook was not installed: {handle.installed}")


def pytest_report_header(config):
    if _record.get("requested"):
        return [f"gproj_patch: ENABLED for the session (mode={_record.get('mode')}, "
                f"installed={_record.get('installed')})"]
    return ["gproj_patch: not enabled (set GPROJ_EXTERNAL_PATCH=1 to enable it for the session)"]


def pytest_unconfigure(config):
    path = os.environ.get(_STATS_ENV)
    if not path:
        return
    out = dict(_record)
    if _record.get("requested"):
        import gproj_patch

        out["enabled_at_end"] = gproj_patch.is_enabled()
        stats = gproj_patch.stats()
        stats.pop("layers", None)
        out["stats"] = stats
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, sort_keys=True, default=str)
