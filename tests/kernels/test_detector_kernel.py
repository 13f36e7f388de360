"""The detector's Triton kernel (backends/detector_kernel.py) against an fp64 computation of the statistics'
definitions (detector.py's docstring) on the same sampled rows.

On CPU the kernel runs in Triton's interpreter. ``triton.jit`` picks compiled or interpreted when a kernel is
defined, so the kernel module must be imported with ``TRITON_INTERPRET=1`` already set: one subprocess (this
file run as a script) imports it that way, runs every case of ``CASES`` and saves the results; the tests here
regenerate the same inputs (seeded) and compare. On CUDA (``@pytest.mark.gpu``) the compiled kernel is compared
in-process, and ``detector.compute`` is checked to take it.

Tolerances (fp32 accumulation): 1e-5 relative on r_k, r_q, leak_dq, leak_dk, logit_bound; lse_gap and p_sink are
differences of large terms (LSE_i and α·q_i·k̄ grow with the offsets), so their error is bounded by 1e-5 times
the sum of the absolute values of those terms (α Σ_d |q_id k̄_d| + |LSE_i|) — their condition number.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (tests/kernels/..)
sys.path.insert(0, ROOT)
from gproj_patch.policy import detector  # noqa: E402
from gproj_patch.backends import detector_kernel  # noqa: E402
from gproj_patch.backends.spec import normalize_lse  # noqa: E402

RTOL = 1e-5
UNIT = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
DEFAULT_CASE = dict(B=2, Hq=2, Hkv=2, Sq=37, Sk=37, D=32, dtype=torch.float32, k_off=0.0, q_off=0.0,
                    transposed=False, max_rows=64, lse="live", scale=None, seed=0)
CASES = {  # name -> overrides of DEFAULT_CASE
    "fp32_all_rows_odd_s": dict(Sq=137, Sk=137, max_rows=256),
    "fp32_key_offset_300_sampled": dict(B=1, Sq=301, Sk=301, D=64, k_off=300.0, max_rows=150),
    "fp16_key_offset_300_gqa_strided": dict(Hq=4, Sq=97, Sk=131, D=48, dtype=torch.float16, k_off=300.0,
                                            q_off=20.0, transposed=True, max_rows=80, seed=1),
    "fp32_gqa_strided_some_dead": dict(Hq=4, Sq=75, Sk=75, transposed=True, max_rows=16, lse="some_dead", seed=2),
    "fp16_gqa_head_all_dead": dict(Hq=4, Sq=50, Sk=50, dtype=torch.float16, max_rows=20, lse="head_dead", seed=3),
    "fp32_all_dead": dict(Sq=33, Sk=33, max_rows=8, lse="all_dead", seed=4),
    "fp16_no_lse_mqa": dict(Hq=4, Hkv=1, Sq=65, Sk=65, D=16, dtype=torch.float16, k_off=50.0, max_rows=16,
                            lse="none", seed=5),
    "fp32_sq_below_sk_above_max_rows": dict(Sq=20, Sk=90, D=24, max_rows=32, k_off=8.0, scale=0.3, seed=6),
    "fp32_sink_on_key_0": dict(B=1, Sq=40, Sk=40, D=16, max_rows=64, lse="sink", scale=1.0, seed=7),
}


def _case(name):
    return {**DEFAULT_CASE, **CASES[name]}


def make_inputs(name, device="cpu"):
    """(q, k, lse, scale, q_index, k_index) of a case; lse in the layout the forward would give (or None)."""
    c = _case(name)
    g = torch.Generator().manual_seed(c["seed"])
    B, Hq, Hkv, Sq, Sk, D = c["B"], c["Hq"], c["Hkv"], c["Sq"], c["Sk"], c["D"]
    if c["transposed"]:  # (B, S, H, D) storage seen as (B, H, S, D): non-contiguous strides
        q = torch.randn(B, Sq, Hq, D, generator=g, dtype=torch.float64).transpose(1, 2)
        k = torch.randn(B, Sk, Hkv, D, generator=g, dtype=torch.float64).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, Sq, D, generator=g, dtype=torch.float64)
        k = torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64)
    k = k + c["k_off"] * torch.randn(D, generator=g, dtype=torch.float64)   # common key offset (in σ)
    q = q + c["q_off"] * torch.randn(D, generator=g, dtype=torch.float64)
    if c["lse"] == "sink":  # key 0 takes nearly all the weight of every row
        q[..., 0] = 4.0
        k[:, :, 0, 0] = 10.0
    q, k = q.to(c["dtype"]), k.to(c["dtype"])
    scale = D ** -0.5 if c["scale"] is None else c["scale"]
    kx = k.double().repeat_interleave(Hq // Hkv, dim=1)
    lse = torch.logsumexp(scale * q.double() @ kx.transpose(-1, -2), dim=-1).float()   # (B, Hq, Sq)
    if c["lse"] == "some_dead":
        lse[0, 1, ::3] = -math.inf
        lse[1, 2, :10] = -math.inf
    elif c["lse"] == "head_dead":
        lse[1, 3] = -math.inf
    elif c["lse"] == "all_dead":
        lse.fill_(-math.inf)
    if c["transposed"]:  # stored (B, S, H): a strided (B, H, S) view
        lse = lse.transpose(1, 2).contiguous().transpose(1, 2)
    lse = None if c["lse"] == "none" else lse.to(device)
    q, k = q.to(device), k.to(device)
    q_index = detector._row_index(Sq, c["max_rows"], q.device)
    k_index = detector._row_index(Sk, c["max_rows"], k.device)
    return q, k, lse, scale, q_index, k_index


def run_kernel(name, device="cpu"):
    q, k, lse, scale, q_index, k_index = make_inputs(name, device)
    lse = None if lse is None else normalize_lse(lse, *q.shape[:3])
    out = detector_kernel.head_statistics(q, k, lse, scale=scale, u=UNIT[q.dtype], q_index=q_index, k_index=k_index)
    return {f: getattr(out, f).cpu() for f in ("r_k", "r_q", "leak_dq", "leak_dk", "logit_bound", "lse_gap",
                                               "p_sink", "worst")}


def reference(name):
    """The statistics in fp64 from their definitions (detector.py's docstring), on the sampled rows
    round(linspace(0, S − 1, max_rows)) (all rows when S <= max_rows); plus the tolerance scales."""
    c = _case(name)
    q, k, lse, scale, _, _ = make_inputs(name)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    u = UNIT[q.dtype]

    def rows(s):
        n = c["max_rows"]
        return torch.arange(s) if s <= n else torch.linspace(0, s - 1, n).round().long()

    qs, ks = q.double()[:, :, rows(Sq)], k.double()[:, :, rows(Sk)]
    k0 = k.double()[:, :, 0]

    def offset_ratio(x):
        mean = x.mean(dim=2)
        spread = ((x - mean.unsqueeze(2)) ** 2).sum(-1).mean(-1).sqrt()
        return mean, mean.norm(dim=-1) / spread.clamp_min(1e-30)

    kmean, r_k = offset_ratio(ks)
    _, r_q = offset_ratio(qs)
    kmean_q, k0_q = kmean.repeat_interleave(group, 1), k0.repeat_interleave(group, 1)   # per query head
    kmax = ks.norm(dim=-1).amax(-1).repeat_interleave(group, 1)
    out = {"r_k": r_k, "r_q": r_q, "leak_dq": 2 * u * r_k, "leak_dk": 2 * u * r_q,
           "logit_bound": scale * qs.norm(dim=-1).amax(-1) * kmax}
    nan = torch.full((B, Hq), math.nan, dtype=torch.float64)
    out["lse_gap"], out["p_sink"], out["gap_scale"], out["sink_scale"] = nan, nan, nan, nan
    if lse is not None:
        ls = lse.double()[:, :, rows(Sq)]
        live = torch.isfinite(ls)
        n_live = live.sum(-1)
        lf = torch.where(live, ls, 0.0)
        score_mean = scale * torch.einsum("bhid,bhd->bhi", qs, kmean_q)
        score_0 = scale * torch.einsum("bhid,bhd->bhi", qs, k0_q)

        def live_mean(x):
            return torch.where(n_live > 0, torch.where(live, x, 0.0).sum(-1) / n_live.clamp_min(1), math.nan)

        weight_0 = torch.exp((score_0 - lf).clamp_max(0.0))   # attention weight on key 0 (a weight: at most 1)
        out["lse_gap"] = live_mean(lf - score_mean)
        out["p_sink"] = live_mean(weight_0)
        # condition numbers: the sums of the absolute values of the terms each statistic is the difference of
        out["gap_scale"] = live_mean(lf.abs() + scale * torch.einsum("bhid,bhd->bhi", qs.abs(), kmean_q.abs()))
        terms_0 = lf.abs() + scale * torch.einsum("bhid,bhd->bhi", qs.abs(), k0_q.abs())
        out["sink_scale"] = live_mean(weight_0 * terms_0)
    gap = out["lse_gap"]
    out["worst"] = torch.stack([out["r_k"].max(), out["r_q"].max(), out["leak_dq"].max(), out["leak_dk"].max(),
                                out["logit_bound"].max(), gap[~gap.isnan()].mean(),
                                torch.nan_to_num(out["p_sink"], nan=0.0).max()])
    return out


def check_against_reference(got, ref):
    for name in ("r_k", "r_q", "leak_dq", "leak_dk", "logit_bound"):
        assert got[name].dtype == torch.float32 and got[name].shape == ref[name].shape, name
        torch.testing.assert_close(got[name].double(), ref[name], rtol=RTOL, atol=0.0, msg=name)
    for name, scale in (("lse_gap", "gap_scale"), ("p_sink", "sink_scale")):
        g, r = got[name].double(), ref[name]
        assert torch.equal(g.isnan(), r.isnan()), (name, g, r)
        err = (g - r).abs()[~r.isnan()]
        bound = RTOL * ref[scale][~r.isnan()] + 1e-30
        assert (err <= bound).all(), (name, err, bound)
    worst, ref_worst = got["worst"].double(), ref["worst"]
    assert worst.shape == (7,)
    for i in (0, 1, 2, 3, 4):
        assert worst[i] == pytest.approx(float(ref_worst[i]), rel=RTOL), (detector.SUMMARY_KEYS[i], worst, ref_worst)
    if math.isnan(ref_worst[5]):
        assert math.isnan(worst[5])
    else:  # the mean of per-head values each within its own bound
        live = ~ref["lse_gap"].isnan()
        assert abs(float(worst[5] - ref_worst[5])) <= RTOL * float(ref["gap_scale"][live].mean()) + 1e-30
    assert abs(float(worst[6] - ref_worst[6])) <= RTOL * float(torch.nan_to_num(ref["sink_scale"]).max()) + 1e-30


# ---- CPU: the kernel in Triton's interpreter ----------------------------------------------------------------
@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every case's kernel results, computed once in a subprocess with TRITON_INTERPRET=1."""
    out = tmp_path_factory.mktemp("detector_kernel") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted_kernel_matches_fp64(interpreted, name):
    check_against_reference(interpreted[name], reference(name))


def test_interpreted_kernel_matches_the_torch_path(interpreted):
    """The same values as the torch arithmetic ``detector._statistics`` on gathered rows (the CPU path)."""
    for name in sorted(CASES):
        q, k, lse, scale, q_index, k_index = make_inputs(name)
        torch_path = detector.compute(q, k, lse, scale, max_rows=_case(name)["max_rows"])
        for field in ("r_k", "r_q", "leak_dq", "leak_dk", "logit_bound", "lse_gap", "p_sink", "worst"):
            torch.testing.assert_close(interpreted[name][field], getattr(torch_path, field), rtol=1e-4, atol=1e-6,
                                       equal_nan=True, msg=f"{name}: {field}")


def test_cases_cover_the_brief():
    cases = [_case(n) for n in CASES]
    assert any(c["k_off"] >= 300 and c["dtype"] == torch.float32 for c in cases)
    assert any(c["k_off"] >= 300 and c["dtype"] == torch.float16 for c in cases)
    assert any(c["Hq"] == 4 and c["Hkv"] == 2 for c in cases) and any(c["transposed"] for c in cases)
    assert any(c["Sq"] <= c["max_rows"] for c in cases) and any(c["Sq"] > c["max_rows"] for c in cases)
    assert any(c["Sq"] % 2 for c in cases)
    assert any(min(c["Sq"], c["max_rows"]) > 2 * detector_kernel.MAX_BLOCK_ROWS for c in cases)  # several tiles
    assert {"some_dead", "head_dead", "all_dead", "none"} <= {c["lse"] for c in cases}


def test_supported_predicate_reasons():
    q, k, lse, *_ = make_inputs("fp32_all_rows_odd_s")
    lse = normalize_lse(lse, *q.shape[:3])
    supported = detector_kernel.detector_kernel_supported
    wide = torch.zeros(1, 1, 4, 512)
    assert "head_dim" in supported(wide, wide, None)[1]
    assert "lse" in supported(q, k, lse[..., :-1])[1]
    assert "attention problem" in supported(q, k[:, :, :, :8], None)[1]
    ok, reason = supported(q, k, lse)
    if detector_kernel._interpreted():  # kernels built for the interpreter (TRITON_INTERPRET=1 at import)
        assert ok and "bfloat16" in supported(q.bfloat16(), k.bfloat16(), None)[1]
    else:                               # built compiled: CPU tensors are the interpreter's only
        assert not ok and "cpu" in reason
        with pytest.raises(ValueError, match="cannot run"):
            detector_kernel.head_statistics(q, k, lse, scale=1.0, u=2.0 ** -24)


# ---- CUDA: the compiled kernel and the shipped path ---------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_kernel_matches_fp64(name):
    check_against_reference(run_kernel(name, "cuda"), reference(name))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_takes_the_kernel_on_cuda(dtype):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 1000, 64, device="cuda").to(dtype)
    k = (torch.randn(2, 2, 1000, 64, device="cuda") + 40.0).to(dtype)
    lse = torch.randn(2, 4, 1000, 1, device="cuda") + 10.0   # cuDNN's (B, H, S, 1)
    lse[0, 1, :5] = -math.inf
    stats = detector.compute(q, k, lse, None)
    assert stats.ready is not None and stats.host.is_pinned()   # the kernel path, summary through pinned memory
    got = stats.summary()
    fallback = detector.compute(q.cpu(), k.cpu(), lse.cpu(), None).summary()   # torch arithmetic
    assert set(got) == set(detector.SUMMARY_KEYS)
    for key in detector.SUMMARY_KEYS:
        assert got[key] == pytest.approx(fallback[key], rel=1e-4), key


def _main(path):
    """Subprocess entry: the kernel (interpreted) on every case, saved to ``path``."""
    assert detector_kernel._interpreted(), "run with TRITON_INTERPRET=1"
    torch.save({name: run_kernel(name) for name in CASES}, path)


if __name__ == "__main__":
    _main(sys.argv[1])
