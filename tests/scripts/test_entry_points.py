"""The shape of ``benchmarks/``: every entry point answers ``python -m benchmarks.<name> --help`` (run in
subprocesses: tests do not import benchmark modules), is named in benchmarks/README.md, and the package's source
puts nothing on ``sys.path``, imports of it form no circle, and a module imports from ``benchmarks`` only
``common`` and modules of its own subpackage (so no entry point can import another). The scans read the source
(AST), every import counted: function-level ones and those under ``if TYPE_CHECKING:`` included. Comments and
docstrings carry no run or issue numbers: that history is BENCHMARKS.md's.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gproj_patch.runtime import config
from tests.helpers.paths import REPO

BENCH = REPO / "benchmarks"
#: the one helpers module every entry point may import
HELPERS = "benchmarks.common"
#: history in comments and docstrings ("run 12", "runs 40–41", "issue 21 item 4")
HISTORY = re.compile(r"\b(?:run|issue)s? \d")


def module_name(path: Path, root: Path = REPO) -> str:
    """``benchmarks.training.data`` for benchmarks/training/data.py; a package's ``__init__``/``__main__`` is the
    package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] in ("__init__", "__main__"):
        parts = parts[:-1]
    return ".".join(parts)


def sources(package: Path) -> dict:
    """{path: source} of every Python file under ``package``."""
    return {p: p.read_text() for p in sorted(package.rglob("*.py"))}


def is_entry_point(tree: ast.Module) -> bool:
    """A top-level ``if __name__ == "__main__":``."""
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            left, right = node.test.left, node.test.comparators
            if isinstance(left, ast.Name) and left.id == "__name__" and len(right) == 1 and \
                    isinstance(right[0], ast.Constant) and right[0].value == "__main__":
                return True
    return False


