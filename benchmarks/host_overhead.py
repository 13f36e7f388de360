"""Where a hooked SDPA call spends its time on the host, and what the patch costs end to end (H200).

1. Host time per call: forward+backward wall time at a tiny CUDA shape (GPU work ~µs, so wall ≈ host), per
   arm: unpatched, gproj, auto (benign keys: the policy keeps "original", unsampled calls), and the Python
   profile's top functions of the patched call.
2. Attention forward+backward (do_bench median) at the issue-11 shapes, unpatched (cuDNN) vs gproj vs auto.
3. Training step of a Llama-style model from a config (hidden 2048, 16×128 heads, 8 KV heads, 8 layers, AdamW,
   BF16) at seq 4096 batch 2 and seq 16384 batch 1 (``--contexts``), arms alternated over ``--reps`` repetitions
   of ``--steps`` steps; median step time and peak memory per arm.

    PYTHONPATH=. python benchmarks/host_overhead.py [--reps 3 --steps 8] [--skip-host] [--skip-attention]
        [--contexts 4096x2,16384x1 | ""] [--compile]

``--compile``: the model's loss (and the tiny call of 1.) under ``torch.compile(fullgraph=True)``, one compiled
function per arm (enable/disable changes what Dynamo traces); Dynamo's graph and recompile counts per arm are
reported — the patch must compile each arm once (issue 19, item 1).
"""
import argparse
import json
import os
import statistics
import time
import types

import torch
import torch.nn.functional as F
import triton.testing

import gproj_patch
import host_cpu  # tottime_profile (benchmarks/ is on sys.path: this script's folder, or speed_run's)

ARMS = ("unpatched", "gproj", "auto")
# (B, H, S, D, causal[, KV heads]): the issue-11 shapes, GQA last
SHAPES = [(4, 16, 4096, 64, True), (4, 16, 4096, 128, True), (2, 16, 8192, 128, False), (1, 16, 16384, 128, True),
          (2, 32, 8192, 128, True, 8)]


def _arm(mode):
    gproj_patch.disable()
    gproj_patch.reset_stats()
    if mode != "unpatched":
        gproj_patch.enable(mode=mode, sample_every=1000)


def _attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def host_time(mode, n=300, compile_=False):
    _arm(mode)
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    attend = torch.compile(_attend, fullgraph=True) if compile_ else _attend

    def step():
        attend(q, k, v).backward(do)
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    us = (time.perf_counter() - t) / n * 1e6
    profile = ""
    if mode != "unpatched" and not compile_:
        profile = host_cpu.tottime_profile(step, 100, 12, sync=torch.cuda.synchronize)
    return us, profile


def attention_time(mode, B, H, S, D, causal, hkv=None):
    _arm(mode)
    hkv = H if hkv is None else hkv
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, hkv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != H).backward(do)
    return triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")


def build_model(seq):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=seq)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    return model, cfg


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _own_code(fn, arm):
    """``fn`` with a code object of its own: Dynamo caches compiled graphs per code object, so each arm's graph
    is its first compile (not a recompile of another arm's) and the counts per arm mean what they say."""
    return types.FunctionType(fn.__code__.replace(co_name=f"{fn.__name__}_{arm}"), fn.__globals__, fn.__name__)


def step_times(args, seq, batch):
    """Median step ms and peak MiB per arm, arms alternated ``args.reps`` times (with ``--compile``: one
    compiled loss per arm, and Dynamo's graphs/recompiles counted per arm)."""
    from torch._dynamo.utils import counters
    model, cfg = build_model(seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    times = {a: [] for a in ARMS}
    peak = {a: 0.0 for a in ARMS}
    loss_fn = {a: torch.compile(_own_code(_loss, a), fullgraph=True) if args.compile else _loss for a in ARMS}
    compiles = {a: [0, 0] for a in ARMS}  # graphs, recompiles
    torch._dynamo.reset()
    for _rep in range(args.reps):
        for mode in ARMS:
            _arm(mode)
            torch.cuda.reset_peak_memory_stats()
            graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
            for i in range(args.steps + 1):
                torch.cuda.synchronize()
                t = time.perf_counter()
                loss_fn[mode](model, ids).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                if i:  # the first step of each block warms up
                    times[mode].append((time.perf_counter() - t) * 1e3)
            peak[mode] = max(peak[mode], torch.cuda.max_memory_allocated() / 2**20)
            compiles[mode][0] += counters["stats"]["unique_graphs"] - graphs
            compiles[mode][1] += sum(counters["recompiles"].values()) - recompiles
    gproj_patch.disable()
    del model, opt
    torch.cuda.empty_cache()
    return {"ms": {m: statistics.median(v) for m, v in times.items()}, "peak_mib": peak,
            "graphs_recompiles": compiles if args.compile else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--contexts", default="4096x2,16384x1", help="seq x batch of the training steps")
    ap.add_argument("--skip-host", action="store_true")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the loss and tiny call")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "host_us": {}, "attention_ms": {},
           "compiled": args.compile}
    for mode in ARMS if not args.skip_host else ():
        us, profile = host_time(mode, compile_=args.compile)
        res["host_us"][mode] = us
        if profile:
            print(f"--- profile, mode {mode} (100 calls) ---\n{profile[-2500:]}")
    for shape in SHAPES if not args.skip_attention else ():
        res["attention_ms"][str(shape)] = {m: attention_time(m, *shape) for m in ARMS}
    res["steps"] = {}
    for ctx in (c for c in args.contexts.split(",") if c):
        seq, batch = (int(x) for x in ctx.split("x"))
        res["steps"][ctx] = step_times(args, seq, batch)
        with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
            json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
        json.dump(res, f, indent=1)
    if res["host_us"]:
        base = res["host_us"]["unpatched"]
        print(f"host µs per fwd+bwd call (1·2·128·64{', compiled' if args.compile else ''}):",
              ", ".join(f"{m} {v:.0f} (+{v - base:.0f})" for m, v in res["host_us"].items()))
    if res["attention_ms"]:
        print(f"{'shape':28s} " + " ".join(f"{m:>10s}" for m in ARMS) + "   gproj/unp  auto/unp")
    for shape, t in res["attention_ms"].items():
        print(f"{shape:28s} " + " ".join(f"{t[m]:10.3f}" for m in ARMS)
              + f"   ×{t['gproj'] / t['unpatched']:.3f}   ×{t['auto'] / t['unpatched']:.3f}")
    for ctx, r in res["steps"].items():
        s, peak = r["ms"], r["peak_mib"]
        print(f"step ms (0.5B, seq x batch {ctx}, median of {args.reps}×{args.steps}, alternated): "
              + ", ".join(f"{m} {v:.1f}" for m, v in s.items())
              + f"; gproj {100 * (s['gproj'] / s['unpatched'] - 1):+.1f}%, auto {100 * (s['auto'] / s['unpatched'] - 1):+.1f}%"
              + "; peak MiB " + ", ".join(f"{m} {v:.0f}" for m, v in peak.items())
              + ("" if not r["graphs_recompiles"] else
                 "; graphs/recompiles " + ", ".join(f"{m} {g}/{c}" for m, (g, c) in r["graphs_recompiles"].items())))


if __name__ == "__main__":
    main()
