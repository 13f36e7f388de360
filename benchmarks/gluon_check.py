"""One device call for the GProj backward with the Hopper Gluon KV-major launch (issues 11, 21): correctness,
then timing of the default config against its variants; on any machine, ``--compile-only`` compiles every
config for sm_90a and reports registers, spills and shared memory.

    PYTHONPATH=. python benchmarks/gluon_check.py [--seed N] [--skip-suite] [--skip-timing] [--budget S] [--out DIR]
    PYTHONPATH=. python benchmarks/gluon_check.py --compile-only

1. Correctness (BF16/FP16 vs the fp64 oracle, fresh random inputs each run: the seed is printed): key offsets
   to 512σ, sinks and P == 1 rows, causal in both alignments, odd lengths with Sq ≠ Sk (and rows that see no
   key), GQA/MQA, D = 64 and 128, strided (B, S, H, D) memory, the four-key witness; outputs poisoned with NaN
   before every launch; two launches compared bitwise; bitwise against the tl KV-major launch and against the
   paired slot release (``PAIRED``: same products, same order); a head whose forward rows are not finite next
   to heads that are (``foreign``: the others must stay finite, exact and bitwise tl's); the predicate's reason
   on what the kernel does not cover.
2. Timing (``triton.testing.do_bench`` medians, one run): GProj with the Gluon KV-major launch, GProj all-tl
   and cuDNN SDPA backward at the issue's shapes, each launch alone, and the KV-major launch alone with each
   config of ``VARIANTS`` (D=128 tiles retired first, slot release halved; D=64 tile rows and stages).
   Variants stop at ``--budget`` seconds from the start (logged as skipped) so that the call stays within its
   time.

Writes ``gluon_check.log`` and ``gluon_check.json`` to --out (default $OUT or ./gluon_out) and prints the tables
last, the variants' last. Needs an sm_90 GPU (except --compile-only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gproj_patch.backends import triton_bwd  # noqa: E402
from gproj_patch.backends.gluon_bwd import CONFIGS, KernelConfig  # noqa: E402
from gproj_patch.backends.gluon_entry import gluon_backward, gluon_supported_reason  # noqa: E402
from gproj_patch.backends.reference import reference_backward, reference_forward  # noqa: E402
from gproj_patch.backends.triton_bwd import gproj_backward  # noqa: E402
from tests.helpers import adversarial as adv  # noqa: E402
from tests.helpers.kernel_build import gluon_compile_report  # noqa: E402

LOG = []
T_START = time.time()
#: matmul products of one backward tile: the standard fused backward and the split GProj design
STANDARD_PRODUCTS, GPROJ_PRODUCTS = 5, 8
#: the paired slot release with the default's tile rows (4 slots): bitwise the default, checked on every case
PAIRED = {d: KernelConfig(c.block_m, 4, release_pairs=True) for d, c in CONFIGS.items()}
#: the default's tile rows and ring with each tile's products retired within it: the D=128 build whose wgmmas
#: ptxas keeps async (the default's are serialized, C7512; NOTES_gluon.md), bitwise the same products
RETIRED = {d: KernelConfig(c.block_m, c.num_stages, retire_tiles=True) for d, c in CONFIGS.items()}
#: KV-major configs timed against the default (``CONFIGS``): D=128 first the retired tiles (the budget reaches
#: it), the paired release, the same 4-slot ring releasing every tile (to tell the ring's depth from the
#: pairing apart), and 32-row tiles paired; D=64 the 64/128-row × 2/3-stage configs (NOTES_gluon.md item 5)
#: and both paired
VARIANTS = {128: (RETIRED[128], PAIRED[128], KernelConfig(64, 4), KernelConfig(32, 4, release_pairs=True)),
            64: (KernelConfig(64, 3), KernelConfig(128, 2), KernelConfig(128, 3), PAIRED[64],
                 KernelConfig(128, 4, release_pairs=True))}


def log(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


def name_of(cfg: KernelConfig) -> str:
    """``m64s4p``: tile rows, ring slots, p when slots are released in pairs, r when tiles are retired."""
    return f"m{cfg.block_m}s{cfg.num_stages}{'p' if cfg.release_pairs else ''}{'r' if cfg.retire_tiles else ''}"


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def check_case(name, seed):
    if name == "witness":
        inp, kw = adv.witness_rows4(), {}
    elif name in adv.ODD_CASES:
        inp, kw = adv.make_odd(name, seed)
    else:
        inp, kw, _ = adv.make_case(name, seed=seed)
    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
    out, lse = reference_forward(q, k, v, **kw)
    o, lse = out.to(q.dtype), lse.float()
    ref = reference_backward(q, k, v, do, **kw)
    reason = gluon_supported_reason(q, k, v, do=do, **kw)
    row = dict(case=name, reason=reason, gauge=name not in adv.NOT_GAUGE)
    if reason is not None:
        return row
    g1 = gluon_backward(do, q, k, v, o, lse, **kw)
    g2 = gluon_backward(do, q, k, v, o, lse, **kw)
    torch.cuda.synchronize()
    row["finite"] = all(bool(torch.isfinite(x).all()) for x in g1)
    row["deterministic"] = _same(g1, g2)
    row["paired_bitwise"] = _same(g1, gluon_backward(do, q, k, v, o, lse, _gluon_config=PAIRED[q.shape[-1]], **kw))
    for nm, a, r in zip("qkv", g1, ref):
        row[f"d{nm}"] = adv.rel(a, r) if row["finite"] else float("nan")
    tl = gproj_backward(do, q, k, v, o, lse, kv_major="tl", **kw)
    for nm, t, r in zip("qkv", tl, ref):
        row[f"tl_d{nm}"] = adv.rel(t, r)
    row["tl_bitwise"] = _same(g1, tl)
    if name == "witness":
        row["dq0"] = float(g1[0].abs().max())
    if name == "empty_rows_br":  # rows that see no key: exactly zero gradients
        shift = k.shape[2] - q.shape[2]
        row["empty_rows_zero"] = bool((g1[0][:, :, : -shift] == 0).all())
    return row


def check_foreign(head_dim, causal, cfg, seed):
    """One head's forward rows not finite (``adversarial.poison_head``): the other heads' gradients finite,
    within the target of fp64 and bitwise the tl KV-major launch's."""
    inp, kw = adv.foreign_nonfinite(head_dim, seed, causal=causal)
    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
    out, lse = reference_forward(q, k, v, **kw)
    o, lse = adv.poison_head(out.to(q.dtype), lse.float())
    kept = [adv.outside_poisoned(x) for x in gluon_backward(do, q, k, v, o, lse, _gluon_config=cfg, **kw)]
    tl = [adv.outside_poisoned(x) for x in gproj_backward(do, q, k, v, o, lse, kv_major="tl", **kw)]
    ref = reference_backward(q, k, v, do, **kw)
    finite = all(bool(torch.isfinite(x).all()) for x in kept)
    err = max(adv.rel(x, adv.outside_poisoned(r)) for x, r in zip(kept, ref)) if finite else float("nan")
    return dict(case=f"foreign_d{head_dim}_{'causal' if causal else 'dense'}_{name_of(cfg)}", finite=finite,
                err=err, tl_bitwise=_same(kept, tl))