def sys_path_edits(tree: ast.Module) -> list:
    """(line, what) of each edit of ``sys.path``: a method call on it (``insert``, ``append``, ``extend``,
    ``remove``, ...), an assignment to it or to a slice of it, ``site.addsitedir``, and ``from sys import path``
    (which would hide the others from this scan)."""
    def is_sys_path(node):
        return ast.unparse(node) == "sys.path" or (
            isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.path")
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            bad.append((node.lineno, "from sys import path"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if is_sys_path(node.func.value) or node.func.attr == "addsitedir":
                bad.append((node.lineno, ast.unparse(node.func)))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bad += [(node.lineno, f"{ast.unparse(t)} = ...") for t in targets if is_sys_path(t)]
    return bad


def imported_modules(tree: ast.Module, name: str, is_package: bool, known: set) -> set:
    """The ``benchmarks`` modules (of ``known``) module ``name`` imports anywhere in its source: ``import a.b``,
    ``from a import b`` (b a module or a name of a), relative imports resolved against its package."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import benchmarks.x.y`` of a name inside x: the module x
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict) -> list:
    """Every import circle of ``graph`` ({module: {imported modules}}), each as the list of its modules."""
    out, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                out.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return out


def disallowed_imports(graph: dict, packages: set) -> list:
    """(importer, imported) pairs where a module imports a ``benchmarks`` module other than ``HELPERS``, the
    package ``benchmarks`` itself, or a module of its own subpackage (``benchmarks.training`` and its modules among
    themselves). ``packages``: the names that are packages."""
    bad = []
    for importer, imported in graph.items():
        parent = importer.rpartition(".")[0]
        own = importer if importer in packages and importer != "benchmarks" else (
            parent if parent and parent != "benchmarks" else None)
        for target in imported:
            if target in (HELPERS, "benchmarks") or (own and (target == own or target.startswith(own + "."))):
                continue
            bad.append((importer, target))
    return bad


def scan(package: Path = BENCH, root: Path = REPO) -> dict:
    """Per file: its tree and module name (named relative to ``root``; a package's ``__init__`` and ``__main__``
    both the package's); the packages; the import graph among the modules; the entry points."""
    trees = {p: ast.parse(src) for p, src in sources(package).items()}
    names = {p: module_name(p, root) for p in trees}
    packages = {names[p] for p in trees if p.name in ("__init__.py", "__main__.py")}
    known = set(names.values())
    graph: dict = {}
    for p, tree in trees.items():
        graph.setdefault(names[p], set()).update(imported_modules(tree, names[p], names[p] in packages, known))
    entry = sorted(names[p] for p, tree in trees.items() if is_entry_point(tree))
    return dict(trees=trees, names=names, packages=packages, graph=graph, entry=entry)


@pytest.fixture(scope="module")
def found():
    return scan()


#: run in one subprocess from the repository root: each named module as ``python -m NAME --help`` runs it
#: (``runpy.run_module`` as ``__main__``), its exit code and stdout as JSON; one interpreter, so torch is imported
#: once (a process per module took a minute on two cores)
HELP_RUNNER = """
import contextlib, io, json, runpy, sys, traceback
out = {}
for name in sys.argv[1:]:
    buf, code, error = io.StringIO(), None, ""
    sys.argv = [name, "--help"]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException:
        error = traceback.format_exc()[-1500:]
    out[name] = dict(code=code, stdout=buf.getvalue()[:300], error=error)
print(json.dumps(out))
"""


def test_every_entry_point_answers_help(found):
    """Each entry point, run as ``python -m <name> --help``, imports and exits 0 with a usage line."""
    assert len(found["entry"]) >= 10, found["entry"]
    env = {k: v for k, v in os.environ.items() if k not in config.ENV.values()}
    proc = subprocess.run([sys.executable, "-c", HELP_RUNNER, *found["entry"]], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {name: r for name, r in ran.items() if r["code"] != 0 or not r["stdout"].startswith("usage: ")}
    assert set(ran) == set(found["entry"]) and not failed, failed


def test_readme_names_every_entry_point(found):
    readme = (BENCH / "README.md").read_text()
    missing = [name for name in found["entry"] if f"python -m {name}" not in readme]
    assert not missing, f"benchmarks/README.md does not show how to run {missing}"


def test_nothing_edits_sys_path(found):
    bad = [f"{p.relative_to(REPO)}:{line}: {what}" for p, tree in found["trees"].items()
           for line, what in sys_path_edits(tree)]
    assert not bad, bad


def test_no_import_circle_and_entry_points_share_only_common(found):
    assert not cycles(found["graph"]), cycles(found["graph"])
    bad = disallowed_imports(found["graph"], found["packages"])
    assert not bad, bad
    # the helpers module is a leaf: it imports nothing of benchmarks (so it cannot close a circle either)
    assert not found["graph"][HELPERS], found["graph"][HELPERS]


def test_no_history_in_comments_or_docstrings():
    bad = []
    for path in sorted(BENCH.rglob("*")):
        if path.suffix not in (".py", ".sh"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                bad.append(f"{path.relative_to(REPO)}:{i}: {line.strip()[:100]}")
    assert not bad, "run/issue numbers belong in BENCHMARKS.md:\n" + "\n".join(bad)


def test_the_scans_see_what_they_look_for(tmp_path):
    """The scans on a made-up package: each way of editing sys.path, a circle closed only by a function-level
    import and one under TYPE_CHECKING, an entry point importing another, a subpackage importing its own modules;
    and none of it flagged where it is allowed."""
    pkg = tmp_path / "benchmarks"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "common.py": "import os\n",
        "a.py": "import sys\nsys.path.insert(0, 'x')\nfrom benchmarks import common\n"
                "def f():\n    from benchmarks import b\nif __name__ == '__main__':\n    f()\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from benchmarks.a import f\n"
                "import site, sys\nsite.addsitedir('y')\nsys.path[:0] = ['z']\nif __name__ == '__main__':\n    pass\n",
        "c.py": "import benchmarks.common\nimport sys\nsys.path = sys.path + ['w']\nfrom sys import path\n"
                "path = 'not sys.path'\nif __name__ == '__main__':\n    pass\n",
        "sub/__init__.py": "import sys\nsys.path.append('v')\n",
        "sub/__main__.py": "from benchmarks.sub import data\nfrom . import tool\nfrom benchmarks import common\n"
                           "if __name__ == '__main__':\n    pass\n",
        "sub/data.py": "import json\nif __name__ == '__main__':\n    pass\n",
        "sub/tool.py": "from .data import json\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    got = scan(pkg, tmp_path)
    edits = {p.relative_to(pkg).as_posix(): len(sys_path_edits(tree)) for p, tree in got["trees"].items()}
    assert edits == {"__init__.py": 0, "common.py": 0, "a.py": 1, "b.py": 2, "c.py": 2, "sub/__init__.py": 1,
                     "sub/__main__.py": 0, "sub/data.py": 0, "sub/tool.py": 0}
    graph = got["graph"]
    assert [sorted(set(c)) for c in cycles(graph)] == [["benchmarks.a", "benchmarks.b"]]
    assert sorted(disallowed_imports(graph, got["packages"])) == [("benchmarks.a", "benchmarks.b"),
                                                                  ("benchmarks.b", "benchmarks.a")]
    assert graph["benchmarks.sub"] == {"benchmarks.sub.data", "benchmarks.sub.tool", "benchmarks.common"}
    assert graph["benchmarks.sub.tool"] == {"benchmarks.sub.data"}
    assert got["entry"] == ["benchmarks.a", "benchmarks.b", "benchmarks.c", "benchmarks.sub", "benchmarks.sub.data"]
    assert HISTORY.search("# as measured in run 12") and HISTORY.search("(issue 21 item 4)")
    assert HISTORY.search("runs 40–41")
    assert not HISTORY.search("three runs of it") and not HISTORY.search("rerun 3 times")
