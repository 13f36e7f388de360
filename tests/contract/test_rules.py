"""The structure rules of the package (ARCHITECTURE.md), checked on the source: one runtime state, no import cycle
at any level and no upward import, no environment read in the numerics, no host function with a dozen loose
arguments, the backward tiers spelled out once, no run or issue numbers in
comments and docstrings.

Each rule is an AST scan of ``gproj_patch/`` (the history rule: a line scan of the package and the tests; the last
one: of ``tests/``, which loads no benchmark script); a violation names the file, line and what to do instead.
"""
import ast
import re

from tests.helpers.paths import REPO

PKG = REPO / "gproj_patch"
#: the one module that owns turning the patch on and off (it may keep ``global`` state of its own)
OWNER = PKG / "patch.py"
#: the one module that holds the runtime state
STATE_MODULE = PKG / "runtime" / "state.py"
MAX_PARAMETERS = 12
#: containers a module-level assignment must not create outside the state module (unless a bounded cache)
MUTABLE_CALLS = {"dict", "list", "set", "Counter", "OrderedDict", "defaultdict", "deque", "WeakValueDictionary",
                 "WeakKeyDictionary", "WeakSet", "local"}
#: decorators whose functions are kernels or op schemas (their parameters are the kernel's / the op's)
KERNEL_DECORATORS = ("jit", "custom_op", "register_fake", "register_kernel")


def _modules(root=PKG):
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        yield name, path


KNOWN = {n: p for n, p in _modules()}


def _type_checking_blocks(tree):
    """Nodes under ``if TYPE_CHECKING:`` (imports for annotations only: never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _edges(name, path, known=KNOWN, type_checking=False):
    """(imported module, line) of every import statement of module ``name`` among ``known``, at any level (with
    ``type_checking``, those under ``if TYPE_CHECKING:`` too)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = set() if type_checking else _type_checking_blocks(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:  # `from pkg import sub` imports the submodule; `from mod import x` the module
                target = f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                if target in known and target != name:
                    yield target, node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known and a.name != name:
                    yield a.name, node.lineno


def _cycle(known) -> None:
    """Raise naming the first import cycle among ``known`` (every import: function-level ones, which still tie
    the modules' initialisation order, and those under TYPE_CHECKING, which tie their definitions)."""
    graph = {name: {m for m, _ in _edges(name, path, known, type_checking=True)} for name, path in known.items()}
    done, stack = set(), []

    def visit(n):
        if n in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
        if n in done:
            return
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            visit(m)
        stack.pop()
        done.add(n)
    for n in sorted(graph):
        visit(n)


def test_no_import_cycle_at_any_level():
    """In the package and in the tests and their helpers (``benchmarks/``: tests/scripts/test_entry_points.py)."""
    _cycle(KNOWN)
    _cycle({n: p for n, p in _modules(REPO / "tests")})


def test_the_cycle_rule_sees_type_checking_and_function_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg.a import A\n")
    known = {"pkg.a": tmp_path / "pkg" / "a.py", "pkg.b": tmp_path / "pkg" / "b.py"}
    try:
        _cycle(known)
    except AssertionError as exc:
        assert "pkg.a -> pkg.b -> pkg.a" in str(exc)
    else:
        raise AssertionError("the cycle through TYPE_CHECKING and a function-level import was not seen")


def test_no_upward_import():
    """No module imports a package above it (its names live in the modules below: the package's ``__init__``
    imports its parts, never the reverse)."""
    bad = []
    for name, path in KNOWN.items():
        for target, line in _edges(name, path):
            if name.startswith(target + "."):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not bad, bad


def test_backends_import_nothing_above_them():
    bad = [f"{path.relative_to(REPO)}:{line} imports {target}" for name, path in KNOWN.items()
           if name.startswith("gproj_patch.backends") for target, line in _edges(name, path)
           if not target.startswith("gproj_patch.backends")]
    assert not bad, bad


def test_backends_read_no_environment():
    """The numerics decide nothing: no ``os.environ`` / ``os.getenv`` under backends/ (the options are resolved
    at ``enable()`` and reach the backends through the call's plan)."""
    bad = []
    for path in sorted((PKG / "backends").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bad, bad


def test_no_global_statement_outside_the_owner():
    bad = []
    for _, path in KNOWN.items():
        if path == OWNER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} global {', '.join(node.names)}")
    assert not bad, bad


def _creates_container(value) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        fn = value.func
        fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        return fname in MUTABLE_CALLS
    return False


def _constant(name: str) -> bool:
    """UPPER_CASE module names are constants (PEP 8): the package never assigns into them
    (``test_constants_are_never_mutated``); tuned tables such as ``configs.TL_CONFIGS`` may be overridden by a
    benchmark's sweep, never by the package."""
    return name.isupper() and not name.startswith("_")


def test_module_level_mutable_state_only_in_the_state_module():
    """Every module-level container lives in the runtime state, is a constant (UPPER_CASE), or is a documented
    bounded cache (a comment with "bounded cache" right above it, saying what bounds it)."""
    bad = []
    for _, path in KNOWN.items():
        if path == STATE_MODULE:
            continue
        lines = path.read_text().splitlines()
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if not names or names == ["__all__"] or _constant(names[0]) or not _creates_container(node.value):
                continue
            above = " ".join(lines[max(0, node.lineno - 4): node.lineno - 1])
            if "bounded cache" not in above:
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} {names[0]}")
    assert not bad, bad


