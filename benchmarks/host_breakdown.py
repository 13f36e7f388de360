"""Host µs of one hooked SDPA call at a tiny shape, taken apart layer by layer (issue 21 item 2), in one run.

At 1·2·128·64 causal the GPU work is a few µs, so a loop of calls without a synchronize per call is bound by the
host: its µs per call is host time. Rows (each the median of ``--reps`` blocks of ``--n`` calls):

    unpatched fwd+bwd             the builtin (cuDNN / flash), the reference
    auto fwd+bwd                  the patch passing the call through (benign keys, unsampled calls)
    gproj fwd                     the patched forward alone (graph built, no backward)
    gproj fwd+bwd [bind|prepared] the whole call with Triton's argument binding / with prepared launches
    fwd + grad_fn(do)             the call with its backward node run on the main thread (no autograd engine)
    engine on the calling thread  fwd+bwd with ``torch.autograd.set_multithreading_enabled(False)`` (no device thread)
    launch_backward [bind|prep.]  the backend's host path alone on saved tensors (allocations, job, two launches)
    two launches [bind|prepared]  the two kernel launches alone (arguments built once)
    6 allocations                 torch.empty of the outputs and scratch

then a cProfile (tottime) of the prepared call. ``bind`` turns the prepared launches off (``triton_launch
.launch_key`` returning None: Triton's own path), as before issue 21.

    PYTHONPATH=. python benchmarks/host_breakdown.py [--shape 1,2,128,64] [--n 300] [--reps 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import host_cpu  # noqa: E402  (per_call_us, inclusive, tottime_profile: the CPU harness's, with CUDA syncs)
import gproj_patch  # noqa: E402
from gproj_patch.backends import launch_cache, triton_bwd, triton_launch  # noqa: E402
from gproj_patch.backends.spec import MaskSpec  # noqa: E402

CAUSAL = MaskSpec(causal=True, causal_align="top_left", window=(-1, -1), softcap=0.0)


def per_call_us(fn, n, reps):
    """Median over ``reps`` blocks of µs per call of ``fn`` (20 warm-up calls, ``n`` calls a block, one synchronize
    a block): ``host_cpu.per_call_us`` with CUDA synchronizes."""
    return host_cpu.per_call_us(fn, n, reps, warm=20, sync=torch.cuda.synchronize)


def collections_per_1000(fn):
    """Python garbage collections (per generation) during 1000 calls of ``fn``."""
    before = [st["collections"] for st in gc.get_stats()]
    for _ in range(1000):
        fn()
    torch.cuda.synchronize()
    return [st["collections"] - b for st, b in zip(gc.get_stats(), before)]


class Frozen:
    """Every object alive now moved out of the collector's generations (``gc.freeze``) while active: what the
    calls cost when collections find only the calls' own objects."""

    def __enter__(self):
        gc.collect()
        gc.freeze()

    def __exit__(self, *exc):
        gc.unfreeze()


def instrumented(call, q, k, v, do, n):
    """Inclusive µs per call of the hooked call's forward and backward halves and of their layers, gproj mode,
    prepared launches: ``host_cpu.inclusive`` (its ``_layers()``) with CUDA synchronizes."""
    gproj_patch.enable(mode="gproj")
    try:
        return host_cpu.inclusive(call, q, k, v, do, n, sync=torch.cuda.synchronize)
    finally:
        gproj_patch.disable()


