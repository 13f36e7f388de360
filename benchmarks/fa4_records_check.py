"""Device check of FA4 forward records in ``auto`` (issue 19 item 2): real flash-attn-4, two layers, one sick.

    bash benchmarks/external_gpu.sh records                      # H200: installs FA4 from the carried wheels
    PYTHONPATH=. python3 benchmarks/fa4_records_check.py         # where flash-attn-4 is importable already
    PYTHONPATH=. python3 benchmarks/fa4_records_check.py --cpu   # the same code on the CPU stand-in of 4.0.0b36

Two FA4 attention layers through ``flash_attn.cute.interface.flash_attn_func`` — the caller keeps ``out`` only,
as models do — one with benign keys, one with a common key offset of ``--offset`` (300) times the keys' spread.
Each runs unpatched first (FA4's own backward), then under ``gproj_patch.enable(mode="auto", sample_every=1)``
for ``--steps`` steps, each layer's forward inside its ``layer_scope``, one backward per step after both
forwards. Checked:

- two policy records, under the two layer names (a backward that missed its forward's record would be filed
  under the source ``flash_attn_4:dense``: one record for both layers);
- the healthy layer ran FA4's own backward on every step, the sick layer left it (the GProj kernel on a GPU, the
  FP32 tier on the CPU) from the first step on;
- gradients against the fp64 oracle (``backends/reference.py``, same BF16 inputs): the sick layer's patched
  dq, dk, dv within ``--bound`` (1%) and its unpatched dq at least 10x worse; the healthy layer's patched
  error no worse than twice its unpatched one (FA4's backward, not bitwise: its dq accumulates atomically);
- no "no forward record" line logged by ``gproj_patch`` and no such fallback reason counted;
- no forward record alive after the last backward.

Prints a table (layer, tier per step, dq/dk/dv error off and on) and a JSON summary (``--out DIR`` writes
``fa4_records.json`` there). Exit status 1 if a check fails, 2 if FA4 cannot be imported.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import pathlib
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Dict, List, Tuple

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import gproj_patch  # noqa: E402
from gproj_patch import policy  # noqa: E402
from gproj_patch.backends.reference import reference_backward  # noqa: E402
from gproj_patch.integrations import fa_records  # noqa: E402

NO_RECORD = "no forward record"
FAR = 10.0  # the sick layer's unpatched dq error: at least this many times its patched one


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass
class Layer:
    name: str
    offset: float
    inputs: Tuple[torch.Tensor, ...]   # q, k, v, do in FA4's (B, S, H, D) layout, BF16
    oracle: Tuple[torch.Tensor, ...]   # fp64 dq, dk, dv in (B, H, S, D)


class Lines(logging.Handler):
    """Keeps every message logged to ``gproj_patch``."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: List[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def load_fa4(cpu: bool):
    """The FA4 interface module: the installed release, or (``cpu``) the tests' stand-in of 4.0.0b36."""
    if cpu:
        sys.path.insert(0, str(REPO / "tests"))
        import fa4_standin

        class _Patch:  # fa4_standin.load takes a monkeypatch; here the modules simply stay installed
            @staticmethod
            def setitem(mapping, key, value):
                mapping[key] = value
        return fa4_standin.load(_Patch()), f"stand-in of {fa4_standin.RELEASE}"
    import flash_attn.cute.interface as iface
    try:
        version = metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:  # importable without its metadata (e.g. a source checkout)
        version = "unknown"
    return iface, version


def bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def make_layer(name: str, offset: float, shape: Shape, seed: int, device: str) -> Layer:
    g = torch.Generator().manual_seed(seed)
    lead = (shape.batch, shape.seqlen)
    q, k, v, do = (torch.randn(*lead, h, shape.head_dim, generator=g)
                   for h in (shape.heads, shape.kv_heads, shape.kv_heads, shape.heads))
    inputs = tuple(t.bfloat16().to(device) for t in (q, k + offset, v, do))
    oracle = reference_backward(*(bhsd(t) for t in inputs), causal=True, causal_align="bottom_right")
    return Layer(name, offset, inputs, tuple(oracle))


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = bhsd(got).double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def gradients(iface, layers: List[Layer], scoped: bool) -> Dict[str, Tuple[torch.Tensor, ...]]:
    """One step: every layer's forward (``flash_attn_func``, ``out`` kept only), then one backward."""
    leaves, loss = {}, 0.0
    for layer in layers:
        q, k, v, do = layer.inputs
        leaves[layer.name] = [t.clone().requires_grad_() for t in (q, k, v)]
        if scoped:
            with gproj_patch.layer_scope(layer.name):
                out = iface.flash_attn_func(*leaves[layer.name], causal=True)[0]
        else:
            out = iface.flash_attn_func(*leaves[layer.name], causal=True)[0]
        loss = loss + (out.float() * do.float()).sum()
    loss.backward()
    return {name: tuple(t.grad for t in ts) for name, ts in leaves.items()}


