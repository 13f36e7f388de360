"""Issue 21 item 4: one run that prints the speed table — cuDNN, FA4 and the patch's variants, gated on numerics.

    bash benchmarks/external_gpu.sh speed                 # H200: right after `prepare` (FA4 from the carried wheels)
    PYTHONPATH=. python3 benchmarks/speed_run.py [--out DIR] [--deadline S] [--shapes 0,1,...] [--skip-host]
        [--skip-steps] [--contexts 4096x2,16384x1] [--step-reps 2 --step-steps 4] [--seed N] [--rounds 3]
    python benchmarks/speed_run.py --smoke                 # CPU: tiny shapes, the kernel through the interpreter

1. Gate. One fresh-random adversarial case (B·H·S·D 2·8·1024·128, causal, BF16, keys shifted by a common vector
   times 128σ; the seed is printed) through every variant, dq/dk/dv against the fp64 oracle
   (``backends/reference.py``), the patch's outputs NaN-poisoned (``triton_bwd._POISON_OUTPUTS``). A patched
   variant passes with dq, dk, dv within 0.5% (``tests/helpers/adversarial.TARGET``), finite, the kernel tier
   run, and the KV-major kernel it names; an unpatched one (cuDNN, FA4) with dk and dv within 0.5% (its dq
   error is printed: the leak that makes the case adversarial). A variant that fails is not timed.
2. Timing (``device_check.bench``: ``triton.testing.do_bench`` median) of forward+backward and of the forward
   alone (backward = the difference) at ``device_check.SHAPES``, the variants interleaved over ``--rounds``
   rounds (medians; each round's fwd+bwd kept in the cell's ``rounds``), variants: ``cudnn`` (SDPA forced to cuDNN),
   ``sdpa_tl`` / ``sdpa_gluon`` / ``sdpa_routed`` (SDPA, cuDNN forward, the patch on with both launches tl
   (``kv_major="tl"``, ``dq_major="tl"``); the Gluon KV-major launch forced — the plan's faster-head-dim list
   widened for the variant — with the tl dQ-major one (the routing of runs 45–55); and both options "auto", the
   plan's routing), ``fa4`` (``flash_attn.cute.interface.flash_attn_func``, B·S·H·D) and ``fa4_patched``. Each
   cell checks which KV-major kernel ran (``stats()["kv_major"]``; a cell whose kernel is not the variant's is
   "n/a") and records the dQ-major one (``stats()["dq_major"]``).
   TFLOP/s (``device_check.tflops``): 2·P·B·Hq·S²·D, halved when causal, P = 7 forward+backward (2 forward
   + the standard backward's 5 products), P = 5 the backward alone (GProj runs 8: its own rate is 8/5 of that).
3. Host µs per forward+backward call at 1·2·128·64 causal, unpatched / ``gproj`` / ``auto`` (``host_trace``).
4. Training step of the 0.5B Llama-style model (``host_overhead.step_times``): unpatched, ``gproj``, ``auto``.

Where FA4 (or CUDA, for cuDNN) is missing those columns read "n/a". ``--smoke`` (CPU: FP16, the GProj kernel
through Triton's interpreter, the CPU SDPA kernel standing in for cuDNN) checks the script, not the numbers.
Writes ``speed_run.json`` and ``speed_run.log`` under ``--out``; the summary table is printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass
from typing import Optional
from unittest import mock

import torch
import torch.nn.functional as F

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH]

import device_check as dc  # noqa: E402  (bench, SHAPES, make_inputs, tflops, log/LOG)
import host_overhead as ho  # noqa: E402  (ARMS, step_times)
import host_trace as ht  # noqa: E402  (measure)
from fa4_records_check import load_fa4  # noqa: E402
from speed_table import label, summary  # noqa: E402
import gproj_patch  # noqa: E402
from gproj_patch.backends import gluon_bwd, triton_bwd  # noqa: E402
from gproj_patch.backends.reference import reference_backward  # noqa: E402
from tests.helpers.adversarial import TARGET  # noqa: E402
from tests.helpers.numerics import kernel_inputs, rel  # noqa: E402

log = dc.log
#: the gate's case: (B, H, S, D), the keys' common offset in σ
GATE_SHAPE, GATE_OFFSET = (2, 8, 1024, 128), 128.0
SMOKE_GATE_SHAPE = (1, 1, 16, 16)
#: (B, H, S, D, causal[, KV heads]) under --smoke: the interpreter takes ~0.15-0.4 s a backward at 1·2·16·16
SMOKE_SHAPES = [(1, 2, 16, 16, True, 1)]
HOST_SHAPE, SMOKE_HOST_SHAPE = (1, 2, 128, 64), (1, 1, 16, 16)
#: every head dim the kernels take: with it as the plan's measured-faster list, the plan picks Gluon wherever
#: ``gluon_bwd.kv_major_reason`` allows it
ALL_HEAD_DIMS = tuple(range(1, triton_bwd.MAX_HEAD_DIM + 1))
#: forward products (QKᵀ, PV) and the standard backward's (QKᵀ again, dO·Vᵀ, dS·K, dSᵀ·Q, Pᵀ·dO)
FWD_PRODUCTS, BWD_PRODUCTS = 2, 5
CPU_REPS = 2


@dataclass(frozen=True)
class Variant:
    name: str
    library: str                       # "sdpa" | "fa4"
    kv_major: Optional[str] = None     # None: the patch off; else enable(kv_major=...)
    dq_major: str = "auto"             # enable(dq_major=...) when the patch is on
    force_gluon: bool = False          # the plan's faster-head-dim list widened: Gluon wherever it can run
    want_kernel: Optional[str] = None  # the KV-major kernel that must have run ("tl", "gluon"), None: any


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
                stack.enter_context(mock.patch.object(triton_bwd, "_POISON_OUTPUTS", True))
        if variant.force_gluon:
            stack.enter_context(mock.patch.object(gluon_bwd, "FASTER_HEAD_DIMS", ALL_HEAD_DIMS))
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
        err = [rel(g, r) for g, r in zip(grads, ref)]
        gated = (0, 1, 2) if variant.kv_major is not None else (1, 2)
        ok = all(math.isfinite(e) for e in err) and all(err[i] <= TARGET for i in gated)
        status = "PASS" if ok and mismatch is None else ("n/a" if ok else "FAIL")
        out[variant.name] = dict(status=status, err=err, gated="dq dk dv" if len(gated) == 3 else "dk dv",
                                 why=mismatch or ("" if ok else f"dq/dk/dv errors {err}"))
        log(f"gate {variant.name:12s} {status}: dq {err[0]:.2e} dk {err[1]:.2e} dv {err[2]:.2e} "
            f"(gated: {out[variant.name]['gated']} <= {TARGET:g}) {mismatch or ''}")
    return out


def bench(fn, run: Run) -> float:
    """Median ms of ``fn``: ``device_check.bench`` on CUDA, a few wall-clock calls on the CPU."""
    if run.device == "cuda":
        return dc.bench(fn)
    times = []
    for _ in range(CPU_REPS):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def shape_inputs(shape, run: Run):
    B, H, S, D = shape[:4]
    hkv = shape[5] if len(shape) > 5 else H
    if run.device == "cuda":
        return list(dc.make_inputs(B, H, S, D, dtype=run.dtype, hkv=hkv))
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
        fwdbwd = bench(step, run)
        fwd = bench(lambda: call(q, k, v), run)
        kernels = gproj_patch.stats()["kv_major"]
        dq_kernels = gproj_patch.stats()["dq_major"]
    bwd = fwdbwd - fwd
    return dict(status="ok", fwdbwd=fwdbwd, fwd=fwd, bwd=bwd, kv_major=kernels, dq_major=dq_kernels,
                tflops=dc.tflops(shape, fwdbwd, products=FWD_PRODUCTS + BWD_PRODUCTS),
                bwd_tflops=dc.tflops(shape, bwd, products=BWD_PRODUCTS))


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
                log(f"{label(shape):26s} {variant.name:12s} r{r} " + (
                    f"fwd+bwd {cell['fwdbwd']:8.3f} ms  fwd {cell['fwd']:7.3f}  bwd {cell['bwd']:8.3f}  "
                    f"{cell['tflops']:6.1f} TFLOP/s  rounds {cell['rounds']}  kv_major {cell['kv_major']}  "
                    f"dq_major {cell['dq_major']}"
                    if cell["status"] == "ok" else f"{cell['status']}: {cell.get('why', '')}"))
        rows.append(row)
        del tensors
        if run.device == "cuda":
            torch.cuda.empty_cache()
    return rows


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


def host(run: Run, shape, n: int) -> dict:
    out = {}
    for mode in ho.ARMS:
        r = ht.measure(mode, shape, run.device, n)
        out[mode] = dict(serial=r["serial"], batched=r["batched"], tiers=r["tiers"], kv_major=r["kv_major"])
        log(f"host {mode:10s} {r['serial']:8.0f} µs a call (sync each), {r['batched']:8.0f} (sync per batch) "
            f"tiers {r['tiers']}")
    gproj_patch.disable()
    return out


def steps(args, run: Run) -> dict:
    out = {}
    for ctx in (c for c in args.contexts.split(",") if c):
        if run.left() < args.step_reserve / 2:
            out[ctx] = dict(skipped="deadline")
            continue
        seq, batch = (int(x) for x in ctx.split("x"))
        t0 = time.time()
        r = ho.step_times(types.SimpleNamespace(reps=args.step_reps, steps=args.step_steps, compile=False),
                          seq, batch)
        out[ctx] = r
        log(f"step {ctx}: " + ", ".join(f"{m} {v:.1f} ms" for m, v in r["ms"].items())
            + "; peak MiB " + ", ".join(f"{m} {v:.0f}" for m, v in r["peak_mib"].items())
            + f" ({time.time() - t0:.0f} s)")
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "speed_out"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU check of the script)")
    ap.add_argument("--deadline", type=float, default=330.0, help="seconds for the whole run")
    ap.add_argument("--seed", type=int, default=None, help="the gate's seed (default: fresh)")
    ap.add_argument("--shapes", default=None, help="indices into device_check.SHAPES (default: all)")
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
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    fa4, fa4_why, fa4_version = None, "no CUDA", "n/a"
    if cuda:
        try:
            iface, fa4_version = load_fa4(False)
            fa4, fa4_why = iface.flash_attn_func, ""
        except ImportError as e:
            fa4_why = f"flash_attn.cute not importable ({e})"
    else:  # the kernel tier on the CPU: FP16 through the interpreter (host_trace's arms read the variable)
        os.environ.setdefault("GPROJ_TIER", "triton")
        torch.set_num_threads(1)  # tiny tiles: one thread is faster (tests/conftest.py one_thread)
    run = Run(device, torch.bfloat16 if cuda else torch.float16, fa4, fa4_why, time.time(), args.deadline)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") % 2**31
    import triton
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=device,
                  gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                  triton=triton.__version__, fa4=fa4_version, fa4_missing=fa4_why, seed=seed, target=TARGET,
                  flops="2·P·B·Hq·S²·D, halved when causal; P=7 fwd+bwd, P=5 bwd (device_check.tflops)")
    log(f"speed_run {json.dumps(result)}")
    result["gate"] = gate(run, seed, GATE_SHAPE if cuda else SMOKE_GATE_SHAPE)
    save(result, args.out)
    shapes = SMOKE_SHAPES if not cuda else dc.SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    result["host_shape"] = list(HOST_SHAPE if cuda else SMOKE_HOST_SHAPE)
    if not args.skip_host:
        result["host_us"] = host(run, tuple(result["host_shape"]), args.host_calls if cuda else 2)
        save(result, args.out)
    reserve = 0.0 if args.skip_steps or not cuda else args.step_reserve
    result["timing"] = timing(run, shapes, result["gate"], stop_at=reserve, rounds=args.rounds)
    save(result, args.out)
    result["steps"] = steps(args, run) if cuda and not args.skip_steps else {}
    result["seconds"] = round(time.time() - run.t0, 1)
    log("\n" + summary(result))
    save(result, args.out)
    return result


def save(result: dict, out: str) -> None:
    """JSON and log so far (after each part: a run stopped by its time limit keeps what it measured)."""
    with open(os.path.join(out, "speed_run.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, "speed_run.log"), "w") as f:
        f.write("\n".join(dc.LOG) + "\n")


if __name__ == "__main__":
    main()
