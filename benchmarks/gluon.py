"""The two Gluon (sm_90a) launches of the GProj backward: correctness against fp64 on the adversarial suite, then
timing of their default builds against the tl launches and their variants. Needs an sm_90 GPU.

    python -m benchmarks.gluon [--launch kv,dq] [--seed N] [--skip-suite] [--skip-timing] [--budget S]
        [--cases a,b] [--shapes 0,1] [--out DIR]

``kv``: the warp-specialized KV-major launch (dk, dv). Suite (fresh random inputs each run: the seed is
printed; outputs NaN-poisoned before every launch): key offsets to 512σ, sinks and P == 1 rows, causal in both
alignments, odd lengths with Sq ≠ Sk (and rows that see no key), GQA/MQA, D = 64 and 128, strided memory, the
four-key witness; dq/dk/dv against fp64, two launches bitwise, bitwise the tl KV-major launch's and the paired slot
release's (the same products in the same order); a head whose forward rows are not finite next to heads that are
(the others must stay finite, exact and bitwise tl's); the predicate's reason on what the launch does not cover.
Timing: the backward with the Gluon KV launch and all-tl, each launch alone, cuDNN's backward, and the KV launch
alone with each config of ``KV_VARIANTS``.

``dq``: the warp-specialized dQ-major launch. Suite: the same cases plus the massive sink, Sq not a multiple of 4
(``adversarial.DQ_ODD_CASES``) and a learnable sink at D = 64 and 128, each with the KV-major launch Gluon where it
takes the call (else tl): dq/dk/dv against fp64, two launches bitwise, the witness's dq exactly 0, rows without
keys exactly 0, dq against the tl dQ launch's (another summation order: close, not bitwise), the default build
bitwise the other ``overlap`` setting; the non-finite head. Timing: the backward with the tl and the Gluon dQ
launch (the Gluon KV launch in both), the dQ launch alone with each config of ``DQ_VARIANTS``, cuDNN's backward.

Variants stop ``--budget`` seconds after the start (logged as skipped), so that one call stays within its time.
Registers, spills and shared memory of the builds, without a GPU: ``python -m benchmarks.ptx --gluon``.
Writes ``gluon.json`` and ``gluon.log`` under ``--out`` (default ``$OUT/gluon``); the tables are printed last.
Exit status 2 when a case raised, 1 when a suite check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from benchmarks import common
from gproj_patch.backends.configs import GLUON_DQ_CONFIGS as DQ_CONFIGS, GLUON_KV_CONFIGS as KV_CONFIGS
from gproj_patch.backends.configs import DqConfig, KernelConfig
from gproj_patch.backends.gluon_entry import gluon_backward, gluon_supported_reason
from gproj_patch.backends.reference import reference_backward, reference_forward
from gproj_patch.backends.triton_bwd import gproj_backward
from tests.helpers import adversarial as adv

log = common.Log()
T_START = time.time()
#: the paired slot release with the default's tile rows (4 slots): bitwise the default, checked on every case
PAIRED = {d: KernelConfig(c.block_m, 4, release_pairs=True) for d, c in KV_CONFIGS.items()}
#: KV-major configs timed against the default: at D=128 the paired release, the same 4-slot ring releasing every
#: tile (to tell the ring's depth from the pairing) and 32-row tiles paired; at D=64 tile rows × stages and both
#: paired releases (``benchmarks.kernel --gluon-sweep`` times the retired-tiles builds)
KV_VARIANTS = {128: (PAIRED[128], KernelConfig(64, 4), KernelConfig(32, 4, release_pairs=True)),
               64: (KernelConfig(64, 3), KernelConfig(128, 2), KernelConfig(128, 3), PAIRED[64],
                    KernelConfig(128, 4, release_pairs=True))}
#: dQ-major configs timed against the default (the launch alone)
DQ_VARIANTS = {64: (DqConfig(64, 2), DqConfig(64, 2, overlap=True), DqConfig(64, 3, overlap=True)),
               128: (DqConfig(64, 2), DqConfig(64, 2, overlap=True), DqConfig(64, 3, overlap=True), DqConfig(64, 3))}
#: the default's tiles and ring with the other ``overlap`` setting: the same products in the same order (bitwise)
OTHER_OVERLAP = {d: DqConfig(c.block_n, c.num_stages, overlap=not c.overlap) for d, c in DQ_CONFIGS.items()}
KV_CASES = adv.SUITE_CASES + list(adv.ODD_CASES)
DQ_CASES = adv.SUITE_CASES + ["massive_sink", "offset32"] + list(adv.ODD_CASES) + list(adv.DQ_ODD_CASES) + [
    "learned_sink_d64", "learned_sink_d128"]


def kv_name(cfg: KernelConfig) -> str:
    """``m64s4pr``: tile rows, ring slots, p when slots are released in pairs, r when tiles are retired."""
    return f"m{cfg.block_m}s{cfg.num_stages}{'p' * cfg.release_pairs}{'r' * cfg.retire_tiles}"


def dq_name(cfg: DqConfig) -> str:
    """``n64s2o``: keys a tile, ring slots, o for the ``overlap`` build."""
    return f"n{cfg.block_n}s{cfg.num_stages}{'o' * cfg.overlap}"


def case_inputs(name, seed):
    """(q, k, v, do, mask kwargs, learnable sink or None) of a suite case."""
    if name == "witness":
        inp, kw = adv.witness_rows4(), {}
    elif name in adv.ODD_CASES or name in adv.DQ_ODD_CASES:
        inp, kw = adv.make_odd(name, seed)
    elif name.startswith("learned_sink"):
        d = int(name.rsplit("d", 1)[1])
        inp, _, _ = adv.make_case("offset128", seed=seed)
        inp = {n: torch.nn.functional.pad(x, (0, d - x.shape[-1])) for n, x in inp.items()}
        g = torch.Generator(device="cuda").manual_seed(seed)
        sink = 4.0 * torch.randn(inp["q"].shape[1], generator=g, device="cuda")
        return inp["q"], inp["k"], inp["v"], inp["do"], dict(causal=True), sink
    else:
        inp, kw, _ = adv.make_case(name, seed=seed)
    return inp["q"], inp["k"], inp["v"], inp["do"], kw, None


def exact_zeros(row, name, g, q, k) -> None:
    """The witness's largest |dq| (exactly 0) and, for rows that see no key, whether their dq is exactly 0."""
    if name == "witness":
        row["dq0"] = float(g[0].abs().max())
    if name == "empty_rows_br":
        row["empty_rows_zero"] = bool((g[0][:, :, : -(k.shape[2] - q.shape[2])] == 0).all())

