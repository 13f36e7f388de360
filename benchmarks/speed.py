"""The one-run speed table: cuDNN, FA4 and the patch's variants, each gated on fp64 numerics first.

    bash benchmarks/external_gpu.sh prepare; bash benchmarks/external_gpu.sh speed   # GPU machine, FA4 from wheels
    python -m benchmarks.speed [--out DIR] [--deadline S] [--shapes 0,1,...] [--skip-host] [--skip-steps]
        [--contexts 4096x2,16384x1] [--step-reps 2 --step-steps 4] [--seed N] [--rounds 3]
    python -m benchmarks.speed --smoke          # CPU: tiny shapes, the kernel through Triton's interpreter

1. Gate. One fresh-random adversarial case (B·H·S·D 2·8·1024·128, causal, BF16, keys shifted by a common vector
   times 128σ; the seed is printed) through every variant, dq/dk/dv against the fp64 oracle
   (``backends/reference.py``), the patch's outputs NaN-poisoned. A patched variant passes with dq, dk, dv within
   0.5% (``tests/helpers/adversarial.TARGET``), finite, the kernel tier run, and the KV-major launch it names; an
   unpatched one (cuDNN, FA4) with dk and dv within 0.5% (its dq error is printed: the leak that makes the case
   adversarial). A variant that fails is not timed.
2. Timing (``common.bench``: ``triton.testing.do_bench`` medians) of forward+backward and of the forward alone
   (backward = the difference) at ``common.SHAPES``, the variants interleaved over ``--rounds`` rounds (medians;
   each round's fwd+bwd kept in the cell's ``rounds``): ``cudnn`` (SDPA forced to cuDNN), ``sdpa_tl`` (the patch
   on, both launches tl), ``sdpa_gluon`` (the Gluon KV-major launch wherever its predicate allows, with the tl
   dQ-major one), ``sdpa_routed`` (the plan's routing), ``fa4`` (``flash_attn.cute.interface.flash_attn_func``,
   B·S·H·D) and ``fa4_patched``. A cell whose KV-major launch is not the variant's reads "n/a".
   TFLOP/s (``common.tflops``): 7 products forward+backward, 5 the backward alone (GProj has 8: its own rate
   a product is 8/5 of that).
3. Host µs per forward+backward call at 1·2·128·64 causal, unpatched / ``gproj`` / ``auto``, each arm a process of
   its own (``common.fresh_host_calls``).
4. The 0.5B Llama-style training step (``common.step_times``): unpatched, ``gproj``, ``auto``.

Where FA4 (or CUDA, for cuDNN) is missing those columns read "n/a". ``--smoke`` (CPU: FP16, the GProj kernel
through Triton's interpreter, the CPU SDPA kernel standing in for cuDNN) checks the script, not the numbers.
Writes ``speed.json`` and ``speed.log`` under ``--out`` (default ``$OUT/speed``); the table is printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Optional
from unittest import mock

import torch
import torch.nn.functional as F

import gproj_patch
from benchmarks import common
from gproj_patch.backends import configs
from gproj_patch.backends.reference import reference_backward
from tests.helpers.numerics import kernel_inputs

log = common.Log()
#: the gate's case: (B, H, S, D), the keys' common offset in σ
GATE_SHAPE, GATE_OFFSET = (2, 8, 1024, 128), 128.0
SMOKE_GATE_SHAPE = (1, 1, 16, 16)
#: (B, H, S, D, causal[, KV heads]) under --smoke: the interpreter takes ~0.15-0.4 s a backward at 1·2·16·16
SMOKE_SHAPES = [(1, 2, 16, 16, True, 1)]
HOST_SHAPE, SMOKE_HOST_SHAPE = (1, 2, 128, 64), (1, 1, 16, 16)
#: every head dim the kernels take: with it as the plan's measured-faster list, the plan picks Gluon wherever
#: ``gluon_bwd.kv_major_reason`` allows it
ALL_HEAD_DIMS = tuple(range(1, configs.MAX_HEAD_DIM + 1))
#: forward products (QKᵀ, PV) and the standard backward's (QKᵀ again, dO·Vᵀ, dS·K, dSᵀ·Q, Pᵀ·dO)
FWD_PRODUCTS, BWD_PRODUCTS = 2, 5
#: (column, numerator, denominator) of the table's forward+backward ratios, then the backward alone's
RATIOS = (("FA4/cuDNN", "fa4", "cudnn"), ("tl/cuDNN", "sdpa_tl", "cudnn"), ("gluon/cuDNN", "sdpa_gluon", "cudnn"),
          ("routed/cuDNN", "sdpa_routed", "cudnn"), ("pFA4/FA4", "fa4_patched", "fa4"))
BWD_RATIOS = (("routed/cuDNN", "sdpa_routed", "cudnn"), ("pFA4/FA4", "fa4_patched", "fa4"))
TFLOPS_OF = ("cudnn", "sdpa_routed", "fa4", "fa4_patched")
#: products each backward runs: ``bwd_tflops`` is saved on 5, the per-product rate rescales it
PRODUCTS = {"cudnn": 5, "fa4": 5, "sdpa_tl": 8, "sdpa_gluon": 8, "sdpa_routed": 8, "fa4_patched": 8}


@dataclass(frozen=True)
class Variant:
    name: str
    library: str                       # "sdpa" | "fa4"
    kv_major: Optional[str] = None     # None: the patch off; else enable(kv_major=...)
    dq_major: str = "auto"             # enable(dq_major=...) when the patch is on
    force_gluon: bool = False          # the plan's faster-head-dim list widened: Gluon wherever it can run
    want_kernel: Optional[str] = None  # the KV-major launch that must have run ("tl", "gluon"), None: any


VARIANTS = (Variant("cudnn", "sdpa"), Variant("sdpa_tl", "sdpa", "tl", dq_major="tl", want_kernel="tl"),
            Variant("sdpa_gluon", "sdpa", "auto", dq_major="tl", force_gluon=True, want_kernel="gluon"),
            Variant("sdpa_routed", "sdpa", "auto"), Variant("fa4", "fa4"), Variant("fa4_patched", "fa4", "auto"))


@dataclass
class Run:
    device: str
    dtype: torch.dtype
    fa4: Optional[object]   # flash_attn_func, or None
    fa4_why: str            # why FA4 is missing ("" when present)
    t0: float
    deadline: float

    def left(self) -> float:
        return self.deadline - (time.time() - self.t0)


@contextlib.contextmanager
def armed(variant: Variant, run: Run, poison: bool = False):
    """The variant's setting for the block: the patch on (kernel tier only) or off, cuDNN forced for SDPA on CUDA,
    Gluon forced, outputs NaN-poisoned; stats counted from zero."""
    gproj_patch.disable()
    gproj_patch.reset_stats()
    with contextlib.ExitStack() as stack:
        if variant.kv_major is not None:
            gproj_patch.enable(mode="gproj", tier="triton", kv_major=variant.kv_major, dq_major=variant.dq_major)
            stack.callback(gproj_patch.disable)
            if poison:
                stack.enter_context(common.poisoned_outputs())
        if variant.force_gluon:
            stack.enter_context(mock.patch.object(configs, "GLUON_KV_FASTER_HEAD_DIMS", ALL_HEAD_DIMS))
        if variant.library == "sdpa" and run.device == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel
            stack.enter_context(sdpa_kernel(SDPBackend.CUDNN_ATTENTION))
        yield


def caller(variant: Variant, run: Run, causal: bool):
    """attention(q, k, v) in the variant's layout (SDPA: B·H·S·D; FA4: B·S·H·D)."""
    if variant.library == "fa4":
        def call(q, k, v):
            out = run.fa4(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out
        return call
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                          enable_gqa=q.shape[1] != k.shape[1])


