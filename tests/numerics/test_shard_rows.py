"""Shards of a row are never projected (docs/math.md §8): a backward given the merged LSE and output of whole
rows over one slice of their keys — how PyTorch's ring attention calls the fused backward per key shard — must
return that shard's part of the whole attention's gradient, leave those rows unprojected (their true dS sum is
not 0) and count them; full rows are projected as before.

The Triton kernel runs under the interpreter in FP16 (its BF16 is inexact there; the GPU test
``tests/kernels/test_shard_rows_gpu.py`` covers BF16 and the Gluon dQ-major kernel), the FP32 tier in fp32.
"""
from __future__ import annotations

import pytest
import torch

from gproj_patch.backends.fp32_tier import fp32_backward
from gproj_patch.backends.reference import reference_forward
from gproj_patch.backends.triton_bwd import gproj_backward
from tests.distributed.shards import problem, shard_dq, shard_row_bounds, whole
from tests.helpers.numerics import rel

triton = pytest.importorskip("triton")

#: the FP16 kernel against fp64 (both GProj and uncorrected rows: no key offset large enough to leak in FP16)
KERNEL_BOUND = 1.5e-3
#: the FP32 tier against fp64 (P and D in fp32 from the given LSE and output)
FP32_BOUND = 2e-5
S, HALF = 48, 24


def _shards(causal: bool):
    """(key slice, mask kwargs of the shard call) of the two halves of the keys. Causal: the first half is
    top-left causal on (S, S/2) (rows < S/2 see their whole row there: full rows), the second bottom-right
    (shift −S/2: key S/2 + j visible from row i iff j ≤ i − S/2; rows < S/2 see none of it)."""
    if not causal:
        return ((slice(0, HALF), {}), (slice(HALF, S), {}))
    return ((slice(0, HALF), dict(causal=True)),
            (slice(HALF, S), dict(causal=True, causal_align="bottom_right")))


def _expected_shard_rows(causal: bool, B: int, H: int):
    """Rows with a finite LSE whose keys' positive mass in each shard is not the whole row's (causal: in the first
    shard rows below S/2 are whole rows, in the second they see no key, so no mass: neither is a shard row). These
    inputs (a 4σ key offset, 24 keys a shard) keep every other row's shard mass far from 1 and from 0
    (``_assert_count`` checks that against the fp64 masses)."""
    return (B * H * HALF, B * H * HALF) if causal else (B * H * S, B * H * S)


def _assert_count(count: torch.Tensor, expected: int, p, keys: slice) -> None:
    fewest, most = shard_row_bounds(p, keys)
    assert fewest == most == expected, (fewest, most, expected)  # no row near the threshold: the count is exact
    assert int(count) == expected


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_shard_rows_get_their_part_of_the_gradient(one_thread, causal):
    B, H = 1, 2
    p = problem(B, H, 1, S, 32, offset=4.0, causal=causal, seed=1, dtype=torch.float16)
    ref = whole(p)
    o, lse = p.o.to(torch.float16), p.lse.float()
    for (keys, mask), expected in zip(_shards(causal), _expected_shard_rows(causal, B, H)):
        count = torch.zeros(1, dtype=torch.int32)
        k, v = p.k[:, :, keys], p.v[:, :, keys]
        dq, dk, dv = gproj_backward(p.do, p.q, k, v, o, lse, partial_rows=count, **mask)
        _assert_count(count, expected, p, keys)
        assert rel(dq, shard_dq(p, keys)) < KERNEL_BOUND, rel(dq, shard_dq(p, keys))
        assert rel(dk, ref[1][:, :, keys]) < KERNEL_BOUND and rel(dv, ref[2][:, :, keys]) < KERNEL_BOUND
        # shard rows are exactly the uncorrected kernel's (λ = 0 adds −0·Σ r·K and rounds dk's operand alike)
        plain = gproj_backward(p.do, p.q, k, v, o, lse, correct=False, **mask)
        if not causal:
            assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), plain))
        else:  # rows < S/2: full rows in the first shard (projected), no key in the second (zero); the rest not
            assert torch.equal(dq[:, :, HALF:], plain[0][:, :, HALF:])
            if keys.start == 0:
                assert not torch.equal(dq[:, :, :HALF], plain[0][:, :, :HALF])
            else:
                assert not dq[:, :, :HALF].any() and not plain[0][:, :, :HALF].any()
                assert torch.equal(dk, plain[1]) and torch.equal(dv, plain[2])


