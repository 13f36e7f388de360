"""Time the corrected ring attention backward against PyTorch's uncorrected one on one GPU.

    python -m tests.distributed.ring_timing [--quick] [--backend CUDNN_ATTENTION|FLASH_ATTENTION|EFFICIENT_ATTENTION]

PyTorch's ring is simulated in one process (``ring_sim``: its step logic and FP32 accumulation, no communication:
the two compute the same ring, so the communication would be the same bytes except the corrected ring's second K/V
rotation where the rotater is not the all-gather one). Uncorrected: per step the fused backward SDPA picks (cuDNN
on the H100/H200 image by default; ``--backend`` restricts it) with the merged output and LSE. Corrected:
``backends.ring.RingRows`` — the dQ-major row pass over all steps, then the KV-major column pass (each Gluon where
the plan's rule picks it, else tl: ``context_parallel.pass_launches``). Every rank's steps run in turn on the one
GPU, so each time is the sum over ranks (one rank's share is 1/W of it).

For each configuration, first correctness: fresh random BF16 inputs (a random seed, keys at a 200σ common offset),
the kernels' outputs poisoned with NaN before their launches, both rings against fp64 of the whole attention (the
corrected one must be within 0.5%: the script exits 1 otherwise); then ``triton.testing.do_bench`` medians of the
whole ring backward, and of the corrected ring's row and column passes apart (where the plan picks a Gluon launch,
also with the portable tl launches: the rows tagged tl/tl). The table comes last; with ``$OUT``
set, ``$OUT/ring_timing.json`` and ``$OUT/ring_timing.txt`` too.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys

import torch

#: (name, B, H, HKV, S of the whole sequence, D, ranks, causal): the shapes of BENCHMARKS.md's table cut into rings
CONFIGS = (
    ("D128 causal-LB W4 16K", 1, 16, 16, 16384, 128, 4, True),
    ("D128 full W4 16K", 1, 16, 16, 16384, 128, 4, False),
    ("D64 causal-LB W4 16K", 1, 16, 16, 16384, 64, 4, True),
    ("D128 GQA4 causal-LB W2 8K", 2, 16, 4, 8192, 128, 2, True),
)
QUICK = (("D128 causal-LB W2 4K", 1, 8, 8, 4096, 128, 2, True), ("D64 full W2 4K", 1, 8, 2, 4096, 64, 2, False))
TARGET = 5e-3
OFFSET = 200.0


def _check(cfg, seed, backend):
    """Fresh inputs (the ranks' pieces) and the fp64 errors (dq, dk, dv) of the corrected and the uncorrected ring
    on them, the kernels' outputs poisoned."""
    from gproj_patch.backends import triton_bwd
    from gproj_patch.hooks.context_parallel import pass_launches
    from tests.distributed import ring_sim
    from tests.distributed.shards import problem, whole
    from tests.helpers.numerics import rel
    name, B, H, HKV, S, D, world, causal = cfg
    p = problem(B, H, HKV, S, D, offset=OFFSET, causal=causal, seed=seed, device="cuda")
    pieces = [ring_sim.shard(x, world, causal) for x in (p.q, p.k, p.v, p.do, p.o.bfloat16(), p.lse.float())]
    launches = pass_launches(pieces[0][0], pieces[1][0], pieces[2][0])
    triton_bwd._POISON_OUTPUTS = True
    try:
        with ring_sim.load_balance(causal), backend:
            ring = ring_sim.corrected(*pieces, causal, kernel=True, launches=launches)
            plain = ring_sim.uncorrected(ring_sim.fused_step_backward(), *pieces, causal)
    finally:
        triton_bwd._POISON_OUTPUTS = False
    ref = whole(p)
    err = lambda grads: [rel(ring_sim.unshard(g, causal), r) for g, r in zip(grads, ref)]  # noqa: E731
    return pieces, launches, err(ring), err(plain)


def _time(cfg, pieces, launches, backend):
    """Medians (ms) of PyTorch's ring, the corrected ring, and its row and column passes apart."""
    from triton.testing import do_bench
    from gproj_patch.backends.ring import RingRows
    from gproj_patch.hooks.context_parallel import ring_step, step_operands
    from tests.distributed import ring_sim
    world, causal = cfg[6], cfg[7]
    cp = ring_sim.cp_module()
    qs, ks, vs, dos, os_, lses = pieces

    def steps(rank, rows):
        for i in range(world):
            s = ring_step(cp, rank, world, i, causal)
            if s is not None:
                yield step_operands(rows, ks[(rank - i) % world], vs[(rank - i) % world], s)

    def rows_pass(launches=launches):
        ranks = [RingRows(dos[r], qs[r], os_[r], lses[r], kernel=True, dq_major=launches[0], kv_major=launches[1])
                 for r in range(world)]
        for r, rows in enumerate(ranks):
            for q_rows, k, v, c in steps(r, rows):
                rows.row_step(k, v, causal=c, rows=q_rows)
            rows.finish()
        return ranks

    def columns_pass(ranks):
        for r, rows in enumerate(ranks):
            for q_rows, k, v, c in steps(r, rows):
                rows.column_step(k, v, causal=c, rows=q_rows)

    with ring_sim.load_balance(causal), backend:
        step = ring_sim.fused_step_backward()
        finished = rows_pass()
        times = {"pytorch": do_bench(lambda: ring_sim.uncorrected(step, *pieces, causal)),
                 "corrected": do_bench(lambda: ring_sim.corrected(*pieces, causal, kernel=True, launches=launches)),
                 "row pass": do_bench(rows_pass), "column pass": do_bench(lambda: columns_pass(finished))}
        if launches != ("tl", "tl"):  # the plan picked a Gluon launch: the portable ones beside it
            portable = ("tl", "tl")
            times["corrected tl"] = do_bench(lambda: ring_sim.corrected(*pieces, causal, kernel=True,
                                                                        launches=portable))
            times["row pass tl"] = do_bench(lambda: rows_pass(portable))
            finished_tl = rows_pass(portable)
            times["column pass tl"] = do_bench(lambda: columns_pass(finished_tl))
        return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small configurations")
    parser.add_argument("--backend", default=None, help="the SDPBackend PyTorch's ring steps use (default: SDPA's)")
    parser.add_argument("--only", default=None, help="run only the configurations whose name contains this")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = (lambda: sdpa_kernel([getattr(SDPBackend, args.backend)])) if args.backend else contextlib.nullcontext
    rows, ok = [], True
    device = torch.cuda.get_device_name()
    for cfg in [c for c in (QUICK if args.quick else CONFIGS) if args.only is None or args.only in c[0]]:
        seed = random.randrange(1 << 30)
        pieces, launches, corrected, pytorch = _check(cfg, seed, backend())
        good = max(corrected) < TARGET
        ok &= good
        times = _time(cfg, pieces, launches, backend()) if good else {}
        del pieces
        row = dict(config=cfg[0], seed=seed, launches=launches, error_corrected=corrected, error_pytorch=pytorch,
                   **{f"ms_{n.replace(' ', '_')}": t for n, t in times.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = [f"{device}, torch {torch.__version__}; ms: triton.testing.do_bench medians, all ranks' steps on one GPU",
             f"{'config launches':34s} {'dq err pytorch':>14s} {'dq err gproj':>12s} {'pytorch ms':>10s} {'gproj ms':>9s} "
             f"{'ratio':>6s} {'rows ms':>8s} {'cols ms':>8s}"]
    fmt = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
    for r in rows:
        for tag, suffix in (("/".join(r["launches"]), ""), ("tl/tl", "_tl")):
            t = (r.get("ms_pytorch"), r.get(f"ms_corrected{suffix}"), r.get(f"ms_row_pass{suffix}"),
                 r.get(f"ms_column_pass{suffix}"))
            if suffix and t[1] is None:
                continue
            ratio = t[1] / t[0] if t[0] and t[1] else float("nan")
            lines.append(f"{r['config'] + ' ' + tag:34s} {100 * r['error_pytorch'][0]:13.2f}% "
                         f"{100 * r['error_corrected'][0]:11.3f}% {fmt(t[0]):>10s} {fmt(t[1]):>9s} {ratio:6.3f} "
                         f"{fmt(t[2]):>8s} {fmt(t[3]):>8s}")
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ring_timing.json"), "w") as f:
            json.dump(dict(device=device, torch=torch.__version__, rows=rows), f, indent=1)
        with open(os.path.join(os.environ["OUT"], "ring_timing.txt"), "w") as f:
            f.write(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
