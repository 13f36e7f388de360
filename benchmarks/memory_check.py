"""Memory over repeated training steps, patched vs unpatched (issue 8.1): a BF16 Llama-style model from a config
on cuDNN SDPA, ≥ 20 AdamW steps per arm; prints allocated memory after each step and the peak, per arm.

    PYTHONPATH=. python benchmarks/memory_check.py [--steps 20] [--seq 4096] [--layers 8]
"""
import argparse
import json
import os

import torch

import gproj_patch


def run_arm(mode, args):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    gproj_patch.reset_stats()
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=args.layers,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=args.seq)
    if mode != "unpatched":
        gproj_patch.enable(mode=mode)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    allocated = []
    for _ in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated() / 2 ** 20)
    peak = torch.cuda.max_memory_allocated() / 2 ** 20
    stats = gproj_patch.stats()
    gproj_patch.disable()
    del model, opt
    torch.cuda.empty_cache()
    return {"allocated_mib": allocated, "peak_mib": peak, "stats": {k: stats[k] for k in ("gproj", "fp32", "original")}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    res = {mode: run_arm(mode, args) for mode in ("unpatched", "gproj", "auto")}
    with open(os.path.join(args.out, "memory_check.json"), "w") as f:
        json.dump({"args": vars(args), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), **res}, f)
    print(f"{'arm':10s} {'after step 1':>13s} {'after last':>11s} {'growth':>8s} {'peak':>9s}  backward tiers")
    for mode, r in res.items():
        a = r["allocated_mib"]
        print(f"{mode:10s} {a[0]:11.1f}Mi {a[-1]:9.1f}Mi {a[-1] - a[0]:7.1f}Mi {r['peak_mib']:7.1f}Mi  {r['stats']}")


if __name__ == "__main__":
    main()
