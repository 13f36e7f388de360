"""Data-parallel training (DDP or FSDP2) of a tiny Llama with the corrected attention backward on every rank.

    GPROJ_PATCH=1 torchrun --nproc-per-node 2 examples/multi_gpu_train.py --wrap ddp
    GPROJ_PATCH=1 torchrun --nproc-per-node 2 examples/multi_gpu_train.py --wrap fsdp2
    GPROJ_PATCH=1 accelerate launch --multi_gpu --num_processes 2 examples/multi_gpu_train.py --wrap fsdp2
    # no GPU: the same commands run two gloo ranks on the CPU (accelerate: add ACCELERATE_USE_CPU=1)

The patch is per process: GPROJ_PATCH=1 makes each rank's interpreter call ``gproj_patch.enable()`` when it
imports torch (the .pth start-up hook the package installs; torchrun and accelerate pass the environment to every
rank), so each rank's attention backward is corrected on its own shard of the *batch* — exact, since data
parallelism never splits an attention row. ``--enable MODE`` turns it on in code instead. Nothing else in the
loop mentions gproj_patch; every rank prints its own ``gproj_patch.stats()`` at the end.

The script is launcher-agnostic: it reads RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun and by accelerate
launch), initializes NCCL on GPUs and gloo on the CPU, and wraps the model with plain PyTorch
(``DistributedDataParallel`` or FSDP2's ``fully_shard`` per decoder layer and at the root). Parameters stay FP32;
the forward runs under BF16 autocast, so attention sees BF16 q/k/v (what the patch corrects). The model is a
tiny Llama built from a config (no downloads), the data fixed random tokens: every rank takes its slice of the
same global batch, so the run equals a single-process run on that global batch up to reduction order
(``python -m benchmarks.multi_gpu --part dp`` checks exactly that on two GPUs, or with ``--cpu`` on two gloo ranks).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tiny_llama import build_model  # noqa: E402  (the repository's tiny Llama, optionally key-driven)


def setup():
    """(rank, world, device): the process group from the launcher's environment (a single process without)."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def global_batch(step: int, batch: int, seq: int, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    """Token ids (batch, seq) of global step ``step``: the same on every rank and in a single-process run."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def local_slice(ids: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if ids.shape[0] % world:
        raise ValueError(f"global batch {ids.shape[0]} is not divisible by the world size {world}")
    n = ids.shape[0] // world
    return ids[rank * n:(rank + 1) * n]


def make_model(device, layers=2, hidden=128, heads=4, kv_heads=2, drive_layer=None, offset=60.0):
    """The tiny Llama in FP32 (same initialization on every rank: build_model seeds it)."""
    return build_model(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, drive_layer=drive_layer,
                       offset=offset, dtype=torch.float32).to(device)


def wrap(model, how: str, device):
    if how == "none":
        return model
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    raise ValueError(f"unknown wrap {how!r}")


def loss_of(model, ids, device):
    ids = ids.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        return model(input_ids=ids, labels=ids).loss


def full_grads(model):
    """{name: full FP32 gradient} (FSDP2's DTensor shards gathered; DDP's are already averaged)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name.replace("module.", "", 1)] = g.detach().float().cpu()
    return out


def report(rank, world, wrap_name):
    import gproj_patch
    st = gproj_patch.stats()
    return (f"[rank {rank}/{world}] wrap={wrap_name} gproj_patch enabled={gproj_patch.is_enabled()} "
            f"backward tiers: gproj={st['gproj']} fp32={st['fp32']} original={st['original']} "
            f"fallback_reasons={st['fallback_reasons']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wrap", choices=["ddp", "fsdp2", "none"], default="ddp")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--drive-layer", type=int, default=None, help="put this layer's keys in the large-key regime")
    ap.add_argument("--enable", default=None, help="enable in code with this mode (instead of GPROJ_PATCH=1)")
    args = ap.parse_args(argv)

    import gproj_patch
    if args.enable:
        gproj_patch.enable(mode=args.enable)
    rank, world, device = setup()
    how = args.wrap if world > 1 else "none"
    model = wrap(make_model(device, layers=args.layers, drive_layer=args.drive_layer), how, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    for step in range(args.steps):
        ids = local_slice(global_batch(step, args.global_batch, args.seq), rank, world)
        loss = loss_of(model, ids, device)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 2 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if world > 1:
        dist.barrier()
    print(report(rank, world, how), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
