"""The warp-specialized Gluon dQ-major launch (``gluon_dq``, ``gluon_dq_kernels``).

CPU: the shipped configs compile for sm_90a with Triton's own ptxas without spills and without serialized wgmma;
the launch's arguments name every kernel parameter; the predicate's reasons. GPU (sm_90, marked ``gpu``): dq
against the fp64 oracle on the adversarial inputs (key offsets to 512σ, key sinks, causal in both alignments,
GQA/MQA, odd lengths with Sq ≠ Sk and rows that see no key, fp16, strided memory, the witness), and dq, D, LSE2, λ
against the tl dQ-major launch on the same inputs, every output and scratch buffer NaN-poisoned before the
launch; bitwise run-to-run determinism.
"""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from gproj_patch.backends import gluon_dq

needs_gluon = pytest.mark.skipif(gluon_dq.UNAVAILABLE_REASON is not None, reason="no Gluon in this Triton")
ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def gpu_test(fn):
    """Marked ``gpu``; skipped without Gluon or without an sm_90 GPU (the kernel is sm_90a)."""
    for mark in (pytest.mark.gpu, needs_gluon, pytest.mark.skipif(not ON_SM90, reason="needs an sm_90 GPU")):
        fn = mark(fn)
    return fn


# ---- CPU -------------------------------------------------------------------------------------------------------

@needs_gluon
@pytest.mark.parametrize("head_dim", sorted(gluon_dq.CONFIGS))
def test_default_configs_compile_for_sm90a_without_spills_or_serialized_wgmma(head_dim):
    """Each shipped config compiles (dense and causal) on this GPU-less machine with Triton's own ptxas, spills
    nothing, keeps its wgmmas pipelined (ptxas serializes them all when an accumulator is redefined mid-flight
    or the in-flight set does not fit) and fits the shared memory: a kernel edit that breaks any of these fails
    here, before a GPU run."""
    from tests.helpers.dq_launch import compile_report
    rows = compile_report(head_dims=(head_dim,))
    assert len(rows) == 2, rows
    for row in rows:
        assert "error" not in row, row
        assert row["stack"] == 0 and row["regs"] == gluon_dq.MAXNREG, row
        assert not row["serialized"], row
        assert row["smem"] <= gluon_dq.SMEM_LIMIT_BYTES, row


def _job(sq=96, sk=160, h=4, hkv=2, d=128, causal=True, align="bottom_right"):
    from tests.helpers.dq_launch import dense_job
    q = torch.empty(1, h, sq, d, dtype=torch.bfloat16)
    k = torch.empty(1, hkv, sk, d, dtype=torch.bfloat16)
    lse = torch.empty(1, h, sq)
    return dense_job(q, q, k, k, q, lse, causal=causal, causal_align=align)


@needs_gluon
def test_dq_arguments_name_every_kernel_parameter_and_refuse_what_it_cannot_run():
    """The launch's keyword arguments are exactly the kernel's parameters (num_warps aside), the causal shift
    follows the alignment, and jobs the kernel does not cover (window, sink, softcap, uncorrected, scratch of the
    wrong size) are refused rather than run."""
    from gproj_patch.backends import gluon_dq_kernels, triton_launch
    job = _job()
    scratch = triton_launch.allocate_scratch(job)
    args = gluon_dq.dq_arguments(job, scratch, gluon_dq.CONFIGS[128])
    assert set(args) == set(inspect.signature(gluon_dq_kernels._dq_kernel.fn).parameters) - {"num_warps"}
    assert args["CAUSAL"] and args["shift"] == 160 - 96 and args["GROUP"] == 2 and args["SQ"] == 96
    assert args["DELTA"] is scratch.delta and args["LSE2"] is scratch.lse2 and args["LAM"] is scratch.lam
    top_left = gluon_dq.dq_arguments(dataclasses.replace(job, bottom_right=False), scratch, gluon_dq.CONFIGS[128])
    assert top_left["shift"] == 0
    dense = gluon_dq.dq_arguments(dataclasses.replace(job, window=(-1, -1)), scratch, gluon_dq.CONFIGS[128])
    assert not dense["CAUSAL"] and dense["shift"] == 0
    for change in (dict(window=(16, 0)), dict(sink=torch.zeros(4)), dict(softcap=30.0), dict(correct=False)):
        with pytest.raises(ValueError, match="dq_major_reason"):
            gluon_dq.dq_arguments(dataclasses.replace(job, **change), scratch, gluon_dq.CONFIGS[128])
    small = triton_launch.allocate_scratch(_job(sq=64))
    with pytest.raises(ValueError, match="scratch"):
        gluon_dq.dq_arguments(job, small, gluon_dq.CONFIGS[128])


