"""The GProj backward kernels alone, on saved tensors (no hook): correctness against fp64, time per launch
against cuDNN / flash / FA4 backwards and the FP32 tier, block-config sweeps, and the Nsight Compute target.

    python -m benchmarks.kernel [--skip-suite] [--skip-timing] [--skip-fp32-tier] [--shapes 0,1] [--configs JSON]
    python -m benchmarks.kernel --sweep 32,256 [--fp32-sweep 64,128] [--gluon-sweep 64,128] [--kinds dq,dkdv]
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --csv --page raw \\
        python -m benchmarks.kernel --ncu > $OUT/ncu_raw.csv
    python -m benchmarks.kernel --summarize $OUT/ncu_raw.csv      # anywhere: one Markdown row per kernel
    python -m benchmarks.kernel --smoke                            # CPU: tiny cases through Triton's interpreter

1. Suite (``tests/helpers/adversarial.SUITE``: key offsets to 512σ, sinks, P == 1 rows, causal both alignments,
   GQA, window, varlen, D 96/128/256, strided, softcap, the four-key witness; BF16, O the fp64 forward's output
   rounded, so the forward channel is in every row): the tl kernel with each dk form and uncorrected, outputs
   NaN-poisoned before every launch, dq/dk/dv against fp64, two launches compared bitwise.
2. Timing (``common.bench`` medians) at ``common.SHAPES``: the backward as the plan routes it (``kv``/``dq``
   launch Gluon or tl), both launches tl, the two dk forms, uncorrected; each launch alone; cuDNN's, flash's and
   FA4's backward (FA4 where importable: ``external_gpu.sh timing`` installs it); FP32 efficient attention
   forward+backward, and at D=64 and 128 the FP32 tier two ways (the kernel on fp32 copies, the chunked GEMMs).
3. ``--sweep`` / ``--fp32-sweep``: greedy block-config sweeps of the tl launches (the best dQ-major config with
   the current KV-major one, then the best KV-major one with it), the whole backward timed per candidate;
   ``--gluon-sweep``: the KV-major launch alone, tl against the Gluon builds of ``GLUON_SWEEP``, causal and dense,
   each Gluon build's dk, dv checked bitwise against tl's. Printed last in the form of ``configs.TL_CONFIGS``.
4. ``--ncu``: inside the profiled range one backward per launch pairing (KV-major tl and Gluon with the tl dQ
   launch; the Gluon dQ launch plain and ``overlap`` with the routed KV launch) and one cuDNN backward at
   ``NCU_SHAPE``; ``--summarize`` turns ncu's raw CSV into duration, SM and tensor-pipe throughput, occupancy,
   registers and the top stall reasons per kernel.

Writes ``kernel.json``, ``kernel.log`` and ``kernel.md`` (the tables) or ``sweep.json`` under ``--out`` (default
``$OUT/kernel``); the tables are printed last.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import time
import traceback

import torch

from benchmarks import common
from gproj_patch.backends import configs, triton_bwd
from gproj_patch.backends.configs import KernelConfig
from gproj_patch.backends.reference import reference_backward, reference_forward
from gproj_patch.backends.triton_bwd import gproj_backward
from tests.helpers import adversarial
from tests.helpers.numerics import kernel_inputs

log = common.Log()
#: indices into SHAPES where the FP32 tier is timed too (D = 64 and 128, causal)
FP32_SHAPES = (0, 1)
#: CPU: the witness and one small offset case through the interpreter, one tiny shape timed by wall clock
SMOKE_SHAPES = [(1, 2, 16, 16, True)]
#: what the suite table says of a case outside the gauge regime
NOTES = {"sharp_p1": " (P==1 rows: beyond fp32)", "query_offset": " (not a gauge symmetry)",
         "softcap": " (softcap 5: no exact gauge)"}

# ------------------------------------------------------------------------------------------------------ suite --


def suite_cases(smoke: bool):
    """(name, inputs dict, mask kwargs, gauge) of the suite (``--smoke``: two small FP16 cases on the CPU)."""
    if smoke:
        q, k, v, do = kernel_inputs(1, 2, 2, 16, 16, 16, offset=64.0, seed=1)
        return [("offset64_tiny", dict(q=q, k=k, v=v, do=do), dict(causal=True), True),
                ("witness", adversarial.witness("cpu", torch.float16), {}, True)]
    return [(name, *adversarial.make_case(name, "cuda", torch.bfloat16)) for name in adversarial.SUITE]


def run_suite(smoke: bool):
    rows = []
    with common.poisoned_outputs():
        for name, inp, kw, gauge in suite_cases(smoke):
            q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
            out, lse = reference_forward(q, k, v, **kw)
            o, lse = out.to(q.dtype), lse.float()  # the saved low-precision output (forward channel included)
            ref = reference_backward(q, k, v, do, **kw)
            row = dict(case=name, gauge=gauge)
            for tag, extra in (("two", dict(dk_form="two_product")), ("fused", dict(dk_form="fused")),
                               ("unc", dict(correct=False))):
                g1 = gproj_backward(do, q, k, v, o, lse, **kw, **extra)
                common.sync(q.device)
                ok = common.finite(g1)
                for nm, a, b in zip("qkv", g1, ref):
                    row[f"{tag}_d{nm}"] = common.rel(a, b) if ok else float("nan")
                if tag == "two":
                    row["deterministic"] = common.same(g1, gproj_backward(do, q, k, v, o, lse, **kw, **extra))
                    row["finite"] = ok
                if name == "witness":
                    row[f"{tag}_dq0"] = float(g1[0][0, 0, 0, 0])
            rows.append(row)
            log(json.dumps(row))
    return rows


def suite_bad(rows) -> list:
    """(case, why) of each gauge case over the 0.5% target (either dk form), not finite or not deterministic, and
    a witness whose dq is not exactly 0."""
    bad = []
    for r in rows:
        if not (r["finite"] and r["deterministic"]):
            bad.append((r["case"], "not finite or not deterministic"))
        if r["case"] == "witness":
            if r["two_dq0"] != 0.0 or r["fused_dq0"] != 0.0:
                bad.append((r["case"], f"witness dq0 {r['two_dq0']} / {r['fused_dq0']}"))
        elif r["gauge"] and max(r[f"{t}_d{n}"] for t in ("two", "fused") for n in "qkv") >= common.TARGET:
            bad.append((r["case"], "error over 0.5%"))
    return bad

# ----------------------------------------------------------------------------------------------------- timing --


def _fa4_bwd(q, k, v, do, causal):
    """FA4's backward (``flash_attn.cute``'s CuTe kernels, B·S·H·D)."""
    iface, _ = common.fa4_interface()
    qq, kk, vv = (x.transpose(1, 2).contiguous().detach().requires_grad_() for x in (q, k, v))
    y = iface.flash_attn_func(qq, kk, vv, causal=causal)
    y = y[0] if isinstance(y, tuple) else y
    dot = do.transpose(1, 2).contiguous()
    return lambda: torch.autograd.grad(y, (qq, kk, vv), dot, retain_graph=True)


def _fp32_efficient(q, k, v, do, causal):
    """FP32 efficient attention forward+backward (PyTorch's fused FP32 path, no projection: for scale)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qf, kf, vf = (x.float().detach().requires_grad_() for x in (q, k, v))
    dof = do.float()

    def fn():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            y = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
        return torch.autograd.grad(y, (qf, kf, vf), dof)
    return fn


def timed(res: dict, tag: str, make, device) -> None:
    """``res[tag]`` = median ms of the closure ``make()`` returns (after one untimed call), or nan with the error
    logged: a backend that cannot run here is a missing cell, not a failed run."""
    try:
        fn = make()
        fn()
        res[tag] = common.bench(fn, device)
    except Exception as e:
        res[tag] = float("nan")
        log(f"{tag} not timed: {type(e).__name__}: {str(e)[:200]}")


def fp32_tier_ms(q, k, v, do, o, lse, causal, device) -> dict:
    """The FP32 tier's backward two ways (the kernel on fp32 copies, as the router runs it, copies included; the
    chunked fp32 GEMMs), and the kernel form's error against fp64 on the first batch entry and head."""
    from gproj_patch.backends.fp32_tier import fp32_backward
    res = {}
    forms = {"fp32_kernel_bwd": lambda: gproj_backward(*(x.float() for x in (do, q, k, v, o)), lse, causal=causal),
             "fp32_chunked_bwd": lambda: fp32_backward(q, k, v, do, causal=causal)}
    for tag, fn in forms.items():
        try:
            fn()  # compiles the kernel form: not timed
            common.sync(device)
            t0 = time.time()
            fn()
            common.sync(device)
            # a form slower than 5 s a call is timed once (do_bench would take minutes)
            res[tag] = common.bench(fn, device) if time.time() - t0 < 5.0 else (time.time() - t0) * 1e3
        except Exception as e:
            res[tag] = float("nan")
            log(f"{tag} failed: {type(e).__name__}: {str(e)[:300]}")
    sl = lambda x: x[:1, :1]  # noqa: E731  (k, v: the KV head of query head 0)
    ref = reference_backward(sl(q), sl(k), sl(v), sl(do), causal=causal)
    got = gproj_backward(*(sl(x).float() for x in (do, q, k, v, o)), sl(lse), causal=causal)
    res["fp32_kernel_err"] = [common.rel(a, b) for a, b in zip(got, ref)]
    return res


def time_shape(shape, *, device="cuda", fp32_tier=True) -> dict:
    B, H, S, D, causal = shape[:5]
    hkv = shape[5] if len(shape) > 5 else None
    if device == "cuda":
        q, k, v, do = common.make_inputs(B, H, S, D, hkv=hkv)
    else:
        q, k, v, do = kernel_inputs(B, H, hkv or H, S, S, D)
    o, lse = common.saved_forward(q, k, v, causal)
    kv, dq = common.routed_launches(q, k, v, do)
    res = {"kv_major": kv, "dq_major": dq}
    runs = {"gproj": dict(kv_major=kv, dq_major=dq), "gproj_tl": dict(kv_major="tl", dq_major="tl"),
            "gproj_two": dict(dk_form="two_product"), "gproj_fused": dict(dk_form="fused"),
            "uncorrected": dict(correct=False)}
    for tag, extra in runs.items():
        fn = lambda extra=extra: gproj_backward(do, q, k, v, o, lse, causal=causal, **extra)  # noqa: E731
        fn()
        res[tag] = common.bench(fn, device)
        if tag in ("gproj", "gproj_tl", "uncorrected"):  # each launch alone (results invalid, timing only)
            for part in ("dq", "dkdv"):
                res[f"{tag}_{part}"] = common.launch_alone_ms(fn, part, device)
    timed(res, "cudnn", lambda: common.sdpa_backward_fn(q, k, v, do, causal, "cudnn"), device)
    timed(res, "flash", lambda: common.sdpa_backward_fn(q, k, v, do, causal, "flash"), device)
    timed(res, "fa4", lambda: _fa4_bwd(q, k, v, do, causal), device)
    timed(res, "fp32_efficient_fwdbwd", lambda: _fp32_efficient(q, k, v, do, causal), device)
    if fp32_tier:
        res.update(fp32_tier_ms(q, k, v, do, o, lse, causal, device))
    return res

# ---------------------------------------------------------------------------------------------------- tables --


def _pct(x):
    return "nan" if x != x else f"{100 * x:.3g}%"


def _shape(t):
    return common.label(t["shape"])


def markdown(r: dict) -> str:
    """The suite's errors, the backward times and ratios, each launch alone, the FP32 tier."""
    lines = [f"Kernel run — {common.banner(r['environment'])}", ""]
    if r["suite"]:
        lines += ["‖x − ref‖/‖ref‖ vs fp64 (BF16 inputs and saved O; FP16 under --smoke). two = two-product dk, "
                  "fused = fused dk, unc = the same kernel uncorrected.", "",
                  "| case | two dq | two dk | two dv | fused dq | fused dk | unc dq | unc dk | det |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for s in r["suite"]:
            if s["case"] == "witness":
                lines.append(f"| witness dq[0] (exact 0) | {s['two_dq0']:g} | | | {s['fused_dq0']:g} | | "
                             f"{s['unc_dq0']:g} | | {s['deterministic']} |")
                continue
            note = "" if s["gauge"] else NOTES.get(s["case"], " (not gauge)")
            lines.append(f"| {s['case']}{note} | {_pct(s['two_dq'])} | {_pct(s['two_dk'])} | {_pct(s['two_dv'])} | "
                         f"{_pct(s['fused_dq'])} | {_pct(s['fused_dk'])} | {_pct(s['unc_dq'])} | "
                         f"{_pct(s['unc_dk'])} | {s['deterministic']} |")
        lines += ["", f"suite problems: {r['suite_bad'] or 'none'}", ""]
    if r["timings"]:
        lines += [f"Configs (BLOCK_M, BLOCK_N, warps, stages): {json.dumps(r['configs'])}", "",
                  "Backward, median ms (`triton.testing.do_bench`); routed = the plan's launches (KV/dQ). TFLOP/s on "
                  "5 products for every column (GProj has 8: its own rate is 8/5 of that).", "",
                  "| B·H·S·D | routed (KV/dQ) | all tl | two-product dk | uncorrected | cuDNN | flash | FA4 | "
                  "routed/cuDNN | routed/FA4 | routed/unc | TFLOP/s routed / cuDNN / FA4 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for t in r["timings"]:
            f = lambda k: t.get(k, float("nan"))  # noqa: E731
            g = f("gproj")
            tf = " / ".join(f"{common.tflops(t['shape'], f(k)):.0f}" for k in ("gproj", "cudnn", "fa4"))
            lines.append(f"| {_shape(t)} | {g:.3f} ({t.get('kv_major')}/{t.get('dq_major')}) | {f('gproj_tl'):.3f} | "
                         f"{f('gproj_two'):.3f} | {f('uncorrected'):.3f} | {f('cudnn'):.3f} | {f('flash'):.3f} | "
                         f"{f('fa4'):.3f} | ×{g / f('cudnn'):.3f} | ×{g / f('fa4'):.3f} | "
                         f"×{g / f('uncorrected'):.3f} | {tf} |")
        lines += ["", "Each launch alone (ms): dQ-major / KV-major.", "",
                  "| B·H·S·D | routed dq | routed dkdv | tl dq | tl dkdv | uncorrected dq | uncorrected dkdv |",
                  "|---|---|---|---|---|---|---|"]
        for t in r["timings"]:
            lines.append(f"| {_shape(t)} | " + " | ".join(f"{t.get(f'{a}_{p}', float('nan')):.3f}"
                                                          for a in ("gproj", "gproj_tl", "uncorrected")
                                                          for p in ("dq", "dkdv")) + " |")
        fp32 = [t for t in r["timings"] if "fp32_kernel_bwd" in t]
        if fp32:
            lines += ["", "FP32 tier backward (ms): the kernel on fp32 copies vs the chunked fp32 GEMMs; FP32 "
                      "efficient attention fwd+bwd for scale; the kernel form's error vs fp64 (dq, dk, dv; one head).",
                      "",
                      "| B·H·S·D | kernel form | chunked | chunked / kernel | FP32 eff fwd+bwd | error |",
                      "|---|---|---|---|---|---|"]
            for t in fp32:
                err = ", ".join(f"{e:.1e}" for e in t.get("fp32_kernel_err", []))
                lines.append(f"| {_shape(t)} | {t['fp32_kernel_bwd']:.2f} | {t['fp32_chunked_bwd']:.2f} | "
                             f"×{t['fp32_chunked_bwd'] / t['fp32_kernel_bwd']:.1f} | "
                             f"{t.get('fp32_efficient_fwdbwd', float('nan')):.2f} | {err} |")
    return "\n".join(lines) + "\n"

# ----------------------------------------------------------------------------------------------------- sweeps --

#: candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim; the shipped config is always tried
SWEEP = {
    32: {"dq": [(64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3)],
         "dkdv": [(64, 128, 4, 3), (128, 64, 8, 3), (32, 128, 4, 3), (128, 128, 8, 3)]},
    64: {"dq": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2), (32, 64, 4, 3),
                (128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 4), (64, 32, 4, 4)],
         "dkdv": [(32, 128, 4, 3), (32, 128, 4, 2), (64, 128, 8, 3), (32, 64, 4, 3), (16, 128, 4, 3),
                  (64, 64, 4, 3)]},
    128: {"dq": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (32, 64, 4, 2), (128, 64, 8, 2), (64, 64, 8, 2),
                 (128, 32, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3), (64, 128, 8, 2)],
          "dkdv": [(32, 64, 4, 3), (32, 64, 4, 4), (64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 4, 2), (32, 128, 8, 2),
                   (64, 64, 4, 3), (16, 64, 4, 2), (64, 128, 8, 3)]},
    256: {"dq": [(64, 32, 4, 1), (32, 32, 4, 1), (64, 64, 8, 1), (32, 64, 4, 1)],
          "dkdv": [(32, 32, 4, 1), (16, 64, 4, 1), (32, 64, 4, 1), (64, 32, 8, 1)]},
}
SWEEP_FP32 = {
    64: {"dq": [(64, 32, 4, 2), (32, 64, 4, 2), (16, 32, 4, 2), (64, 64, 8, 2)],
         "dkdv": [(32, 64, 4, 2), (64, 32, 4, 2), (16, 64, 4, 2), (64, 64, 8, 2)]},
    128: {"dq": [(32, 32, 4, 2), (16, 16, 4, 2), (32, 16, 4, 2), (16, 32, 4, 1)],
          "dkdv": [(32, 32, 4, 2), (32, 16, 4, 2), (16, 16, 4, 2), (16, 32, 4, 1)]},
}
#: KV-major Gluon builds timed against the tl launch: the non-retired m64s2 (ptxas serializes its wgmmas) and the
#: retired-tiles builds whose wgmmas stay async, at D=64; the shipped D=128 build against deeper rings and the
#: paired slot release (NOTES.md, "The Gluon launches")
GLUON_SWEEP = {64: (KernelConfig(64, 2), KernelConfig(64, 2, retire_tiles=True), KernelConfig(64, 3, retire_tiles=True),
                    KernelConfig(128, 3, retire_tiles=True)),
               128: (KernelConfig(64, 2, retire_tiles=True), KernelConfig(64, 3, retire_tiles=True),
                     KernelConfig(64, 4, retire_tiles=True),
                     KernelConfig(64, 4, release_pairs=True, retire_tiles=True))}
