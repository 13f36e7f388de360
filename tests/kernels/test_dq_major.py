"""The dQ-major launch's own side of the per-call kernel choice on CPU: the predicate's reasons where they differ
from the KV-major one's, the configs, the launch's arguments and its sm_90a build (what both launches share —
options, explicit argument, ``stats()`` — is ``test_launch_choice.py``). The Gluon kernel itself runs on the H200
(``tests/kernels/test_gluon_dq_gpu.py``, ``python -m benchmarks.gluon --launch dq``)."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from gproj_patch.backends import configs, gluon_bwd, gluon_dq
from gproj_patch.backends.gluon_dq import dq_major_reason
from tests.helpers.launch_choice import qkv

#: stack bytes a thread of the shipped D=128 build (Triton 3.6's ptxas, the ``overlap`` build): what its timings on
#: the H200 were taken with (the plain build: 128–144)
SPILL_BYTES_D128 = 80
#: the same with a learnable sink: the shard-row test (1 − P_sink against m) adds two values the consumer keeps in
#: local memory from before its key loop to after it (two stores, two loads per CTA; none inside the loop, sm_90a
#: SASS), 88 bytes against 80
SPILL_BYTES_D128_SINK = 88
needs_gluon = pytest.mark.skipif(gluon_bwd.UNAVAILABLE_REASON is not None, reason="no Gluon in this Triton")


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


def test_every_gluon_head_dim_has_a_dq_config():
    assert set(configs.GLUON_DQ_CONFIGS) == set(configs.GLUON_HEAD_DIMS)
    assert set(configs.GLUON_DQ_FASTER_HEAD_DIMS) <= set(configs.GLUON_DQ_CONFIGS)


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
    cfg = configs.GLUON_DQ_CONFIGS[128]
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
@pytest.mark.parametrize("head_dim", sorted(configs.GLUON_DQ_CONFIGS))
def test_default_configs_compile_for_sm90a_with_async_wgmma(head_dim):
    """The shipped dQ-major configs compile for sm_90a on this GPU-less machine with Triton's own ptxas (causal and
    full, with and without a sink), ptxas keeps every wgmma async, and the spills stay what the H200 timings were taken
    with: none at D=64; at D=128 a stack frame of at most ``SPILL_BYTES_D128`` (the 128 registers of Σ t·K and Σ r·K
    leave little room)."""
    from tests.helpers.kernel_build import gluon_dq_compile_report
    for causal, sink in ((True, False), (False, True)):
        (row,) = gluon_dq_compile_report(head_dims=(head_dim,), causal=causal, sink=sink)
        assert "error" not in row and not row["serialized"], row
        assert row["stack"] <= (0 if head_dim == 64 else SPILL_BYTES_D128_SINK if sink else SPILL_BYTES_D128), row
