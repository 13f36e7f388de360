"""torch.ops.gproj.attention_backward: registration, fake implementation, opcheck, torch.compile tracing.

Runs the real kernels on CPU through Triton's interpreter (GPROJ_TIER=triton), FP16, tiny shapes.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from gproj_patch.backends import ops  # noqa: E402
from gproj_patch.backends.reference import reference_backward, reference_forward  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("GPROJ_TIER", "triton")


def _inputs(seed=0, B=1, H=2, HKV=1, S=20, D=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g).half()
    k = torch.randn(B, HKV, S, D, generator=g).half()
    v = torch.randn(B, HKV, S, D, generator=g).half()
    do = torch.randn(B, H, S, D, generator=g).half()
    o, lse = reference_forward(q, k, v, causal=True)
    return do, q, k, v, o.half(), lse.float()


def test_op_registered_and_matches_reference():
    assert hasattr(torch.ops.gproj, "attention_backward")
    do, q, k, v, o, lse = _inputs()
    dq, dk, dv = ops.attention_backward(do, q, k, v, o, lse.unsqueeze(-1), causal=True)  # cuDNN-style LSE
    ref = reference_backward(q, k, v, do, causal=True)
    for a, r in zip((dq, dk, dv), ref):
        assert a.dtype == torch.float16
        assert float((a.double() - r).norm() / r.norm()) < 1.5e-3


def test_opcheck():
    do, q, k, v, o, lse = _inputs(seed=1, S=16)
    torch.library.opcheck(torch.ops.gproj.attention_backward.default, (do, q, k, v, o, lse),
                          dict(causal=True, window_left=-1, window_right=-1))


def test_fake_tensor_shapes_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode
    do, q, k, v, o, lse = _inputs(seed=2)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(x) for x in (do, qt, k, v, o, lse)]
        dq, dk, dv = torch.ops.gproj.attention_backward(*args)
    assert dq.shape == q.shape and dq.stride() == qt.stride()
    assert dk.shape == k.shape and dv.shape == v.shape


def test_compile_fullgraph_traces_the_op():
    do, q, k, v, o, lse = _inputs(seed=3, S=16)

    def f(do, q, k, v, o, lse):
        dq, dk, dv = ops.attention_backward(do, q, k, v, o, lse, causal=True)
        return dq.float().sum() + dk.float().sum() + dv.float().sum()

    eager = f(do, q, k, v, o, lse)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(do, q, k, v, o, lse)
    assert torch.equal(eager, compiled)


def test_cpu_bf16_is_refused_with_or_without_the_variables(monkeypatch):
    """The op is an explicit call of the kernel: it runs where the tensors are (CPU fp16 interpreted) and reads
    no environment; CPU bf16 is refused (the interpreter's bf16 is inexact), with or without GPROJ_TIER."""
    do, q, k, v, o, lse = _inputs(seed=4, S=8)
    for env in ({"GPROJ_TIER": "triton"}, {}):
        monkeypatch.delenv("GPROJ_TIER", raising=False)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match="bfloat16 under the Triton interpreter"):
            ops.attention_backward(*(x.bfloat16() for x in (do, q, k, v, o)), lse)