#: the sweeps' shapes: (B, H, S) per padded head dim, causal; FP32 smaller (its products are ~4× slower)
SWEEP_SHAPE = {32: (4, 16, 4096), 64: (4, 16, 4096), 128: (4, 16, 4096), 256: (2, 16, 4096)}
SWEEP_SHAPE_FP32 = {64: (1, 16, 4096), 128: (1, 16, 4096)}


def gluon_name(c: KernelConfig) -> str:
    """``m64s4pr``: tile rows, ring slots, p when slots are released in pairs, r when tiles are retired."""
    return f"m{c.block_m}s{c.num_stages}{'p' * c.release_pairs}{'r' * c.retire_tiles}"


def sweep(D, *, fp32=False, deadline=float("inf"), causal=True, kinds=("dq", "dkdv")):
    """The greedy sweep at head dim D; returns {"dq": cfg, "dkdv": cfg, "times": {...}}."""
    B, H, S = (SWEEP_SHAPE_FP32 if fp32 else SWEEP_SHAPE)[D]
    q, k, v, do = common.make_inputs(B, H, S, D)
    o, lse = common.saved_forward(q, k, v, causal)
    if fp32:
        q, k, v, do, o = (x.float() for x in (q, k, v, do, o))
    table = configs.TL_CONFIGS_FP32 if fp32 else configs.TL_CONFIGS
    best = {"dq": table["dq"][D], "dkdv": table["dkdv"][D]}
    times = {}
    for which in kinds:
        cand = {}
        for c in [best[which]] + [c for c in (SWEEP_FP32 if fp32 else SWEEP)[D][which] if c != best[which]]:
            if time.time() > deadline:
                log(f"sweep D={D} fp32={fp32} {which} {c}: skipped (time budget)")
                continue
            cfg = dict(best, **{which: c})
            try:
                fn = lambda cfg=cfg: gproj_backward(do, q, k, v, o, lse, causal=causal, _config=cfg)  # noqa: E731
                fn()
                common.sync()
                cand[c] = common.bench(fn)
                log(f"sweep D={D} fp32={fp32} {which} {c}: {cand[c]:.3f} ms  regs/spills {triton_bwd.LAST_KERNELS}")
            except Exception as e:  # shared memory, registers: a candidate that cannot run is skipped
                log(f"sweep D={D} fp32={fp32} {which} {c} failed: {type(e).__name__}: {str(e)[:200]}")
        if cand:
            best[which] = min(cand, key=cand.get)
        times[which] = {str(c): t for c, t in cand.items()}
    log(f"sweep D={D} fp32={fp32} chosen {best}")
    return dict(best, times=times)


