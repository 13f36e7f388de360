"""The FP32 tier's kernel form: the GProj Triton kernels on fp32 copies with fp32-level products
(``configs.FP32_DOT_PRECISION``, 3×TF32 on the GPU; the interpreter computes every precision in plain fp32).

On CPU through Triton's interpreter, whose ``tl.dot`` is ``np.matmul`` of the fp32 tiles (``input_precision``
ignored: no TF32 split, numpy's sgemm of whatever BLAS numpy loaded). The saved output and LSE are what a BF16
fused forward keeps (O rounded to BF16, LSE in fp32): the projection removes what O's rounding puts into D, so
dq and dv are within 1e-4 of fp64 on every case (measured: at most 4.7e-5, at the 512σ offset; the
chunked tier 6.7e-5 there) — ten times below the chunked tier's test bar and far below what any low-precision
product gives.

dk is held to the same 1e-4, against an fp64 evaluation of the kernel's own products: the exact dk plus the
first-order effect of the difference between the two launches' fp32 dP (``tests/helpers/launch_mismatch.py``). The
dQ-major launch derives λ from its dP = dO·Vᵀ, the KV-major launch forms P∘(dP − D − λ) from its own V·dOᵀ;
whether those are bitwise transposes depends on the BLAS kernel (OpenBLAS's SkylakeX sgemm yes,
its Haswell sgemm — ``OPENBLAS_CORETYPE=Haswell`` — no, 1–2 ulps apart on ~40% of the elements at equal
accuracy). On ``sink_offset_64`` the sink key's exact dk is a cancellation (P ≈ 1, dP − D − λ ≈ e^-20·|dP|), so
those ulps are 1.5e-2 of dk (measured under Haswell; predicted by the mismatch term to 4 digits; 0 under
SkylakeX). It is not a rounding of the kernel's result, nor anything the projection could remove, and it stays
far below a missing projection (``test_missing_projection_is_caught``: 98% dk, 4400% dq on that case). Also: the
router takes this form for the FP32 tier where the kernel takes the mask as flags, and the chunked tier where
it does not.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

import gproj_patch  # noqa: E402
from gproj_patch.dispatch import plan, router  # noqa: E402,F401
from gproj_patch.backends import fp32_tier, triton_bwd  # noqa: E402
from gproj_patch.backends.reference import reference_backward  # noqa: E402
from gproj_patch.backends.triton_bwd import gproj_backward, kernel_unsupported_reason  # noqa: E402
from gproj_patch.audit.cases import get_case  # noqa: E402
from gproj_patch.dispatch.record import Problem  # noqa: E402
from tests.helpers.launch_mismatch import dk_mismatch_term, dp_launch_mismatch  # noqa: E402
from tests.helpers.numerics import rel, saved_forward  # noqa: E402

#: relative error bound against fp64 (the chunked FP32 tier is held to 1e-3 in tests/numerics/test_fp32_tier.py)
FP32_KERNEL_BOUND = 1e-4
#: a missing projection must be at least this many times the bound away
FAR = 100.0
CASES = ["key_offset_128", "key_offset_512", "sink_offset_64", "repeated_max", "causal_top_left",
         "causal_bottom_right", "window", "singleton_keys", "odd_lengths", "gqa", "varlen", "witness"]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_bwd, "_POISON_OUTPUTS", True)


def fp32_kernel(q, k, v, do, o, lse, **kw):
    return gproj_backward(do.float(), q.float(), k.float(), v.float(), o, lse, **kw)


def kernel_model(inp, ref):
    """What the interpreted kernel computes, in fp64: the exact gradients, dk plus the effect of the two launches'
    dP mismatch on this machine's BLAS (module docstring)."""
    mask = inp.mask
    varlen = {key: mask[key] for key in ("cu_seqlens_q", "cu_seqlens_k") if key in mask}
    delta = dp_launch_mismatch(inp.do.float(), inp.v.float(), **varlen)
    return ref[0], ref[1] + dk_mismatch_term(inp.q, inp.k, inp.v, delta, **mask), ref[2]


def rel_to(x, model, ref):
    """‖x − model‖ relative to ‖ref‖ (max |x − model| where ref is exactly 0)."""
    n = ref.norm()
    d = x.double() - model
    return float(d.norm() / n) if n > 0 else float(d.abs().max())


