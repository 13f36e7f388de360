"""The training step with the patch: step time per arm, memory over steps, compile counts, and where a step's
``gproj`` overhead goes (attention kernels, other kernels, GPU idle).

    python -m benchmarks.step [--contexts 4096x2,16384x1] [--reps 3] [--steps 8] [--compile] [--out DIR]
    python -m benchmarks.step --profile [--contexts 4096x2] [--reps 3] [--steps 6]
    python -m benchmarks.step --fresh [--arms unpatched,gproj,auto] [--contexts 4096x2] [--reps 2]
    python -m benchmarks.step --smoke            # CPU: a 2-layer Llama at seq 64 (the plumbing)

The model (``common.build_llama``): Llama-style from a config, 0.5B (hidden 2048, 16 query heads of 128, 8 KV
heads, 8 layers), BF16, HF's "sdpa" attention (cuDNN on the H200), AdamW; random token ids.

Times (``common.step_times``): arms unpatched, ``gproj`` and ``auto`` (benign keys: the policy keeps the original
backward), alternated ``--reps`` times, ``--steps`` timed steps a block after one warm-up step; the median step
ms per arm, the peak allocated MiB and the MiB allocated after every timed step (flat when nothing leaks: the
growth column). ``--compile``: the loss under ``torch.compile(fullgraph=True)``, one compiled function per arm,
and Dynamo's graphs / recompiles per arm (the patch must compile each arm once).

``--fresh``: every block in a process of its own (the arms alternated over processes), each arm's first backward
the first of its process — as in a training script that calls ``enable()`` before it trains. In one process an
arm enabled after the unpatched arm's CUDA backwards finds cuDNN plans it did not build (their cached dO layout
unknown to it), and the patch's cuDNN guard sends those keys to the corrected tier, so ``auto`` there costs what
``gproj`` does; ``--fresh`` measures ``auto`` as a user gets it. Step times pooled per arm over the processes.

``--profile`` (CUDA), at the first context, arms unpatched and ``gproj``: the wall ms a step as above (no
profiler), then a ``torch.profiler`` trace of CUDA activity only over ``--steps`` more steps (no CPU events, so
the host path is not slowed): every kernel's device time a step, split into attention kernels (the fused SDPA
forwards and backwards and GProj's launches, matched by name) and the rest. Kernels of one stream do not
overlap, so wall − kernel time is the time the GPU waited for the host. The table says which part of
``gproj − unpatched`` is attention kernel time, other kernels and GPU idle.

Writes ``step.json`` and ``step.log`` under ``--out`` (default ``$OUT/step``); the table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from benchmarks import common

#: substrings of the attention kernels' names: cuDNN's / flash's fused SDPA and GProj's launches
ATTENTION_NAMES = ("cudnn", "fmha", "flash", "sdpa", "attention", "_dq_kernel", "_dkdv_kernel", "gproj")
PROFILE_ARMS = ("unpatched", "gproj")


def is_attention(name: str) -> bool:
    low = name.lower()
    return any(s in low for s in ATTENTION_NAMES)


def one_step(model, opt, ids):
    common.loss_of(model, ids).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def kernel_split(model, opt, ids, steps: int) -> dict:
    """Device ms a step of every kernel, of the attention kernels (by name), and of each other kernel."""
    from torch.profiler import ProfilerActivity, profile
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
    """(name, unpatched ms, gproj ms) of the non-attention kernels whose time a step differs most between the arms
    (a kernel only one arm runs counts 0 in the other): what the "other kernels" difference adds up."""
    rows = [(n, unpatched.get(n, 0.0), gproj.get(n, 0.0)) for n in set(unpatched) | set(gproj)]
    return sorted(rows, key=lambda r: -abs(r[2] - r[1]))[:top]


def profile_step(context: str, reps: int, steps: int, log) -> dict:
    seq, batch = (int(x) for x in context.split("x"))
    walls = common.step_times(seq, batch, reps=reps, steps=steps, arms=PROFILE_ARMS)["ms"]
    model, cfg = common.build_llama(seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    rows, split = {}, {}
    for arm in PROFILE_ARMS:
        common.arm(arm)
        k = split[arm] = kernel_split(model, opt, ids, steps)
        rows[arm] = {"wall_ms": walls[arm], "kernels_ms": k["kernels_ms"], "attention_ms": k["attention_ms"],
                     "other_ms": k["kernels_ms"] - k["attention_ms"], "idle_ms": walls[arm] - k["kernels_ms"],
                     "attention_kernels_ms": k["attention_kernels_ms"], "tiers": common.tiers()}
    common.arm("unpatched")
    changes = other_kernel_changes(split["unpatched"]["other_kernels_ms"], split["gproj"]["other_kernels_ms"])
    for arm in PROFILE_ARMS:
        log(arm, "attention kernels (ms a step):", json.dumps(rows[arm]["attention_kernels_ms"]))
    log("\nother kernels that differ most (ms a step): unpatched / gproj")
    for name, a, b in changes:
        log(f"  {a:7.3f} / {b:7.3f}  {name}")
    u, g = rows["unpatched"], rows["gproj"]
    log(f"\nstep {context}, {reps}x{steps} steps an arm (wall: no profiler; kernels: CUDA-only trace)")
    log("| arm | wall ms | kernels ms | attention kernels ms | other kernels ms | GPU idle ms |")
    log("|---|---|---|---|---|---|")
    for arm, r in rows.items():
        log(f"| {arm} | {r['wall_ms']:.2f} | {r['kernels_ms']:.2f} | {r['attention_ms']:.2f} | {r['other_ms']:.2f} "
            f"| {r['idle_ms']:.2f} |")
    d = {key: g[key] - u[key] for key in ("wall_ms", "attention_ms", "other_ms", "idle_ms")}
    log(f"| gproj − unpatched | {d['wall_ms']:+.2f} ({d['wall_ms'] / u['wall_ms']:+.1%}) | | "
        f"{d['attention_ms']:+.2f} | {d['other_ms']:+.2f} | {d['idle_ms']:+.2f} |")
    return {"context": context, "rows": rows, "other_kernel_changes": changes}


def fresh_times(args, ctx: str, out: str, log) -> dict:
    """``step_times`` with every block (one arm, ``--steps`` timed steps) in a new process, the arms alternated
    over ``--reps`` rounds; each arm's step times pooled over its processes."""
    arms = args.arms.split(",")
    pooled = {"ms": {}, "times_ms": {a: [] for a in arms}, "peak_mib": {}, "allocated_mib": {},
              "graphs_recompiles": {} if args.compile else None, "processes": []}
    for rep in range(args.reps):
        for a in arms:
            sub = os.path.join(out, f"fresh_{ctx}_{rep}_{a}")
            options = ["--contexts", ctx, "--reps", "1", "--steps", str(args.steps), "--arms", a] + \
                (["--compile"] if args.compile else []) + (["--smoke"] if args.smoke else [])
            r = common.run_entry_point("step", options, sub)["steps"][ctx]
            pooled["times_ms"][a] += r["times_ms"][a]
            pooled["processes"].append({"arm": a, "rep": rep, "ms": r["ms"][a]})
            if r["peak_mib"]:
                pooled["peak_mib"][a] = max(pooled["peak_mib"].get(a, 0.0), r["peak_mib"][a])
                pooled["allocated_mib"][a] = r["allocated_mib"][a]  # the last process's steps
            if args.compile:
                g, c = pooled["graphs_recompiles"].get(a, (0, 0))
                pooled["graphs_recompiles"][a] = (g + r["graphs_recompiles"][a][0], c + r["graphs_recompiles"][a][1])
            log(f"  process {rep}/{a}: median {r['ms'][a]:.2f} ms")
    pooled["ms"] = {a: statistics.median(v) for a, v in pooled["times_ms"].items()}
    if not pooled["peak_mib"]:  # no CUDA: as step_times reports it
        pooled["peak_mib"] = pooled["allocated_mib"] = None
    return pooled


