"""The per-call choice of the dQ-major kernel (Gluon on sm_90, tl elsewhere) on CPU: the predicate's reasons
(what differs from the KV-major one), the explicit ``dq_major=`` argument, the option, ``stats()`` counting which
kernel ran, the launch's arguments and its sm_90a build. The Gluon kernel itself runs on the H200
(``tests/kernels/test_gluon_gpu.py``, ``benchmarks/gluon_dq_check.py``)."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import gproj_patch
from gproj_patch.backends import gluon_bwd, gluon_dq
from gproj_patch.backends.gluon_dq import dq_major_reason
from gproj_patch.backends.reference import reference_backward, reference_forward
from gproj_patch.backends.triton_bwd import gproj_backward
from tests.helpers.launch_choice import qkv, sdpa_fp16_causal

#: stack bytes a thread of the shipped D=128 build (Triton 3.6's ptxas, the ``overlap`` build): what run 58 timed
#: (the plain build: 128–144)
SPILL_BYTES_D128 = 80
needs_gluon = pytest.mark.skipif(gluon_bwd.UNAVAILABLE_REASON is not None, reason="no Gluon in this Triton")



@pytest.mark.parametrize("kwargs,fragment", [
    (dict(window=(8, 0)), "window"),
    (dict(softcap=30.0), "softcap"),
    (dict(varlen=True), "varlen"),
    (dict(correct=False), "correct=False"),
])
def test_uncovered_options_get_a_reason(kwargs, fragment):
    q, k, v, do = qkv()
    reason = dq_major_reason(q, k, v, do=do, **kwargs)
    assert reason is not None and fragment in reason


def test_the_scratch_alignment_is_the_kv_major_launchs_only():
    """Sq = 333 stops the Gluon KV-major launch (its TMA reads the fp32 scratch rows) but not the dQ-major one,
    which writes the scratch with plain stores: on this CPU its first reason is the device."""
    q, k, v, do = qkv(sq=333)
    if gluon_bwd.UNAVAILABLE_REASON is not None:
        assert dq_major_reason(q, k, v, do=do) == gluon_bwd.UNAVAILABLE_REASON
        return
    assert "Sq=333" in gluon_bwd.kv_major_reason(q, k, v, do=do)
    assert dq_major_reason(q, k, v, do=do) == "device=cpu"
    for shape, dtype, fragment in (((64, 64, 96), torch.bfloat16, "head_dim=96"),
                                   ((64, 64, 128), torch.float32, "dtype=float32")):
        q, k, v, do = qkv(*shape, dtype=dtype)
        assert fragment in dq_major_reason(q, k, v, do=do)


def _choice(q, k, v, option="auto"):
    """The plan's dQ-major choice for a dense call (``plan.dq_major_choice``, made at the forward)."""
    from gproj_patch.dispatch.plan import ForwardTensors, dq_major_choice
    from gproj_patch.dispatch.record import Problem
    return dq_major_choice(ForwardTensors(q, k, v, None, None), Problem(scale=q.shape[-1] ** -0.5), option)


def test_dq_major_kernel_prefers_tl_where_gluon_is_not_faster(monkeypatch):
    """Where the Gluon kernel could run but was not measured faster the plan picks tl and says why; inside
    ``FASTER_HEAD_DIMS``, Gluon; ``dq_major="tl"`` always tl. The predicate is stubbed (no sm_90 here)."""
    monkeypatch.setattr(gluon_dq, "dq_major_reason", lambda *a, **kw: None)
    monkeypatch.setattr(gluon_dq, "FASTER_HEAD_DIMS", (128,))
    assert _choice(*qkv(d=64)[:3]) == ("tl", "head_dim=64: the tl dQ-major kernel is faster there")
    assert _choice(*qkv(d=128)[:3]) == ("gluon", None)
    assert _choice(*qkv(d=128)[:3], option="tl")[0] == "tl"
    monkeypatch.undo()
    assert set(gluon_dq.FASTER_HEAD_DIMS) <= set(gluon_bwd.GLUON_HEAD_DIMS) and set(gluon_dq.CONFIGS) == set(
        gluon_bwd.GLUON_HEAD_DIMS)


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("GPROJ_TIER", "triton")


def test_explicit_dq_major_is_checked(interpreter):
    q, k, v, do = qkv(dtype=torch.float16)
    o, lse = reference_forward(q, k, v)
    with pytest.raises(ValueError, match="dq_major='gluon'"):
        gproj_backward(do, q, k, v, o.to(q.dtype), lse.float(), dq_major="gluon")
    with pytest.raises(ValueError, match="dq_major must be one of"):
        gproj_backward(do, q, k, v, o.to(q.dtype), lse.float(), dq_major="cudnn")



