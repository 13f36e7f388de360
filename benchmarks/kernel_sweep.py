"""Block-config sweeps of the GProj Triton kernels on the GPU (greedy: the best dq config with the current dkdv
config, then the best dkdv config with that dq config), for the BF16 kernels and for the FP32 tier's kernel form.

    python benchmarks/kernel_sweep.py [--dims 32,256] [--fp32-dims 64,128] [--deadline 300] [--out DIR]
    python benchmarks/kernel_sweep.py --dims "" --fp32-dims "" --gluon-dims 64      # KV-major: tl vs Gluon builds

``device_check.py --sweep`` calls ``sweep`` for D = 64 and 128. Every candidate is timed (do_bench median of the
whole backward); a candidate that fails to compile or run (shared memory, registers) is skipped with its error.
Writes ``sweep.json`` and prints the chosen configs last, in the form of ``triton_bwd.CONFIGS``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from device_check import bench, make_inputs, saved_forward  # noqa: E402  (benchmarks/device_check.py)
from gproj_patch.backends import triton_bwd  # noqa: E402
from gproj_patch.backends.gluon_bwd import KernelConfig  # noqa: E402
from gproj_patch.backends.triton_bwd import gproj_backward  # noqa: E402

# candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim; the current default is always tried
SWEEP = {
    32: {"dq": [(64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3)],
         "dkdv": [(64, 128, 4, 3), (128, 64, 8, 3), (32, 128, 4, 3), (128, 128, 8, 3)]},
    64: {"dq": [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2), (32, 64, 4, 3),
                (128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 4), (64, 32, 4, 4)],
         "dkdv": [(32, 128, 4, 3), (32, 128, 4, 2), (64, 128, 8, 3), (32, 64, 4, 3), (16, 128, 4, 3),
                  (64, 64, 4, 3)]},
    128: {"dq": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (32, 64, 4, 2), (128, 64, 8, 2), (64, 64, 8, 2),
                 (128, 32, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3), (64, 128, 8, 2)],
          "dkdv": [(32, 64, 4, 3), (32, 64, 4, 4), (64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 4, 2), (32, 128, 8, 2),
                   (64, 64, 4, 3), (16, 64, 4, 2), (64, 128, 8, 3)]},
    256: {"dq": [(64, 32, 4, 1), (32, 32, 4, 1), (64, 64, 8, 1), (32, 64, 4, 1)],
          "dkdv": [(32, 32, 4, 1), (16, 64, 4, 1), (32, 64, 4, 1), (64, 32, 8, 1)]},
}
SWEEP_FP32 = {
    64: {"dq": [(64, 32, 4, 2), (32, 64, 4, 2), (16, 32, 4, 2), (64, 64, 8, 2)],
         "dkdv": [(32, 64, 4, 2), (64, 32, 4, 2), (16, 64, 4, 2), (64, 64, 8, 2)]},
    128: {"dq": [(32, 32, 4, 2), (16, 16, 4, 2), (32, 16, 4, 2), (16, 32, 4, 1)],
          "dkdv": [(32, 32, 4, 2), (32, 16, 4, 2), (16, 16, 4, 2), (16, 32, 4, 1)]},
}
#: KV-major launch builds timed against the tl one (``--gluon-dims``): D=64's former Gluon config m64s2, whose
#: wgmmas ptxas serializes (C7512; the tl launches' are async at every shipped config), and the retired-tiles
#: builds whose are not, 0 spills causal and dense (m128s2r spills 8 B dense) — NOTES_kernel.md, "Are the tl
#: kernels' wgmmas serialized". m128s3r, ×0.876–0.894 of tl in run 40, is D=64's shipped config since
GLUON_SWEEP = {64: (KernelConfig(64, 2), KernelConfig(64, 2, retire_tiles=True), KernelConfig(64, 3, retire_tiles=True),
                    KernelConfig(128, 3, retire_tiles=True)),
               # D=128: the shipped m64s2r against the deeper rings NOTES_gluon found unserialized and spill-free
               # on a CPU compile (m64s3r spills 16 B dense); run 54 timed them: none faster causal and dense both
               128: (KernelConfig(64, 2, retire_tiles=True), KernelConfig(64, 3, retire_tiles=True),
                     KernelConfig(64, 4, retire_tiles=True),
                     KernelConfig(64, 4, release_pairs=True, retire_tiles=True))}
#: the sweep's shapes: (B, H, S) per padded head dim, causal; FP32 smaller (IEEE products are ~15× slower)
SHAPE = {32: (4, 16, 4096), 64: (4, 16, 4096), 128: (4, 16, 4096), 256: (2, 16, 4096)}
SHAPE_FP32 = {64: (1, 16, 4096), 128: (1, 16, 4096)}


def sweep(D, *, fp32=False, deadline=float("inf"), log=print, causal=True, kinds=("dq", "dkdv")):
    """The greedy sweep at head dim D; returns {"dq": cfg, "dkdv": cfg, "times": {...}}."""
    B, H, S = (SHAPE_FP32 if fp32 else SHAPE)[D]
    q, k, v, do = make_inputs(B, H, S, D)
    o, lse = saved_forward(q, k, v, causal)
    if fp32:
        q, k, v, do, o = (x.float() for x in (q, k, v, do, o))
    table = triton_bwd.CONFIGS_FP32 if fp32 else triton_bwd.CONFIGS
    best = {"dq": table["dq"][D], "dkdv": table["dkdv"][D]}
    times = {}
    for which in kinds:
        cand = {}
        for c in [best[which]] + [c for c in (SWEEP_FP32 if fp32 else SWEEP)[D][which] if c != best[which]]:
            if time.time() > deadline:
                log(f"sweep D={D} fp32={fp32} {which} {c}: skipped (time budget)")
                continue
            cfg = dict(best, **{which: c})
            try:
                fn = lambda cfg=cfg: gproj_backward(do, q, k, v, o, lse, causal=causal, _config=cfg)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                cand[c] = bench(fn)
                log(f"sweep D={D} fp32={fp32} {which} {c}: {cand[c]:.3f} ms  regs/spills {triton_bwd.LAST_KERNELS}")
            except Exception as e:
                log(f"sweep D={D} fp32={fp32} {which} {c} failed: {type(e).__name__}: {str(e)[:200]}")
        if cand:
            best[which] = min(cand, key=cand.get)
        times[which] = {str(c): t for c, t in cand.items()}
    log(f"sweep D={D} fp32={fp32} chosen {best}")
    return dict(best, times=times)


def _launch_alone(fn, part: str):
    """Median ms of one launch of ``fn``'s backward ("dq" or "dkdv") with the other skipped (a timing: the KV-major
    launch alone reads scratch the dQ-major launch did not write this time)."""
    triton_bwd._RUN = (part,)
    try:
        return bench(fn)
    finally:
        triton_bwd._RUN = ("dq", "dkdv")


def _kv_launch(fn):
    """Median ms of ``fn``'s KV-major launch alone."""
    return _launch_alone(fn, "dkdv")


