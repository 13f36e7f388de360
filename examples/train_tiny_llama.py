"""Train a tiny Llama (built from a config: no downloads) with the HF Trainer and GProjCallback, on CPU or GPU.

    python examples/train_tiny_llama.py                       # auto mode, ~20 s on a laptop CPU
    python examples/train_tiny_llama.py --drive-layer 1       # push layer 1's keys into the large-key regime
    python examples/train_tiny_llama.py --mode audit --sample-every 5

The callback enables the patch when the Trainer is built (before the first forward), names each attention
call after its module ("model.layers.1.self_attn"), and writes gproj/... statistics into every log, so they
reach TensorBoard / W&B with `--report-to tensorboard`. With --drive-layer, that layer's key projection gets a
large constant bias on its lowest RoPE frequency (which RoPE barely rotates): a common key offset far beyond
the keys' spread, the regime where fused BF16 backwards leak (docs/math.md §3). The detector flags that layer.
"""
import argparse
import logging

import torch
import transformers

from gproj_patch import policy
from gproj_patch.integrations.trainer import GProjCallback


class RandomTokens(torch.utils.data.Dataset):
    """Synthetic causal-LM data: fixed random token sequences (labels = inputs)."""

    def __init__(self, n, seq, vocab, seed=0):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(layers=2, hidden=128, heads=4, kv_heads=2, vocab=256, drive_layer=None, offset=60.0,
                dtype=torch.bfloat16, attn="sdpa"):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=1024, attention_bias=drive_layer is not None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.config._attn_implementation = attn
    if drive_layer is not None:
        hd = hidden // heads
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                bias = layer.self_attn.k_proj.bias
                bias.zero_()
                if i == drive_layer:
                    bias[hd // 2 - 1::hd] = offset
                    bias.requires_grad_(False)  # keep the layer in the regime while training
    return model.to(dtype)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="auto", choices=["auto", "audit", "gproj", "fp32", "off"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--drive-layer", type=int, default=None)
    ap.add_argument("--sample-every", type=int, default=10)
    ap.add_argument("--report-to", default="none")
    ap.add_argument("--output-dir", default="/tmp/gproj_tiny_llama")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    model = build_model(layers=args.layers, drive_layer=args.drive_layer)
    targs = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch, logging_steps=10,
        learning_rate=1e-3, report_to=[] if args.report_to == "none" else [args.report_to], save_strategy="no",
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True, dataloader_num_workers=0)
    callback = GProjCallback(mode=args.mode, sample_every=args.sample_every)
    trainer = transformers.Trainer(model=model, args=targs, callbacks=[callback],
                                   train_dataset=RandomTokens(args.steps * args.batch, args.seq, 256))
    trainer.train()

    if trainer.state.is_world_process_zero:
        print("\nper-layer policy records:")
        for name, rec in policy.stats().items():
            s = rec["stats"]
            print(f"  {name:28s} tier={rec['tier']:8s} R_k={s.get('r_k', float('nan')):8.3f} "
                  f"R_q={s.get('r_q', float('nan')):6.3f} predicted dq leak={100 * s.get('leak_dq', 0):7.3f}% "
                  f"calls={rec['calls']}" + (f" audit={rec['audit']}" if rec["audit"] else ""))
        import gproj_patch
        print("backward tiers:", {k: v for k, v in gproj_patch.stats().items() if k != "forward"})


if __name__ == "__main__":
    main()