@pytest.mark.parametrize("causal", [False, True])
def test_fp32_tier_with_the_given_lse_and_output(one_thread, causal):
    """``fp32_backward(lse=, out=)``: P from the given LSE, D from the given output, shard rows unprojected and
    counted; on the whole keys the same gradients as the tier's own recomputed forward."""
    B, H = 1, 2
    p = problem(B, H, 1, S, 32, offset=64.0, causal=causal, seed=2)
    ref = whole(p)
    for (keys, mask), expected in zip(_shards(causal), _expected_shard_rows(causal, B, H)):
        count = torch.zeros(1, dtype=torch.int32)
        dq, dk, dv = fp32_backward(p.q, p.k[:, :, keys], p.v[:, :, keys], p.do, lse=p.lse.float(), out=p.o.float(),
                                   partial_rows=count, **mask)
        _assert_count(count, expected, p, keys)
        assert rel(dq, shard_dq(p, keys)) < FP32_BOUND, rel(dq, shard_dq(p, keys))
        assert rel(dk, ref[1][:, :, keys]) < FP32_BOUND and rel(dv, ref[2][:, :, keys]) < FP32_BOUND
    count = torch.zeros(1, dtype=torch.int32)
    given = fp32_backward(p.q, p.k, p.v, p.do, lse=p.lse.float(), out=p.o.to(p.q.dtype), partial_rows=count,
                          causal=causal)
    assert int(count) == 0
    for a, b in zip(given, ref):  # the bf16 output's rounding enters D as a multiple of P: projected away
        assert rel(a, b) < FP32_BOUND


def test_full_rows_are_never_shards(one_thread):
    """Rows whose rounded mass Σ low(P) misses 1 the most a full row can (uniform rows: q = 0), rows that see no
    key (LSE −inf: bottom-right causal with Sq > Sk; +inf, as the router marks dead rows), a learnable sink and a
    window: nothing counted, and the kernel still projects (it differs from the uncorrected kernel at a key
    offset)."""
    p = problem(1, 2, 2, 40, 32, offset=16.0, seed=3, dtype=torch.float16)
    q = p.q.clone()
    q[:, :, ::3] = 0  # uniform rows: m = N·low(1/N)
    kv = (p.k, p.v)
    for (k, v), mask in ((kv, {}), (kv, dict(window=(5, 2))), (kv, dict(sink=torch.tensor([-1.0, 2.0]))),
                         ((p.k[:, :, :30], p.v[:, :, :30]), dict(causal=True, causal_align="bottom_right"))):
        o, lse = reference_forward(q, k, v, **mask)
        lse = lse.float()
        lse[:, :, -1] = float("inf")  # a dead row
        count = torch.zeros(1, dtype=torch.int32)
        got = gproj_backward(p.do, q, k, v, o.half(), lse, partial_rows=count, **mask)
        plain = gproj_backward(p.do, q, k, v, o.half(), lse, correct=False, **mask)
        assert int(count) == 0, mask
        assert not torch.equal(got[0], plain[0])


def test_partial_rows_must_be_an_int32_device_counter():
    p = problem(1, 1, 1, 8, 16, seed=4, dtype=torch.float16)
    with pytest.raises(ValueError, match="partial_rows"):
        gproj_backward(p.do, p.q, p.k, p.v, p.o.half(), p.lse.float(), partial_rows=torch.zeros(1))
    with pytest.raises(ValueError, match="together"):
        fp32_backward(p.q, p.k, p.v, p.do, lse=p.lse.float())
    with pytest.raises(ValueError, match="sink"):
        fp32_backward(p.q, p.k, p.v, p.do, lse=p.lse.float(), out=p.o.float(), sink=torch.zeros(1))