def _qkv(sq=64, sk=64, d=128, dtype=torch.bfloat16):
    q = torch.zeros(1, 2, sq, d, dtype=dtype)
    k = torch.zeros(1, 2, sk, d, dtype=dtype)
    return q, k, k.clone()


@pytest.mark.parametrize("shape,kwargs,fragment", [
    ((64, 64, 128), dict(window=(8, 0)), "window"),
    ((64, 64, 128), dict(softcap=30.0), "softcap"),
    ((64, 64, 128), dict(varlen=True), "varlen"),
    ((64, 64, 128), dict(correct=False), "correct=False"),
    ((64, 64, 128), dict(sink=torch.zeros(2)), "sink"),
    ((64, 64, 96), {}, "head_dim=96"),
    ((64, 64, 256), {}, "head_dim=256"),
    ((64, 0, 128), {}, "no query or no key"),
    ((64, 64, 128), {}, "device=cpu"),
])
def test_uncovered_calls_get_a_reason(shape, kwargs, fragment):
    q, k, v = _qkv(*shape)
    reason = gluon_dq.dq_major_reason(q, k, v, do=q, o=q, **kwargs)
    if gluon_dq.UNAVAILABLE_REASON is not None:  # a Triton without Gluon: that is the reason for everything
        assert reason == gluon_dq.UNAVAILABLE_REASON
    else:
        assert reason is not None and fragment in reason


def test_mixed_and_fp32_dtypes_get_a_reason():
    q, k, v = _qkv()
    if gluon_dq.UNAVAILABLE_REASON is not None:
        pytest.skip(gluon_dq.UNAVAILABLE_REASON)
    assert "mixed dtypes" in gluon_dq.dq_major_reason(q, k, v, do=q, o=q.half())
    assert "dtype=float32" in gluon_dq.dq_major_reason(q.float(), k.float(), v.float())


# ---- GPU (sm_90) -------------------------------------------------------------------------------------------------

#: agreement of dq with the tl dQ-major launch on the same inputs (same contract, different fp32 summation order)
TL_AGREEMENT = 2e-3
#: agreement of D (fp32 row sums of D products) and λ (ρ/m, ρ a cancelling sum) with the tl launch's, in ``rel``
ROW_AGREEMENT = 1e-4
LAM_AGREEMENT = 1e-3


def _run_both(name, seed, config=None):
    """(case, Gluon job and scratch, tl job and scratch) on fresh poisoned outputs."""
    from tests.helpers import dq_launch
    q, k, v, do, o, lse, kw = dq_launch.case_inputs(name, seed)
    assert gluon_dq.dq_major_reason(q, k, v, do=do, o=o) is None
    job = dq_launch.case_job(do, q, k, v, o, lse, kw)
    scratch = dq_launch.run_gluon(job, config)
    tl_job = dq_launch.fresh(job)
    tl_scratch = dq_launch.run_tl(tl_job)
    torch.cuda.synchronize()
    return (q, k, v, do, kw), (job, scratch), (tl_job, tl_scratch)


def _cases():
    from tests.helpers import adversarial as dc
    return [c for c in dc.SUITE_CASES if c != "witness"] + list(dc.ODD_CASES) + ["witness"]


def _gauge():
    from tests.helpers import adversarial as dc
    return [c for c in _cases() if c not in dc.NOT_GAUGE]


def _assert_scratch_matches(scratch, tl_scratch):
    from tests.helpers.numerics import rel
    assert torch.isfinite(scratch.delta).all() and torch.isfinite(scratch.lam).all()
    assert not torch.isnan(scratch.lse2).any()
    # LSE2: the same fp32 product and the same +∞ rows
    assert torch.equal(scratch.lse2, tl_scratch.lse2)
    assert rel(scratch.delta, tl_scratch.delta) < ROW_AGREEMENT
    assert rel(scratch.lam, tl_scratch.lam) < LAM_AGREEMENT


