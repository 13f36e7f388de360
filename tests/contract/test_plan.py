"""One backward plan per call, made at its forward (issue 20, item 1): the backward carries it out and reads
nothing else — not the options, not the environment, not the policy.

Each test changes something between a call's forward and its backward (an environment variable, the policy's
step, the options) and checks that the backward still does what the forward planned; gradients are checked
against the fp64 oracle where a tier runs.
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


def test_auto_decides_at_the_forward(patch_off):
    """``auto`` samples the detector on the forward's q, k and LSE: the layer's record exists, sampled, before
    any backward ran; a step change between forward and backward does not re-decide."""
    gproj_patch.enable(targets=("sdpa",), mode="auto", sample_every=1)
    q, k, v, do = _inputs(dtype=torch.bfloat16, offset=512.0, S=64)
    with gproj_patch.layer_scope("attn0"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    layers = gproj_patch.policy.stats()
    assert layers["attn0"]["samples"] == 1, layers
    planned = layers["attn0"]["policy_tier"]
    assert planned in ("gproj", "fp32")  # a 512σ key offset: the uncorrected leak is far over the threshold
    gproj_patch.policy.set_step(1000)  # would start a new sampling period if the backward decided
    out.backward(do)
    layers = gproj_patch.policy.stats()
    assert layers["attn0"]["samples"] == 1 and layers["attn0"]["policy_tier"] == planned, layers
    assert layers["attn0"]["calls"]["original"] == 0, layers  # the corrected tier ran (fp32: CPU bf16)
    ref = reference_backward(q.detach(), k.detach(), v.detach(), do, causal=True)
    assert _rel(q.grad, ref[0]) < 1e-2


def test_options_changed_after_the_forward_change_nothing(patch_off):
    """disable() and enable(mode="fp32") between forward and backward: the planned tier runs."""
    gproj_patch.enable(targets=("sdpa",), mode="off")
    gproj_patch.disable()
    gproj_patch.enable(targets=("sdpa",), tier="fp32")
    q, k, v, do = _inputs(dtype=torch.bfloat16)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gproj_patch.disable()
    gproj_patch.enable(targets=("sdpa",), mode="off")
    out.backward(do)
    assert gproj_patch.stats()["fp32"] == 1, gproj_patch.stats()


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
