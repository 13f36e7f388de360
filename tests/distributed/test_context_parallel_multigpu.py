"""Corrected gradients under context parallelism with PyTorch's real ring on 2 GPUs (NCCL; skipped with fewer):
the CUDA flash ops as PyTorch's ``_scaled_dot_product_ring_flash_attention(_backward)`` call them, unpatched and
with ``hooks.context_parallel`` installed (the GProj kernels: tl dQ-major row pass, Gluon or tl KV-major
column pass), B2 H8 S2048 D128, causal load balanced and full, a 200σ key offset and a sink key. The CPU version
is ``test_context_parallel_cpu.py``; the same judgement.

Run on a 2-GPU machine: ``python -m pytest -q tests/distributed/test_context_parallel_multigpu.py``."""
import pytest
import torch

from tests.distributed.cp_worker import CASES, TARGET, UNPATCHED_AT_LEAST, errors, run_ranks

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("cp_gpu"), 2, "cuda", timeout=900)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal_balanced", "full"])
def test_corrected_ring_vs_fp64(ranks, name, causal):
    patched = errors(ranks, "patched", name, causal, "cuda")
    unpatched = errors(ranks, "unpatched", name, causal, "cuda")
    print(f"{name} {'causal' if causal else 'full'}: unpatched {unpatched}, patched {patched}")
    assert max(patched) < TARGET, (patched, unpatched)
    assert unpatched[0] > UNPATCHED_AT_LEAST, (patched, unpatched)


def test_the_kernels_ran(ranks):
    for res in ranks:
        assert res["ran"] == ["gproj"] * (2 * len(CASES))
        assert res["notes"] == [] and res["restored"]