# ---------------------------------------------------------------------------------------------- KV-major suite --


def kv_case(name, seed):
    q, k, v, do, kw, _ = case_inputs(name, seed)
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
    row["finite"] = common.finite(g1)
    row["deterministic"] = common.same(g1, g2)
    row["paired_bitwise"] = common.same(g1, gluon_backward(do, q, k, v, o, lse, _gluon_config=PAIRED[q.shape[-1]],
                                                           **kw))
    for nm, a, r in zip("qkv", g1, ref):
        row[f"d{nm}"] = common.rel(a, r) if row["finite"] else float("nan")
    tl = gproj_backward(do, q, k, v, o, lse, kv_major="tl", **kw)
    for nm, t, r in zip("qkv", tl, ref):
        row[f"tl_d{nm}"] = common.rel(t, r)
    row["tl_bitwise"] = common.same(g1, tl)
    exact_zeros(row, name, g1, q, k)
    return row


def foreign(head_dim, causal, seed, launch, cfg=None):
    """One head's forward rows not finite (``adversarial.poison_head``): the other heads' gradients finite, within
    the target of fp64 and (the KV-major launch) bitwise the tl launches'."""
    inp, kw = adv.foreign_nonfinite(head_dim, seed, causal=causal)
    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
    out, lse = reference_forward(q, k, v, **kw)
    o, lse = adv.poison_head(out.to(q.dtype), lse.float())
    options = dict(kv_major="gluon", _gluon_config=cfg) if launch == "kv" else dict(kv_major="gluon", dq_major="gluon")
    kept = [adv.outside_poisoned(x) for x in gproj_backward(do, q, k, v, o, lse, **options, **kw)]
    tl = [adv.outside_poisoned(x) for x in gproj_backward(do, q, k, v, o, lse, kv_major="tl", **kw)]
    ref = reference_backward(q, k, v, do, **kw)
    ok = common.finite(kept)
    err = max(common.rel(x, adv.outside_poisoned(r)) for x, r in zip(kept, ref)) if ok else float("nan")
    tag = f"foreign_{launch}_d{head_dim}_{'causal' if causal else 'dense'}" + (f"_{kv_name(cfg)}" if cfg else "")
    return dict(case=tag, finite=ok, err=err, tl_bitwise=common.same(kept, tl) if launch == "kv" else None)