def gluon_sweep(D, *, deadline=float("inf")):
    """The KV-major launch alone at head dim D (``SWEEP_SHAPE[D]``, causal and dense) in tl and in each
    ``GLUON_SWEEP[D]`` build; {mask: {name: ms, name_bitwise: dk, dv bitwise tl's}}."""
    B, H, S = SWEEP_SHAPE[D]
    q, k, v, do = common.make_inputs(B, H, S, D)
    out = {}
    for causal in (True, False):
        o, lse = common.saved_forward(q, k, v, causal)
        times, tl = {}, None
        for name, cfg in [("tl", None)] + [(gluon_name(c), c) for c in GLUON_SWEEP[D]]:
            if time.time() > deadline:
                log(f"gluon sweep D={D} causal={causal} {name}: skipped (time budget)")
                continue
            kw = dict(kv_major="tl") if cfg is None else dict(kv_major="gluon", _gluon_config=cfg)
            fn = lambda kw=kw: gproj_backward(do, q, k, v, o, lse, causal=causal, **kw)  # noqa: E731
            try:
                dk_dv = fn()[1:3]
                if cfg is None:
                    tl = dk_dv
                elif tl is not None:
                    times[f"{name}_bitwise"] = common.same(dk_dv, tl)
                times[name] = common.launch_alone_ms(fn, "dkdv")
                log(f"gluon sweep D={D} causal={causal} {name}: KV launch {times[name]:.3f} ms")
            except Exception as e:
                log(f"gluon sweep D={D} causal={causal} {name} failed: {type(e).__name__}: {str(e)[:200]}")
        out["causal" if causal else "dense"] = times
    return out