def run_suite(seed, cases=None):
    rows = []
    triton_bwd._POISON_OUTPUTS = True
    try:
        for i, name in enumerate(adv.SUITE_CASES + list(adv.ODD_CASES)):
            if cases is not None and name not in cases:
                continue
            try:
                row = check_case(name, seed + i)
            except Exception as e:  # keep going: one failing case must not hide the others
                row = dict(case=name, error=f"{type(e).__name__}: {e}"[:500])
            rows.append(row)
            log(json.dumps(row, default=str))
        for d in sorted(CONFIGS):
            for causal in (True, False):
                for cfg in (CONFIGS[d], PAIRED[d]):
                    try:
                        row = check_foreign(d, causal, cfg, seed)
                    except Exception as e:
                        row = dict(case=f"foreign_d{d}_{causal}_{name_of(cfg)}", error=f"{type(e).__name__}: {e}"[:500])
                    rows.append(row)
                    log(json.dumps(row, default=str))
        for name in adv.UNCOVERED if cases is None else [c for c in adv.UNCOVERED if c in cases]:
            inp, kw, _ = adv.make_case(name, seed=seed)
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
        if r["case"].startswith("foreign"):
            if not (r["finite"] and r["tl_bitwise"] and r["err"] < adv.TARGET):
                bad.append((r["case"], "another head's non-finite rows reached this one, or not tl's bits"))
            continue
        if not (r["finite"] and r["deterministic"]):
            bad.append((r["case"], "not finite or not deterministic"))
        if not (r["tl_bitwise"] and r["paired_bitwise"]):
            bad.append((r["case"], f"bitwise: tl {r['tl_bitwise']}, paired release {r['paired_bitwise']}"))
        if r["case"] == "witness" and r["dq0"] != 0.0:
            bad.append((r["case"], f"witness dq0={r['dq0']}"))
        if r["gauge"] and max(r["dq"], r["dk"], r["dv"]) >= adv.TARGET:
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


