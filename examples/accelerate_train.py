"""A plain Accelerate training loop that the patch reaches with no code change.

    GPROJ_PATCH=1 GPROJ_MODE=auto accelerate launch examples/accelerate_train.py
    GPROJ_PATCH=1 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py   # CPU: gloo ranks

GPROJ_PATCH=1 makes every rank's interpreter enable gproj_patch when it imports torch (the .pth start-up hook
the package installs; accelerate passes the environment to each rank). Nothing below mentions gproj_patch
except the report at the end and the optional layer naming (`--name-layers`, one line: track_layers(model)).
Without the flag, `--enable` turns the patch on in code instead.
"""
import argparse
import os
import sys

import torch
import transformers
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tiny_llama import RandomTokens, build_model  # noqa: E402  (same tiny model and data)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--drive-layer", type=int, default=None)
    ap.add_argument("--enable", default=None, help="enable in code with this mode (instead of GPROJ_PATCH=1)")
    ap.add_argument("--name-layers", action="store_true", help="name policy records after HF modules")
    args = ap.parse_args(argv)

    import gproj_patch
    if args.enable:
        gproj_patch.enable(mode=args.enable)
    acc = Accelerator(cpu=not torch.cuda.is_available())
    model = build_model(drive_layer=args.drive_layer)
    if args.name_layers:
        from gproj_patch.layers.tracking import track_layers
        track_layers(model)
    data = torch.utils.data.DataLoader(RandomTokens(args.steps * args.batch * acc.num_processes, args.seq, 256),
                                       batch_size=args.batch)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt, data = acc.prepare(model, opt, data)
    model.train()
    for step, batch in enumerate(data):
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if step % 5 == 0:
            acc.print(f"step {step} loss {loss.item():.4f}")

    st = gproj_patch.stats()
    # every rank reports itself (the acceptance check of GPROJ_PATCH=1 under accelerate launch)
    print(f"[rank {acc.process_index}/{acc.num_processes}] gproj_patch enabled={gproj_patch.is_enabled()} "
          f"backward tiers: gproj={st['gproj']} fp32={st['fp32']} original={st['original']}", flush=True)
    if acc.is_main_process:
        from gproj_patch import policy
        for name, rec in policy.stats().items():
            acc.print(f"  {name}: tier={rec['tier']} R_k={rec['stats'].get('r_k', float('nan')):.3f}")
    acc.end_training()


if __name__ == "__main__":
    main()