def kv_suite(seed, cases=None):
    rows = []
    for i, name in enumerate(KV_CASES):
        if cases is None or name in cases:
            rows.append(guarded(name, lambda: kv_case(name, seed + i)))
    for d in sorted(KV_CONFIGS):
        for causal in (True, False):
            for cfg in (KV_CONFIGS[d], PAIRED[d]):
                rows.append(guarded(f"foreign_kv_d{d}_{causal}", lambda: foreign(d, causal, seed, "kv", cfg)))
    for name in adv.UNCOVERED if cases is None else [c for c in adv.UNCOVERED if c in cases]:
        inp, kw, _ = adv.make_case(name, seed=seed)
        reason = gluon_supported_reason(inp["q"], inp["k"], inp["v"], do=inp["do"], **kw)
        rows.append(dict(case=name, reason=reason, expect_reason=True))
        log(json.dumps(rows[-1]))
    return rows

# ---------------------------------------------------------------------------------------------- dQ-major suite --


def dq_case(name, seed):
    q, k, v, do, kw, sink = case_inputs(name, seed)
    skw = {} if sink is None else {"sink": sink}
    out, lse = reference_forward(q, k, v, **kw, **skw)
    o, lse = out.to(q.dtype), lse.float()
    ref = reference_backward(q, k, v, do, **kw, **skw)
    kv = "gluon" if gluon_supported_reason(q, k, v, do=do, **kw) is None else "tl"
    row = dict(case=name, kv_major=kv, gauge=name not in adv.NOT_GAUGE, shape=list(q.shape) + [k.shape[2]])
    run = lambda dq_major, cfg=None: gproj_backward(do, q, k, v, o, lse, dq_major=dq_major, kv_major=kv,  # noqa
                                                    _gluon_dq_config=cfg, **kw, **skw)
    try:
        g1 = run("gluon")
    except ValueError as e:  # the launch's predicate turned the case down
        row["reason"] = str(e)[:200]
        return row
    g2, tl = run("gluon"), run("tl")
    torch.cuda.synchronize()
    row["finite"] = common.finite(g1)
    row["deterministic"] = common.same(g1, g2)
    for nm, a, r in zip(("dq", "dk", "dv", "dsink"), g1, ref):
        row[nm] = common.rel(a, r) if row["finite"] else float("nan")
    for nm, a, r in zip(("dq", "dk", "dv"), tl, ref):
        row[f"tl_{nm}"] = common.rel(a, r)
    row["dq_vs_tl"] = common.rel(g1[0], tl[0])
    row["dkdv_bitwise_tl"] = common.same(g1[1:3], tl[1:3])
    row["overlap_bitwise"] = common.same(g1, run("gluon", OTHER_OVERLAP[q.shape[-1]]))
    exact_zeros(row, name, g1, q, k)
    return row


def dq_suite(seed, cases=None):
    rows = [guarded(name, lambda: dq_case(name, seed + i)) for i, name in enumerate(DQ_CASES)
            if cases is None or name in cases]
    for d in (64, 128):
        for causal in (True, False):
            rows.append(guarded(f"foreign_dq_d{d}_{causal}", lambda: foreign(d, causal, seed, "dq")))
    return rows


def guarded(name, fn) -> dict:
    """``fn()``'s row, or the exception it raised as the row's ``error``: one failing case must not hide the
    others."""
    try:
        row = fn()
    except Exception as e:
        row = dict(case=name, error=f"{type(e).__name__}: {e}"[:500])
    log(json.dumps(row, default=str))
    return row


def suite_bad(rows, launch) -> list:
    """(case, why) of every row that breaks a check of the module docstring."""
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
            if not (r["finite"] and r["err"] < common.TARGET and r["tl_bitwise"] is not False):
                bad.append((r["case"], "another head's non-finite rows reached this one, or not tl's bits"))
            continue
        if not (r["finite"] and r["deterministic"]):
            bad.append((r["case"], "not finite or not deterministic"))
        if launch == "kv" and not (r["tl_bitwise"] and r["paired_bitwise"]):
            bad.append((r["case"], f"bitwise: tl {r['tl_bitwise']}, paired release {r['paired_bitwise']}"))
        if launch == "dq" and not r["overlap_bitwise"]:
            bad.append((r["case"], "overlap on/off not bitwise equal"))
        if r.get("dq0", 0.0) != 0.0 or r.get("empty_rows_zero") is False:
            bad.append((r["case"], "an exactly-zero dq is not zero"))
        if r["gauge"] and max(r["dq"], r["dk"], r["dv"]) >= common.TARGET:
            bad.append((r["case"], "error over 0.5%"))
    return bad

# ------------------------------------------------------------------------------------------------------ timing --


def shape_tensors(shape):
    B, H, S, D, causal = shape[:5]
    q, k, v, do = common.make_inputs(B, H, S, D, seed=1, hkv=shape[5] if len(shape) > 5 else None)
    return (q, k, v, do) + common.saved_forward(q, k, v, causal)


