"""Corrected gradients under context parallelism, with PyTorch's real ring on the CPU: 2 and 4 gloo ranks.

PyTorch's ring attention runs on the CPU with the CPU flash ops (``cp_worker``'s docstring), and the CPU flash
backward rounds dS to BF16 as the CUDA fused ones do, so the leak is PyTorch's own. Each rank runs the ring
forward and backward on its piece of the sequence (causal: head-tail load balanced; full), unpatched and with
``hooks.context_parallel`` installed (the FP32 form here: no GPU), on a 200σ common key offset and on a sink
key that holds nearly all the mass (keys offset 64σ), GQA. The pieces put back together are judged against fp64
of the whole (unsharded) attention. The ranks run in a subprocess (``python -m tests.distributed.cp_worker OUTDIR
WORLD cpu``), ~45 s for both sizes on 2 cores.
"""
import pytest
import torch

from tests.distributed.cp_worker import CASES, TARGET, UNPATCHED_AT_LEAST, errors, run_ranks


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return run_ranks(tmp_path_factory.mktemp(f"cp{request.param}"), request.param, "cpu", timeout=600)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal_balanced", "full"])
def test_corrected_ring_vs_fp64(ranks, name, causal):
    """dq, dk, dv of the corrected ring within 0.5% of fp64 of the whole attention; the unpatched ring's dq tens
    of % off (dk too on the sink case)."""
    patched = errors(ranks, "patched", name, causal, "cpu")
    unpatched = errors(ranks, "unpatched", name, causal, "cpu")
    assert max(patched) < TARGET, (len(ranks), patched, unpatched)
    assert unpatched[0] > UNPATCHED_AT_LEAST, (len(ranks), patched, unpatched)
    for res in ranks:
        assert [g.dtype for g in res[(name, causal)]["patched"]] == [torch.bfloat16] * 3


def test_hook_reports_and_restores(ranks):
    """Every bf16 call ran the FP32 form (no GPU); the fp32 call went to PyTorch's ring unchanged (bit for bit)
    with its reason noted; uninstall() put the original back."""
    for res in ranks:
        assert res["ran"] == ["fp32"] * (2 * len(CASES))
        assert res["notes"] == ["context parallel: dtype=float32 (nothing to repair)"]
        assert all(torch.equal(a, b) for a, b in zip(res["fp32"]["patched"], res["fp32"]["unpatched"]))
        assert res["restored"]