@pytest.mark.parametrize("name", CASES)
def test_fp32_kernel_against_fp64(name):
    inp = get_case(name).build(dtype=torch.bfloat16, quick=True)
    o, lse = saved_forward(inp.q, inp.k, inp.v, **inp.mask)
    ref = reference_backward(inp.q, inp.k, inp.v, inp.do, **inp.mask)
    grads = fp32_kernel(inp.q, inp.k, inp.v, inp.do, o, lse, **inp.mask)
    model = kernel_model(inp, ref)
    for gname, g, m, r in zip(("dq", "dk", "dv"), grads, model, ref):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), gname
        assert rel_to(g, m, r) <= FP32_KERNEL_BOUND, (name, gname, rel_to(g, m, r), rel(g, r))
    if inp.expected.get("dq_index") is not None:  # the four-key witness: exact dq coordinate 0
        assert float(grads[0][inp.expected["dq_index"]]) == inp.expected["dq_exact"]


@pytest.mark.parametrize("name", ["sink_offset_64", "key_offset_512"])
def test_missing_projection_is_caught(name):
    """The kernel without the projection (``correct=False``) is far outside the bound above, on dq and on dk,
    also on the case where the launch mismatch moves dk by 1.5e-2 (Haswell sgemm)."""
    inp = get_case(name).build(dtype=torch.bfloat16, quick=True)
    o, lse = saved_forward(inp.q, inp.k, inp.v, **inp.mask)
    ref = reference_backward(inp.q, inp.k, inp.v, inp.do, **inp.mask)
    model = kernel_model(inp, ref)
    unc = fp32_kernel(inp.q, inp.k, inp.v, inp.do, o, lse, correct=False, **inp.mask)
    assert rel_to(unc[0], model[0], ref[0]) > FAR * FP32_KERNEL_BOUND
    if name == "sink_offset_64":  # at 512σ the leak is in dq; on the sink key dk leaks too
        assert rel_to(unc[1], model[1], ref[1]) > FAR * FP32_KERNEL_BOUND


def test_learnable_sink_takes_the_chunked_tier():
    """With a sink the saved output's rounding enters the target P_sink·D; the kernel form would leave
    δ·P_sink/(1 − P_sink) of it in dq (measured here: above the 1e-4 bound), the chunked tier recomputes O in fp32
    and meets it. The router's predicate sends sinks to the chunked tier."""
    inp = get_case("key_offset_128").build(dtype=torch.bfloat16, quick=True)
    g = torch.Generator().manual_seed(5)
    sink = (torch.randn(inp.q.shape[1], generator=g) * 2.0 + 4.0).float()
    o, lse = saved_forward(inp.q, inp.k, inp.v, sink=sink)
    ref = reference_backward(inp.q, inp.k, inp.v, inp.do, sink=sink)
    kernel_form = fp32_kernel(inp.q, inp.k, inp.v, inp.do, o, lse, sink=sink)
    chunked = fp32_tier.fp32_backward(inp.q, inp.k, inp.v, inp.do, sink=sink)
    assert rel(kernel_form[0], ref[0]) > FP32_KERNEL_BOUND
    for gname, x, r in zip(("dq", "dk", "dv", "dsink"), chunked, ref):
        assert rel(x, r) <= FP32_KERNEL_BOUND, (gname, rel(x, r))
    t = plan.ForwardTensors(inp.q, inp.k, inp.v, o, lse)
    assert plan.kernel_reason(t, Problem(scale=inp.q.shape[-1] ** -0.5), cpu_kernel=True, fp32=True) is None
    assert "sink" in plan.kernel_reason(t, Problem(scale=inp.q.shape[-1] ** -0.5, sink=sink), cpu_kernel=True,
                                        fp32=True)


def test_predicate_fp32_form():
    q = torch.zeros(1, 2, 8, 16, dtype=torch.float32)
    assert kernel_unsupported_reason(q, q, q, cpu_kernel=True) == "dtype=float32"  # not the low-precision tier
    assert kernel_unsupported_reason(q, q, q, fp32=True, cpu_kernel=True) is None
    assert kernel_unsupported_reason(q.bfloat16(), q.bfloat16(), q.bfloat16(), fp32=True, cpu_kernel=True) is None
    assert kernel_unsupported_reason(q.double(), q.double(), q.double(), fp32=True, cpu_kernel=True) == \
        "dtype=float64"
    assert kernel_unsupported_reason(q, q, q, fp32=True, attn_mask=torch.ones(8, 8, dtype=torch.bool),
                                     cpu_kernel=True) == \
        "attn_mask"