@gpu_test
@pytest.mark.parametrize("name", _cases())
def test_matches_tl_launch(name):
    """dq, D, LSE2, λ of the Gluon launch against the tl launch on the same inputs (every row written)."""
    from tests.helpers.numerics import rel
    _, (job, scratch), (tl_job, tl_scratch) = _run_both(name, seed=5)
    assert torch.isfinite(job.dq).all(), name
    assert rel(job.dq, tl_job.dq) < TL_AGREEMENT, (name, rel(job.dq, tl_job.dq))
    _assert_scratch_matches(scratch, tl_scratch)


@gpu_test
@pytest.mark.parametrize("name", _gauge())
def test_gauge_cases_vs_fp64(name):
    from gproj_patch.backends.reference import reference_backward
    from tests.helpers.adversarial import TARGET
    from tests.helpers.numerics import rel
    (q, k, v, do, kw), (job, _), (tl_job, _) = _run_both(name, seed=11)
    ref_dq = reference_backward(q, k, v, do, **kw)[0]
    err, tl_err = rel(job.dq, ref_dq), rel(tl_job.dq, ref_dq)
    assert err < TARGET, (name, err, tl_err)


@gpu_test
@pytest.mark.parametrize("config", [gluon_dq.DqConfig(64, 2, rk_in_flight=False), gluon_dq.DqConfig(32, 2),
                                    gluon_dq.DqConfig(32, 4)])
@pytest.mark.parametrize("name", ["odd_br_mqa_d128", "fp16_d128_dense"])
def test_other_configs_match_tl_launch(name, config):
    """The D=128 configs the benchmark times besides the default: the same results within the agreement."""
    from tests.helpers.numerics import rel
    _, (job, scratch), (tl_job, tl_scratch) = _run_both(name, seed=6, config=config)
    assert rel(job.dq, tl_job.dq) < TL_AGREEMENT
    _assert_scratch_matches(scratch, tl_scratch)


@gpu_test
def test_rows_without_keys_get_zero_and_the_tl_scratch():
    """Bottom-right causal with Sq > Sk: the first Sq − Sk rows see no key; dq = 0 exactly there, LSE2 = +∞,
    λ = 0, as the tl launch writes."""
    _, (job, scratch), (_, tl_scratch) = _run_both("empty_rows_br", seed=3)
    empty = job.q.shape[2] - job.k.shape[2]
    assert (job.dq[:, :, :empty] == 0).all()
    lse2 = scratch.lse2.view(job.q.shape[:3])
    lam = scratch.lam.view(job.q.shape[:3])
    assert torch.isinf(lse2[:, :, :empty]).all() and (lse2[:, :, :empty] > 0).all()
    assert (lam[:, :, :empty] == 0).all()
    assert torch.equal(scratch.lse2, tl_scratch.lse2)


@gpu_test
def test_witness_exact_zero():
    """The four-key witness (D=128, Sq=4): exact dq is 0, and the corrected kernel returns exactly 0."""
    _, (job, _), _ = _run_both("witness", seed=0)
    assert (job.dq == 0).all()


@gpu_test
def test_bitwise_deterministic():
    from tests.helpers import dq_launch
    q, k, v, do, o, lse, kw = dq_launch.case_inputs("odd_br_mqa_d128", seed=7)
    job = dq_launch.case_job(do, q, k, v, o, lse, kw)
    a = dq_launch.run_gluon(job)
    job2 = dq_launch.fresh(job)
    b = dq_launch.run_gluon(job2)
    assert torch.equal(job.dq, job2.dq)
    assert all(torch.equal(x, y) for x, y in ((a.delta, b.delta), (a.lse2, b.lse2), (a.lam, b.lam)))


@gpu_test
def test_uncovered_adversarial_cases_get_a_reason():
    from tests.helpers import adversarial as dc
    for name in dc.UNCOVERED:
        inp, kw, _ = dc.make_case(name)
        reason = gluon_dq.dq_major_reason(
            inp["q"], inp["k"], inp["v"], do=inp["do"], window=kw.get("window", (-1, -1)),
            softcap=kw.get("softcap", 0.0), varlen="cu_seqlens_q" in kw)
        assert reason is not None, name