def run_sweeps(args, out: str) -> None:
    end = time.time() + args.deadline
    result = {"environment": common.environment()}
    kinds = tuple(args.kinds.split(","))
    for D in (int(d) for d in args.sweep.split(",") if d):
        result[f"low_{D}"] = sweep(D, deadline=end, kinds=kinds)
    for D in (int(d) for d in args.fp32_sweep.split(",") if d):
        result[f"fp32_{D}"] = sweep(D, fp32=True, deadline=end, kinds=kinds)
    for D in (int(d) for d in args.gluon_sweep.split(",") if d):
        result[f"gluon_{D}"] = gluon_sweep(D, deadline=end)
    common.save_json(os.path.join(out, "sweep.json"), result)
    log.write(os.path.join(out, "sweep.log"))
    for key, r in result.items():
        if isinstance(r, dict) and "dq" in r:
            log(f"chosen {key}: dq {r['dq']} dkdv {r['dkdv']}")
        for mask, times in (r.items() if key.startswith("gluon_") else ()):
            tl = times.get("tl", float("nan"))
            log(f"{key} {mask} KV launch ms (× tl): " + "  ".join(
                f"{n} {t:.3f} (×{t / tl:.3f}{'' if times.get(n + '_bitwise', True) else ', NOT BITWISE'})"
                for n, t in times.items() if not n.endswith("_bitwise")))
    log.write(os.path.join(out, "sweep.log"))

