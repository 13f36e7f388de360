"""One device call for the Gluon dQ-major launch (issue 21 item 1): correctness against the fp64 oracle, then
timing against the tl dQ-major launch, each launch alone and the whole backward, beside cuDNN's backward.

    PYTHONPATH=. python benchmarks/gluon_dq_check.py [--seed N] [--skip-suite] [--skip-timing] [--budget S]

1. Correctness (BF16/FP16, fresh random inputs: the seed is printed; outputs poisoned with NaN before every
   launch): the Gluon kernels' adversarial suite (``adversarial.SUITE_CASES`` and ``ODD_CASES``, the massive
   sink, ``DQ_ODD_CASES`` with Sq not a multiple of 4, a learnable sink at D = 64 and 128), each with the dQ-major
   launch Gluon and the KV-major launch Gluon where it takes the call (else tl): dq, dk, dv against fp64, two
   launches bitwise, the witness's dq exactly 0, rows that see no key exactly 0, and dq against the tl dQ-major
   launch's (a different summation order of the same products: close, not bitwise); a head whose forward rows
   are not finite next to heads that are.
2. Timing (``triton.testing.do_bench`` medians, one run) at the issue's shapes: the whole backward with the tl
   and with the Gluon dQ-major launch (the Gluon KV-major launch in both), the dQ-major launch alone with each
   ``VARIANTS`` config, cuDNN's backward.

Writes ``gluon_dq_check.log`` / ``.json`` to --out (default $OUT or ./gluon_dq_out); prints the tables last.
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

from gluon_check import _bench, _same, alone  # noqa: E402  (benchmarks/gluon_check.py: median, bitwise, one launch)
from gproj_patch.backends import triton_bwd  # noqa: E402
from gproj_patch.backends.gluon_dq import CONFIGS, DqConfig  # noqa: E402
from gproj_patch.backends.reference import reference_backward, reference_forward  # noqa: E402
from gproj_patch.backends.triton_bwd import gproj_backward  # noqa: E402
from tests.helpers import adversarial as adv  # noqa: E402

LOG = []
T_START = time.time()
#: dQ-major configs timed against the default (the launch alone)
VARIANTS = {64: (DqConfig(64, 2), DqConfig(64, 2, overlap=True), DqConfig(64, 3, overlap=True)),
            128: (DqConfig(64, 2), DqConfig(64, 2, overlap=True), DqConfig(64, 3, overlap=True),
                  DqConfig(64, 3))}
#: the default's tiles and ring with the other ``overlap`` setting: the same products in the same order (bitwise)
OTHER_OVERLAP = {d: DqConfig(c.block_n, c.num_stages, overlap=not c.overlap) for d, c in CONFIGS.items()}
#: (B, Hq, Hkv, S, D, causal): the issue's shapes
SHAPES = [(4, 16, 16, 4096, 64, True), (4, 16, 16, 4096, 128, True), (2, 16, 16, 8192, 128, False),
          (1, 16, 16, 16384, 128, True), (2, 32, 8, 8192, 128, True)]
CASES = adv.SUITE_CASES + ["massive_sink", "offset32"] + list(adv.ODD_CASES) + list(adv.DQ_ODD_CASES) + [
    "learned_sink_d64", "learned_sink_d128"]


def log(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


def _inputs(name, seed):
    """(q, k, v, do, mask kwargs, learnable sink or None)."""
    if name == "witness":
        inp, kw = adv.witness_rows4(), {}
    elif name in adv.ODD_CASES or name in adv.DQ_ODD_CASES:
        inp, kw = adv.make_odd(name, seed)
    elif name.startswith("learned_sink"):
        d = int(name.rsplit("d", 1)[1])
        inp, kw, _ = adv.make_case("offset128", seed=seed)
        inp = {n: torch.nn.functional.pad(x, (0, d - x.shape[-1])) for n, x in inp.items()}
        kw = dict(causal=True)
        g = torch.Generator(device="cuda").manual_seed(seed)
        sink = 4.0 * torch.randn(inp["q"].shape[1], generator=g, device="cuda")
        return inp["q"], inp["k"], inp["v"], inp["do"], kw, sink
    else:
        inp, kw, _ = adv.make_case(name, seed=seed)
    return inp["q"], inp["k"], inp["v"], inp["do"], kw, None


def _kv_kernel(q, k, v, do, kw):
    """The KV-major kernel paired with the Gluon dQ launch: Gluon where it takes the call."""
    from gproj_patch.backends.gluon_entry import gluon_supported_reason
    return "gluon" if gluon_supported_reason(q, k, v, do=do, **kw) is None else "tl"


def check_case(name, seed):
    q, k, v, do, kw, sink = _inputs(name, seed)
    skw = {} if sink is None else {"sink": sink}
    out, lse = reference_forward(q, k, v, **kw, **skw)
    o, lse = out.to(q.dtype), lse.float()
    ref = reference_backward(q, k, v, do, **kw, **skw)
    kv = _kv_kernel(q, k, v, do, kw)
    row = dict(case=name, kv_major=kv, gauge=name not in adv.NOT_GAUGE, shape=list(q.shape) + [k.shape[2]])
    run = lambda dq_major, cfg=None: gproj_backward(do, q, k, v, o, lse, dq_major=dq_major, kv_major=kv,  # noqa
                                                    _gluon_dq_config=cfg, **kw, **skw)
    try:
        g1 = run("gluon")
    except ValueError as e:
        row["reason"] = str(e)[:200]
        return row
    g2 = run("gluon")
    tl = run("tl")
    torch.cuda.synchronize()
    row["finite"] = all(bool(torch.isfinite(x).all()) for x in g1)
    row["deterministic"] = _same(g1, g2)
    for nm, a, r in zip(("dq", "dk", "dv", "dsink"), g1, ref):
        row[nm] = adv.rel(a, r) if row["finite"] else float("nan")
    for nm, a, r in zip(("dq", "dk", "dv"), tl, ref):
        row[f"tl_{nm}"] = adv.rel(a, r)
    row["dq_vs_tl"] = adv.rel(g1[0], tl[0])
    row["dkdv_bitwise_tl"] = _same(g1[1:3], tl[1:3])
    row["overlap_bitwise"] = _same(g1, run("gluon", OTHER_OVERLAP[q.shape[-1]]))
    if name == "witness":
        row["dq0"] = float(g1[0].abs().max())
    if name == "empty_rows_br":
        shift = k.shape[2] - q.shape[2]
        row["empty_rows_zero"] = bool((g1[0][:, :, : -shift] == 0).all())
    return row


def check_foreign(head_dim, causal, seed):
    inp, kw = adv.foreign_nonfinite(head_dim, seed, causal=causal)
    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
    out, lse = reference_forward(q, k, v, **kw)
    o, lse = adv.poison_head(out.to(q.dtype), lse.float())
    got = [adv.outside_poisoned(x) for x in gproj_backward(do, q, k, v, o, lse, dq_major="gluon",
                                                             kv_major="gluon", **kw)]
    ref = [adv.outside_poisoned(x) for x in reference_backward(q, k, v, do, **kw)]
    finite = all(bool(torch.isfinite(x).all()) for x in got)
    err = max(adv.rel(x, r) for x, r in zip(got, ref)) if finite else float("nan")
    return dict(case=f"foreign_d{head_dim}_{'causal' if causal else 'dense'}", finite=finite, err=err)


def run_suite(seed):
    rows = []
    triton_bwd._POISON_OUTPUTS = True
    try:
        for i, name in enumerate(CASES):
            try:
                row = check_case(name, seed + i)
            except Exception as e:  # keep going: one failing case must not hide the others
                row = dict(case=name, error=f"{type(e).__name__}: {e}"[:500])
            rows.append(row)
            log(json.dumps(row, default=str))
        for d in (64, 128):
            for causal in (True, False):
                try:
                    row = check_foreign(d, causal, seed)
                except Exception as e:
                    row = dict(case=f"foreign_d{d}_{causal}", error=f"{type(e).__name__}: {e}"[:500])
                rows.append(row)
                log(json.dumps(row, default=str))
    finally:
        triton_bwd._POISON_OUTPUTS = False
    return rows


def suite_bad(rows):
    bad = []
    for r in rows:
        if "error" in r or r.get("reason"):
            bad.append((r["case"], r.get("error") or r.get("reason")))
        elif r["case"].startswith("foreign"):
            if not (r["finite"] and r["err"] < adv.TARGET):
                bad.append((r["case"], "another head's non-finite rows reached this one"))
        else:
            if not (r["finite"] and r["deterministic"]):
                bad.append((r["case"], "not finite or not deterministic"))
            if r["gauge"] and max(r["dq"], r["dk"], r["dv"]) >= adv.TARGET:
                bad.append((r["case"], "error over 0.5%"))
            if not r["overlap_bitwise"]:
                bad.append((r["case"], "overlap on/off not bitwise equal"))
            if r.get("dq0", 0.0) != 0.0 or r.get("empty_rows_zero") is False:
                bad.append((r["case"], "an exactly-zero dq is not zero"))
    return bad


def time_shape(B, H, HKV, S, D, causal, budget):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    g = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda h: torch.randn(B, h, S, D, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
    q, k, v, do = mk(H), mk(HKV), mk(HKV), mk(H)
    krep, vrep = (x.repeat_interleave(H // HKV, dim=1) for x in (k, v)) if HKV != H else (k, v)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, krep, vrep, 0.0, causal)[:2]
    res = {}

    def fn(dq_major, cfg=None):
        return lambda: gproj_backward(do, q, k, v, o, lse, causal=causal, dq_major=dq_major, kv_major="gluon",
                                      _gluon_dq_config=cfg)
    for tag in ("tl", "gluon"):
        f = fn(tag)
        f()
        res[tag] = _bench(f)
        res[f"{tag}_dq"] = alone(f, "dq")
        res[f"{tag}_kernels"] = dict(triton_bwd.LAST_KERNELS)
    for cfg in VARIANTS[D]:
        name = f"n{cfg.block_n}s{cfg.num_stages}{'o' if cfg.overlap else ''}"
        if time.time() - T_START > budget:
            res[f"var_{name}"] = "skipped (budget)"
            continue
        try:
            fn("gluon", cfg)()
            res[f"var_{name}"] = alone(fn("gluon", cfg), "dq")
        except Exception as e:
            res[f"var_{name}"] = f"failed: {e!r}"[:300]
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, krep, vrep))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
    fc = lambda: torch.autograd.grad(y, (qq, kk, vv), do, retain_graph=True)  # noqa: E731
    fc()
    res["cudnn"] = _bench(fc)
    return res


def _shape_name(s):
    B, H, HKV, S, D, c = s
    return f"{B}·{H}({HKV})·{S}·{D} {'causal' if c else 'full'}"


def tables(rows, timing):
    log("\n| case | kv | dq | dk | dv | tl dq | dq vs tl | det | dk,dv = tl's | = other overlap | note |")
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
    log("\n| shape | cuDNN bwd ms | bwd tl-dq ms | bwd gluon-dq ms | ratio | dq launch tl | dq launch gluon | "
        "variants (dq launch ms) |")
    log("|---|---|---|---|---|---|---|---|")
    for r in timing:
        if "error" in r:
            log(f"| {_shape_name(r['shape'])} | {r['error']} |")
            continue
        var = "; ".join(f"{n[4:]} {t:.3f}" if isinstance(t, float) else f"{n[4:]} {t}"
                        for n, t in r.items() if n.startswith("var_"))
        log(f"| {_shape_name(r['shape'])} | {r['cudnn']:.3f} | {r['tl']:.3f} | {r['gluon']:.3f} | "
            f"×{r['gluon'] / r['tl']:.3f} | {r['tl_dq']:.3f} | {r['gluon_dq']:.3f} | {var} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--skip-suite", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds after which variants are skipped")
    ap.add_argument("--out", default=os.environ.get("OUT", "gluon_dq_out"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little") % 10**8
    log(f"seed {seed}; torch {torch.__version__}; {torch.cuda.get_device_name()}; configs {CONFIGS}")
    rows = [] if a.skip_suite else run_suite(seed)
    timing = []
    if not a.skip_timing:
        for shape in SHAPES:
            try:
                res = time_shape(*shape, budget=a.budget)
            except Exception as e:
                res = dict(error=f"{type(e).__name__}: {e}"[:300])
            res["shape"] = shape
            timing.append(res)
            log(json.dumps(res, default=str))
    tables(rows, timing)
    bad = suite_bad(rows)
    log(f"\nsuite: {len(rows)} rows, {len(bad)} bad" + "".join(f"\n  {c}: {w}" for c, w in bad))
    with open(os.path.join(a.out, "gluon_dq_check.json"), "w") as fh:
        json.dump(dict(seed=seed, rows=rows, timing=timing, bad=bad), fh, default=str, indent=1)
    with open(os.path.join(a.out, "gluon_dq_check.log"), "w") as fh:
        fh.write("\n".join(LOG) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
