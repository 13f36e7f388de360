"""One device call for the GProj backward with the Hopper Gluon KV-major launch (issue 11): correctness, then
timing; on any machine, ``--compile-only`` compiles the Gluon kernel for sm_90a and reports registers and spills.

    PYTHONPATH=. python benchmarks/gluon_check.py [--seed N] [--skip-suite] [--skip-timing] [--sweep] [--out DIR]
    PYTHONPATH=. python benchmarks/gluon_check.py --compile-only

1. Correctness (BF16/FP16 vs the fp64 oracle, fresh random inputs each run: the seed is printed): key offsets
   to 512σ, sinks and P == 1 rows, causal in both alignments, odd lengths with Sq ≠ Sk (and rows that see no
   key), GQA/MQA, D = 64 and 128, strided (B, S, H, D) memory, the four-key witness; outputs poisoned with NaN
   before every launch; two launches compared bitwise; the tl kernel on the same inputs for comparison; and
   the predicate's reason on what the kernel does not cover.
2. Timing (``triton.testing.do_bench`` medians, one run): GProj with the Gluon KV-major launch, GProj all-tl
   and cuDNN SDPA backward at the issue's shapes, and each launch alone; TFLOP/s counting the standard
   5-product backward and GProj's 8 products.

Writes ``gluon_check.log`` and ``gluon_check.json`` to --out (default $OUT or ./gluon_out) and prints a short
table last. Needs an sm_90 GPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gproj_patch.backends import triton_bwd  # noqa: E402
from gproj_patch.backends.gluon_bwd import KernelConfig  # noqa: E402
from gproj_patch.backends.gluon_entry import gluon_backward, gluon_supported_reason  # noqa: E402
from gproj_patch.backends.reference import reference_backward, reference_forward  # noqa: E402
from gproj_patch.backends.triton_bwd import gproj_backward  # noqa: E402
from tests.helpers.kernel_build import gluon_compile_report  # noqa: E402
from tests.helpers.adversarial import (NOT_GAUGE, ODD_CASES, SUITE_CASES, TARGET, UNCOVERED, make_odd,  # noqa: E402
                                      witness_rows4)

_spec = importlib.util.spec_from_file_location("device_check", os.path.join(ROOT, "benchmarks", "device_check.py"))
dc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dc)

LOG = []
#: matmul products of one backward tile: the standard fused backward and the split GProj design
STANDARD_PRODUCTS, GPROJ_PRODUCTS = 5, 8


def log(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


# cases: tests/helpers/adversarial.py (device_check's suite and odd shapes of our own), shared with the GPU tests


def check_case(name, seed):
    if name == "witness":
        inp, kw = witness_rows4(), {}
    elif name in ODD_CASES:
        inp, kw = make_odd(name, seed)
    else:
        inp, kw, _ = dc.make_case(name, seed=seed)
    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
    out, lse = reference_forward(q, k, v, **kw)
    o, lse = out.to(q.dtype), lse.float()
    ref = reference_backward(q, k, v, do, **kw)
    reason = gluon_supported_reason(q, k, v, do=do, **kw)
    row = dict(case=name, reason=reason, gauge=name not in NOT_GAUGE)
    if reason is not None:
        return row
    g1 = gluon_backward(do, q, k, v, o, lse, **kw)
    g2 = gluon_backward(do, q, k, v, o, lse, **kw)
    torch.cuda.synchronize()
    row["finite"] = all(bool(torch.isfinite(x).all()) for x in g1)
    row["deterministic"] = all(torch.equal(x, y) for x, y in zip(g1, g2))
    for nm, a, r in zip("qkv", g1, ref):
        row[f"d{nm}"] = dc.rel(a, r) if row["finite"] else float("nan")
    try:  # the tl kernel on the same inputs, for comparison
        tl = gproj_backward(do, q, k, v, o, lse, kv_major="tl", **kw)
        for nm, t, r in zip("qkv", tl, ref):
            row[f"tl_d{nm}"] = dc.rel(t, r)
        row["vs_tl"] = max(dc.rel(a, t) for a, t in zip(g1, tl)) if row["finite"] else float("nan")
    except Exception as e:
        row.update(tl_dq=float("nan"), tl_dk=float("nan"), tl_dv=float("nan"), tl_error=repr(e)[:300])
    if name == "witness":
        row["dq0"] = float(g1[0].abs().max())
    if name == "empty_rows_br":  # rows that see no key: exactly zero gradients
        shift = k.shape[2] - q.shape[2]
        row["empty_rows_zero"] = bool((g1[0][:, :, : -shift] == 0).all())
    return row


def run_suite(seed, cases=None):
    rows = []
    triton_bwd._POISON_OUTPUTS = True
    try:
        for i, name in enumerate(SUITE_CASES + list(ODD_CASES)):
            if cases is not None and name not in cases:
                continue
            try:
                row = check_case(name, seed + i)
            except Exception as e:  # keep going: one failing case must not hide the others
                row = dict(case=name, error=f"{type(e).__name__}: {e}"[:500])
            rows.append(row)
            log(json.dumps(row, default=str))
        for name in UNCOVERED if cases is None else [c for c in UNCOVERED if c in cases]:
            inp, kw, _ = dc.make_case(name, seed=seed)
            reason = gluon_supported_reason(inp["q"], inp["k"], inp["v"], do=inp["do"], **kw)
            rows.append(dict(case=name, reason=reason, expect_reason=True))
            log(json.dumps(rows[-1]))
    finally:
        triton_bwd._POISON_OUTPUTS = False
    return rows


def suite_ok(rows):
    bad = []
    for r in rows:
        if r.get("expect_reason"):
            if r["reason"] is None:
                bad.append((r["case"], "predicate accepted an uncovered case"))
            continue
        if "error" in r or r.get("reason") is not None:
            bad.append((r["case"], r.get("error") or r.get("reason")))
            continue
        if not (r["finite"] and r["deterministic"]):
            bad.append((r["case"], "not finite or not deterministic"))
        if r["case"] == "witness" and r["dq0"] != 0.0:
            bad.append((r["case"], f"witness dq0={r['dq0']}"))
        if r["gauge"] and max(r["dq"], r["dk"], r["dv"]) >= TARGET:
            bad.append((r["case"], "error over 0.5%"))
        if r.get("empty_rows_zero") is False:
            bad.append((r["case"], "rows with no key got nonzero dq"))
    return bad


# ----------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------

#: (B, Hq, Hkv, S, D, causal)
SHAPES = [(4, 16, 16, 4096, 64, True), (4, 16, 16, 4096, 128, True), (2, 16, 16, 8192, 128, False),
          (1, 16, 16, 16384, 128, True), (2, 32, 8, 8192, 128, True)]
#: Gluon KV-major configs timed besides the default with --sweep
SWEEP = {64: [KernelConfig(128, 3), KernelConfig(64, 3), KernelConfig(32, 2)],
         128: [KernelConfig(32, 2), KernelConfig(32, 3)]}


def _bench(fn):
    import triton.testing as tt
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def standard_flops(B, H, S, D, causal):
    return 2.5 * (4 * B * H * S * S * D) * (0.5 if causal else 1.0)


def time_shape(B, H, HKV, S, D, causal, sweep=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    g = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda h: torch.randn(B, h, S, D, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)  # noqa
    q, k, v, do = mk(H), mk(HKV), mk(HKV), mk(H)
    krep, vrep = (x.repeat_interleave(H // HKV, dim=1) for x in (k, v)) if HKV != H else (k, v)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, krep, vrep, 0.0, causal)
    o, lse = out[0], out[1]
    res = {}
    fn = lambda: gluon_backward(do, q, k, v, o, lse, causal=causal)  # noqa: E731
    fn_tl = lambda: gproj_backward(do, q, k, v, o, lse, causal=causal, kv_major="tl")  # noqa: E731
    for tag, f in (("gluon", fn), ("tl", fn_tl)):
        f()
        res[tag] = _bench(f)
        for part in ("dq", "dkdv"):  # each launch alone (the other one's outputs then stale: a timing only)
            triton_bwd._RUN = (part,)
            try:
                res[f"{tag}_{part}"] = _bench(f)
            finally:
                triton_bwd._RUN = ("dq", "dkdv")
    try:
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, krep, vrep))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        fc = lambda: torch.autograd.grad(y, (qq, kk, vv), do, retain_graph=True)  # noqa: E731
        fc()
        res["cudnn"] = _bench(fc)
        res["cudnn_note"] = "K/V repeated to Hq heads" if HKV != H else ""
    except Exception as e:  # pragma: no cover
        res["cudnn"] = float("nan")
        log(f"cudnn failed: {e!r}")
    if sweep and D in SWEEP:
        triton_bwd._RUN = ("dkdv",)
        try:
            for cfg in SWEEP[D]:
                fs = lambda cfg=cfg: gluon_backward(do, q, k, v, o, lse, causal=causal, _gluon_config=cfg)  # noqa
                try:
                    fs()
                    res[f"sweep_dkdv_m{cfg.block_m}s{cfg.num_stages}"] = _bench(fs)
                except Exception as e:
                    log(f"sweep {cfg} failed: {e!r}"[:400])
        finally:
            triton_bwd._RUN = ("dq", "dkdv")
    flops = standard_flops(B, H, S, D, causal)
    for tag in ("gluon", "tl", "cudnn"):
        res[f"tflops_std_{tag}"] = flops / (res[tag] * 1e-3) / 1e12
    for tag in ("gluon", "tl"):
        res[f"tflops_actual_{tag}"] = flops * GPROJ_PRODUCTS / STANDARD_PRODUCTS / (res[tag] * 1e-3) / 1e12
    res["kernels"] = dict(triton_bwd.LAST_KERNELS)
    return res


compile_report = gluon_compile_report  # (tests/helpers/kernel_build.py: the kernel tests use it too)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--skip-suite", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES (default: all)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a (no GPU) and report registers")
    ap.add_argument("--tag", default="", help="suffix of the log/json names (several calls in one run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gluon_out"))
    args = ap.parse_args()
    if args.compile_only:
        for row in compile_report():
            print(row)
        return 0
    os.makedirs(args.out, exist_ok=True)
    import triton
    seed = args.seed if args.seed is not None else int(time.time()) % (2 ** 31 - 100)
    log(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} seed {seed} "
        f"cases {args.cases} shapes {args.shapes}")
    result = dict(seed=seed)
    if not args.skip_suite:
        rows = run_suite(seed, None if args.cases is None else args.cases.split(","))
        result["suite"] = rows
        result["suite_bad"] = suite_ok(rows)
        log("suite problems:", result["suite_bad"] or "none")
    timing = []
    if not args.skip_timing:
        picked = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
        for shp in picked:
            try:
                r = time_shape(*shp, sweep=args.sweep)
            except Exception as e:
                r = dict(error=f"{type(e).__name__}: {e}"[:500])
            r["shape"] = shp
            timing.append(r)
            log(json.dumps(r, default=str))
        result["timing"] = timing
    with open(os.path.join(args.out, f"gluon_check{args.tag}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    # short tables last
    if not args.skip_suite:
        log("\n| case | dq | dk | dv | tl dq | tl dk | tl dv | det | note |")
        log("|---|---|---|---|---|---|---|---|---|")
        for r in result["suite"]:
            if "dq" in r:
                note = f"dq0={r['dq0']}" if "dq0" in r else ("" if r["gauge"] else "not gauge")
                log(f"| {r['case']} | {r['dq']:.3%} | {r['dk']:.3%} | {r['dv']:.3%} | {r['tl_dq']:.3%} | "
                    f"{r['tl_dk']:.3%} | {r['tl_dv']:.3%} | {r['deterministic']} | {note} |")
            else:
                log(f"| {r['case']} | | | | | | | | {r.get('error') or r.get('reason')} |")
    if timing:
        log("\n| B,Hq(Hkv),S,D,causal | gluon ms | dq | gluon dkdv | tl ms | tl dkdv | cuDNN ms | gluon/cuDNN | "
            "tl/cuDNN | TF/s std gluon/cuDNN | TF/s actual gluon |")
        log("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in timing:
            B, H, HKV, S, D, c = r["shape"]
            if "error" in r:
                log(f"| {B},{H}({HKV}),{S},{D},{'T' if c else 'F'} | {r['error']} |")
                continue
            log(f"| {B},{H}({HKV}),{S},{D},{'T' if c else 'F'} | {r['gluon']:.3f} | {r['gluon_dq']:.3f} | "
                f"{r['gluon_dkdv']:.3f} | {r['tl']:.3f} | {r['tl_dkdv']:.3f} | {r['cudnn']:.3f} | ×{r['gluon'] / r['cudnn']:.2f} | "
                f"×{r['tl'] / r['cudnn']:.2f} | {r['tflops_std_gluon']:.0f}/{r['tflops_std_cudnn']:.0f} | "
                f"{r['tflops_actual_gluon']:.0f} |")
    with open(os.path.join(args.out, f"gluon_check{args.tag}.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    if any("error" in r for r in result.get("suite", [])):
        return 2  # a case raised (e.g. a crashed launch)
    return 1 if result.get("suite_bad") else 0


if __name__ == "__main__":
    sys.exit(main())