# ------------------------------------------------------------------------------------------------ Nsight Compute --

NCU_SHAPE = (2, 16, 8192, 128, False)  # B, H, S, D, causal: the issue shape at full attention
STALL_MARK = "issue_stalled_"  # smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio
STALL_SUFFIX = "_per_issue_active.ratio"
NCU_COLUMNS = {  # ncu raw metric -> short name
    "gpu__time_duration.sum": "ms",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM %",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "launch__registers_per_thread": "regs",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles/issue",
}


def ncu_launches() -> None:
    """Compile and warm up outside the profiled range, then inside it: the KV-major launch tl and Gluon (where its
    predicate allows) with the tl dQ launch; the Gluon dQ launch in its plain and ``overlap`` builds (where its
    predicate allows) with the routed KV launch; one cuDNN backward. Kernel names tell the launches apart; the two
    Gluon dQ builds share a name and are profiled in that order (plain, then overlap)."""
    from gproj_patch.backends.gluon_bwd import kv_major_reason
    from gproj_patch.backends.configs import DqConfig, gluon_dq_config
    from gproj_patch.backends.gluon_dq import dq_major_reason
    B, H, S, D, causal = NCU_SHAPE
    q, k, v, do = common.make_inputs(B, H, S, D)
    o, lse = common.saved_forward(q, k, v, causal)
    cudnn = common.sdpa_backward_fn(q, k, v, do, causal, "cudnn")
    kv_kernels = ("tl",) if kv_major_reason(q, k, v, do=do) else ("tl", "gluon")
    dq_builds = []
    if dq_major_reason(q, k, v, do=do) is None:
        cfg = gluon_dq_config(D)
        dq_builds = [DqConfig(cfg.block_n, cfg.num_stages, overlap=False),
                     DqConfig(cfg.block_n, cfg.num_stages, overlap=True)]

    def all_launches():
        for kernel in kv_kernels:
            gproj_backward(do, q, k, v, o, lse, causal=causal, kv_major=kernel, dq_major="tl")
        for cfg in dq_builds:
            gproj_backward(do, q, k, v, o, lse, causal=causal, kv_major=kv_kernels[-1], dq_major="gluon",
                           _gluon_dq_config=cfg)
        cudnn()
    all_launches()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    all_launches()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _number(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return float("nan")


def summarize(path, top=4) -> str:
    """Markdown rows from ncu's ``--csv --page raw`` output (one row per profiled kernel)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(line for line in f if line.startswith('"'))]
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    lines = ["| kernel | " + " | ".join(NCU_COLUMNS.values())
             + " | top stall reasons (cycles per issued instruction) |", "|---|" + "---|" * len(NCU_COLUMNS) + "---|"]
    for r in data:
        vals = []
        for metric in NCU_COLUMNS:
            x = _number(r[col[metric]]) if metric in col else float("nan")
            if metric == "gpu__time_duration.sum":
                unit = units[col[metric]] if metric in col else "ns"
                x = x / {"ns": 1e6, "us": 1e3, "usecond": 1e3, "nsecond": 1e6, "ms": 1.0, "msecond": 1.0}.get(unit, 1e6)
            vals.append(f"{x:.3g}")
        stalls = sorted(((_number(r[i]), h.split(STALL_MARK, 1)[1][:-len(STALL_SUFFIX)]) for h, i in col.items()
                         if STALL_MARK in h and h.endswith(STALL_SUFFIX) and "not_issued" not in h), reverse=True)
        lines.append(f"| {r[col['Kernel Name']][:48]} | " + " | ".join(vals) + " | " +
                     ", ".join(f"{n} {v:.2g}" for v, n in stalls[:top] if v == v) + " |")
    return "\n".join(lines)

# ------------------------------------------------------------------------------------------------------- main --


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-suite", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-fp32-tier", action="store_true")
    ap.add_argument("--shapes", default=None, help="indices into common.SHAPES (default: all)")
    ap.add_argument("--configs", default=None, help='tl configs to time, JSON {"64": {"dq": [...], "dkdv": [...]}}')
    ap.add_argument("--sweep", default="", help="head dims of the tl config sweep (e.g. 32,256): sweeps only")
    ap.add_argument("--fp32-sweep", default="", help="head dims of the FP32 kernel form's sweep (e.g. 64,128)")
    ap.add_argument("--gluon-sweep", default="", help="head dims of the KV-major launch: tl vs GLUON_SWEEP")
    ap.add_argument("--kinds", default="dq,dkdv", help="which tl launches the sweeps change")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds for the sweeps")
    ap.add_argument("--ncu", action="store_true", help="the launches Nsight Compute profiles (run under ncu)")
    ap.add_argument("--summarize", default=None, help="ncu --csv --page raw output to summarize")
    ap.add_argument("--smoke", action="store_true", help="CPU: two small cases and one tiny shape (the plumbing)")
    ap.add_argument("--out", default=None, help="folder for the results (default $OUT/kernel)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    if args.ncu:
        ncu_launches()
        return 0
    out = common.out_dir("kernel", args.out)
    if args.sweep or args.fp32_sweep or args.gluon_sweep:
        run_sweeps(args, out)
        return 0
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        torch.set_num_threads(1)  # tiny tiles through the interpreter: one thread is faster
    result = {"environment": common.environment(), "suite": [], "timings": []}
    log(common.banner(result["environment"]))
    if args.configs:
        for d, c in json.loads(args.configs).items():
            for which in ("dq", "dkdv"):
                if which in c:
                    configs.TL_CONFIGS[which][int(d)] = tuple(c[which])
    if not args.skip_suite:
        t0 = time.time()
        result["suite"] = run_suite(args.smoke)
        result["suite_bad"] = suite_bad(result["suite"])
        log(f"suite took {time.time() - t0:.1f} s; problems: {result['suite_bad'] or 'none'}")
    result["configs"] = {w: {str(d): c for d, c in configs.TL_CONFIGS[w].items()} for w in ("dq", "dkdv")}
    if not args.skip_timing:
        shapes = common.parse_indices(args.shapes, SMOKE_SHAPES if args.smoke else common.SHAPES)
        for shape in shapes:
            t0 = time.time()
            fp32 = not args.skip_fp32_tier and (args.smoke or common.SHAPES.index(shape) in FP32_SHAPES)
            try:
                r = time_shape(shape, device=device, fp32_tier=fp32)
            except Exception:
                log(traceback.format_exc())
                r = {}
            r["shape"] = list(shape)
            result["timings"].append(r)
            log(json.dumps(r), f"({time.time() - t0:.1f} s)")
    common.save_json(os.path.join(out, "kernel.json"), result)
    section = markdown(result)
    with open(os.path.join(out, "kernel.md"), "w") as f:
        f.write(section)
    log("\n" + section)
    log.write(os.path.join(out, "kernel.log"))
    return 1 if result.get("suite_bad") else 0


if __name__ == "__main__":
    raise SystemExit(main())
