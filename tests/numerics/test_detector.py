"""Detector statistics against an fp64 computation; cost against an fp32 backward."""
import math
import time

import pytest
import torch

from gproj_patch.policy import detector


def _inputs(B=2, Hq=4, Hkv=2, Sq=96, Sk=80, D=32, k_off=0.0, q_off=0.0, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g)
    k = torch.randn(B, Hkv, Sk, D, generator=g)
    k[..., 0] += k_off
    q[..., 1] += q_off
    return q.to(dtype), k.to(dtype)


def _fp64_stats(q, k, lse, scale):
    q64, k64 = q.double(), k.double()
    group = q.shape[1] // k.shape[1]
    out = {}
    for name, x in (("r_k", k64), ("r_q", q64)):
        mean = x.mean(2)
        spread = ((x - mean.unsqueeze(2)) ** 2).sum(-1).mean(-1).sqrt()
        out[name] = mean.norm(dim=-1) / spread
    kx = k64.repeat_interleave(group, 1)
    out["logit_bound"] = scale * q64.norm(dim=-1).amax(-1) * kx.norm(dim=-1).amax(-1)
    s = scale * q64 @ kx.transpose(-1, -2)
    lse64 = lse.double()
    live = torch.isfinite(lse64)
    gap = torch.where(live, lse64 - s.mean(-1), torch.nan)
    out["lse_gap"] = gap.nanmean(-1)
    out["p_sink"] = torch.where(live, torch.exp(s[..., 0] - lse64), torch.nan).nanmean(-1)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_off,q_off", [(0.0, 0.0), (40.0, 0.0), (0.0, 25.0)])
def test_statistics_match_fp64(dtype, k_off, q_off):
    q, k = _inputs(k_off=k_off, q_off=q_off, dtype=dtype)
    scale = 0.3
    kx = k.double().repeat_interleave(2, 1)
    lse = torch.logsumexp(scale * q.double() @ kx.transpose(-1, -2), -1).float()
    lse[0, 1, 5] = -math.inf  # an empty row is excluded, never NaN
    st = detector.compute(q, k, lse, scale, dtype=dtype)
    ref = _fp64_stats(q, k, lse, scale)
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    for name in ("r_k", "r_q", "logit_bound", "lse_gap", "p_sink"):
        got = getattr(st, name).double()
        assert got.shape == ref[name].shape, name
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, ref[name], rtol=2e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(st.leak_dq.double(), 2 * u * ref["r_k"], rtol=2e-4, atol=1e-7)
    torch.testing.assert_close(st.leak_dk.double(), 2 * u * ref["r_q"], rtol=2e-4, atol=1e-7)
    summ = st.summary()
    assert set(summ) == set(detector.SUMMARY_KEYS)
    assert summ["r_k"] == pytest.approx(ref["r_k"].max().item(), rel=1e-3)
    assert summ["log_sk"] == pytest.approx(math.log(k.shape[2]))
    if k_off:
        assert summ["r_k"] > 5 and summ["r_q"] < 1
    if q_off:
        assert summ["r_q"] > 3 and summ["r_k"] < 1


def test_lse_layouts_and_no_lse():
    q, k = _inputs(B=1, Hq=2, Hkv=2, Sq=40, Sk=40)
    lse = torch.logsumexp(0.2 * q.float() @ k.float().transpose(-1, -2), -1)
    a = detector.compute(q, k, lse, 0.2)
    b = detector.compute(q, k, lse.unsqueeze(-1), 0.2)                          # cuDNN (B, H, S, 1)
    c = detector.compute(q, k, torch.cat([lse, lse[..., :24]], -1), 0.2)         # efficient, padded to 64
    for other in (b, c):
        torch.testing.assert_close(other.lse_gap, a.lse_gap)
        torch.testing.assert_close(other.p_sink, a.p_sink)
    none = detector.compute(q, k, None, 0.2)
    assert torch.isnan(none.p_sink).all()
    torch.testing.assert_close(none.r_k, a.r_k)