def test_dq_major_option_tl_is_recorded_at_forward_and_counted(interpreter, monkeypatch):
    """``dq_major="tl"`` (GPROJ_DQ_MAJOR) is part of the record made at the forward: a backward that runs after
    the option changed still follows its forward; ``stats()`` counts each launch's kernel with its reason, and
    the gradients match the fp64 oracle."""
    q, k, v, do = sdpa_fp16_causal()
    gproj_patch.enable(mode="gproj", dq_major="tl")
    try:
        gproj_patch.reset_stats()
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    finally:
        gproj_patch.disable()
    monkeypatch.setenv("GPROJ_DQ_MAJOR", "auto")
    with gproj_patch.enable(mode="gproj"):
        y.backward(do)
        s = gproj_patch.stats()
    assert s["dq_major"] == {"tl": 1} and any("dq_major=tl" in r for r in s["dq_major_reasons"]), s
    assert s["kv_major"] == {"tl": 1}, s
    ref = reference_backward(q, k, v, do, causal=True)
    err = max(float((x.grad.double() - r).norm() / r.norm()) for x, r in zip((qq, kk, vv), ref))
    assert err < 5e-3
    gproj_patch.reset_stats()
    assert gproj_patch.stats()["dq_major"] == {}


def test_dq_major_option_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="dq_major must be one of auto, tl"):
        gproj_patch.enable(dq_major="gluon-always")
    monkeypatch.setenv("GPROJ_DQ_MAJOR", "cudnn")
    with pytest.raises(ValueError, match="GPROJ_DQ_MAJOR must be one of auto, tl"):
        gproj_patch.enable()
    assert not gproj_patch.is_enabled()


def _job(sq=96, sk=160, h=4, hkv=2, d=128, sink=False):
    """A causal bottom-right ``Launch`` on CPU tensors (host work only) and its scratch."""
    from gproj_patch.backends.triton_launch import Launch, Scratch
    q = torch.empty(1, h, sq, d, dtype=torch.bfloat16)
    k = torch.empty(1, hkv, sk, d, dtype=torch.bfloat16)
    f = torch.empty(h, sq)
    job = Launch(do=q.clone(), q=q, k=k, v=k.clone(), o=q.clone(), lse=torch.empty(1, h, sq), dq=q.clone(),
                 dk=k.clone(), dv=k.clone(), sink=torch.zeros(h) if sink else None, cu_q=q, cu_k=q, varlen=False,
                 n_problems=1, max_q=sq, max_k=sk, window=(-1, 0), bottom_right=True, alpha=0.125, softcap=0.0,
                 correct=True, fused=True, cfg_dq=(64, 64, 4, 2), cfg_dkdv=(32, 64, 4, 2))
    return job, Scratch(delta=f, lse2=f.clone(), lam=f.clone(), target=f.clone())


@pytest.fixture
def cpu_one_hot(monkeypatch):
    """The one-hot columns on the CPU (the launch puts them on the call's CUDA device)."""
    monkeypatch.setattr(gluon_dq, "_one_hot",
                        lambda device, dtype, block_n: torch.zeros(2 * block_n, gluon_dq.ROWSUM_WIDTH, dtype=dtype))
    gluon_dq._launch_class.cache_clear()
    yield
    gluon_dq._launch_class.cache_clear()


@needs_gluon
def test_dq_arguments_name_every_kernel_parameter_and_refuse_what_it_cannot_run(cpu_one_hot):
    """The launch's keyword arguments are exactly the kernel's parameters (num_warps aside); the causal shift
    follows the alignment, the group and the sink flag the job; a job the kernel does not cover is refused."""
    from gproj_patch.backends import gluon_dq_kernels
    job, scratch = _job()
    cfg = gluon_dq.CONFIGS[128]
    args = gluon_dq.dq_arguments(job, scratch, cfg)
    assert set(args) == set(inspect.signature(gluon_dq_kernels._dq_kernel.fn).parameters) - {"num_warps"}
    assert args["CAUSAL"] and args["shift"] == 160 - 96 and args["GROUP"] == 2 and not args["HAS_SINK"]
    assert args["SINK"] is scratch.delta and args["TGT"] is scratch.target and args["DQ"] is job.dq
    assert not gluon_dq.dq_arguments(dataclasses.replace(job, bottom_right=False), scratch, cfg)["shift"]
    job_s, scratch_s = _job(sink=True)
    args = gluon_dq.dq_arguments(job_s, scratch_s, cfg)
    assert args["HAS_SINK"] and args["SINK"] is job_s.sink
    for bad in (dict(window=(16, 0)), dict(varlen=True), dict(softcap=30.0), dict(correct=False)):
        with pytest.raises(ValueError, match="launch_dq"):
            gluon_dq.dq_arguments(dataclasses.replace(job, **bad), scratch, cfg)


@needs_gluon
@pytest.mark.parametrize("head_dim", sorted(gluon_dq.CONFIGS))
def test_default_configs_compile_for_sm90a_with_async_wgmma(head_dim):
    """The shipped dQ-major configs compile for sm_90a on this GPU-less machine with Triton's own ptxas (causal
    and full, with and without a sink), ptxas keeps every wgmma async, and the spills stay what runs 58–59 timed:
    none at D=64; at D=128 a stack frame of at most ``SPILL_BYTES_D128`` (the 128 registers of Σ t·K and Σ r·K leave
    little room)."""
    from tests.helpers.kernel_build import gluon_dq_compile_report
    for causal, sink in ((True, False), (False, True)):
        (row,) = gluon_dq_compile_report(head_dims=(head_dim,), causal=causal, sink=sink)
        assert "error" not in row and not row["serialized"], row
        assert row["stack"] <= (0 if head_dim == 64 else SPILL_BYTES_D128), row
