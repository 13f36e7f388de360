"""The package's shape: backends/ is pure numerics, no import cycles, ARCHITECTURE.md names every module, every
private upstream touch-point works on the installed versions (issue 9.2, 9.4, 9.6)."""
import ast

import pytest
import torch
from tests.helpers.paths import REPO

ROOT = REPO
PKG = ROOT / "gproj_patch"


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        yield name, path


def _imported(name, path, node):
    """Package modules one import statement of module ``name`` names (absolute)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        names = {mod} | {f"{mod}.{a.name}" for a in node.names}
    elif isinstance(node, ast.Import):
        names = {a.name for a in node.names}
    else:
        return set()
    return names & KNOWN


KNOWN = {n for n, _ in _modules()}


def _imports(name, path, top_level_only=False):
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    return set().union(*(_imported(name, path, n) for n in nodes)) - {name}


def test_backends_import_nothing_outside_backends():
    for name, path in _modules():
        if name.startswith("gproj_patch.backends"):
            bad = {m for m in _imports(name, path) if not m.startswith("gproj_patch.backends")}
            assert not bad, f"{name} imports {bad}"


def test_no_import_cycles_at_module_level():
    """Module-level imports form no cycle (imports inside functions run later and cannot deadlock an import)."""
    graph = {name: {m for m in _imports(name, path, top_level_only=True) if not name.startswith(m + ".")}
             for name, path in _modules()}
    done, stack = set(), []

    def visit(n):
        if n in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
        if n in done:
            return
        stack.append(n)
        for m in graph.get(n, ()):
            visit(m)
        stack.pop()
        done.add(n)
    for n in graph:
        visit(n)


def test_architecture_names_every_module():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    files = [str(p.relative_to(PKG)) for _, p in _modules() if p.name != "__init__.py"]
    missing = [f for f in files if f"`{f}`" not in text]
    assert not missing, f"ARCHITECTURE.md does not mention {missing}"


# ---- compat: each private upstream touch-point, on the installed versions ------------------------------------
def test_compat_fused_sdpa_lse():
    from gproj_patch.backends import compat
    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    lse = compat.fused_sdpa_lse(out.grad_fn)
    assert lse is not None and lse.shape[:3] == (1, 2, 16)
    ref = torch.logsumexp(8 ** -0.5 * q.float() @ k.float().transpose(-1, -2), -1)
    assert torch.allclose(lse.reshape(1, 2, 16), ref, atol=1e-2)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert compat.fused_sdpa_lse(out.grad_fn) is None


def test_compat_custom_op_internals():
    from gproj_patch.backends import compat

    @torch.library.custom_op("gproj_compat_test::f", mutates_args=(), device_types=("cpu",))
    def f(x: torch.Tensor, y: float = 1.0) -> torch.Tensor:
        return x * y
    opdef = compat.custom_op_def("gproj_compat_test::f")
    kernel = compat.custom_op_kernel(opdef, "cpu")
    assert kernel is not None and "y" in str(__import__("inspect").signature(compat.custom_op_signature_fn(opdef)))
    opdef.register_kernel("cpu")(lambda x, y=1.0: x * 0)
    assert torch.equal(torch.ops.gproj_compat_test.f(torch.ones(2)), torch.zeros(2))
    compat.set_custom_op_kernel(opdef, "cpu", kernel)
    assert torch.equal(torch.ops.gproj_compat_test.f(torch.ones(2), 3.0), torch.full((2,), 3.0))
    assert compat.custom_op_def("gproj_compat_test::nope") is None


def test_compat_hf_registries():
    pytest.importorskip("transformers")
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from gproj_patch.backends import compat
    assert "sdpa" in compat.hf_registry_mapping(AttentionInterface)
    assert "sdpa" in compat.hf_registry_mapping(AttentionMaskInterface)
    with pytest.raises(compat.CompatError):
        compat.hf_registry_mapping(object())


def test_compat_gluon_release_gate():
    """The Gluon kernel runs only on Triton releases it was checked against (any patch level); others get a
    reason naming the release, and the installed one's answer is what gluon_bwd holds."""
    import triton

    from gproj_patch.backends import compat, gluon_bwd
    for checked in compat.GLUON_CHECKED_TRITON:
        assert compat.gluon_unsupported_reason(checked + ".0") is None
        assert compat.gluon_unsupported_reason(checked + ".1+git1234") is None
    for other in ("3.5.1", "3.7.0", "4.0.0", "3.60.0"):
        reason = compat.gluon_unsupported_reason(other)
        assert reason is not None and other in reason
    installed = compat.gluon_unsupported_reason(triton.__version__)
    assert installed is None or gluon_bwd.UNAVAILABLE_REASON == installed
