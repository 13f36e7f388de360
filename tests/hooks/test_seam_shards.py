"""A ring's per-shard backwards through the SDPA seam are never projected to a zero row sum.

PyTorch's ring attention calls SDPA's fused backward op once per KV shard with the *merged* output and LSE of the
whole row: over one shard's keys P sums to less than 1, and the exact Σ_j dS_ij over the shard is not 0 — a
projection to zero is wrong by the shard's true mass. Simulated in one process the way the ring calls it
(per-shard forward with the CPU flash op, the shards' outputs and LSEs merged as ``_SDPAMerger`` merges them,
then the per-shard aten backward op with the merged output and LSE, reached through the dispatcher): patched,
each shard's gradient is the fp64 gradient of that shard's part of the attention (within PyTorch's own
per-shard error), its rows counted as shards (``stats()["partial_rows"]``) and left unprojected; the shards' sum
is as accurate as PyTorch's ring, and a call over whole rows is still corrected. (The ring itself, with the
row's λ over every shard, is ``hooks/context_parallel.py``: tests/distributed.)
"""
import pytest
import torch

import gproj_patch
from tests.distributed.shards import problem, shard_dq
from tests.helpers.numerics import rel

pytestmark = pytest.mark.usefixtures("patch_off")

aten = torch.ops.aten
B, H, S, D, SHARDS = 1, 2, 64, 32, 2


def _merged(q, k, v):
    """Per-shard forwards (the CPU flash op), merged as PyTorch's ring merges them: (out, lse) of the whole row."""
    n = k.shape[2] // SHARDS
    outs, lses = [], []
    for s in range(SHARDS):
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k[:, :, s * n:(s + 1) * n],
                                                                  v[:, :, s * n:(s + 1) * n], 0.0, False)
        outs.append(o.float())
        lses.append(lse.float())
    lse = torch.logsumexp(torch.stack(lses), 0)
    out = sum(torch.exp(l - lse)[..., None] * o for l, o in zip(lses, outs))
    return out.to(q.dtype), lse


def _shard_backwards(p):
    """The per-shard aten backward calls of the ring (each reaches the seam when it is installed): dq per shard."""
    q, k, v, do = p.q, p.k, p.v, p.do
    out, lse = _merged(q, k, v)
    n = S // SHARDS
    return [aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k[:, :, s * n:(s + 1) * n], v[:, :, s * n:(s + 1) * n], out, lse, 0.0, False)[0]
        for s in range(SHARDS)]


@pytest.mark.parametrize("case", ["offset", "sink"])
def test_ring_shards_through_the_seam_are_not_projected(case):
    p = problem(B, H, H, S, D, offset=150.0, sink=case == "sink", seed=3)
    plain = _shard_backwards(p)
    with gproj_patch.enable(targets=("sdpa",)):
        patched = _shard_backwards(p)
        st = gproj_patch.stats()
    n = S // SHARDS
    for s in range(SHARDS):
        want = shard_dq(p, slice(s * n, (s + 1) * n))
        # the gradient of the shard's part, not a projection of it (which is off by the shard's true mass)
        assert rel(patched[s], want) <= max(2 * rel(plain[s], want), 2e-2), (s, rel(patched[s], want),
                                                                                   rel(plain[s], want))
    # every row of every shard is a shard row — except, in the sink case, those of the sink key's shard, which
    # holds all but ~1e-5 of each row's mass: within rounding of a whole row (its projection moves dq by that)
    assert st["partial_rows"] == (SHARDS if case == "offset" else SHARDS - 1) * B * H * S, st
    assert st["fp32"] == SHARDS


def test_whole_rows_are_still_corrected():
    """The same call over all keys (one shard): whole rows, projected; nothing counted as a shard."""
    p = problem(B, H, H, S, D, offset=150.0, seed=4)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(p.q, p.k, p.v, 0.0, False)
    args = (p.do, p.q, p.k, p.v, out, lse, 0.0, False)
    plain = aten._scaled_dot_product_flash_attention_for_cpu_backward(*args)[0]
    with gproj_patch.enable(targets=("sdpa",)):
        patched = aten._scaled_dot_product_flash_attention_for_cpu_backward(*args)[0]
        st = gproj_patch.stats()
    want = shard_dq(p, slice(None))
    assert rel(patched, want) < 1e-2 < rel(plain, want) / 5
    assert st["partial_rows"] == 0


def test_rows_a_mask_hides_entirely_are_not_shards():
    """A boolean mask that hides every key of some rows (PyTorch's CPU flash kernel leaves their LSE finite and
    their output zero): those rows get zero gradients, no shard row is counted, and the other rows are corrected
    as whole rows against fp64."""
    from gproj_patch.backends.reference import reference_backward
    p = problem(2, 3, 3, 40, 24, offset=64.0, seed=5)
    mask = torch.ones(2, 3, 40, 40, dtype=torch.bool)
    mask[:, :, 5:8] = False  # rows 5..7 see no key
    grads = {}
    for arm in ("plain", "patched"):
        q, k, v = (t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v))
        with gproj_patch.enable(targets=("sdpa",)) if arm == "patched" else torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out.backward(p.do)
            st = gproj_patch.stats()
        grads[arm] = (q.grad, k.grad, v.grad)
    assert st["partial_rows"] == 0 and st["fp32"] == 1, st
    assert not grads["patched"][0][:, :, 5:8].any()
    visible = mask.clone()
    visible[:, :, 5:8] = True  # the oracle on the rows that see keys (the hidden rows' gradients are zero)
    want = reference_backward(*(t.double() for t in (p.q, p.k, p.v, p.do)), attn_mask=visible)
    rows = torch.ones(40, dtype=torch.bool)
    rows[5:8] = False
    assert rel(grads["patched"][0][:, :, rows], want[0][:, :, rows]) < 1e-2
    assert rel(grads["patched"][0][:, :, rows], want[0][:, :, rows]) < rel(grads["plain"][0][:, :, rows],
                                                                              want[0][:, :, rows]) / 5
