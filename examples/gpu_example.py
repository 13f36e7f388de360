"""gproj_patch on a GPU, in code: a BF16 Llama on SDPA (cuDNN / flash), `auto` mode, optional torch.compile.

    python examples/gpu_example.py                         # auto mode, layer 1 driven into the large-key regime
    python examples/gpu_example.py --mode gproj --compile  # always the GProj kernel, compiled model

The fused forward is unchanged and only the backward is corrected (per layer in `auto`). SDPA's backward is
corrected at the dispatcher, so the patch must be on while the backward runs (enabling before or after
torch.compile makes no difference: nothing of the patch is in the graph). Without a GPU it runs a CPU-sized model
instead (`CPU_SIZES`: 2 layers, hidden 128, 128 tokens, 20 steps; ~25 s on a 2-core CPU — the GPU sizes would take
hours there) and says so; there the corrected backward is the FP32 tier (the CPU's planned backward: no fallback
reason). Any size given on the command line is used as given.
"""
import argparse
import logging
import os
import sys
import time

import torch

import gproj_patch
from gproj_patch import policy
from gproj_patch.layers.tracking import track_layers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tiny_llama import build_model  # noqa: E402


#: the model and run on a GPU (the point of the example), and the CPU-sized stand-in used without one
GPU_SIZES = dict(steps=50, seq=2048, batch=4, layers=4, hidden=1024, heads=8)
CPU_SIZES = dict(steps=20, seq=128, batch=2, layers=2, hidden=128, heads=4)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="auto", choices=["auto", "audit", "gproj", "fp32", "off"])
    for name in GPU_SIZES:
        ap.add_argument(f"--{name}", type=int, default=None,
                        help=f"default {GPU_SIZES[name]} on a GPU, {CPU_SIZES[name]} on a CPU")
    ap.add_argument("--drive-layer", type=int, default=1)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = GPU_SIZES if device == "cuda" else CPU_SIZES
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if device == "cpu":
        print(f"no CUDA GPU: a CPU-sized run ({args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
              f"batch {args.batch} x {args.seq} tokens, {args.steps} steps); sizes given on the command line are used "
              "as given", flush=True)

    handle = gproj_patch.enable(mode=args.mode, sample_every=10)   # 1. before the first forward / compile
    model = build_model(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.heads // 2,
                        vocab=32000, drive_layer=args.drive_layer).to(device)
    track_layers(model)                                            # 2. policy records named after HF modules
    if args.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4)
    ids = torch.randint(0, 32000, (args.batch, args.seq), device=device)
    t0 = time.perf_counter()
    for step in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step:4d} loss {loss.item():.4f}")
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"{args.steps} steps in {time.perf_counter() - t0:.2f} s")

    print("backward calls per tier:", {k: v for k, v in gproj_patch.stats().items() if k != "forward"})
    for name, rec in policy.stats().items():                       # 3. what the detector saw, per layer
        s = rec["stats"]
        print(f"  {name:28s} tier={rec['tier']:8s} R_k={s.get('r_k', float('nan')):8.3f} "
              f"predicted dq leak={100 * s.get('leak_dq', 0):7.3f}%  p_sink={s.get('p_sink', float('nan')):.3f}")
    handle.disable()


if __name__ == "__main__":
    main()
