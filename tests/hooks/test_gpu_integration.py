"""The SDPA hook on a CUDA GPU: each fused backend's forward kept bit for bit, the GProj kernel's backward.

Skipped without CUDA; run on the H200 by `benchmarks/run_device.sh`.
"""
import pytest
import torch
import torch.nn.functional as F

import gproj_patch
from gproj_patch.backends.reference import reference_backward
from tests.helpers.numerics import rel as _rel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BACKENDS = {
    "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
    "flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
    "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
}


def _inputs(seed, B=2, H=4, Hkv=4, S=384, D=64, offset=512.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, D, device="cuda", generator=g, dtype=torch.float64)
    mu = torch.randn(D, device="cuda", generator=g, dtype=torch.float64)
    k = k + offset * mu / mu.norm()
    v = torch.randn(B, Hkv, S, D, device="cuda", generator=g, dtype=torch.float64)
    do = torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.float64)
    return [t.to(torch.bfloat16) for t in (q, k, v, do)]


def _run(q, k, v, do, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, **kw)
    out.backward(do)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("causal", [False, True])
def test_forward_bitwise_and_grads_corrected(backend, causal):
    q, k, v, do = _inputs(1)
    with torch.nn.attention.sdpa_kernel(BACKENDS[backend]):
        out_plain, grads_plain = _run(q, k, v, do, is_causal=causal)
        gproj_patch.reset_stats()
        with gproj_patch.enable(mode="gproj"):
            out, grads = _run(q, k, v, do, is_causal=causal)
        stats = gproj_patch.stats()
    assert torch.equal(out, out_plain), "the patched forward must be the fused forward, bit for bit"
    assert stats["gproj"] == 1, stats
    ref = reference_backward(q, k, v, do, causal=causal)
    plain_err = _rel(grads_plain[0], ref[0])
    for name, g, r in zip("qkv", grads, ref):
        assert _rel(g, r) < 5e-3, (name, _rel(g, r))
    assert plain_err > 0.1, f"the unpatched backward should leak at a 512 key offset (R_k ≈ 64) ({plain_err:.3g})"


def test_gqa_through_hook():
    q, k, v, do = _inputs(2, H=8, Hkv=2)
    with gproj_patch.enable(mode="gproj"):
        _, grads = _run(q, k, v, do, is_causal=True, enable_gqa=True)
    ref = reference_backward(q, k, v, do, causal=True)
    for g, r in zip(grads, ref):
        assert _rel(g, r) < 5e-3


def test_compiled_fullgraph_uses_kernel_without_graph_break():
    q, k, v, do = _inputs(3)

    def f(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    with gproj_patch.enable(mode="gproj"):
        compiled = torch.compile(f, fullgraph=True)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        compiled(*leaves).backward(do)
    ref = reference_backward(q, k, v, do, causal=True)
    for g, r in zip([t.grad for t in leaves], ref):
        assert _rel(g, r) < 5e-3


def test_fp32_tier_on_cuda_with_arbitrary_mask():
    q, k, v, do = _inputs(4, S=256)
    keep = torch.rand(2, 1, 256, 256, device="cuda") > 0.2
    keep[..., 0] = True
    with gproj_patch.enable(mode="gproj"):
        gproj_patch.reset_stats()
        _, grads = _run(q, k, v, do, attn_mask=keep)
        assert gproj_patch.stats()["fp32"] == 1
    ref = reference_backward(q, k, v, do, attn_mask=keep)
    for g, r in zip(grads, ref):
        assert _rel(g, r) < 5e-3


def test_detector_graph_replay_matches_eager(monkeypatch):
    """The torch fallback of the detector (the Triton kernel off): its CUDA graph replays what eager computes."""
    from gproj_patch.policy import detector
    from gproj_patch.runtime.state import STATE
    monkeypatch.setattr(STATE, "detector_kernel_failed", True)
    stats = []
    for seed in (5, 6):  # the second call replays the captured graph on new data
        q, k, _, _ = _inputs(seed)
        lse = torch.randn(2, 4, 384, device="cuda")
        lse[0, 0, 5] = float("-inf")
        graphed = detector.compute(q, k, lse)
        monkeypatch.setenv("GPROJ_DETECTOR_GRAPH", "0")
        eager = detector.compute(q, k, lse)
        monkeypatch.delenv("GPROJ_DETECTOR_GRAPH")
        for name in ("r_k", "r_q", "leak_dq", "leak_dk", "logit_bound", "lse_gap", "p_sink"):
            torch.testing.assert_close(getattr(graphed, name), getattr(eager, name), equal_nan=True)
        assert graphed.summary() == eager.summary()
        stats.append(graphed.summary())
    assert stats[0] != stats[1]
    assert not STATE.detector_graph_failed and detector._GRAPHS