def leaves(variant: Variant, tensors):
    """q, k, v (requiring grad) and dO in the variant's layout, from B·H·S·D tensors."""
    if variant.library == "fa4":
        tensors = [t.transpose(1, 2).contiguous() for t in tensors]
    return [t.detach().requires_grad_() for t in tensors[:3]] + [tensors[3]]


def kernel_mismatch(variant: Variant) -> Optional[str]:
    """Why the last calls did not run what the variant names (None when they did), from ``stats()``."""
    if variant.kv_major is None:
        return None
    s = gproj_patch.stats()
    if not s["gproj"] or s["fp32"] or s["original"]:
        return f"tiers ran: gproj {s['gproj']}, fp32 {s['fp32']}, original {s['original']} {s['fallback_reasons']}"
    ran = set(s["kv_major"])
    if variant.want_kernel is not None and ran != {variant.want_kernel}:
        return f"KV-major kernel ran: {s['kv_major']} ({s['kv_major_reasons']})"
    return None


def gate(run: Run, seed: int, shape) -> dict:
    B, H, S, D = shape
    case = [t.to(run.device) for t in kernel_inputs(B, H, H, S, S, D, offset=GATE_OFFSET, seed=seed,
                                                     dtype=run.dtype)]
    ref = reference_backward(*case, causal=True)
    out = {}
    for variant in VARIANTS:
        if variant.library == "fa4" and run.fa4 is None:
            out[variant.name] = dict(status="n/a", why=run.fa4_why)
            log(f"gate {variant.name:12s} n/a: {run.fa4_why}")
            continue
        q, k, v, do = leaves(variant, case)
        try:
            with armed(variant, run, poison=True):
                grads = torch.autograd.grad(caller(variant, run, True)(q, k, v), (q, k, v), do)
                mismatch = kernel_mismatch(variant)
        except Exception as e:  # a variant that cannot run here fails its gate, the run goes on
            out[variant.name] = dict(status="FAIL", why=f"{type(e).__name__}: {str(e)[:300]}")
            log(f"gate {variant.name:12s} FAIL: {out[variant.name]['why']}")
            continue
        if variant.library == "fa4":
            grads = [g.transpose(1, 2) for g in grads]
        err = [common.rel(g, r) for g, r in zip(grads, ref)]
        gated = (0, 1, 2) if variant.kv_major is not None else (1, 2)
        ok = all(math.isfinite(e) for e in err) and all(err[i] <= common.TARGET for i in gated)
        status = "PASS" if ok and mismatch is None else ("n/a" if ok else "FAIL")
        out[variant.name] = dict(status=status, err=err, gated="dq dk dv" if len(gated) == 3 else "dk dv",
                                 why=mismatch or ("" if ok else f"dq/dk/dv errors {err}"))
        log(f"gate {variant.name:12s} {status}: dq {err[0]:.2e} dk {err[1]:.2e} dv {err[2]:.2e} "
            f"(gated: {out[variant.name]['gated']} <= {common.TARGET:g}) {mismatch or ''}")
    return out


