"""One backward plan per call, made once, in one place: the router carries it out and reads nothing else — not
the options, not the environment, not the policy. Where it is made depends on the hook: the SDPA seam makes it in
the backward op's kernel, from the op's own arguments and the options in force then (there is no Python in an
SDPA forward); the Python-level hooks (FA4, HF eager, flex) at their forward.

Each test changes something between a plan and its execution (an environment variable, the policy's step, the
options) and checks that the backward still does what was planned; gradients are checked against the fp64 oracle
where a tier runs.
"""
import pytest
import torch
import torch.nn.functional as F

import gproj_patch
from gproj_patch.dispatch import plan as plan_mod
from gproj_patch.backends.reference import reference_backward
from gproj_patch.dispatch.record import CallRecord, Context, Problem


def _inputs(dtype=torch.float16, seed=0, S=16, D=16, offset=64.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, S, D, generator=g)
    k = torch.randn(1, 2, S, D, generator=g) + offset
    v = torch.randn(1, 2, S, D, generator=g)
    do = torch.randn(1, 2, S, D, generator=g)
    return tuple(t.to(dtype).requires_grad_() for t in (q, k, v)) + (do.to(dtype),)


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def test_tier_triton_keyword_runs_the_cpu_kernel_without_the_variable(patch_off, monkeypatch):
    """``enable(tier="triton")`` lets CPU fp16 run the kernel through the interpreter: before, the backend read
    GPROJ_TIER/TRITON_INTERPRET from the environment at the backward and refused the call (RuntimeError)."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gproj_patch.enable(targets=("sdpa",), tier="triton")
    q, k, v, do = _inputs()
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    assert gproj_patch.stats()["gproj"] == 1, gproj_patch.stats()
    ref = reference_backward(q.detach(), k.detach(), v.detach(), do, causal=True)
    assert _rel(q.grad, ref[0]) < 5e-3


def test_keyword_beats_the_variable(patch_off, monkeypatch):
    """GPROJ_TIER=triton in the environment, ``tier="auto"`` as a keyword: the keyword wins (before, the
    variable, read by the backend at each backward, won)."""
    monkeypatch.setenv("GPROJ_TIER", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gproj_patch.enable(targets=("sdpa",), tier="auto")
    q, k, v, do = _inputs()
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    s = gproj_patch.stats()
    assert s["gproj"] == 0 and s["fp32"] == 1, s


def test_environment_changed_after_the_forward_changes_nothing(patch_off, monkeypatch):
    """The backward reads no environment: setting TRITON_INTERPRET between forward and backward keeps the
    planned FP32 tier (and vice versa, unsetting it keeps the planned kernel)."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gproj_patch.enable(targets=("sdpa",))
    q, k, v, do = _inputs()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out.backward(do)
    assert gproj_patch.stats()["fp32"] == 1 and gproj_patch.stats()["gproj"] == 0
    gproj_patch.disable()
    gproj_patch.reset_stats()
    gproj_patch.enable(targets=("sdpa",))  # resolved with the variable set: the kernel is planned
    q, k, v, do = _inputs(seed=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    monkeypatch.delenv("TRITON_INTERPRET")
    out.backward(do)
    assert gproj_patch.stats()["gproj"] == 1, gproj_patch.stats()


def test_auto_decides_once_in_the_backward_op(patch_off):
    """SDPA under ``auto``: nothing is decided at the forward (no layer record yet); the backward op's kernel
    samples the detector once on its own q, k and LSE, and the planned tier runs."""
    gproj_patch.enable(targets=("sdpa",), mode="auto", sample_every=1)
    q, k, v, do = _inputs(dtype=torch.bfloat16, offset=512.0, S=64)
    with gproj_patch.layer_scope("attn0"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert gproj_patch.policy.stats() == {}
    out.backward(do)
    layers = gproj_patch.policy.stats()
    assert layers["attn0"]["samples"] == 1, layers
    assert layers["attn0"]["policy_tier"] in ("gproj", "fp32")  # a 512σ offset: far over the threshold
    assert layers["attn0"]["calls"]["original"] == 0, layers  # the corrected tier ran (fp32: CPU bf16)
    ref = reference_backward(q.detach(), k.detach(), v.detach(), do, causal=True)
    assert _rel(q.grad, ref[0]) < 1e-2


def test_sdpa_backward_runs_under_the_options_in_force_then(patch_off):
    """The seam decides when the backward runs: a forward made with the patch off is corrected if its backward
    runs enabled; after ``disable()`` the backward is PyTorch's own (the seam's registrations are gone)."""
    q, k, v, do = _inputs(dtype=torch.bfloat16)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with gproj_patch.enable(targets=("sdpa",), tier="fp32"):
        out.backward(do)
    assert gproj_patch.stats()["fp32"] == 1
    gproj_patch.reset_stats()
    with gproj_patch.enable(targets=("sdpa",)):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(do)
    assert gproj_patch.stats()["fp32"] + gproj_patch.stats()["gproj"] == 0


def test_a_record_without_plan_is_refused():
    """The router carries out plans; a hook that forgot to plan fails loudly instead of deciding late."""
    from gproj_patch.dispatch.router import BackwardTensors, run_backward
    q, k, v, do = (t.detach() for t in _inputs(dtype=torch.bfloat16))
    record = CallRecord(Problem(scale=0.25), Context(mode="gproj", tier_option="auto", layer="l", source="test"))
    with pytest.raises(RuntimeError, match="without a plan"):
        run_backward(record, BackwardTensors(do, q, k, v, None, None))


def test_plan_fields_name_the_decisions():
    """The plan of a CPU bf16 call: FP32 tier (the interpreter's bf16 is inexact), chunked (no LSE given), the
    kernel's reason kept for the fallback count, the layer and the step of the forward."""
    q, k, v, _ = (t.detach() for t in _inputs(dtype=torch.bfloat16))
    ctx = Context(mode="gproj", tier_option="auto", layer="attn3", source="test", cpu_kernel=True)
    record = plan_mod.make_plan(CallRecord(Problem(scale=0.25), ctx),
                                plan_mod.ForwardTensors(q, k, v, None, None), has_original=False)
    p = record.plan
    assert (p.tier, p.kernel, p.fp32_kernel, p.layer) == ("fp32", None, None, "attn3")
    assert p.reason == "the forward returned no LSE (non-fused forward)"
    lse = torch.zeros(q.shape[:3])
    record = plan_mod.make_plan(CallRecord(Problem(scale=0.25), ctx),
                                plan_mod.ForwardTensors(q.half(), k.half(), v.half(), q.half(), lse),
                                has_original=False)
    assert record.plan.tier == "gproj" and record.plan.kernel.kv_major == "tl" and record.plan.kernel.kv_major_reason