def time_steps(args, device: str, log, out_folder: str) -> dict:
    out = {}
    for ctx in (c for c in args.contexts.split(",") if c):
        seq, batch = (int(x) for x in ctx.split("x"))
        if args.fresh:
            out[ctx] = r = fresh_times(args, ctx, out_folder, log)
        else:
            out[ctx] = r = common.step_times(seq, batch, reps=args.reps, steps=args.steps, compile_loss=args.compile,
                                             device=device, small=args.smoke, arms=tuple(args.arms.split(",")))
        log(common.step_line(ctx, r))
    log(f"\n| seq × batch | arm | step ms (median) | vs unpatched | peak MiB | MiB after first / last timed step "
        f"|{' graphs / recompiles |' if args.compile else ''}")
    log("|---|---|---|---|---|---|" + ("---|" if args.compile else ""))
    for ctx, r in out.items():
        for arm, ms in r["ms"].items():
            alloc = (r["allocated_mib"] or {}).get(arm)
            cells = [ctx, arm, f"{ms:.2f}", f"{100 * (ms / r['ms']['unpatched'] - 1):+.1f}%" if "unpatched" in r["ms"] else "n/a",
                     f"{r['peak_mib'][arm]:.0f}" if r["peak_mib"] else "n/a",
                     f"{alloc[0]:.1f} / {alloc[-1]:.1f}" if alloc else "n/a"]
            if args.compile:
                cells.append("{} / {}".format(*r["graphs_recompiles"][arm]))
            log("| " + " | ".join(cells) + " |")
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default=None, help="seq x batch, comma-separated (default 4096x2,16384x1)")
    ap.add_argument("--reps", type=int, default=3, help="blocks an arm, the arms alternated")
    ap.add_argument("--steps", type=int, default=8, help="timed steps a block (after one warm-up step)")
    ap.add_argument("--compile", action="store_true", help="the loss under torch.compile(fullgraph=True)")
    ap.add_argument("--arms", default=",".join(common.ARMS), help="comma-separated, of unpatched,gproj,auto "
                    "(unpatched first: the others are compared with it)")
    ap.add_argument("--fresh", action="store_true", help="every block in a new process (module docstring)")
    ap.add_argument("--profile", action="store_true", help="split the first context's step (CUDA)")
    ap.add_argument("--smoke", action="store_true", help="CPU: a 2-layer Llama at seq 64, 1 block of 2 steps")
    ap.add_argument("--out", default=None, help="folder for step.json and step.log (default $OUT/step)")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if not arms or any(a not in common.ARMS for a in arms) or len(set(arms)) != len(arms):
        ap.error(f"--arms: distinct names of {', '.join(common.ARMS)}, got {args.arms!r}")
    if args.fresh and arms[0] != "unpatched":
        ap.error("--fresh compares the arms with the unpatched one: list unpatched first")
    if args.fresh and args.profile:
        ap.error("--fresh times steps; --profile splits one process's step: one or the other")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    out = common.out_dir("step", args.out)
    if args.smoke:
        args.contexts, args.reps, args.steps = args.contexts or "64x2", 1, 2
        torch.set_num_threads(1)
    args.contexts = args.contexts or "4096x2,16384x1"
    device = "cpu" if args.smoke else "cuda"
    log = common.Log()
    result = {"environment": common.environment(), "args": vars(args)}
    log(common.banner(result["environment"]))
    if args.profile:
        result["profile"] = profile_step(args.contexts.split(",")[0], args.reps, args.steps, log)
    else:
        result["steps"] = time_steps(args, device, log, out)
    common.save_json(os.path.join(out, "step.json"), result)
    log.write(os.path.join(out, "step.log"))
    return result


if __name__ == "__main__":
    main()
