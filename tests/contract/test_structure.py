"""The package's shape: ARCHITECTURE.md names every module, and every private upstream touch-point works on the
installed versions. The import rules (backends/ pure numerics, no cycle at any level, no upward import) and the
other structure rules are in ``test_rules.py``."""

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