def shape_inputs(shape, run: Run):
    B, H, S, D = shape[:4]
    hkv = shape[5] if len(shape) > 5 else H
    if run.device == "cuda":
        return list(common.make_inputs(B, H, S, D, dtype=run.dtype, hkv=hkv))
    return list(kernel_inputs(B, H, hkv, S, S, D, dtype=run.dtype))


def time_cell(variant: Variant, shape, tensors, run: Run) -> dict:
    q, k, v, do = leaves(variant, tensors)
    call = caller(variant, run, causal=shape[4])
    with armed(variant, run):
        step = lambda: torch.autograd.grad(call(q, k, v), (q, k, v), do)  # noqa: E731
        step()  # compiles: not timed
        mismatch = kernel_mismatch(variant)
        if mismatch:
            return dict(status="n/a", why=mismatch)
        fwdbwd = common.bench(step, run.device)
        fwd = common.bench(lambda: call(q, k, v), run.device)
        kernels = gproj_patch.stats()["kv_major"]
        dq_kernels = gproj_patch.stats()["dq_major"]
    bwd = fwdbwd - fwd
    return dict(status="ok", fwdbwd=fwdbwd, fwd=fwd, bwd=bwd, kv_major=kernels, dq_major=dq_kernels,
                tflops=common.tflops(shape, fwdbwd, products=FWD_PRODUCTS + BWD_PRODUCTS),
                bwd_tflops=common.tflops(shape, bwd, products=BWD_PRODUCTS))


def merged(prior: Optional[dict], cell: dict) -> dict:
    """``cell`` with the fwd+bwd and fwd times of earlier rounds: medians (bwd = their difference, TFLOP/s from
    them) and every round's fwd+bwd in ``rounds``."""
    if cell["status"] != "ok":
        return cell
    runs = (prior or {}).get("runs", []) + [(cell["fwdbwd"], cell["fwd"])]
    fwdbwd, fwd = (statistics.median(x[i] for x in runs) for i in (0, 1))
    scale = fwdbwd / cell["fwdbwd"]
    return dict(cell, fwdbwd=fwdbwd, fwd=fwd, bwd=fwdbwd - fwd, runs=runs, rounds=[round(x[0], 3) for x in runs],
                tflops=cell["tflops"] / scale, bwd_tflops=cell["bwd_tflops"] * cell["bwd"] / (fwdbwd - fwd))


