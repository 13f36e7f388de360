"""The per-call choice of the KV-major kernel (Gluon on sm_90, tl elsewhere) on CPU: the predicate's reasons,
the explicit ``kv_major=`` argument, and ``stats()`` counting which kernel ran. The Gluon kernel itself runs in
``tests/kernels/test_gluon_gpu.py`` (H200)."""
from __future__ import annotations

import pytest
import torch

import gproj_patch
from gproj_patch.backends import gluon_bwd
from gproj_patch.backends.gluon_bwd import kv_major_reason
from gproj_patch.backends.reference import reference_backward, reference_forward
from gproj_patch.backends.triton_bwd import gproj_backward


def _qkv(sq=64, sk=64, d=128, dtype=torch.bfloat16, h=2, hkv=2):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, sq, d, generator=g).to(dtype)
    k = torch.randn(1, hkv, sk, d, generator=g).to(dtype)
    return q, k, k.clone(), q.clone()


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(window=(8, 0)), "window"),
    (dict(softcap=30.0), "softcap"),
    (dict(varlen=True), "varlen"),
    (dict(correct=False), "correct=False"),
    (dict(dk_form="two_product"), "two_product"),
])
def test_uncovered_options_get_a_reason(kwargs, fragment):
    q, k, v, do = _qkv()
    reason = kv_major_reason(q, k, v, do=do, **kwargs)
    assert reason is not None and fragment in reason


@pytest.mark.parametrize("shape,dtype,fragment", [
    ((64, 64, 96), torch.bfloat16, "head_dim=96"),
    ((64, 64, 128), torch.float32, "dtype=float32"),
    ((333, 64, 128), torch.bfloat16, "Sq=333"),
    ((64, 64, 128), torch.bfloat16, "device=cpu"),
])
def test_uncovered_inputs_get_a_reason(shape, dtype, fragment):
    q, k, v, do = _qkv(*shape, dtype=dtype)
    reason = kv_major_reason(q, k, v, do=do)
    if gluon_bwd.UNAVAILABLE_REASON is not None:  # a Triton without Gluon: that is the reason for everything
        assert reason == gluon_bwd.UNAVAILABLE_REASON
    else:
        assert reason is not None and fragment in reason


def _choice(q, k, v, option="auto"):
    """The plan's KV-major choice for a dense call (``plan.kv_major_choice``, made at the forward)."""
    from gproj_patch.dispatch.plan import ForwardTensors, kv_major_choice
    from gproj_patch.dispatch.record import Problem
    return kv_major_choice(ForwardTensors(q, k, v, None, None), Problem(scale=q.shape[-1] ** -0.5), option)


def test_kv_major_kernel_prefers_tl_where_gluon_is_not_faster():
    q, k, v, do = _qkv(d=64)
    name, why = _choice(q, k, v)
    assert name == "tl" and why  # on CPU: the device; on an H200 it would be the head dim
    assert 64 not in gluon_bwd.FASTER_HEAD_DIMS and set(gluon_bwd.FASTER_HEAD_DIMS) <= set(gluon_bwd.GLUON_HEAD_DIMS)


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("GPROJ_TIER", "triton")


def test_explicit_kv_major_is_checked(interpreter):
    q, k, v, do = _qkv(dtype=torch.float16)
    o, lse = reference_forward(q, k, v)
    with pytest.raises(ValueError, match="kv_major='gluon'"):
        gproj_backward(do, q, k, v, o.to(q.dtype), lse.float(), kv_major="gluon")
    with pytest.raises(ValueError, match="kv_major must be one of"):
        gproj_backward(do, q, k, v, o.to(q.dtype), lse.float(), kv_major="cudnn")


def test_stats_count_the_kv_major_kernel_of_each_kernel_call(interpreter):
    """fp16 on CPU runs the kernel tier under Triton's interpreter: the tl KV-major kernel, counted per call
    with its reason; the gradients still match the fp64 oracle."""
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 40, 32, generator=g).to(torch.float16) for _ in range(4))
    k = k + 16.0
    gproj_patch.enable(mode="gproj")
    try:
        gproj_patch.reset_stats()
        for _ in range(2):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True).backward(do)
        s = gproj_patch.stats()
    finally:
        gproj_patch.disable()
    assert s["gproj"] == 2 and s["kv_major"] == {"tl": 2}, s
    assert sum(s["kv_major_reasons"].values()) == 2
    ref = reference_backward(q, k, v, do, causal=True)
    err = max(float((x.grad.double() - r).norm() / r.norm()) for x, r in zip((qq, kk, vv), ref))
    assert err < 5e-3
    gproj_patch.reset_stats()
    assert gproj_patch.stats()["kv_major"] == {}


@pytest.mark.skipif(gluon_bwd.UNAVAILABLE_REASON is not None, reason="no Gluon in this Triton")
def test_descriptors_reuse_one_layout_equal_to_a_fresh_one():
    """The TMA descriptors' shared layouts are built once per (box, dtype) and equal what Gluon builds fresh:
    the cache changes the host cost, never the compiled kernel."""
    from triton.experimental.gluon import language as gl
    x = torch.empty(2, 3, 40, 128, dtype=torch.bfloat16)
    a, b = gluon_bwd._descriptor(x, 64), gluon_bwd._descriptor(x.clone(), 64)
    assert a.layout is b.layout
    assert a.layout == gl.NVMMASharedLayout.get_default_for([1, 1, 64, 128], gl.bfloat16)
    assert gluon_bwd._descriptor(x.half(), 64).layout == gl.NVMMASharedLayout.get_default_for([1, 1, 64, 128],
                                                                                                gl.float16)
    rows = gluon_bwd._row_descriptor(torch.empty(2, 3, 40), 64)
    assert rows.layout is gluon_bwd._row_descriptor(torch.empty(5, 8), 64).layout
    assert list(rows.shape) == [240] and list(rows.block_shape) == [64]