def test_sharpness_separates_uniform_from_sink():
    B, H, S, D = 1, 1, 128, 16
    q = torch.zeros(B, H, S, D)
    k = torch.randn(B, H, S, D) * 0.01
    lse = torch.logsumexp(q @ k.transpose(-1, -2), -1)
    flat = detector.compute(q.bfloat16(), k.bfloat16(), lse, 1.0).summary()
    assert flat["lse_gap"] == pytest.approx(math.log(S), abs=1e-2)
    assert flat["p_sink"] == pytest.approx(1 / S, rel=0.05)
    q[..., 0] = 4.0
    k[:, :, 0, 0] = 10.0  # key 0 dominates every row
    q, k = q.bfloat16(), k.bfloat16()
    lse = torch.logsumexp(q.float() @ k.float().transpose(-1, -2), -1)
    sink = detector.compute(q, k, lse, 1.0).summary()
    assert sink["p_sink"] > 0.99 and sink["lse_gap"] > math.log(S) + 20


def test_sampled_rows_estimate_large_offset_closely():
    q, k = _inputs(B=1, Hq=2, Hkv=2, Sq=2048, Sk=2048, D=64, k_off=200.0)
    exact = detector.compute(q, k, None, None, max_rows=None).summary()
    sampled = detector.compute(q, k, None, None, max_rows=256).summary()
    assert sampled["r_k"] == pytest.approx(exact["r_k"], rel=0.05)


def test_cost_below_three_percent_of_fp32_backward():
    # The detector reads at most 256 rows per head, so its cost is fixed while the backward grows as S²;
    # S = 2048 is a short training sequence. (``python -m benchmarks.auto`` measures the ratio on the GPU.)
    # One intra-op thread for both timings: on a shared, oversubscribed CPU every parallel region of a small op
    # can wait a scheduler slice for a descheduled OpenMP worker, which measures the machine, not the detector.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _cost_check()
    finally:
        torch.set_num_threads(threads)


def _cost_check():
    torch.manual_seed(0)
    B, H, S, D = 1, 8, 2048, 64
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    do = torch.randn_like(out)
    lse = torch.randn(B, H, S)
    qb, kb = q.detach().bfloat16(), k.detach().bfloat16()

    def best(fn, n=3):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    detector.compute(qb, kb, lse, None).summary()  # warm-up
    t_bwd = best(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
    t_det = best(lambda: detector.compute(qb, kb, lse, None).summary())
    assert t_det <= 0.03 * t_bwd, (t_det, t_bwd)


def test_statistics_trace_as_one_graph():
    """The arithmetic is one pure tensor function (no data-dependent Python), as CUDA-graph capture needs."""
    torch.manual_seed(5)
    q = torch.randn(2, 4, 64, 16).bfloat16()
    k = (torch.randn(2, 2, 64, 16) + 30.0).bfloat16()
    lse = torch.randn(2, 4, 64)
    lse[0, 0, 3] = float("-inf")
    args = (q, k, k[:, :, 0, :], lse, 0.25, 2, 2.0 ** -8)
    eager = detector._statistics(*args)
    traced = torch.compile(detector._statistics, fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip(eager, traced):
        torch.testing.assert_close(a, b, equal_nan=True)


def test_detector_failure_flags_live_in_the_runtime_state_and_reset_with_it():
    """The detector's "kernel failed" / "graph capture failed" flags and its logged reasons are runtime state:
    reset_stats() clears them (the next sampled call tries the kernel again)."""
    import gproj_patch
    from gproj_patch.runtime.state import STATE
    STATE.detector_kernel_failed = STATE.detector_graph_failed = True
    STATE.detector_logged.add("head_dim=512")
    gproj_patch.reset_stats()
    assert not STATE.detector_kernel_failed and not STATE.detector_graph_failed and not STATE.detector_logged