def test_constants_are_never_mutated():
    """No ``NAME[...] = ...``, ``del NAME[...]`` or mutating method call on an UPPER_CASE name in the package."""
    mutators = {"append", "extend", "update", "clear", "pop", "popitem", "setdefault", "add", "discard", "remove",
                "insert"}
    bad = []
    for _, path in KNOWN.items():
        for node in ast.walk(ast.parse(path.read_text())):
            target = None
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for t in (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]):
                    if isinstance(t, ast.Subscript):
                        target = t.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators:
                target = node.func.value
            name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) \
                else None
            if name and _constant(name) and name not in ("STATE", "INSTALLED", "ACTIVE", "ENABLED", "OVERRIDES",
                                                         "STATUS"):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} mutates {name}")
    assert not bad, bad


def test_no_host_function_with_a_dozen_loose_arguments():
    """Host functions take at most 12 parameters (group the rest in dataclasses); Triton/Gluon kernels and
    ``torch.library`` op schemas are exempt (their parameters are the kernel's or the op's)."""
    bad = []
    for _, path in KNOWN.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any(d in ast.unparse(dec) for dec in node.decorator_list for d in KERNEL_DECORATORS):
                continue
            a = node.args
            n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
            if n > MAX_PARAMETERS:
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n})")
    assert not bad, bad


#: the backward tiers: one definition (``runtime/config.py`` ``TIERS``, in the policy's rank order) that every
#: layer imports, so no two modules can disagree on the names or their order
TIERS_HOME = PKG / "runtime" / "config.py"
TIER_NAMES = {"original", "gproj", "fp32"}