def engine_rows(q, do, n, reps):
    """What running Python in the autograd engine's device thread costs: a Function whose backward returns the
    gradient as it is, and one whose backward runs the same Python work (a loop of small objects) as on the main
    thread."""
    def busy():
        acc = 0
        for i in range(2000):
            acc += len({"a": i, "b": (i, i)})
        return acc

    def passing(work):
        """A Function whose forward is a view and whose backward runs ``work()`` and returns the gradient."""
        class Passing(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                work()
                return g
        return Passing
    Identity, Busy = passing(lambda: None), passing(busy)
    rows = {"identity Function fwd+bwd": per_call_us(lambda: Identity.apply(q).backward(do), n, reps),
            "busy Function fwd+bwd": per_call_us(lambda: Busy.apply(q).backward(do), n, reps),
            "busy() on the main thread": per_call_us(busy, n, reps)}
    return rows


class Binding:
    """Prepared launches off (Triton's own binding on every launch) while active."""

    def __enter__(self):
        self._key = triton_launch.launch_key
        triton_launch.launch_key = lambda job: None
        return self

    def __exit__(self, *exc):
        triton_launch.launch_key = self._key


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,2,128,64")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    B, H, S, D = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)

    def call():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    def forward():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def main_thread_backward():
        """The call with its backward node run on this thread (no engine, no device thread, no gradient
        accumulation): a C++ node is called, a Python Function's node runs its ``apply`` (the Python backward).
        Against ``call``: what the autograd engine and its device thread add."""
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # alive: the node saves it
        node = y.grad_fn
        (node.apply if hasattr(node, "apply") else node)(do)

    rows, gc_per_1000 = {}, {}
    gproj_patch.disable()
    rows["unpatched fwd+bwd"] = per_call_us(call, args.n, args.reps)
    rows["unpatched fwd + grad_fn(do) on the main thread"] = per_call_us(main_thread_backward, args.n, args.reps)
    with torch.autograd.set_multithreading_enabled(False):
        rows["unpatched fwd+bwd, engine on the calling thread"] = per_call_us(call, args.n, args.reps)
    gproj_patch.enable(mode="auto", sample_every=10 ** 6)
    rows["auto fwd+bwd"] = per_call_us(call, args.n, args.reps)
    gproj_patch.disable()
    gproj_patch.enable(mode="gproj")
    rows["gproj fwd"] = per_call_us(forward, args.n, args.reps)
    with Binding():
        rows["gproj fwd+bwd bind"] = per_call_us(call, args.n, args.reps)
    rows["gproj fwd+bwd prepared"] = per_call_us(call, args.n, args.reps)
    rows["gproj fwd + grad_fn(do) on the main thread"] = per_call_us(main_thread_backward, args.n, args.reps)
    with torch.autograd.set_multithreading_enabled(False):
        rows["gproj fwd+bwd, engine on the calling thread"] = per_call_us(call, args.n, args.reps)
    gc_per_1000["gproj"] = collections_per_1000(call)
    with Frozen():
        rows["gproj fwd+bwd prepared, gc frozen"] = per_call_us(call, args.n, args.reps)
    stats = gproj_patch.stats()
    gproj_patch.disable()
    gc_per_1000["unpatched"] = collections_per_1000(call)
    with Frozen():
        rows["unpatched fwd+bwd, gc frozen"] = per_call_us(call, args.n, args.reps)

    # the backend alone, on tensors as the router passes them
    qd, kd, vd = (x.detach() for x in (q, k, v))
    o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    lse = torch.logsumexp((qd.float() @ kd.float().transpose(-1, -2)) * D ** -0.5
                          + torch.full((S, S), float("-inf"), device="cuda").triu(1), -1)

    def backend():
        triton_bwd.launch_backward(do, qd, kd, vd, o, lse, scale=None, mask=CAUSAL, correct=True, kv_major="tl")
    with Binding():
        rows["launch_backward bind"] = per_call_us(backend, args.n, args.reps)
    rows["launch_backward prepared"] = per_call_us(backend, args.n, args.reps)

    # the two launches alone, their arguments built once
    jobs = []
    orig = triton_bwd._launch
    triton_bwd._launch = lambda km, interpret, job: jobs.append((km, job)) or orig(km, interpret, job)
    try:
        backend()
    finally:
        triton_bwd._launch = orig
    km, job = jobs[-1]
    scratch = triton_launch.allocate_scratch(job)
    bd = triton_bwd.block_d(D)
    kinds = [(getattr(km, triton_launch.KERNELS[kind]), triton_launch.grid(kind, job),
              triton_launch.kernel_arguments(kind, job, scratch, block_d=bd), kind) for kind in ("dq", "dkdv")]

    def bound_launches():
        for fn, grid, kw, _ in kinds:
            fn[grid](**kw)
    rows["two launches bind"] = per_call_us(bound_launches, args.n, args.reps)
    key = triton_launch.launch_key(job)
    prepared = [launch_cache.PREPARED.get((kind, id(fn)) + key) for fn, _, _, kind in kinds]
    tensors = [triton_launch.tensor_arguments(kind, job, scratch) for *_, kind in kinds]
    if all(p is not None for p in prepared):
        from gproj_patch.backends.compat import current_cuda_stream

        def replays():
            stream = current_cuda_stream(q.device.index)
            for p, ts in zip(prepared, tensors):
                p.replay(ts, stream)
        rows["two launches prepared"] = per_call_us(replays, args.n, args.reps)

    def allocations():
        for _ in range(3):
            torch.empty_like(qd)
        for _ in range(3):
            torch.empty((B * H, S), dtype=torch.float32, device="cuda")
    rows["6 allocations"] = per_call_us(allocations, args.n, args.reps)

    inclusive = instrumented(call, q, k, v, do, args.n)
    rows.update(engine_rows(q, do, args.n, args.reps))

    gproj_patch.enable(mode="gproj")
    profile = host_cpu.tottime_profile(call, 200, 25, sync=torch.cuda.synchronize)  # 200 prepared calls
    gproj_patch.disable()
    print(profile)

    base = rows["unpatched fwd+bwd"]
    print(f"host µs per call at {B}·{H}·{S}·{D} causal (median of {args.reps} blocks of {args.n}); tiers {stats}")
    print(f"{'what':32s} {'µs':>8s} {'over unpatched':>15s}")
    for name, us in rows.items():
        print(f"{name:32s} {us:8.1f} {us - base:+15.1f}" if "fwd" in name else f"{name:32s} {us:8.1f}")
    print("inclusive host µs per call of the call's layers (perf_counter around each, gproj prepared):")
    for name, us in inclusive.items():
        print(f"  {name:40s} {us:8.1f}")
    print(f"prepared launches: {launch_cache.PREPARED.hits} hits, {launch_cache.PREPARED.misses} misses")
    print(f"gc collections per 1000 calls (gen 0, 1, 2): {gc_per_1000}; objects tracked {len(gc.get_objects())}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_breakdown.json"), "w") as f:
            json.dump(dict(shape=[B, H, S, D], rows=rows, inclusive=inclusive, gc_per_1000=gc_per_1000, profile=profile), f, indent=1)


if __name__ == "__main__":
    main()
