"""Where one hooked SDPA call's wall time goes at a tiny shape: host Python/C++ vs the GPU (issue 11's host item).

BENCHMARKS.md run 24 measured 1176 µs a forward+backward call in ``gproj`` mode at 1·2·128·64 on the H200 (245
unpatched), while the package's own Python costs ~65 µs over the floor on a CPU with the kernels stubbed
(NOTES_host.md). This script separates the rest, per mode, in one run:

1. wall µs per call with one synchronize per call (host + GPU, serialized) and with one synchronize per batch
   (host-bound calls overlap the GPU: the two agree when the GPU is idle between launches, the batched one is
   lower when the GPU work is the longer);
2. a ``torch.profiler`` trace of a few calls: the top operators by self CPU time and, on CUDA, the kernels by
   device time, and the chrome trace (``host_trace_<mode>.json``) to look at launch gaps.

    PYTHONPATH=. python benchmarks/host_trace.py [--modes unpatched,gproj,auto] [--shape 1,2,128,64] [--stack]
        [--out DIR]

On a machine without CUDA it runs the same on CPU FP16 through the Triton interpreter (``GPROJ_TIER=triton``),
which checks the script, not the H200's numbers.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gproj_patch  # noqa: E402

_spec = importlib.util.spec_from_file_location("host_overhead", os.path.join(ROOT, "benchmarks", "host_overhead.py"))
_ho = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ho)
_arm = _ho._arm  # the same arms as host_overhead.py (unpatched / enable(mode, sample_every=1000))


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(mode, shape, device, n, stack=False):
    _arm(mode)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    do = torch.randn(*shape, generator=g, device=device, dtype=dtype)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    for _ in range(5):
        step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(n):
        step()
        _sync(device)
    serial = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n):
        step()
    _sync(device)
    batched = (time.perf_counter() - t) / n * 1e6

    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts, with_stack=stack) as prof:
        for _ in range(min(n, 20)):
            step()
        _sync(device)
    stats = gproj_patch.stats()
    gproj_patch.disable()
    return dict(serial=serial, batched=batched, prof=prof, tiers={t: stats[t] for t in ("gproj", "fp32", "original")},
                kv_major=stats.get("kv_major", {}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="unpatched,gproj,auto")
    ap.add_argument("--shape", default="1,2,128,64", help="B,H,S,D")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--stack", action="store_true", help="record Python stacks; tables grouped by the top 4 frames")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("GPROJ_TIER", "triton")  # the kernel tier through the interpreter (FP16)
        args.n = min(args.n, 20)
    shape = tuple(int(x) for x in args.shape.split(","))
    os.makedirs(args.out, exist_ok=True)
    print(f"torch {torch.__version__} device {device} shape {shape} calls {args.n}")
    summary = []
    for mode in args.modes.split(","):
        r = measure(mode, shape, device, args.n, stack=args.stack)
        r["prof"].export_chrome_trace(os.path.join(args.out, f"host_trace_{mode}.json"))
        print(f"\n--- {mode}: top operators by self CPU time ({r['tiers']}, kv_major {r['kv_major']}) ---")
        averages = r["prof"].key_averages(group_by_stack_n=4 if args.stack else 0)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if device == "cuda":
            print(f"--- {mode}: by device time ---")
            print(r["prof"].key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
        summary.append((mode, r["serial"], r["batched"]))
    print("\n| mode | µs a call, sync each call | µs a call, sync per batch |")
    print("|---|---|---|")
    for mode, serial, batched in summary:
        print(f"| {mode} | {serial:.0f} | {batched:.0f} |")


if __name__ == "__main__":
    main()
