"""One device call for the warp-specialized Gluon dQ-major launch (issue 21 item 1): correctness, then timing
against the tl dQ-major launch; on any machine, ``--compile-only`` compiles the kernel for sm_90a and reports
registers, spills, shared memory and whether ptxas serialized the wgmmas.

    PYTHONPATH=. python benchmarks/gluon_dq_check.py [--seed N] [--skip-suite] [--skip-timing] [--out DIR]
    PYTHONPATH=. python benchmarks/gluon_dq_check.py --compile-only

1. Correctness (fresh random inputs each run: the seed is printed): the adversarial cases of
   ``tests/helpers/adversarial.py`` the kernel covers (key offsets to 512σ, key sinks, P == 1 rows, causal in
   both alignments, odd lengths with Sq ≠ Sk and rows that see no key, GQA/MQA, D = 64/128, fp16, strided memory,
   the witness); dq and the scratch (D, LSE2, λ) NaN-poisoned before every launch; dq against the fp64 oracle
   and against the tl dQ-major launch, D, LSE2, λ against the tl launch's; two Gluon launches compared bitwise;
   the D=128 configs of the sweep on one odd case too.
2. Timing (``triton.testing.do_bench`` medians, kernels only: arguments built once): the tl dq launch and the
   Gluon one (default config and the sweep) at the issue's shapes; TFLOP/s of the launch's 4 products.

Writes ``gluon_dq_check.log`` and ``.json`` to --out (default $OUT or ./gluon_dq_out); prints a short table
last. Needs an sm_90 GPU (except --compile-only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gproj_patch.backends import gluon_dq, triton_bwd, triton_launch  # noqa: E402
from gproj_patch.backends.gluon_dq import DqConfig  # noqa: E402
from tests.helpers import adversarial as adv  # noqa: E402
from tests.helpers import dq_launch  # noqa: E402

LOG = []
#: (B, Hq, Hkv, S, D, causal): the issue's rows
SHAPES = [(4, 16, 16, 4096, 128, True), (2, 16, 16, 8192, 128, False), (1, 16, 16, 16384, 128, True),
          (2, 32, 8, 8192, 128, True), (4, 16, 16, 4096, 64, True)]
#: configs timed besides the default (and checked for correctness on one case each)
SWEEP = {128: [DqConfig(32, 2), DqConfig(32, 4), DqConfig(64, 2, rk_in_flight=False)],
         64: [DqConfig(64, 2), DqConfig(32, 3)]}
#: matmul products of the dQ-major launch: S = QKᵀ, dP = dO·Vᵀ, t·K, r·K
DQ_PRODUCTS = 4
#: agreement with the tl launch (the GPU tests' bounds: tests/kernels/test_gluon_dq.py)
TL_AGREEMENT, ROW_AGREEMENT, LAM_AGREEMENT = 2e-3, 1e-4, 1e-3


def log(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


def check_case(name, seed, config=None):
    from gproj_patch.backends.reference import reference_backward
    q, k, v, do, o, lse, kw = dq_launch.case_inputs(name, seed)
    row = dict(case=name, config=None if config is None else str(config), gauge=name not in adv.NOT_GAUGE,
               reason=gluon_dq.dq_major_reason(q, k, v, do=do, o=o))
    if row["reason"] is not None:
        return row
    job = dq_launch.case_job(do, q, k, v, o, lse, kw)
    s1 = dq_launch.run_gluon(job, config)
    job2 = dq_launch.fresh(job)
    s2 = dq_launch.run_gluon(job2, config)
    tl_job = dq_launch.fresh(job)
    ts = dq_launch.run_tl(tl_job)
    torch.cuda.synchronize()
    ref = reference_backward(q, k, v, do, **kw)[0]
    row["finite"] = bool(torch.isfinite(job.dq).all() and torch.isfinite(s1.delta).all()
                         and torch.isfinite(s1.lam).all() and not torch.isnan(s1.lse2).any())
    row["deterministic"] = torch.equal(job.dq, job2.dq) and all(
        torch.equal(a, b) for a, b in ((s1.delta, s2.delta), (s1.lse2, s2.lse2), (s1.lam, s2.lam)))
    row["dq"], row["tl_dq"] = adv.rel(job.dq, ref), adv.rel(tl_job.dq, ref)
    row["vs_tl_dq"] = adv.rel(job.dq, tl_job.dq)
    row["vs_tl_delta"] = adv.rel(s1.delta, ts.delta)
    row["lse2_equal"] = torch.equal(s1.lse2, ts.lse2)
    row["vs_tl_lam"] = adv.rel(s1.lam, ts.lam)
    if name == "witness":
        row["dq0"] = float(job.dq.abs().max())
    if name == "empty_rows_br":
        empty = q.shape[2] - k.shape[2]
        row["empty_rows_zero"] = bool((job.dq[:, :, :empty] == 0).all())
    return row


def problems(row):
    """What is wrong with one checked case (empty: nothing)."""
    if "error" in row or row.get("reason") is not None:
        return [row.get("error") or row["reason"]]
    bad = []
    if not (row["finite"] and row["deterministic"]):
        bad.append("not finite or not deterministic")
    if row["gauge"] and row["dq"] >= adv.TARGET:
        bad.append(f"dq {row['dq']:.3%} over the target")
    if row["vs_tl_dq"] >= TL_AGREEMENT or row["vs_tl_delta"] >= ROW_AGREEMENT or row["vs_tl_lam"] >= LAM_AGREEMENT:
        bad.append("disagrees with the tl launch")
    if not row["lse2_equal"]:
        bad.append("LSE2 differs from the tl launch's")
    if row.get("dq0", 0.0) != 0.0 or row.get("empty_rows_zero") is False:
        bad.append("witness / empty rows not exactly zero")
    return bad


def run_suite(seed):
    cases = [c for c in adv.SUITE_CASES if c != "witness"] + list(adv.ODD_CASES) + ["witness"]
    runs = [(c, None) for c in cases] + [("odd_br_mqa_d128", cfg) for cfg in SWEEP[128]] + \
        [("odd_tl_d64_sq_gt_sk", cfg) for cfg in SWEEP[64]]
    rows = []
    for i, (name, cfg) in enumerate(runs):
        try:
            row = check_case(name, seed + i, cfg)
        except Exception as e:  # keep going: one failing case must not hide the others
            row = dict(case=name, config=str(cfg), error=f"{type(e).__name__}: {e}"[:500])
        row["problems"] = problems(row)
        rows.append(row)
        log(json.dumps(row, default=str))
    for name in adv.UNCOVERED:
        inp, kw, _ = adv.make_case(name, seed=seed)
        reason = gluon_dq.dq_major_reason(inp["q"], inp["k"], inp["v"], do=inp["do"], window=kw.get("window", (-1, -1)),
                                          softcap=kw.get("softcap", 0.0), varlen="cu_seqlens_q" in kw)
        rows.append(dict(case=name, reason=reason, problems=[] if reason else ["predicate accepted it"]))
        log(json.dumps(rows[-1]))
    return rows


def _bench(fn):
    import triton.testing as tt
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_shape(B, H, HKV, S, D, causal):
    g = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda h: torch.randn(B, h, S, D, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)  # noqa
    q, k, v, do = mk(H), mk(HKV), mk(HKV), mk(H)
    krep, vrep = (x.repeat_interleave(H // HKV, dim=1) for x in (k, v)) if HKV != H else (k, v)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, krep, vrep, 0.0, causal)[:2]
    del krep, vrep
    job = dq_launch.dense_job(do, q, k, v, o, lse, causal=causal)
    scratch = triton_launch.allocate_scratch(job)
    km = triton_bwd.kernel_module(False)
    tl_args = triton_launch.kernel_arguments("dq", job, scratch, block_d=triton_bwd.block_d(D))
    tl_grid = triton_launch.grid("dq", job)
    res = dict(tl=_bench(lambda: km._bwd_dq[tl_grid](**tl_args)))
    grid = (triton.cdiv(S, gluon_dq.BLOCK_M), H, B)
    for cfg in [gluon_dq.CONFIGS[D]] + SWEEP.get(D, []):
        args = gluon_dq.dq_arguments(job, scratch, cfg)
        fn = lambda args=args: gluon_dq._gk._dq_kernel[grid](**args, num_warps=gluon_dq.NUM_WARPS,  # noqa: E731
                                                             maxnreg=gluon_dq.MAXNREG)
        tag = f"n{cfg.block_n}s{cfg.num_stages}{'' if cfg.rk_in_flight else 'e'}"
        try:
            res[tag] = _bench(fn)
        except Exception as e:
            res[tag] = float("nan")
            log(f"config {cfg} failed: {e!r}"[:400])
        if cfg == gluon_dq.CONFIGS[D]:
            res["gluon"] = res[tag]
    flops = DQ_PRODUCTS * 2.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    for tag in ("tl", "gluon"):
        res[f"tflops_{tag}"] = flops / (res[tag] * 1e-3) / 1e12
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--skip-suite", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a (no GPU) and report resources")
    ap.add_argument("--out", default=os.environ.get("OUT", "gluon_dq_out"))
    args = ap.parse_args()
    if args.compile_only:
        configs = {D: [gluon_dq.CONFIGS[D]] + SWEEP[D] for D in SWEEP}
        for row in dq_launch.compile_report(configs=configs):
            print(row)
        return 0
    os.makedirs(args.out, exist_ok=True)
    seed = args.seed if args.seed is not None else int(time.time()) % (2 ** 31 - 100)
    log(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} seed {seed} "
        f"configs {gluon_dq.CONFIGS}")
    result = dict(seed=seed)
    if not args.skip_suite:
        result["suite"] = run_suite(seed)
        result["suite_bad"] = [(r["case"], r.get("config"), r["problems"]) for r in result["suite"] if r["problems"]]
        log("suite problems:", result["suite_bad"] or "none")
    timing = []
    if not args.skip_timing:
        for shp in SHAPES:
            try:
                r = time_shape(*shp)
            except Exception as e:
                r = dict(error=f"{type(e).__name__}: {e}"[:500])
            r["shape"] = shp
            timing.append(r)
            log(json.dumps(r, default=str))
            torch.cuda.empty_cache()
        result["timing"] = timing
    with open(os.path.join(args.out, "gluon_dq_check.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    if not args.skip_suite:  # short tables last
        log("\n| case | config | dq vs fp64 | tl dq vs fp64 | vs tl: dq | D | λ | LSE2 = | det | problems |")
        log("|---|---|---|---|---|---|---|---|---|---|")
        for r in result["suite"]:
            if "dq" in r:
                log(f"| {r['case']} | {r['config'] or 'default'} | {r['dq']:.3%} | {r['tl_dq']:.3%} | "
                    f"{r['vs_tl_dq']:.1e} | {r['vs_tl_delta']:.1e} | {r['vs_tl_lam']:.1e} | {r['lse2_equal']} | "
                    f"{r['deterministic']} | {'; '.join(r['problems'])} |")
    if timing:
        log("\n| B,Hq(Hkv),S,D,causal | tl dq ms | gluon dq ms (default) | gluon/tl | TF/s tl / gluon | sweep ms |")
        log("|---|---|---|---|---|---|")
        for r in timing:
            B, H, HKV, S, D, c = r["shape"]
            name = f"{B},{H}({HKV}),{S},{D},{'T' if c else 'F'}"
            if "error" in r:
                log(f"| {name} | {r['error']} |")
                continue
            sweep = ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k.startswith("n") and isinstance(v, float))
            log(f"| {name} | {r['tl']:.3f} | {r['gluon']:.3f} | ×{r['gluon'] / r['tl']:.2f} | "
                f"{r['tflops_tl']:.0f} / {r['tflops_gluon']:.0f} | {sweep} |")
    with open(os.path.join(args.out, "gluon_dq_check.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    if any("error" in r for r in result.get("suite", [])):
        return 2  # a case raised (e.g. a crashed launch)
    return 1 if result.get("suite_bad") else 0


if __name__ == "__main__":
    sys.exit(main())