def _sdpa_grads(q, k, v, do, **kw):
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, **kw).backward(do)
    return qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("causal", [False, True])
def test_router_fp32_tier_takes_the_kernel_form(causal, monkeypatch):
    """mode="fp32" with a mask the kernel takes as flags runs the kernel on fp32 copies (counted as the fp32
    tier); with a dense additive mask it runs the chunked tier. Both within the bound of fp64."""
    inp = get_case("key_offset_128").build(dtype=torch.float16, quick=True)
    q, k, v, do = (x[:, :, :40] for x in (inp.q, inp.k, inp.v, inp.do))
    calls = {"kernel": 0, "chunked": 0}
    real_kernel, real_chunked = router._run_kernel, fp32_tier.fp32_backward

    def kernel(t, problem, kv_major_option="auto"):
        calls["kernel"] += t.q.dtype == torch.float32
        return real_kernel(t, problem, kv_major_option)

    def chunked(*a, **kw):
        calls["chunked"] += 1
        return real_chunked(*a, **kw)
    monkeypatch.setattr(router, "_run_kernel", kernel)
    monkeypatch.setattr(fp32_tier, "fp32_backward", chunked)
    ref = reference_backward(q, k, v, do, causal=causal)
    with gproj_patch.enable(mode="fp32"):
        gproj_patch.reset_stats()
        grads = _sdpa_grads(q, k, v, do, is_causal=causal)
        assert gproj_patch.stats()["fp32"] == 1
    assert calls == {"kernel": 1, "chunked": 0}
    for gname, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert g.dtype == q.dtype
        assert rel(g, r) <= 1e-3, (gname, rel(g, r))  # within fp16 output rounding of fp64

    bias = torch.randn(q.shape[2], k.shape[2], dtype=q.dtype)
    with gproj_patch.enable(mode="fp32"):
        _sdpa_grads(q, k, v, do, attn_mask=bias)
    assert calls == {"kernel": 1, "chunked": 1}


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", CASES)
def test_gpu_fp32_kernel_against_fp64(name, monkeypatch):
    """Compiled on the GPU (3×TF32 products): the same bound against fp64 (no launch-mismatch term: the GPU's MMA
    results cannot be replayed on the host), and bitwise deterministic."""
    monkeypatch.delenv("TRITON_INTERPRET")
    inp = get_case(name).build(dtype=torch.bfloat16, device="cuda", quick=False)
    o, lse = saved_forward(inp.q, inp.k, inp.v, **inp.mask)
    ref = reference_backward(inp.q, inp.k, inp.v, inp.do, **inp.mask)
    grads = fp32_kernel(inp.q, inp.k, inp.v, inp.do, o, lse, **inp.mask)
    again = fp32_kernel(inp.q, inp.k, inp.v, inp.do, o, lse, **inp.mask)
    for gname, g, r, g2 in zip(("dq", "dk", "dv"), grads, ref, again):
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), gname
        assert rel(g, r) <= FP32_KERNEL_BOUND, (name, gname, rel(g, r))
        assert torch.equal(g, g2), (name, gname, "not deterministic")
    if inp.expected.get("dq_index") is not None:
        assert float(grads[0][inp.expected["dq_index"]]) == inp.expected["dq_exact"]


@pytest.mark.gpu
@gpu
def test_gpu_router_fp32_tier_takes_the_kernel_form(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    inp = get_case("key_offset_128").build(dtype=torch.bfloat16, device="cuda", quick=False)
    calls = []
    real_kernel = router._run_kernel
    monkeypatch.setattr(router, "_run_kernel", lambda t, p, o="auto": calls.append(t.q.dtype) or real_kernel(t, p, o))
    ref = reference_backward(inp.q, inp.k, inp.v, inp.do, causal=True)
    with gproj_patch.enable(mode="fp32"):
        gproj_patch.reset_stats()
        grads = _sdpa_grads(inp.q, inp.k, inp.v, inp.do, is_causal=True)
        assert gproj_patch.stats()["fp32"] == 1
    assert calls == [torch.float32]
    for gname, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert rel(g, r) <= 5e-3, (gname, rel(g, r))  # the fp32 result rounded to BF16 (2^-9 relative)
