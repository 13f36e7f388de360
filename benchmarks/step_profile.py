"""Where a training step's `gproj` overhead goes (issue 21, "Done when": the profile behind a missed step target).

One device call. The 0.5B Llama-style step of ``host_overhead.py`` (8 layers, D=128, 16 query / 8 KV heads, AdamW,
BF16) at one context, arms ``unpatched`` and ``gproj``:

1. wall ms a step (``host_overhead.step_times``: its arms alternated, medians, synchronized, no profiler);
2. a ``torch.profiler`` trace of CUDA activity only (no CPU events, so the host path is not slowed) over a few
   steps: every kernel's device time, summed per step and split into attention kernels (the fused SDPA
   forwards/backwards and GProj's launches, matched by name) and the rest. Kernels of one stream do not overlap,
   so ``wall − kernel time`` is the time the GPU waited for the host.

The table says which part of ``gproj − unpatched`` is attention kernel time, other kernels and GPU idle (the
backward's Python on the autograd thread delaying the launches behind it).

    PYTHONPATH=. python benchmarks/step_profile.py [--context 4096x2] [--steps 6] [--reps 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import host_overhead as ho  # noqa: E402  (_arm, build_model, _loss)
import gproj_patch  # noqa: E402

ARMS = ("unpatched", "gproj")
#: substrings of the attention kernels' names: cuDNN's / flash's fused SDPA and GProj's launches
ATTENTION_NAMES = ("cudnn", "fmha", "flash", "sdpa", "attention", "_dq_kernel", "_dkdv_kernel", "gproj")


def is_attention(name: str) -> bool:
    low = name.lower()
    return any(s in low for s in ATTENTION_NAMES)


def one_step(model, opt, ids):
    ho._loss(model, ids).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def kernel_split(model, opt, ids, steps: int) -> dict:
    """Device ms a step of every kernel, of the attention kernels, and the kernels by name (top 12)."""
    one_step(model, opt, ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one_step(model, opt, ids)
        torch.cuda.synchronize()
    total = attention = 0.0
    by_name, others = {}, {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.time_range.elapsed_us()  # a kernel's (or a copy's) device time
        total += us
        name = ev.name[:90]
        if is_attention(ev.name):
            attention += us
            by_name[name] = by_name.get(name, 0.0) + us
        else:
            others[name] = others.get(name, 0.0) + us
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"kernels_ms": total / steps / 1e3, "attention_ms": attention / steps / 1e3,
            "attention_kernels_ms": {k: v / steps / 1e3 for k, v in top},
            "other_kernels_ms": {k: v / steps / 1e3 for k, v in others.items()}}


def other_kernel_changes(unpatched: dict, gproj: dict, top: int = 8) -> list:
    """(name, unpatched ms, gproj ms) of the non-attention kernels whose time a step differs most between the
    arms (a kernel only one arm runs counts 0 in the other): what ``other kernels`` adds up."""
    names = set(unpatched) | set(gproj)
    rows = [(n, unpatched.get(n, 0.0), gproj.get(n, 0.0)) for n in names]
    return sorted(rows, key=lambda r: -abs(r[2] - r[1]))[:top]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", default="4096x2", help="seq x batch")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "step_profile_out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    seq, batch = (int(x) for x in args.context.split("x"))
    # wall ms a step, no profiler: host_overhead's own step timing (arms alternated, its model freed after)
    walls = ho.step_times(argparse.Namespace(reps=args.reps, steps=args.steps, compile=False), seq, batch)["ms"]
    model, cfg = ho.build_model(seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    split = {}
    for arm in ARMS:
        ho._arm(arm)
        split[arm] = kernel_split(model, opt, ids, args.steps)
        split[arm]["tiers"] = {k: v for k, v in gproj_patch.stats().items() if k in ("gproj", "original", "fp32")}
    gproj_patch.disable()
    rows = {}
    for arm in ARMS:
        wall = walls[arm]
        k = split[arm]
        rows[arm] = {"wall_ms": wall, "kernels_ms": k["kernels_ms"], "attention_ms": k["attention_ms"],
                     "other_ms": k["kernels_ms"] - k["attention_ms"], "idle_ms": wall - k["kernels_ms"],
                     "attention_kernels_ms": k["attention_kernels_ms"], "tiers": k["tiers"]}
    changes = other_kernel_changes(split["unpatched"]["other_kernels_ms"], split["gproj"]["other_kernels_ms"])
    info = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "context": args.context, "steps": args.steps, "reps": args.reps,
            "rows": rows, "other_kernel_changes": changes}
    with open(os.path.join(args.out, "step_profile.json"), "w") as f:
        json.dump(info, f, indent=1)
    for arm in ARMS:
        print(arm, "attention kernels (ms a step):", json.dumps(rows[arm]["attention_kernels_ms"], indent=None))
    u, g = rows["unpatched"], rows["gproj"]
    print(f"\nstep {args.context}, {args.reps}x{args.steps} steps an arm (wall: no profiler; kernels: CUDA-only trace)")
    print("| arm | wall ms | kernels ms | attention kernels ms | other kernels ms | GPU idle ms |")
    print("|---|---|---|---|---|---|")
    for arm, r in rows.items():
        print(f"| {arm} | {r['wall_ms']:.2f} | {r['kernels_ms']:.2f} | {r['attention_ms']:.2f} | {r['other_ms']:.2f} |"
              f" {r['idle_ms']:.2f} |")
    d = {key: g[key] - u[key] for key in ("wall_ms", "attention_ms", "other_ms", "idle_ms")}
    print(f"| gproj − unpatched | {d['wall_ms']:+.2f} ({d['wall_ms'] / u['wall_ms']:+.1%}) | | "
          f"{d['attention_ms']:+.2f} | {d['other_ms']:+.2f} | {d['idle_ms']:+.2f} |")
    print("\nother kernels that differ most (ms a step): unpatched / gproj")
    for name, a, b in changes:
        print(f"  {a:7.3f} / {b:7.3f}  {name}")


if __name__ == "__main__":
    main()
