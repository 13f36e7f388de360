"""Host µs of one hooked SDPA call on the CPU, the kernels stubbed out: the package's Python alone (issue 21 item 2).

``host_breakdown.py`` measures the host path on the GPU; this is its CPU companion, to cut the Python around the
launches without a device. FP16 CPU tensors at 1·2·128·64 causal (``--shape``), the patch on in mode "gproj" with
tier "triton" (the kernel tier on CPU tensors: ``cpu_kernel``, as ``speed_run.py --smoke``), and the lowest launch
call replaced by a no-op, so what remains is the forward hook, record/plan, the autograd Function, the router,
``launch_planned``, argument building and the launch-key lookup. Two launch paths (``--path``):

    interp    the CPU's own path: ``kernel[grid](**kernel_arguments(...))`` with the kernel a no-op
    prepared  the GPU's path (``launch_cache``): ``launch_key``, then a replay of a prepared launch (tensor slots
              filled, alignment checked per tensor) whose launcher is a no-op. Harness stand-ins, as on a GPU hit
              minus its three CUDA queries (launch hooks, current device, current stream): ``HostCache``.

Printed: µs per call (median of ``--reps`` blocks of ``--n`` calls) of unpatched SDPA fwd+bwd and fwd alone
(references), gproj fwd alone and fwd+bwd (with their difference from the unpatched call); the inclusive µs per
call of each layer, forward sub-layers included (a perf_counter pair around each, as host_breakdown); a
cProfile tottime top 25 of the fwd+bwd call. Check there that no interpreter or kernel frame is left: the stub
removes only the kernel work.

    PYTHONPATH=. python benchmarks/host_cpu.py [--path prepared|interp] [--shape 1,2,128,64] [--n 500] [--reps 5]
        [--json FILE]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gproj_patch  # noqa: E402
from gproj_patch.backends import launch_cache, triton_bwd, triton_launch  # noqa: E402

#: launch options of ``kernel_arguments`` that are not kernel parameters (not in a prepared template)
LAUNCH_OPTIONS = ("num_warps", "num_stages")


class StubKernel:
    """A kernel whose launch does nothing: ``StubKernel()[grid](**kwargs)`` returns None."""

    def __getitem__(self, grid):
        return self._launch

    @staticmethod
    def _launch(*args, **kwargs):
        return None


STUB_MODULE = types.SimpleNamespace(**{name: StubKernel() for name in triton_launch.KERNELS.values()})


def _no_launch(*args):
    """The prepared launcher stand-in (the compiled kernel's ``launch``)."""
    return None


class HostCache(launch_cache.LaunchCache):
    """``LaunchCache.launch`` on CPU tensors: a hit replays a ``Prepared`` (real class, real ``replay``) whose
    launcher is ``_no_launch``; a miss builds it from ``arguments()`` like ``launch_cache._prepare``."""

    def launch(self, fn, key, grid, device, slots, arguments):
        entry = self.get(key) if key is not None else None
        if entry is not None and entry.replay(slots(), 0):
            self.hits += 1
            return entry.kernel
        args = arguments()
        self.misses += 1
        names = [n for n in args if n not in LAUNCH_OPTIONS]
        slot_names = frozenset(slots())  # the slots launch_cache._prepare leaves open
        template, open_slots, aligned = [], [], []
        for pos, name in enumerate(names):
            value = args[name]
            is_slot = name in slot_names
            template.append(None if is_slot else value)
            if is_slot:
                open_slots.append((pos, name))
                aligned.append(value.data_ptr() % launch_cache.TRITON_PTR_ALIGN == 0
                               if isinstance(value, torch.Tensor) else None)
        if key is not None:
            self.put(key, launch_cache.Prepared(kernel=None, go=_no_launch, grid=tuple(grid), template=tuple(template),
                                                slots=tuple(open_slots), aligned=tuple(aligned)))
        return None


class Stubbed:
    """While active: the kernels are no-ops (``triton_bwd.kernel_module`` returns ``STUB_MODULE``); with
    ``prepared``, launches take the compiled path through ``HostCache`` instead of the interpreter's binding."""

    def __init__(self, prepared: bool):
        self.prepared = prepared
        self.cache = HostCache()

    def __enter__(self):
        self._saved = [(triton_bwd, "kernel_module", triton_bwd.kernel_module),
                       (triton_launch, "launch", triton_launch.launch),
                       (triton_launch, "PREPARED", triton_launch.PREPARED)]
        triton_bwd.kernel_module = lambda interpret, source="triton_kernels": STUB_MODULE
        if self.prepared:
            inner = self._saved[1][2]
            triton_launch.launch = lambda km, interpret, job, **kw: inner(km, False, job, **kw)
            triton_launch.PREPARED = self.cache
        return self

    def __exit__(self, *exc):
        for owner, name, value in self._saved:
            setattr(owner, name, value)


def _no_sync():
    return None


def per_call_us(fn, n, reps, *, warm=50, sync=_no_sync):
    """Median over ``reps`` blocks of µs per call of ``fn`` (``warm`` calls first, ``n`` calls a block; ``sync()``
    after the warm-up and after each block — ``torch.cuda.synchronize`` in ``host_breakdown``)."""
    for _ in range(warm):
        fn()
    sync()
    blocks = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        blocks.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(blocks)


def tottime_profile(fn, calls, top, *, sync=_no_sync) -> str:
    """cProfile's table (sorted by tottime, the first ``top`` rows) of ``calls`` calls of ``fn`` and a ``sync()``."""
    with cProfile.Profile() as profile:
        for _ in range(calls):
            fn()
        sync()
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


_MISSING = object()
#: the first backward layer of ``_layers()`` (the ones before it run in the forward)
BACKWARD_FIRST = "ops.sdpa._backward (Function body)"


#: (owner module, attribute, label) of each layer timed inclusively; indentation shows nesting
def _layers():
    from gproj_patch.dispatch import router
    from gproj_patch.integrations import sdpa as sdpa_hook
    from gproj_patch.ops import sdpa as ops_sdpa
    from gproj_patch.ops import sdpa_call
    from gproj_patch import policy
    return [(sdpa_hook, "_well_formed", "    _well_formed (integrations.sdpa wrapper)"),
            (sdpa_hook.sdpa_op, "sdpa", "    ops.sdpa.sdpa (forward hook)"),
            (ops_sdpa, "_needs_correction", "      _needs_correction"),
            (ops_sdpa, "unsupported_reason", "      unsupported_reason"),
            (ops_sdpa, "transform_reason", "      transform_reason"),
            (ops_sdpa, "make_context", "      make_context"),
            (policy, "keeps_original", "      policy.keeps_original"),
            (ops_sdpa, "problem_for", "      problem_for"),
            (ops_sdpa._SdpaFunction, "apply", "      _SdpaFunction.apply"),
            (ops_sdpa._SdpaFunction, "forward", "        _SdpaFunction.forward"),
            (ops_sdpa, "run_original_with_lse", "          run_original_with_lse"),
            (sdpa_call._Original, "fn", "            original SDPA (C builtin)"),
            (sdpa_call, "fused_sdpa_lse", "            fused_sdpa_lse"),
            (ops_sdpa, "make_plan", "          make_plan"),
            (ops_sdpa, "_backward", "ops.sdpa._backward (Function body)"),
            (ops_sdpa, "backward_tensors", "  backward_tensors"),
            (ops_sdpa, "run_backward", "  router.run_backward"),
            (router, "_run_kernel", "    router._run_kernel"),
            (triton_bwd, "launch_planned", "      triton_bwd.launch_planned"),
            (triton_bwd, "_launch", "        triton_bwd._launch (launches)")]


def inclusive(call, q, k, v, do, n, *, sync=_no_sync):
    """Inclusive µs per call of the forward and backward halves and of each layer of ``_layers()`` (each wrapped in
    a perf_counter pair, on whatever thread runs it); ``sync()`` after the warm-up and after the timed calls."""
    totals = {}
    patched = []

    def wrap(owner, name, label):
        inner = getattr(owner, name)
        raw = vars(owner).get(name, _MISSING)  # a class attribute (staticmethod, classmethod) restored as it was

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - t
        setattr(owner, name, timed)
        patched.append((owner, name, raw))
    for _ in range(50):
        call()
    sync()
    for owner, name, label in _layers():
        wrap(owner, name, label)
    try:
        for _ in range(n):
            t = time.perf_counter()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            t1 = time.perf_counter()
            out.backward(do)
            t2 = time.perf_counter()
            totals["forward (main thread)"] = totals.get("forward (main thread)", 0.0) + t1 - t
            totals["backward() call (main thread)"] = totals.get("backward() call (main thread)", 0.0) + t2 - t1
        sync()
    finally:
        for owner, name, raw in reversed(patched):
            if raw is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, raw)
    layers = _layers()
    split = [label for *_, label in layers].index(BACKWARD_FIRST)
    order = ["forward (main thread)"] + [label for *_, label in layers[:split]] + ["backward() call (main thread)"] + \
        [label for *_, label in layers[split:]]
    return {label: totals.get(label, 0.0) / n * 1e6 for label in order}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", choices=("prepared", "interp"), default="prepared")
    ap.add_argument("--shape", default="1,2,128,64")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the rows, layers and profile here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    B, H, S, D = (int(x) for x in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float16, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, S, D, dtype=torch.float16, generator=g)

    def call():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    def forward():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)

    rows = {}
    gproj_patch.disable()
    rows["unpatched fwd+bwd"] = per_call_us(call, args.n, args.reps)
    rows["unpatched fwd"] = per_call_us(forward, args.n, args.reps)
    with Stubbed(prepared=args.path == "prepared") as stub:
        gproj_patch.enable(mode="gproj", tier="triton")
        try:
            rows["gproj fwd"] = per_call_us(forward, args.n, args.reps)
            rows["gproj fwd+bwd"] = per_call_us(call, args.n, args.reps)
            stats = gproj_patch.stats()
            layers = inclusive(call, q, k, v, do, args.n)
            profile = tottime_profile(call, args.n, 25)
        finally:
            gproj_patch.disable()
    print(profile)
    base = rows["unpatched fwd+bwd"]
    print(f"host µs per call at {B}·{H}·{S}·{D} causal FP16 CPU, kernels stubbed, path {args.path} "
          f"(median of {args.reps} blocks of {args.n}); tiers {stats.get('tiers', stats)}")
    for name, us in rows.items():
        if name.startswith("unpatched"):
            print(f"{name:34s} {us:8.1f}")
        else:  # the difference from the unpatched row of the same calls
            ref = rows["unpatched fwd"] if name == "gproj fwd" else base
            print(f"{name:34s} {us:8.1f} {us - ref:+9.1f}")
    print("inclusive µs per call (perf_counter around each layer):")
    for name, us in layers.items():
        print(f"  {name:44s} {us:8.1f}")
    if args.path == "prepared":
        print(f"prepared launches (stand-in cache): {stub.cache.hits} hits, {stub.cache.misses} misses")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=[B, H, S, D], path=args.path, rows=rows, layers=layers, profile=profile), f,
                      indent=1)
    return rows, layers


if __name__ == "__main__":
    main()