def gluon_sweep(D, *, deadline=float("inf"), log=print):
    """The KV-major launch at head dim D (``SHAPE[D]``, causal and dense) in tl (its shipped config) and in each
    ``GLUON_SWEEP[D]`` Gluon build; {mask: {name: ms}}, plus whether each Gluon build gives dk, dv bitwise equal
    to the tl launch's (the same products in the same order: each wgmma's 16-deep chunks added in row order)."""
    B, H, S = SHAPE[D]
    q, k, v, do = make_inputs(B, H, S, D)
    out = {}
    for causal in (True, False):
        o, lse = saved_forward(q, k, v, causal)
        runs = [("tl", None)] + [(f"m{c.block_m}s{c.num_stages}{'p' * c.release_pairs}{'r' * c.retire_tiles}", c)
                                 for c in GLUON_SWEEP[D]]
        times, tl = {}, None
        for name, cfg in runs:
            if time.time() > deadline:
                log(f"gluon sweep D={D} causal={causal} {name}: skipped (time budget)")
                continue
            kw = dict(kv_major="tl") if cfg is None else dict(kv_major="gluon", _gluon_config=cfg)
            fn = lambda kw=kw: gproj_backward(do, q, k, v, o, lse, causal=causal, **kw)  # noqa: E731
            try:
                dk_dv = fn()[1:3]
                if cfg is None:
                    tl = dk_dv
                elif tl is not None:
                    times[f"{name}_bitwise"] = all(torch.equal(a, b) for a, b in zip(dk_dv, tl))
                times[name] = _kv_launch(fn)
                log(f"gluon sweep D={D} causal={causal} {name}: KV launch {times[name]:.3f} ms")
            except Exception as e:
                log(f"gluon sweep D={D} causal={causal} {name} failed: {type(e).__name__}: {str(e)[:200]}")
        out["causal" if causal else "dense"] = times
    return out



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="32,256")
    ap.add_argument("--fp32-dims", default="64,128")
    ap.add_argument("--deadline", type=float, default=300.0)
    ap.add_argument("--kinds", default="dq,dkdv", help="which kernels to sweep (the other keeps its default)")
    ap.add_argument("--gluon-dims", default="", help="also time the KV-major launch: tl vs GLUON_SWEEP's builds")
    ap.add_argument("--out", default=os.environ.get("OUT", "sweep_out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    end = time.time() + args.deadline
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    jobs = [(int(d), False) for d in args.dims.split(",") if d] + [(int(d), True) for d in args.fp32_dims.split(",") if d]
    for D, fp32 in jobs:
        result[f"{'fp32' if fp32 else 'low'}_{D}"] = sweep(D, fp32=fp32, deadline=end,
                                                           kinds=tuple(args.kinds.split(",")))
    for D in (int(d) for d in args.gluon_dims.split(",") if d):
        result[f"gluon_{D}"] = gluon_sweep(D, deadline=end)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(result, f, indent=1)
    chosen = {key: r for key, r in result.items() if isinstance(r, dict) and "dq" in r}
    print("\nchosen:" if chosen else "")
    for key, r in chosen.items():
        print(f"  {key}: dq {r['dq']} dkdv {r['dkdv']}")
    for key, r in result.items():
        for mask, times in (r.items() if key.startswith("gluon_") else ()):
            tl = times.get("tl", float("nan"))
            print(f"  {key} {mask} KV launch ms (× tl): " + "  ".join(
                f"{n} {t:.3f} (×{t / tl:.3f}{'' if times.get(n + '_bitwise', True) else ', NOT BITWISE'})"
                for n, t in times.items() if not n.endswith("_bitwise")))


if __name__ == "__main__":
    main()