def variants_alone(res, variants, fn, part, name, budget) -> None:
    """``res[f"var_{name(cfg)}"]``: the ``part`` launch alone with each variant config (or why not)."""
    for cfg in variants:
        key = f"var_{name(cfg)}"
        if time.time() - T_START > budget:
            res[key] = "skipped (budget)"
            continue
        try:
            fn(cfg)()
            res[key] = common.launch_alone_ms(fn(cfg), part)
        except Exception as e:
            res[key] = f"failed: {e!r}"[:300]


def kv_time(shape, budget):
    q, k, v, do, o, lse = shape_tensors(shape)
    causal, D = shape[4], shape[3]
    fn = lambda cfg=None: lambda: gproj_backward(do, q, k, v, o, lse, causal=causal, kv_major="gluon",  # noqa
                                                 _gluon_config=cfg)
    res = {}
    for tag, f in (("gluon", fn()), ("tl", lambda: gproj_backward(do, q, k, v, o, lse, causal=causal,
                                                                  kv_major="tl"))):
        f()
        res[tag] = common.bench(f)
        for part in ("dq", "dkdv"):
            res[f"{tag}_{part}"] = common.launch_alone_ms(f, part)
    cudnn = common.sdpa_backward_fn(q, k, v, do, causal)
    cudnn()
    res["cudnn"] = common.bench(cudnn)
    variants_alone(res, KV_VARIANTS.get(D, ()), fn, "dkdv", kv_name, budget)
    for tag in ("gluon", "tl", "cudnn"):
        res[f"tflops_{tag}"] = common.tflops(shape, res[tag], 5)
    return res


def dq_time(shape, budget):
    q, k, v, do, o, lse = shape_tensors(shape)
    causal, D = shape[4], shape[3]
    fn = lambda dq_major, cfg=None: lambda: gproj_backward(do, q, k, v, o, lse, causal=causal,  # noqa: E731
                                                           dq_major=dq_major, kv_major="gluon", _gluon_dq_config=cfg)
    res = {}
    for tag in ("tl", "gluon"):
        f = fn(tag)
        f()
        res[tag] = common.bench(f)
        res[f"{tag}_dq"] = common.launch_alone_ms(f, "dq")
    variants_alone(res, DQ_VARIANTS.get(D, ()), lambda cfg: fn("gluon", cfg), "dq", dq_name, budget)
    cudnn = common.sdpa_backward_fn(q, k, v, do, causal)
    cudnn()
    res["cudnn"] = common.bench(cudnn)
    return res

# ------------------------------------------------------------------------------------------------------ tables --


def kv_tables(rows, timing):
    log("\n| case (KV-major) | dq | dk | dv | tl dq | tl dk | tl dv | det | = tl | = paired | note |")
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
    if timing:
        log("\n| B·H·S·D | Gluon-KV bwd ms | dq launch | Gluon KV launch | all-tl bwd ms | tl KV launch | cuDNN ms | "
            "Gluon-KV/cuDNN | all-tl/cuDNN | TFLOP/s 5-product Gluon-KV / cuDNN |")
        log("|---|---|---|---|---|---|---|---|---|---|")
    for r in timing:
        if "error" in r:
            log(f"| {common.label(r['shape'])} | {r['error']} |")
            continue
        log(f"| {common.label(r['shape'])} | {r['gluon']:.3f} | {r['gluon_dq']:.3f} | {r['gluon_dkdv']:.3f} | "
            f"{r['tl']:.3f} | {r['tl_dkdv']:.3f} | {r['cudnn']:.3f} | ×{r['gluon'] / r['cudnn']:.3f} | "
            f"×{r['tl'] / r['cudnn']:.3f} | {r['tflops_gluon']:.0f} / {r['tflops_cudnn']:.0f} |")
    if timing:  # the decision table last: the KV-major launch alone, ms (× the default build's)
        log("\n| KV launch ms (× default) | tl | default | variants |\n|---|---|---|---|")
    for r in timing:
        if "error" in r:
            continue
        base, D = r["gluon_dkdv"], r["shape"][3]
        cells = [f"{kv_name(c)} {t:.3f} (×{t / base:.3f})" if isinstance(t := r.get(f"var_{kv_name(c)}"), float)
                 else f"{kv_name(c)} {t}" for c in KV_VARIANTS.get(D, ())]
        log(f"| {common.label(r['shape'])} | {r['tl_dkdv']:.3f} (×{r['tl_dkdv'] / base:.3f}) | "
            f"{kv_name(KV_CONFIGS[D])} {base:.3f} | {'; '.join(cells)} |")