def timing(run: Run, shapes, gates: dict, stop_at: float, rounds: int = 1) -> list:
    """Each shape's cells, the variants interleaved over ``rounds`` rounds (clock and thermal drift land on every
    variant alike); a cell keeps each round's times and reports their medians."""
    rows = []
    for shape in shapes:
        row = dict(shape=list(shape), cells={})
        tensors = shape_inputs(shape, run)
        for r in range(rounds):
            for variant in VARIANTS:
                g, prior = gates[variant.name], row["cells"].get(variant.name)
                if prior is not None and prior["status"] != "ok":
                    continue  # n/a, failed or skipped in an earlier round: stays so
                if g["status"] != "PASS":
                    cell = dict(status="n/a" if g["status"] == "n/a" else "gate failed", why=g.get("why", ""))
                elif run.left() < stop_at:
                    cell = prior or dict(status="skipped", why="deadline")
                    row["cells"][variant.name] = cell
                    continue
                else:
                    t0 = time.time()
                    try:
                        cell = merged(prior, time_cell(variant, shape, tensors, run))
                    except Exception as e:  # one cell's failure leaves the others
                        cell = dict(status="error", why=f"{type(e).__name__}: {str(e)[:300]}")
                    cell["s"] = round(time.time() - t0 + (prior or {}).get("s", 0.0), 1)
                row["cells"][variant.name] = cell
                log(f"{common.label(shape):26s} {variant.name:12s} r{r} " + (
                    f"fwd+bwd {cell['fwdbwd']:8.3f} ms  fwd {cell['fwd']:7.3f}  bwd {cell['bwd']:8.3f}  "
                    f"{cell['tflops']:6.1f} TFLOP/s  rounds {cell['rounds']}  kv_major {cell['kv_major']}  "
                    f"dq_major {cell['dq_major']}"
                    if cell["status"] == "ok" else f"{cell['status']}: {cell.get('why', '')}"))
        rows.append(row)
        del tensors
        if run.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def host(run: Run, shape, n: int, folder: str) -> dict:
    """Host µs a call per arm; on CUDA each arm in a process of its own (``common.fresh_host_calls``: in this
    process the earlier arms' cuDNN backwards would send ``auto``'s calls to the corrected tier)."""
    out = {}
    for mode in common.ARMS:
        if run.device == "cuda":
            r = common.fresh_host_calls(mode, shape, n, os.path.join(folder, f"host_{mode}"))
        else:
            r = common.host_calls(mode, shape, run.device, n)
        out[mode] = r
        log(f"host {mode:10s} {r['serial']:8.0f} µs a call (sync each), {r['batched']:8.0f} (sync per batch) "
            f"tiers {r['tiers']}")
    return out


def steps(args, run: Run) -> dict:
    out = {}
    for ctx in (c for c in args.contexts.split(",") if c):
        if run.left() < args.step_reserve / 2:
            out[ctx] = dict(skipped="deadline")
            continue
        seq, batch = (int(x) for x in ctx.split("x"))
        t0 = time.time()
        out[ctx] = common.step_times(seq, batch, reps=args.step_reps, steps=args.step_steps)
        log(common.step_line(ctx, out[ctx]) + f" ({time.time() - t0:.0f} s)")
    return out


def _ms(row, name, key="fwdbwd"):
    cell = row["cells"].get(name, {})
    return cell[key] if cell.get("status") == "ok" else float("nan")


def _fmt(x, spec):
    return "n/a" if not math.isfinite(x) else format(x, spec)