def errors(grads, layer: Layer) -> List[float]:
    return [rel(g, w) for g, w in zip(grads[layer.name], layer.oracle)]


def errors_by_layer(grads, layers: List[Layer]) -> Dict[str, List[float]]:
    return {layer.name: errors(grads, layer) for layer in layers}


def run(args) -> int:
    device = "cpu" if args.cpu else "cuda"
    try:
        iface, version = load_fa4(args.cpu)
    except Exception as exc:  # report and stop: nothing to check without FA4
        print(f"flash-attn-4 not importable: {exc!r}")
        return 2
    shape = Shape(args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim)
    layers = [make_layer("fa4.healthy", 0.0, shape, 1, device),
              make_layer("fa4.sick", args.offset, shape, 2, device)]
    off = errors_by_layer(gradients(iface, layers, scoped=False), layers)

    lines = Lines()
    logger = logging.getLogger("gproj_patch")
    logger.addHandler(lines)
    gproj_patch.reset_stats()
    tiers: Dict[str, List[str]] = {layer.name: [] for layer in layers}
    try:
        with gproj_patch.enable(mode="auto", targets=("flash_attn",), sample_every=1) as handle:
            installed = handle.installed["flash_attn"]
            for _step in range(args.steps):
                grads = gradients(iface, layers, scoped=True)
                for name, rec in gproj_patch.stats()["layers"].items():
                    tiers.setdefault(name, []).append(rec["tier"])
        stats = gproj_patch.stats()
    finally:
        logger.removeHandler(lines)
    on = errors_by_layer(grads, layers)
    del grads
    gc.collect()
    live = fa_records.live_records()
    healthy, sick = (layer.name for layer in layers)
    expected_sick_tier = "fp32" if args.cpu else "gproj"
    checks = {
        "two records under the layer names": sorted(policy.stats()) == sorted(tiers) == sorted((healthy, sick)),
        "healthy layer on FA4's backward every step": tiers.get(healthy) == ["original"] * args.steps,
        f"sick layer corrected ({expected_sick_tier}) every step": tiers.get(sick) == [expected_sick_tier] * args.steps,
        "sick layer within bound": max(on[sick]) < args.bound,
        "sick layer's unpatched dq far off": off[sick][0] > FAR * on[sick][0],
        "healthy layer as accurate as unpatched": all(e_on <= 2 * e_off + 1e-6
                                                      for e_on, e_off in zip(on[healthy], off[healthy])),
        "no 'no forward record' logged": not any(NO_RECORD in m for m in lines.messages)
        and not any(NO_RECORD in r for r in stats["fallback_reasons"]),
        "no record alive after the backward": live == 0,
    }
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"flash-attn-4 {version}; {installed}")
    print(f"shape B={shape.batch} S={shape.seqlen} H={shape.heads} Hkv={shape.kv_heads} D={shape.head_dim}, "
          f"causal, BF16, sick offset {args.offset}σ, {args.steps} steps in auto (sample_every=1)")
    print("| layer | tier per step | dq / dk / dv error, FA4 unpatched | dq / dk / dv error, auto |")
    print("|---|---|---|---|")
    for layer in layers:
        fmt = " / ".join
        print(f"| {layer.name} | {', '.join(tiers.get(layer.name, []))} | "
              f"{fmt(f'{e:.2e}' for e in off[layer.name])} | {fmt(f'{e:.2e}' for e in on[layer.name])} |")
    print(f"policy records: {sorted(policy.stats())}; backwards per tier: "
          f"gproj {stats['gproj']}, fp32 {stats['fp32']}, original {stats['original']}; "
          f"fallback reasons: {dict(stats['fallback_reasons'])}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    summary = dict(version=version, device=device, shape=shape.__dict__, offset=args.offset, steps=args.steps,
                   tiers=tiers, errors_off=off, errors_on=on, stats={k: stats[k] for k in ("gproj", "fp32", "original")},
                   fallback_reasons=dict(stats["fallback_reasons"]), log_lines=lines.messages, checks=checks)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fa4_records.json").write_text(json.dumps(summary, indent=1))
    return 0 if all(checks.values()) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU stand-in of FA4 4.0.0b36 (tests/helpers/fa4_standin.py)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seqlen", type=int, default=None)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--offset", type=float, default=300.0, help="the sick layer's common key offset, in σ")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bound", type=float, default=1e-2)
    ap.add_argument("--out", default=None, help="folder for fa4_records.json")
    args = ap.parse_args(argv)
    small = args.cpu  # the CPU stand-in computes in fp64 and emulates the backward: a small problem
    args.batch = args.batch or (1 if small else 2)
    args.seqlen = args.seqlen or (64 if small else 2048)
    args.head_dim = args.head_dim or (32 if small else 128)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