def _bench(fn):
    import triton.testing as tt
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def alone(f, part):
    """``f``'s median time with only its ``part`` launch ("dq" or "dkdv") run (the other one's outputs then
    stale: a timing only)."""
    triton_bwd._RUN = (part,)
    try:
        return _bench(f)
    finally:
        triton_bwd._RUN = ("dq", "dkdv")


def _parts(res, tag, f, parts=("dq", "dkdv")):
    """Each launch alone, into ``res[f"{tag}_{part}"]``."""
    for part in parts:
        res[f"{tag}_{part}"] = alone(f, part)


def standard_flops(B, H, S, D, causal):
    return 2.5 * (4 * B * H * S * S * D) * (0.5 if causal else 1.0)


def time_shape(B, H, HKV, S, D, causal, budget):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    g = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda h: torch.randn(B, h, S, D, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)  # noqa
    q, k, v, do = mk(H), mk(HKV), mk(HKV), mk(H)
    krep, vrep = (x.repeat_interleave(H // HKV, dim=1) for x in (k, v)) if HKV != H else (k, v)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, krep, vrep, 0.0, causal)
    o, lse = out[0], out[1]
    res = {}
    fn = lambda cfg=None: gluon_backward(do, q, k, v, o, lse, causal=causal, _gluon_config=cfg)  # noqa: E731
    fn_tl = lambda: gproj_backward(do, q, k, v, o, lse, causal=causal, kv_major="tl")  # noqa: E731
    for tag, f in (("gluon", fn), ("tl", fn_tl)):
        f()
        res[tag] = _bench(f)
        _parts(res, tag, f)
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
    for cfg in VARIANTS.get(D, ()):  # the KV-major launch alone with each variant
        if time.time() - T_START > budget:
            res[f"var_{name_of(cfg)}"] = "skipped (budget)"
            continue
        try:
            fn(cfg)
            _parts(res, f"var_{name_of(cfg)}", lambda cfg=cfg: fn(cfg), parts=("dkdv",))
        except Exception as e:
            res[f"var_{name_of(cfg)}"] = f"failed: {e!r}"[:300]
    flops = standard_flops(B, H, S, D, causal)
    for tag in ("gluon", "tl", "cudnn"):
        res[f"tflops_std_{tag}"] = flops / (res[tag] * 1e-3) / 1e12
    for tag in ("gluon", "tl"):
        res[f"tflops_actual_{tag}"] = flops * GPROJ_PRODUCTS / STANDARD_PRODUCTS / (res[tag] * 1e-3) / 1e12
    res["kernels"] = dict(triton_bwd.LAST_KERNELS)
    return res


# ----------------------------------------------------------------------------------------------------------
# tables
# ----------------------------------------------------------------------------------------------------------

def _shape_name(shape):
    B, H, HKV, S, D, c = shape
    return f"{B},{H}({HKV}),{S},{D},{'T' if c else 'F'}"


def suite_table(rows):
    log("\n| case | dq | dk | dv | tl dq | tl dk | tl dv | det | = tl | = paired | note |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "dq" in r:
            note = f"dq0={r['dq0']}" if "dq0" in r else ("" if r["gauge"] else "not gauge")
            log(f"| {r['case']} | {r['dq']:.3%} | {r['dk']:.3%} | {r['dv']:.3%} | {r['tl_dq']:.3%} | "
                f"{r['tl_dk']:.3%} | {r['tl_dv']:.3%} | {r['deterministic']} | {r['tl_bitwise']} | "
                f"{r['paired_bitwise']} | {note} |")
        elif "err" in r:
            log(f"| {r['case']} | other heads: finite {r['finite']}, max err {r['err']:.3%} | | | | | | | "
                f"{r['tl_bitwise']} | | |")
        else:
            log(f"| {r['case']} | | | | | | | | | | {r.get('error') or r.get('reason')} |")


def timing_tables(timing):
    log("\n| B,Hq(Hkv),S,D,causal | gluon ms | dq | gluon dkdv | tl ms | tl dkdv | cuDNN ms | gluon/cuDNN | "
        "tl/cuDNN | TF/s std gluon/cuDNN | TF/s actual gluon |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in timing:
        if "error" in r:
            log(f"| {_shape_name(r['shape'])} | {r['error']} |")
            continue
        log(f"| {_shape_name(r['shape'])} | {r['gluon']:.3f} | {r['gluon_dq']:.3f} | {r['gluon_dkdv']:.3f} | "
            f"{r['tl']:.3f} | {r['tl_dkdv']:.3f} | {r['cudnn']:.3f} | ×{r['gluon'] / r['cudnn']:.2f} | "
            f"×{r['tl'] / r['cudnn']:.2f} | {r['tflops_std_gluon']:.0f}/{r['tflops_std_cudnn']:.0f} | "
            f"{r['tflops_actual_gluon']:.0f} |")
    # the decision table last: KV-major launch alone, ms (× the default config's)
    log("\n| KV launch ms (× default) | tl | default | variants |")
    log("|---|---|---|---|")
    for r in timing:
        if "error" in r:
            continue
        base = r["gluon_dkdv"]
        cells = []
        for cfg in VARIANTS.get(r["shape"][4], ()):
            t = r.get(f"var_{name_of(cfg)}_dkdv", r.get(f"var_{name_of(cfg)}"))
            cells.append(f"{name_of(cfg)} {t:.3f} (×{t / base:.3f})" if isinstance(t, float) else
                         f"{name_of(cfg)} {t}")
        default = name_of(CONFIGS[r["shape"][4]])
        log(f"| {_shape_name(r['shape'])} | {r['tl_dkdv']:.3f} (×{r['tl_dkdv'] / base:.3f}) | {default} "
            f"{base:.3f} | {'; '.join(cells)} |")


def compile_table():
    """Registers, spills and shared memory of every config (sm_90a, Triton's ptxas; no GPU needed)."""
    print("| D | rows | stages | release | regs | stack B | smem B |\n|---|---|---|---|---|---|---|")
    for r in gluon_compile_report(stages=(2, 3, 4), release_pairs=(False, True)):
        tail = r.get("error") or f"{r['regs']} | {r['stack']} | {r['smem']}"
        print(f"| {r['D']} | {r['block_m']} | {r['stages']} | {'pairs' if r.get('release_pairs') else 'each'} | "
              f"{tail} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--skip-suite", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--budget", type=float, default=150.0,
                    help="seconds from the start after which variant timings are skipped")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES (default: all)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a (no GPU) and report registers")
    ap.add_argument("--tag", default="", help="suffix of the log/json names (several calls in one run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gluon_out"))
    args = ap.parse_args()
    if args.compile_only:
        compile_table()
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
        log(f"[{time.time() - T_START:.0f} s] suite problems:", result["suite_bad"] or "none")
    timing = []
    if not args.skip_timing:
        picked = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
        for shp in picked:
            try:
                r = time_shape(*shp, budget=args.budget)
            except Exception as e:
                r = dict(error=f"{type(e).__name__}: {e}"[:500])
            r["shape"] = shp
            timing.append(r)
            log(f"[{time.time() - T_START:.0f} s]", json.dumps(r, default=str))
        result["timing"] = timing
    with open(os.path.join(args.out, f"gluon_check{args.tag}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    if not args.skip_suite:  # short tables last
        suite_table(result["suite"])
    if timing:
        timing_tables(timing)
    log(f"\n[{time.time() - T_START:.0f} s] suite problems: {result.get('suite_bad') or 'none'}")
    with open(os.path.join(args.out, f"gluon_check{args.tag}.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    if any("error" in r for r in result.get("suite", [])):
        return 2  # a case raised (e.g. a crashed launch)
    return 1 if result.get("suite_bad") else 0


if __name__ == "__main__":
    sys.exit(main())