def summary(result: dict) -> str:
    """One line per gate, host and step result, then the table of ratios (the last lines of the output)."""
    lines = ["gate (128σ, fp64 oracle): " + ", ".join(f"{n} {g['status']}" for n, g in result["gate"].items())]
    h = result.get("host_us") or {}
    if h:
        base = h["unpatched"]["batched"]
        lines.append(f"host µs a call ({common.label(result['host_shape'] + [True])}, sync per batch): " + ", ".join(
            f"{m} {r['batched']:.0f}" + ("" if m == "unpatched" else f" (+{r['batched'] - base:.0f})")
            for m, r in h.items()))
    for ctx, r in (result.get("steps") or {}).items():
        lines.append(common.step_line(ctx, r) if "ms" in r else f"step {ctx}: {r}")
    head = ["B·H·S·D", "cuDNN ms"] + [c for c, _, _ in RATIOS] + [f"bwd {c}" for c, _, _ in BWD_RATIOS] + \
        ["TFLOP/s " + " / ".join(TFLOPS_OF), "bwd TFLOP/s a product " + " / ".join(TFLOPS_OF)]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["timing"]:
        ratios = [_fmt(_ms(row, a) / _ms(row, b), ".3f") for _, a, b in RATIOS]
        bwd = " | ".join(_fmt(_ms(row, a, "bwd") / _ms(row, b, "bwd"), ".3f") for _, a, b in BWD_RATIOS)
        tf = " / ".join(_fmt(_ms(row, n, "tflops"), ".0f") for n in TFLOPS_OF)
        per_product = " / ".join(_fmt(_ms(row, n, "bwd_tflops") * PRODUCTS[n] / 5, ".0f") for n in TFLOPS_OF)
        lines.append(f"| {common.label(row['shape'])} | {_fmt(_ms(row, 'cudnn'), '.3f')} | " + " | ".join(ratios)
                     + f" | {bwd} | {tf} | {per_product} |")
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for speed.json and speed.log (default $OUT/speed)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a check of the script)")
    ap.add_argument("--deadline", type=float, default=330.0, help="seconds for the whole run")
    ap.add_argument("--seed", type=int, default=None, help="the gate's seed (default: fresh)")
    ap.add_argument("--shapes", default=None, help="indices into common.SHAPES (default: all)")
    ap.add_argument("--skip-host", action="store_true")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--contexts", default="4096x2,16384x1", help="seq x batch of the training steps")
    ap.add_argument("--step-reps", type=int, default=2)
    ap.add_argument("--step-steps", type=int, default=4)
    ap.add_argument("--step-reserve", type=float, default=75.0, help="seconds the timing leaves to the steps")
    ap.add_argument("--host-calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, the variants interleaved (medians)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    out = common.out_dir("speed", args.out)
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    fa4, fa4_why, fa4_version = None, "no CUDA", "n/a"
    if cuda:
        try:
            iface, fa4_version = common.fa4_interface()
            fa4, fa4_why = iface.flash_attn_func, ""
        except ImportError as e:
            fa4_why = f"flash_attn.cute not importable ({e})"
    else:  # the kernel tier on the CPU: FP16 through the interpreter (the host arms read the variable)
        os.environ.setdefault("GPROJ_TIER", "triton")
        torch.set_num_threads(1)  # tiny tiles: one thread is faster (tests/conftest.py one_thread)
    run = Run(device, torch.bfloat16 if cuda else torch.float16, fa4, fa4_why, time.time(), args.deadline)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") % 2**31
    result = dict(common.environment(), run_device=device, fa4=fa4_version, fa4_missing=fa4_why, seed=seed,
                  target=common.TARGET, flops="2·P·B·Hq·S²·D, halved when causal; P=7 fwd+bwd, P=5 bwd")
    log(f"speed {common.banner({k: str(v) for k, v in result.items()})}")

    def save():  # after each part: a run stopped by its time limit keeps what it measured
        common.save_json(os.path.join(out, "speed.json"), result)
        log.write(os.path.join(out, "speed.log"))
    result["gate"] = gate(run, seed, GATE_SHAPE if cuda else SMOKE_GATE_SHAPE)
    save()
    shapes = common.parse_indices(args.shapes, common.SHAPES if cuda else SMOKE_SHAPES)
    result["host_shape"] = list(HOST_SHAPE if cuda else SMOKE_HOST_SHAPE)
    if not args.skip_host:
        result["host_us"] = host(run, tuple(result["host_shape"]), args.host_calls if cuda else 2, out)
        save()
    reserve = 0.0 if args.skip_steps or not cuda else args.step_reserve
    result["timing"] = timing(run, shapes, result["gate"], stop_at=reserve, rounds=args.rounds)
    save()
    result["steps"] = steps(args, run) if cuda and not args.skip_steps else {}
    result["seconds"] = round(time.time() - run.t0, 1)
    log("\n" + summary(result))
    save()
    return result


if __name__ == "__main__":
    main()