def _tier_literals(source: str) -> list:
    """Lines of each tuple, list or set literal (or dict literal's keys) in ``source`` made of exactly the three
    tier names, in any order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else \
            node.keys if isinstance(node, ast.Dict) else None
        if items and len(items) == len(TIER_NAMES) and all(isinstance(e, ast.Constant) for e in items) and \
                {e.value for e in items} == TIER_NAMES:
            found.append(node.lineno)
    return found


def test_the_tiers_are_spelled_out_once():
    """The tuple of tier names appears in exactly one place of the package, ``runtime/config.py`` (which imports
    nothing of the package, so every layer may import it); everyone else uses ``config.TIERS``."""
    found = [f"{path.relative_to(REPO)}:{line}" for _, path in KNOWN.items()
             for line in _tier_literals(path.read_text())]
    assert len(found) == 1 and found[0].startswith(f"{TIERS_HOME.relative_to(REPO)}:"), \
        f"the tier names spelled out {len(found)} times (import TIERS from runtime/config.py instead): {found}"


def test_the_tiers_rule_sees_every_spelling():
    """The scan above flags the tier names as any literal container in any order, and nothing else."""
    sources = {
        'TIERS = ("original", "gproj", "fp32")': 1,
        'for t in ["fp32", "original", "gproj"]:\n    pass': 1,
        'ok = tier in {"gproj", "original", "fp32"}': 1,
        'RANK = {"original": 0, "gproj": 1, "fp32": 2}': 1,
        'MODES = ("gproj", "fp32", "off", "auto", "audit")': 0,
        'PAIR = ("gproj", "fp32")': 0,
        '"""Backward calls per tier ("gproj", "fp32", "original")."""': 0,
    }
    for source, expected in sources.items():
        assert len(_tier_literals(source)) == expected, source


#: history in a comment or docstring ("run 12", "runs 40–41", "Issue 21 item 4"): which run, session or issue found
#: something is BENCHMARKS.md's and CHANGELOG.md's; the source says why it is as it is
HISTORY = re.compile(r"\b(?:run|issue)s? \d", re.IGNORECASE)
#: the files that spell out such labels as examples for their scans
HISTORY_EXAMPLES = (REPO / "tests" / "contract" / "test_rules.py", REPO / "tests" / "scripts" / "test_entry_points.py")


def test_no_history_in_the_package_or_the_tests():
    """No line of the package or of the tests names a run or an issue (the same scan as benchmarks/' own, in
    ``tests/scripts/test_entry_points.py``, case-insensitive)."""
    bad = [f"{path.relative_to(REPO)}:{i}: {line.strip()[:100]}"
           for path in sorted([*PKG.rglob("*.py"), *(REPO / "tests").rglob("*.py")]) if path not in HISTORY_EXAMPLES
           for i, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not bad, "say why the code is as it is; which run or issue found it belongs in BENCHMARKS.md:\n" + \
        "\n".join(bad)


def test_the_history_rule_sees_the_labels():
    assert HISTORY.search("(H200 run 49)") and HISTORY.search("Issue 8 item 5:") and HISTORY.search("runs 56–59")
    assert HISTORY.search("(issue 19, item 4)") and HISTORY.search("issue 8.1's check")
    assert not HISTORY.search("small tile products are 2-3x faster") and not HISTORY.search("rerun 3 times")
    assert not HISTORY.search("three runs of it") and not HISTORY.search("after their issue)")


# ---- tests load no benchmark script ----------------------------------------------------------------------------
BENCHMARKS = REPO / "benchmarks"
#: calls that import or run a file or put a folder on the import path (matched on the call's last name) ...
LOADERS = {"spec_from_file_location", "SourceFileLoader", "run_path", "run_module", "import_module", "__import__",
           "addsitedir", "exec"}
#: ... and the edits of ``sys.path``
PATH_EDITS = {"insert", "append", "extend"}


def _benchmark_loads(source: str, stems) -> list:
    """(line, what) of each place in a test file's source that imports a benchmark script (``import X`` / ``from
    X import`` with X a script of benchmarks/ or ``benchmarks`` itself) or hands a benchmarks path to a loader
    (``LOADERS``: importlib's spec/loader/import_module, runpy, ``sys.path.insert`` ...). A loader's arguments are
    followed through the names they use, to what those names were assigned anywhere in the file."""
    tree = ast.parse(source)
    assigned = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        assigned.setdefault(n.id, []).append(node.value)

    def strings(expr, seen):
        for n in ast.walk(expr):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                yield n.value
            elif isinstance(n, ast.Name) and n.id not in seen:
                seen.add(n.id)
                for value in assigned.get(n.id, ()):
                    yield from strings(value, seen)

    def names_benchmarks(text):
        parts = set(text.replace("\\", "/").replace(".", "/").split("/"))
        return "benchmarks" in parts or text in stems

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [(node.lineno, f"import {a.name}") for a in node.names if names_benchmarks(a.name.split(".")[0])]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if names_benchmarks(node.module.split(".")[0]):
                bad.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            on_path = isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) in ("sys.path", "path")
            if func not in LOADERS and not (func in PATH_EDITS and on_path):
                continue
            seen = set()
            hits = [s for arg in node.args + [k.value for k in node.keywords] for s in strings(arg, seen)
                    if names_benchmarks(s) or s.split("/")[-1].removesuffix(".py") in stems]
            if hits:
                bad.append((node.lineno, f"{ast.unparse(node.func)}(...) with {sorted(set(hits))}"))
    return bad


def _benchmark_stems():
    return {p.stem for p in BENCHMARKS.glob("*.py")}


def test_no_test_loads_a_benchmark_script():
    """Tests (helpers included) run benchmark scripts through their command line in a subprocess, never import
    or exec them: a script is not an API, and its import-time side effects (sys.path edits, module-level
    configuration) would leak into the test process. (A script may import a test helper; not the reverse.)"""
    stems = _benchmark_stems()
    bad = [f"{path.relative_to(REPO)}:{line}: {what}" for path in sorted((REPO / "tests").rglob("*.py"))
           for line, what in _benchmark_loads(path.read_text(), stems)]
    assert not bad, "tests loading benchmark scripts (run them as a subprocess instead):\n" + "\n".join(bad)


def test_the_benchmark_rule_sees_every_way_in():
    """The scan above flags each way a test could load a script, and not a subprocess run of one."""
    stems = {"auto_check", "training_regime"}
    loads = {
        "import training_regime": 1,
        "from benchmarks.auto_check import exit_status": 1,
        "import benchmarks.auto_check as ac": 1,
        "import importlib.util\nP = ROOT / 'benchmarks' / 'auto_check.py'\n"
        "spec = importlib.util.spec_from_file_location('ac', P)": 1,
        "import runpy\nrunpy.run_path('benchmarks/auto_check.py')": 1,
        "import os, sys\nB = os.path.join(os.path.dirname(__file__), '..', 'benchmarks')\nsys.path.insert(0, B)": 1,
        "import importlib\nmod = importlib.import_module('training_regime')": 1,
        "exec(open('benchmarks/auto_check.py').read())": 1,
        "import subprocess, sys\nS = ROOT / 'benchmarks' / 'auto_check.py'\n"
        "subprocess.run([sys.executable, str(S), '--cpu'])": 0,
        "import importlib\nmod = importlib.import_module('gproj_patch.audit')": 0,
        "names = []\nnames.append('benchmarks/auto_check.py')": 0,
    }
    for source, expected in loads.items():
        assert len(_benchmark_loads(source, stems)) == expected, source


#: the packages ``patch.py`` stands on: the hooks it installs and everything below them never import it, nor the
#: entry points above it (``integrations/``: the Trainer callback and the start-up hook, which call ``enable()``)
BELOW_PATCH = ("gproj_patch.hooks", "gproj_patch.dispatch", "gproj_patch.policy", "gproj_patch.layers",
               "gproj_patch.runtime", "gproj_patch.backends")
ABOVE_HOOKS = ("gproj_patch.patch", "gproj_patch.integrations", "gproj_patch.audit")


def test_hooks_and_what_they_use_import_neither_patch_nor_its_entry_points():
    bad = [f"{path.relative_to(REPO)}:{line} imports {target}" for name, path in KNOWN.items()
           if name.startswith(BELOW_PATCH) for target, line in _edges(name, path)
           if target.startswith(ABOVE_HOOKS)]
    assert not bad, bad
