"""Shard rows on the GPU (skipped without CUDA; the Gluon cases without an sm_90 GPU and its Gluon): BF16 through
the tl and the Gluon dQ-major launches, the CPU version being ``tests/numerics/test_shard_rows.py`` (FP16, the
interpreter). A backward given the merged LSE and output over half of the keys — PyTorch's ring attention's
per-shard call — returns the shard's part of the whole attention's gradient, its rows unprojected and counted;
full rows at bf16's worst coherent rounding of P (uniform rows over 255 keys: Σ low(P) = 1 + 0.99·2^-8) are
never counted and still projected.

Run: ``python -m pytest -q tests/kernels/test_shard_rows_gpu.py``."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gproj_patch.backends import triton_bwd  # noqa: E402
from gproj_patch.backends.reference import reference_backward, reference_forward  # noqa: E402
from gproj_patch.backends.triton_bwd import gproj_backward  # noqa: E402
from tests.distributed.shards import problem, shard_dq, shard_row_bounds, shard_rows, whole  # noqa: E402
from tests.helpers.hopper import gluon_gpu_reason  # noqa: E402
from tests.helpers.numerics import rel  # noqa: E402

#: the suite's target (0.5% of fp64): shard rows are uncorrected, so no key offset here
TARGET = 5e-3
#: Gluon against the tl launch on unprojected rows (the same products in another order, rounded to bf16)
SAME_ROWS = 2e-3
S = 512


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(triton_bwd, "_POISON_OUTPUTS", True)


def _kernels(dq_major):
    if dq_major == "gluon" and gluon_gpu_reason() is not None:
        pytest.skip(gluon_gpu_reason())
    return dict(dq_major=dq_major, kv_major="gluon" if dq_major == "gluon" else "tl")


@pytest.mark.parametrize("dq_major", ["tl", "gluon"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_shard_rows_bf16(dq_major, D, causal):
    kernels = _kernels(dq_major)
    B, H = 2, 4
    p = problem(B, H, 2, S, D, causal=causal, seed=5, device="cuda")
    ref = whole(p)
    o, lse = p.o.to(torch.bfloat16), p.lse.float()
    half = S // 2
    shards = ((slice(0, half), dict(causal=causal)),
              (slice(half, S), dict(causal=causal, causal_align="bottom_right" if causal else "top_left")))
    for keys, mask in shards:
        count = torch.zeros(1, dtype=torch.int32, device="cuda")
        k, v = p.k[:, :, keys], p.v[:, :, keys]
        dq, dk, dv = gproj_backward(p.do, p.q, k, v, o, lse, partial_rows=count, **kernels, **mask)
        # causal: rows below S/2 are whole rows in the first shard and see no key in the second (neither counts),
        # and the first rows past S/2 keep all but a sliver of their mass in the first shard (counted or not)
        fewest, most = shard_row_bounds(p, keys)
        assert fewest <= int(count) <= most, (int(count), fewest, most)
        assert most <= (B * H * half if causal else B * H * S)
        assert fewest >= (B * H * half * 9 // 10 if causal else B * H * S)
        assert rel(dq, shard_dq(p, keys)) < TARGET, rel(dq, shard_dq(p, keys))
        assert rel(dk, ref[1][:, :, keys]) < TARGET and rel(dv, ref[2][:, :, keys]) < TARGET
        plain = gproj_backward(p.do, p.q, k, v, o, lse, correct=False, **mask)
        sure = shard_rows(p, keys)[0]  # rows every kernel leaves unprojected
        if dq_major == "tl":
            assert torch.equal(dq[sure], plain[0][sure])
        else:
            assert rel(dq[sure], plain[0][sure]) < SAME_ROWS


@pytest.mark.parametrize("dq_major", ["tl", "gluon"])
def test_full_rows_at_the_worst_rounding_are_projected(dq_major):
    """Uniform rows (q = 0) over 255 keys: bf16(1/255) = 2^-8·(1 + 2^-7), so Σ low(P) = 1 + 0.99·2^-8 — about a
    full row's worst coherent rounding — plus ordinary rows, keys offset 128σ: no row counted, every gradient
    within the target of fp64 (the uncorrected kernel is far off here: the projection ran)."""
    kernels = _kernels(dq_major)
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 4, 256, 128, generator=g, device="cuda", dtype=torch.float64)
    q[:, :, ::2] = 0
    k = torch.randn(1, 4, 255, 128, generator=g, device="cuda", dtype=torch.float64)
    k = k + 128.0 * torch.randn(128, generator=g, device="cuda", dtype=torch.float64)
    v, do = (torch.randn(1, 4, n, 128, generator=g, device="cuda", dtype=torch.float64) for n in (255, 256))
    q, k, v, do = (x.bfloat16() for x in (q, k, v, do))
    assert 255 * float(torch.tensor(1 / 255).bfloat16()) - 1 > 0.99 * 2.0 ** -8
    o, lse = reference_forward(q, k, v)
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    grads = gproj_backward(do, q, k, v, o.bfloat16(), lse.float(), partial_rows=count, **kernels)
    ref = reference_backward(q, k, v, do)
    assert int(count) == 0
    assert all(rel(a, b) < TARGET for a, b in zip(grads, ref)), [rel(a, b) for a, b in zip(grads, ref)]
    plain = gproj_backward(do, q, k, v, o.bfloat16(), lse.float(), correct=False)
    assert rel(plain[0], ref[0]) > 10 * TARGET