def dq_tables(rows, timing):
    log("\n| case (dQ-major) | kv | dq | dk | dv | tl dq | dq vs tl | det | dk,dv = tl's | = other overlap | note |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "dq" in r:
            note = ("dq0=%g" % r["dq0"]) if "dq0" in r else ("" if r["gauge"] else "not gauge")
            if "dsink" in r:
                note += f" dsink {r['dsink']:.2e}"
            log(f"| {r['case']} | {r['kv_major']} | {r['dq']:.3%} | {r['dk']:.3%} | {r['dv']:.3%} | {r['tl_dq']:.3%} |"
                f" {r['dq_vs_tl']:.1e} | {r['deterministic']} | {r['dkdv_bitwise_tl']} | {r['overlap_bitwise']} |"
                f" {note} |")
        elif "err" in r:
            log(f"| {r['case']} | other heads finite {r['finite']}, max err {r['err']:.3%} |")
        else:
            log(f"| {r['case']} | {r.get('error') or r.get('reason')} |")
    if timing:
        log("\n| B·H·S·D | cuDNN bwd ms | bwd tl-dq ms | bwd Gluon-dq ms | ratio | dq launch tl | dq launch Gluon | "
            "variants (dq launch ms) |\n|---|---|---|---|---|---|---|---|")
    for r in timing:
        if "error" in r:
            log(f"| {common.label(r['shape'])} | {r['error']} |")
            continue
        var = "; ".join(f"{n[4:]} {t:.3f}" if isinstance(t, float) else f"{n[4:]} {t}"
                        for n, t in r.items() if n.startswith("var_"))
        log(f"| {common.label(r['shape'])} | {r['cudnn']:.3f} | {r['tl']:.3f} | {r['gluon']:.3f} | "
            f"×{r['gluon'] / r['tl']:.3f} | {r['tl_dq']:.3f} | {r['gluon_dq']:.3f} | {var} |")

# -------------------------------------------------------------------------------------------------------- main --


LAUNCHES = {"kv": (kv_suite, kv_time, kv_tables), "dq": (dq_suite, dq_time, dq_tables)}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launch", default="kv,dq", help="which launches: kv, dq or both")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--skip-suite", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--budget", type=float, default=200.0,
                    help="seconds from the start after which variant timings are skipped")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--shapes", default=None, help="indices into common.SHAPES (default: all)")
    ap.add_argument("--out", default=None, help="folder for gluon.json and gluon.log (default $OUT/gluon)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    out = common.out_dir("gluon", args.out)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") % 10 ** 8
    launches = [x for x in args.launch.split(",") if x]
    cases = None if args.cases is None else args.cases.split(",")
    result = dict(environment=common.environment(), seed=seed, kv_configs=KV_CONFIGS, dq_configs=DQ_CONFIGS)
    log(f"seed {seed}; {common.banner(result['environment'])}; launches {launches}")
    for launch in launches:
        suite, time_shape, _ = LAUNCHES[launch]
        if not args.skip_suite:
            with common.poisoned_outputs():
                rows = suite(seed, cases)
            result[f"{launch}_suite"], result[f"{launch}_bad"] = rows, suite_bad(rows, launch)
            log(f"[{time.time() - T_START:.0f} s] {launch} suite problems: {result[f'{launch}_bad'] or 'none'}")
        timing = []
        for shape in [] if args.skip_timing else common.parse_indices(args.shapes, common.SHAPES):
            try:
                r = time_shape(shape, args.budget)
            except Exception as e:
                r = dict(error=f"{type(e).__name__}: {e}"[:500])
            r["shape"] = list(shape)
            timing.append(r)
            log(f"[{time.time() - T_START:.0f} s] {launch}", json.dumps(r, default=str))
        result[f"{launch}_timing"] = timing
        common.save_json(os.path.join(out, "gluon.json"), result)
    for launch in launches:  # the short tables last
        LAUNCHES[launch][2](result.get(f"{launch}_suite", []), result[f"{launch}_timing"])
        bad = result.get(f"{launch}_bad", [])
        log(f"\n{launch}: {len(result.get(f'{launch}_suite', []))} suite rows, {len(bad)} bad"
            + "".join(f"\n  {c}: {w}" for c, w in bad))
    log.write(os.path.join(out, "gluon.log"))
    if any("error" in r for launch in launches for r in result.get(f"{launch}_suite", [])):
        return 2
    return 1 if any(result.get(f"{launch}_bad") for launch in launches) else 0


if __name__ == "__main__":
    raise SystemExit(main())
