"""The SDPA seam on a CUDA GPU: each fused backend's forward kept bit for bit, the GProj kernel's backward, every
op the seam takes (the three SDPA backward ops, ``varlen_attn``'s), dropout passed through, and cuDNN's cached
plan read with the right dO layout. Skipped without CUDA.
"""
import contextlib
import json
import os
import subprocess
import sys

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


def test_dropout_passes_through_bitwise():
    """Fused dropout cannot be corrected: PyTorch's backward with the same RNG state, bit for bit, counted."""
    q, k, v, do = _inputs(7, S=256)
    results = []
    for patched in (False, True):
        torch.manual_seed(11)
        if patched:
            gproj_patch.reset_stats()
            with gproj_patch.enable(mode="gproj"):
                results.append(_run(q, k, v, do, dropout_p=0.2))
                stats = gproj_patch.stats()
        else:
            results.append(_run(q, k, v, do, dropout_p=0.2))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert stats["original"] == 1 and any("dropout" in r for r in stats["fallback_reasons"]), stats


def test_varlen_attn_is_reached():
    """``torch.nn.attention.varlen.varlen_attn`` (torchtitan's): its backward custom op is a seam op; packed
    sequences with causal (bottom-right per sequence) are corrected against fp64."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    lens, H, D = (100, 37, 256), 4, 64
    cu = torch.tensor([0, 100, 137, 393], dtype=torch.int32, device="cuda")
    T = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v, do = (torch.randn(T, H, D, device="cuda", generator=g, dtype=torch.float64) for _ in range(4))
    k = k + 256.0 * torch.randn(D, device="cuda", generator=g, dtype=torch.float64).div(8.0)
    low = [t.to(torch.bfloat16) for t in (q, k, v, do)]
    grads = []
    for patched in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in low[:3]]
        with gproj_patch.enable(mode="gproj") if patched else _null():
            out = varlen.varlen_attn(*leaves, cu, cu, max(lens), max(lens), window_size=(-1, 0))
            out.backward(low[3])
            if patched:
                stats = gproj_patch.stats()
        grads.append([t.grad for t in leaves])
    four = lambda t: t.unsqueeze(0).transpose(1, 2).double()  # noqa: E731
    ref = reference_backward(*(four(t) for t in low[:3]), four(low[3]), causal=True, causal_align="bottom_right",
                             cu_seqlens_q=cu, cu_seqlens_k=cu)
    for g_, r in zip(grads[1], ref):
        assert _rel(four(g_), r) < 5e-3
    assert _rel(four(grads[0][0]), ref[0]) > 5 * _rel(four(grads[1][0]), ref[0])
    assert stats["gproj"] == 1, stats


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("order", ["contiguous_first", "view_first"])
def test_cudnn_do_layout_defect(order):
    """PyTorch 2.11's cuDNN backward keeps the first call's dO strides in its cached plan: unpatched, the second
    call of one shape with the other dO layout is wrong (gradients off by ~100%); with the seam — enabled before
    any CUDA work, or after the first (unpatched) backward — both calls are right. Fresh processes."""
    def run(mode):
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        res = subprocess.run([sys.executable, "-m", "tests.hooks.cudnn_do_layout_probe", mode, order],
                             capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout.strip().splitlines()[-1])
    unpatched = run("unpatched")
    assert unpatched["errors"][0]["dq"] < 1e-2
    assert max(unpatched["errors"][1].values()) > 0.5, unpatched  # the upstream defect, reproduced
    for mode in ("patched", "patched_late"):
        got = run(mode)
        for errs in got["errors"]:
            assert max(errs.values()) < 1e-2, got
    assert got["stats"]["gproj"] >= 1, got  # patched_late: the key's plan predates the seam


def test_efficient_boolean_causal_mask_runs_as_flags():
    """The efficient op gets SDPA's boolean mask as an additive bias (0 / -inf): recognised as the causal
    pattern, the kernel runs with flags instead of the FP32 tier."""
    q, k, v, do = _inputs(8, S=256)
    causal = torch.ones(256, 256, dtype=torch.bool, device="cuda").tril()
    with torch.nn.attention.sdpa_kernel(BACKENDS["efficient"]):
        gproj_patch.reset_stats()
        with gproj_patch.enable(mode="gproj"):
            _, grads = _run(q, k, v, do, attn_mask=causal)
            stats = gproj_patch.stats()
    assert stats["gproj"] == 1, stats
    ref = reference_backward(q, k, v, do, causal=True)
    for g, r in zip(grads, ref):
        assert _rel(g, r) < 5e-3


def test_efficient_op_asked_for_a_missing_bias_gradient_raises_as_unpatched():
    """The efficient backward op called directly with ``grad_input_mask[3]`` and no bias: PyTorch's kernel raises
    (its own test suite checks that); with the seam the call goes to that kernel and raises the same error."""
    q, k, v = (torch.rand(2, 8, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention.default(q, k, v, None, True)
    do = torch.rand_like(out)
    call = (do, q, k, v, None, out, lse, seed, offset, 0.0, (True, True, True, True), False)
    messages = []
    for patched in (False, True):
        with gproj_patch.enable(mode="gproj") if patched else contextlib.nullcontext():
            with pytest.raises(RuntimeError) as raised:
                torch.ops.aten._scaled_dot_product_efficient_attention_backward.default(*call, scale=None)
        messages.append(str(raised.value).splitlines()[0])
    assert "bias_requires_grad is true but no bias was provided" in messages[0]
    assert messages[1] == messages[0]