@pytest.mark.skipif(gluon_bwd.UNAVAILABLE_REASON is not None, reason="no Gluon in this Triton")
@pytest.mark.parametrize("head_dim", sorted(gluon_bwd.CONFIGS))
def test_default_configs_compile_for_sm90a_without_spills(head_dim):
    """The shipped Gluon configs compile for sm_90a on this (GPU-less) machine with Triton's own ptxas and spill
    nothing (benchmarks/gluon_check.py --compile-only): a kernel edit that breaks compilation or starts spilling
    fails here, in CI, before any GPU run."""
    from tests.helpers.kernel_build import gluon_compile_report
    cfg = gluon_bwd.CONFIGS[head_dim]
    (row,) = gluon_compile_report(head_dims=(head_dim,), block_ms=(cfg.block_m,), stages=(cfg.num_stages,))
    assert "error" not in row, row
    assert row["stack"] == 0 and row["regs"] == gluon_bwd.MAXNREG, row
    assert row["smem"] <= gluon_bwd.SMEM_LIMIT_BYTES, row


@pytest.mark.skipif(gluon_bwd.UNAVAILABLE_REASON is not None, reason="no Gluon in this Triton")
def test_dkdv_arguments_name_every_kernel_parameter_and_refuse_what_it_cannot_run():
    """The launch's keyword arguments are exactly the kernel's parameters (num_warps aside), the causal shift
    follows the alignment, and a job the kernel does not cover (a window) is refused rather than run."""
    import dataclasses
    import inspect
    from gproj_patch.backends import gluon_kernels
    from gproj_patch.backends.triton_launch import Launch
    q = torch.empty(1, 4, 96, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 2, 160, 128, dtype=torch.bfloat16)
    f = torch.empty(4, 96)
    job = Launch(do=q, q=q, k=k, v=k, o=q, lse=f, dq=q, dk=k, dv=k, sink=None, cu_q=q, cu_k=q, varlen=False,
                 n_problems=1, max_q=96, max_k=160, window=(-1, 0), bottom_right=True, alpha=0.125, softcap=0.0,
                 correct=True, fused=True, cfg_dq=(64, 64, 4, 2), cfg_dkdv=(32, 64, 4, 2))
    args = gluon_bwd.dkdv_arguments(job, f, f, f, gluon_bwd.CONFIGS[128])
    params = set(inspect.signature(gluon_kernels._dkdv_kernel.fn).parameters) - {"num_warps"}
    assert set(args) == params
    assert args["CAUSAL"] and args["shift"] == 160 - 96 and args["GROUP"] == 2
    assert not gluon_bwd.dkdv_arguments(dataclasses.replace(job, bottom_right=False), f, f, f,
                                        gluon_bwd.CONFIGS[128])["shift"]
    with pytest.raises(ValueError, match="window"):
        gluon_bwd.dkdv_arguments(dataclasses.replace(job, window=(16, 0)), f, f, f, gluon_bwd.CONFIGS[128])


def test_unavailable_gluon_sends_every_call_to_tl(monkeypatch, interpreter):
    """When the Gluon kernel cannot run in this process (an unchecked Triton release, no Gluon), the choice is
    the tl kernel with that reason, and asking for Gluon explicitly is a clear error."""
    monkeypatch.setattr(gluon_bwd, "UNAVAILABLE_REASON", "triton 9.9.0: the Gluon kernel was checked against 3.6")
    q, k, v, do = _qkv(dtype=torch.float16)  # fp16 on CPU: the tl kernel's own predicate accepts it here
    assert _choice(q, k, v) == ("tl", "triton 9.9.0: the Gluon kernel was checked against 3.6")
    from gproj_patch.backends.gluon_entry import gluon_supported_reason
    assert "triton 9.9.0" in gluon_supported_reason(q, k, v, do=do)
    o, lse = reference_forward(q, k, v)
    with pytest.raises(ValueError, match="triton 9.9.0"):
        gproj_backward(do, q, k, v, o.to(q.dtype), lse.float(), kv_major="gluon")


def _sdpa_fp16_causal(seed=5):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, 2, 24, 16, generator=g).to(torch.float16) for _ in range(4))
    return q, k + 8.0, v, do


def test_kv_major_option_tl_is_recorded_at_forward_and_counted(interpreter, monkeypatch):
    """``kv_major="tl"`` (GPROJ_KV_MAJOR) keeps every call on the tl KV-major launch; the option is part of the
    record made at forward time, so a backward that runs after the option changed still follows its forward."""
    q, k, v, do = _sdpa_fp16_causal()
    gproj_patch.enable(mode="gproj", kv_major="tl")
    try:
        gproj_patch.reset_stats()
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    finally:
        gproj_patch.disable()
    monkeypatch.setenv("GPROJ_KV_MAJOR", "auto")
    with gproj_patch.enable(mode="gproj"):
        y.backward(do)  # the forward's record says tl
        s = gproj_patch.stats()
    assert s["kv_major"] == {"tl": 1} and any("kv_major=tl" in r for r in s["kv_major_reasons"]), s
    ref = reference_backward(q, k, v, do, causal=True)
    err = max(float((x.grad.double() - r).norm() / r.norm()) for x, r in zip((qq, kk, vv), ref))
    assert err < 5e-3


def test_kv_major_option_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="kv_major must be one of auto, tl"):
        gproj_patch.enable(kv_major="gluon-always")
    monkeypatch.setenv("GPROJ_KV_MAJOR", "cudnn")
    with pytest.raises(ValueError, match="GPROJ_KV_MAJOR must be one of auto, tl"):
        gproj_patch.enable()
    assert not gproj_patch.is_enabled()
