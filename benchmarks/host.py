"""Host time of one hooked SDPA call at a tiny shape, where the GPU work is a few µs: where it goes, layer by
layer (``breakdown``), and per arm, plain or compiled, with a profiler trace (``calls``).

    python -m benchmarks.host [--shape 1,2,128,64] [--n 300] [--reps 5] [--out DIR]     # breakdown (GPU)
    python -m benchmarks.host --cpu [--path prepared|interp]                           # breakdown, CPU companion
    python -m benchmarks.host --mode calls [--modes unpatched,gproj,auto] [--compile] [--trace [--stack]]
    python -m benchmarks.host --mode calls --cpu --n 5 --trace       # CPU: 1·1·16·16, the kernel interpreted
    python -m benchmarks.host --mode calls --fresh --rounds 2 [--library fa4]   # every arm its own process

``breakdown`` on a GPU (µs a call, each row the median of ``--reps`` blocks of ``--n`` calls with one synchronize
a block, so at this shape host time):

    unpatched fwd+bwd / fwd            the builtin (cuDNN / flash), the reference
    auto fwd+bwd                       the patch passing the call through (benign keys, unsampled)
    gproj fwd / fwd+bwd [bind]         the forward alone (PyTorch's: no hook); the whole call with prepared launches and with
                                       Triton's own argument binding on every launch
    fwd + grad_fn(do) main thread      the call with its backward node run on the calling thread (no engine)
    engine on the calling thread       fwd+bwd with ``torch.autograd.set_multithreading_enabled(False)``
    gc frozen                          fwd+bwd with every older object out of the collector's generations
    launch_backward [bind]             the backend's host path alone on saved tensors (allocations, job, launches)
    two launches [bind|prepared]       the two kernel launches alone, their arguments built once
    6 allocations                      torch.empty of the outputs and scratch
    identity / busy Function           what the autograd engine's device thread adds around a Python backward,
                                       and ``busy()`` on the main thread: a yardstick of this host's Python speed

then the inclusive µs of each layer of the call (a perf_counter pair around each of ``LAYERS``, on whatever thread
runs it: inflated, for the shape of the split) and a cProfile (tottime) of the prepared call.

``breakdown`` on the CPU (``--cpu``, or no CUDA): FP16 CPU tensors, the patch on in mode "gproj" with tier
"triton", and the lowest launch call replaced by a no-op, so what remains is the package's Python around the
launches: the seam's kernel at the backward op, record and plan, the router, argument building and the
launch-key lookup (the forward runs no package code). ``--path interp``: the CPU's own launch path (``kernel[grid](**kwargs)``, kernel a no-op);
``prepared``: the GPU's (``launch_cache``: a replay of a prepared launch whose launcher is a no-op: ``HostCache``).
Check in the profile that no interpreter or kernel frame is left: the stub removes only the kernel work.

``calls``: per arm µs a call with a synchronize per call and per block, the fastest of 5 blocks of ``--n`` / 5
calls (``common.host_calls``), the arms alternated ``--rounds`` times, with ``--fresh`` each in a process of its
own; ``--library fa4``: FA4's
``flash_attn_func`` instead of SDPA (installed: ``benchmarks/external_gpu.sh host``; on the CPU the stand-in); with
``--compile`` the call under ``torch.compile(fullgraph=True)``; with ``--trace`` a ``torch.profiler`` trace of 20
calls per arm: the top operators by self CPU time (``--stack``: grouped by the top 4 Python frames) and, on CUDA,
by device time, and ``host_trace_<arm>.json.gz`` for Perfetto.

Writes ``host.json`` (and the traces) under ``--out`` (default ``$OUT/host``); the table is printed last.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import time
import types

import torch
import torch.nn.functional as F

import gproj_patch
from benchmarks import common
from gproj_patch.backends import configs, launch_cache, triton_bwd, triton_launch
from gproj_patch.backends.spec import MaskSpec

CAUSAL = MaskSpec(causal=True, causal_align="top_left", window=(-1, -1), softcap=0.0)
#: (owner: "module" or "module:attribute.path", attribute, label) of each layer timed inclusively; indentation
#: shows nesting. A layer the package no longer has is skipped and named in the output.
LAYERS = (
    ("gproj_patch.hooks.sdpa", "_backward", "seam kernel (hooks.sdpa._backward)"),
    ("gproj_patch.hooks.sdpa", "bind", "  bind (the op's arguments by name)"),
    ("gproj_patch.hooks.sdpa", "_cudnn_plan_known", "  _cudnn_plan_known"),
    ("gproj_patch.hooks.sdpa", "corrected", "  corrected"),
    ("gproj_patch.hooks.sdpa", "pass_reason", "    pass_reason"),
    ("gproj_patch.hooks.sdpa", "backward_layer", "    backward_layer"),
    ("gproj_patch.hooks.sdpa", "make_context", "    make_context"),
    ("gproj_patch.hooks.sdpa", "make_plan", "    make_plan"),
    ("gproj_patch.hooks.sdpa", "_run", "    _run"),
    ("gproj_patch.hooks.sdpa", "run_backward", "      router.run_backward"),
    ("gproj_patch.dispatch.router", "_run_kernel", "        router._run_kernel"),
    ("gproj_patch.backends.triton_bwd", "launch_planned", "          triton_bwd.launch_planned"),
    ("gproj_patch.backends.triton_bwd", "_launch", "            triton_bwd._launch (launches)"),
    ("gproj_patch.hooks.sdpa", "_restore", "    _restore (PyTorch's strides)"),
)
#: the first backward layer of ``LAYERS`` (the ones before it run in the forward: none, since the seam)
BACKWARD_FIRST = "seam kernel (hooks.sdpa._backward)"
#: launch options of ``kernel_arguments`` that are not kernel parameters (not in a prepared template)
LAUNCH_OPTIONS = ("num_warps", "num_stages")
_MISSING = object()

# --------------------------------------------------------------------------------------------- measured layers --


def _owner(spec: str):
    """The module (or the object inside it) a ``LAYERS`` owner names; None when the package no longer has it."""
    module, _, path = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj


def inclusive(call, q, k, v, do, n, *, sync_fn=lambda: None):
    """({label: inclusive µs a call} of the forward and backward halves and of each layer of ``LAYERS`` (each
    wrapped in a perf_counter pair, on whatever thread runs it), [labels absent from the package])."""
    totals, patched, absent = {}, [], []

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
    sync_fn()
    for spec, name, label in LAYERS:
        owner = _owner(spec)
        if owner is None or not hasattr(owner, name):
            absent.append(label.strip())
            continue
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
        sync_fn()
    finally:
        for owner, name, raw in reversed(patched):
            if raw is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, raw)
    labels = [label for *_, label in LAYERS]
    split = labels.index(BACKWARD_FIRST)
    order = ["forward (main thread)"] + labels[:split] + ["backward() call (main thread)"] + labels[split:]
    return {label: totals[label] / n * 1e6 for label in order if label in totals}, absent

# ------------------------------------------------------------------------------------------- CPU: kernels stubbed --


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
    launcher is ``_no_launch``; a miss builds it from ``arguments()`` like ``launch_cache`` does. A GPU hit also
    makes three CUDA queries (launch hooks, current device, current stream), which this leaves out."""

    def launch(self, fn, key, grid, device, slots, arguments):
        entry = self.get(key) if key is not None else None
        if entry is not None and entry.replay(slots(), 0):
            self.hits += 1
            return entry.kernel
        args = arguments()
        self.misses += 1
        names = [n for n in args if n not in LAUNCH_OPTIONS]
        slot_names = frozenset(slots())  # the slots a prepared launch leaves open
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

# ---------------------------------------------------------------------------------------------- GPU-only rows --


class Binding:
    """Prepared launches off (Triton's own binding on every launch) while active."""

    def __enter__(self):
        self._key = triton_launch.launch_key
        triton_launch.launch_key = lambda job: None
        return self

    def __exit__(self, *exc):
        triton_launch.launch_key = self._key


class Frozen:
    """Every object alive now moved out of the collector's generations (``gc.freeze``) while active: what the calls
    cost when collections find only the calls' own objects."""

    def __enter__(self):
        gc.collect()
        gc.freeze()

    def __exit__(self, *exc):
        gc.unfreeze()


def collections_per_1000(fn, sync_fn):
    """Python garbage collections (per generation) during 1000 calls of ``fn``."""
    before = [st["collections"] for st in gc.get_stats()]
    for _ in range(1000):
        fn()
    sync_fn()
    return [st["collections"] - b for st, b in zip(gc.get_stats(), before)]


def engine_rows(q, do, n, reps, sync_fn):
    """What running Python in the autograd engine's device thread costs: a Function whose backward returns the
    gradient as it is, one whose backward runs ``busy()`` (a loop of small objects), and ``busy()`` alone on the
    main thread (how fast this host runs Python: compare runs by it)."""
    def busy():
        acc = 0
        for i in range(2000):
            acc += len({"a": i, "b": (i, i)})
        return acc

    def passing(work):
        class Passing(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                work()
                return g
        return Passing
    identity, busy_fn = passing(lambda: None), passing(busy)
    return {"identity Function fwd+bwd": common.per_call_us(lambda: identity.apply(q).backward(do), n, reps,
                                                            sync_fn=sync_fn),
            "busy Function fwd+bwd": common.per_call_us(lambda: busy_fn.apply(q).backward(do), n, reps,
                                                        sync_fn=sync_fn),
            "busy() on the main thread": common.per_call_us(busy, n, reps, sync_fn=sync_fn)}


def backend_rows(q, k, v, do, n, reps, sync_fn) -> dict:
    """The backend alone on tensors as the router passes them: ``launch_backward`` (bound, prepared), the two
    launches alone (bound, prepared replays), the six allocations."""
    B, H, S, D = q.shape
    qd, kd, vd = (x.detach() for x in (q, k, v))
    o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    lse = torch.logsumexp((qd.float() @ kd.float().transpose(-1, -2)) * D ** -0.5
                          + torch.full((S, S), float("-inf"), device=q.device).triu(1), -1)

    def backend():
        triton_bwd.launch_backward(do, qd, kd, vd, o, lse, scale=None, mask=CAUSAL, correct=True, kv_major="tl")
    rows = {}
    with Binding():
        rows["launch_backward bind"] = common.per_call_us(backend, n, reps, sync_fn=sync_fn)
    rows["launch_backward prepared"] = common.per_call_us(backend, n, reps, sync_fn=sync_fn)
    jobs, orig = [], triton_bwd._launch  # the last job ``launch_backward`` described, caught on its way out
    triton_bwd._launch = lambda km, interpret, job: jobs.append((km, job)) or orig(km, interpret, job)
    try:
        backend()
    finally:
        triton_bwd._launch = orig
    km, job = jobs[-1]
    scratch = triton_launch.allocate_scratch(job)
    bd = configs.block_d(D)
    kinds = [(getattr(km, triton_launch.KERNELS[kind]), triton_launch.grid(kind, job),
              triton_launch.kernel_arguments(kind, job, scratch, block_d=bd), kind) for kind in ("dq", "dkdv")]

    def bound_launches():
        for fn, grid, kw, _ in kinds:
            fn[grid](**kw)
    rows["two launches bind"] = common.per_call_us(bound_launches, n, reps, sync_fn=sync_fn)
    key = triton_launch.launch_key(job)
    prepared = [launch_cache.PREPARED.get((kind, id(fn)) + key) for fn, _, _, kind in kinds]
    tensors = [triton_launch.tensor_arguments(kind, job, scratch) for *_, kind in kinds]
    if all(p is not None for p in prepared):
        from gproj_patch.backends.compat import current_cuda_stream

        def replays():
            stream = current_cuda_stream(q.device.index)
            for p, ts in zip(prepared, tensors):
                p.replay(ts, stream)
        rows["two launches prepared"] = common.per_call_us(replays, n, reps, sync_fn=sync_fn)

    def allocations():
        for _ in range(3):
            torch.empty_like(qd)
        for _ in range(3):
            torch.empty((B * H, S), dtype=torch.float32, device=q.device)
    rows["6 allocations"] = common.per_call_us(allocations, n, reps, sync_fn=sync_fn)
    return rows

# ------------------------------------------------------------------------------------------------- breakdown --


def breakdown(args, cuda: bool) -> dict:
    B, H, S, D = (int(x) for x in args.shape.split(","))
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    sync_fn = torch.cuda.synchronize if cuda else (lambda: None)
    if not cuda:
        torch.set_num_threads(1)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g)

    def call():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    def forward():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def main_thread_backward():
        """The call with its backward node run on this thread (no engine, no device thread, no gradient
        accumulation): a C++ node is called, a Python Function's node runs its ``apply``."""
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # alive: the node saves it
        node = y.grad_fn
        (node.apply if hasattr(node, "apply") else node)(do)

    def us(fn):
        return common.per_call_us(fn, args.n, args.reps, sync_fn=sync_fn)

    def engine_on_caller(fn):
        with torch.autograd.set_multithreading_enabled(False):
            return us(fn)
    rows, gc_per_1000 = {}, {}
    gproj_patch.disable()
    rows["unpatched fwd+bwd"] = us(call)
    rows["unpatched fwd"] = us(forward)
    if cuda:  # on the CPU the unpatched backward computes (ms) while the patched one is stubbed: no like for like
        rows["unpatched fwd + grad_fn(do) on the main thread"] = us(main_thread_backward)
        rows["unpatched fwd+bwd, engine on the calling thread"] = engine_on_caller(call)
    stub = Stubbed(prepared=args.path == "prepared") if not cuda else None
    if cuda:
        common.arm("auto", sample_every=10 ** 6)
        rows["auto fwd+bwd"] = us(call)
    if stub is not None:
        stub.__enter__()
    try:
        gproj_patch.disable()
        gproj_patch.enable(mode="gproj", tier="triton")
        rows["gproj fwd"] = us(forward)
        if cuda:
            with Binding():
                rows["gproj fwd+bwd bind"] = us(call)
        rows["gproj fwd+bwd prepared" if cuda or args.path == "prepared" else "gproj fwd+bwd"] = us(call)
        rows["gproj fwd + grad_fn(do) on the main thread"] = us(main_thread_backward)
        rows["gproj fwd+bwd, engine on the calling thread"] = engine_on_caller(call)
        gc_per_1000["gproj"] = collections_per_1000(call, sync_fn)
        with Frozen():
            rows["gproj fwd+bwd, gc frozen"] = us(call)
        stats = common.tiers()
        layers, absent = inclusive(call, q, k, v, do, args.n, sync_fn=sync_fn)
        profile = common.cprofile_table(call, 200, 25, sync_fn=sync_fn)
    finally:
        gproj_patch.disable()
        if stub is not None:
            stub.__exit__()
    if cuda:
        gc_per_1000["unpatched"] = collections_per_1000(call, sync_fn)
        with Frozen():
            rows["unpatched fwd+bwd, gc frozen"] = us(call)
        rows.update(backend_rows(q, k, v, do, args.n, args.reps, sync_fn))
    rows.update(engine_rows(q, do, args.n, args.reps, sync_fn))
    prepared = (launch_cache.PREPARED if cuda else stub.cache) if cuda or args.path == "prepared" else None
    return dict(shape=[B, H, S, D], device=device, path="compiled" if cuda else args.path, rows=rows,
                inclusive=layers, absent_layers=absent, tiers=stats, gc_per_1000=gc_per_1000, profile=profile,
                prepared_hits_misses=[prepared.hits, prepared.misses] if prepared is not None else None)


def print_breakdown(r: dict, log) -> None:
    B, H, S, D = r["shape"]
    log(r["profile"])
    base = r["rows"]["unpatched fwd+bwd"]
    how = f"kernels stubbed, path {r['path']}" if r["device"] == "cpu" else "real launches"
    log(f"host µs a call at {B}·{H}·{S}·{D} causal on {r['device']} ({how}); "
        f"tiers {r['tiers']}; gc collections per 1000 calls (gen 0, 1, 2) {r['gc_per_1000']}; "
        f"prepared launches (hits, misses) {r['prepared_hits_misses']}")
    log("inclusive µs a call of the call's layers (perf_counter around each; gproj):")
    for name, us in r["inclusive"].items():
        log(f"  {name:46s} {us:8.1f}")
    if r["absent_layers"]:
        log(f"  layers the package no longer has (not timed): {', '.join(r['absent_layers'])}")
    log("\n| row | µs a call | over the unpatched call (fwd: its forward) |\n|---|---|---|")
    for name, us in r["rows"].items():
        ref = None
        if name.split()[0] in ("unpatched", "auto", "gproj"):
            # the CPU's patched backward is stubbed while the unpatched one computes: no difference to show there
            ref = r["rows"]["unpatched fwd"] if name.endswith(" fwd") else base if r["device"] == "cuda" else None
        log(f"| {name} | {us:.1f} | {'' if ref is None else format(us - ref, '+.1f')} |")

# ----------------------------------------------------------------------------------------------------- calls --


def trace(mode, shape, device, stack, rows, out) -> str:
    """A ``torch.profiler`` trace of 20 calls in arm ``mode``: its tables, and the chrome trace written to ``out``."""
    from torch.profiler import ProfilerActivity, profile
    common.arm(mode)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    do = torch.randn(*shape, generator=g, device=device, dtype=dtype)
    for _ in range(5):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts, with_stack=stack) as prof:
        for _ in range(20):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
        common.sync(device)
    gproj_patch.disable()
    prof.export_chrome_trace(os.path.join(out, f"host_trace_{mode}.json.gz"))
    text = f"--- {mode}: top operators by self CPU time ---\n" + prof.key_averages(
        group_by_stack_n=4 if stack else 0).table(sort_by="self_cpu_time_total", row_limit=rows)
    if device == "cuda":
        text += f"\n--- {mode}: by device time ---\n" + prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=rows)
    return text


def calls(args, cuda: bool, out: str, log) -> dict:
    device = "cuda" if cuda else "cpu"
    if not cuda:
        os.environ.setdefault("GPROJ_TIER", "triton")  # the kernel tier through the interpreter (FP16)
        torch.set_num_threads(1)  # tiny ops on a shared CPU otherwise time the OpenMP wake-ups
        args.n = min(args.n, 20)
    shape = tuple(int(x) for x in args.shape.split(","))
    result = {"shape": list(shape), "device": device, "compiled": args.compile, "library": args.library,
              "fresh": args.fresh, "arms": {}}
    arms = [m for _ in range(args.rounds) for m in args.modes.split(",")]
    for i, mode in enumerate(arms):
        if args.fresh:
            r = common.fresh_host_calls(mode, shape, args.n, os.path.join(out, f"fresh_{i}_{mode}"),
                                        cpu=not cuda, compiled=args.compile, library=args.library,
                                        profile=args.cprofile)
        else:
            r = common.host_calls(mode, shape, device, args.n, compiled=args.compile, library=args.library,
                                  profile=args.cprofile)
        result["arms"].setdefault(mode, []).append(r)
        log(f"{mode:10s} {r['serial']:8.0f} µs a call (sync each), {r['batched']:8.0f} (sync per batch); tiers "
            f"{r['tiers']} kv_major {r['kv_major']}")
        for order, table in (r.get("profile") or {}).items():
            log(f"--- {mode}: cProfile of {args.cprofile} calls by {order} ---\n{table}")
        if args.trace and not args.fresh:
            log(trace(mode, shape, device, args.stack, args.rows, out))
    log(f"\nhost µs a call of {args.library} at {'·'.join(map(str, shape))} causal on {device}"
        f"{', the call under torch.compile' if args.compile else ''}"
        f"{', each arm in a process of its own' if args.fresh else ''} (one column per round):")
    log("| arm | µs a call, sync each call | µs a call, sync per batch |\n|---|---|---|")
    for mode, rs in result["arms"].items():
        serial, batched = (" / ".join(f"{r[key]:.0f}" for r in rs) for key in ("serial", "batched"))
        log(f"| {mode} | {serial} | {batched} |")
    return result


# ------------------------------------------------------------------------------------------------------- main --


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("breakdown", "calls"), default="breakdown")
    ap.add_argument("--cpu", action="store_true", help="the CPU even where CUDA is present (kernels stubbed)")
    ap.add_argument("--path", choices=("prepared", "interp"), default="prepared", help="CPU breakdown's launch path")
    ap.add_argument("--shape", default=None,
                    help="B,H,S,D, causal (default 1,2,128,64; CPU calls, whose kernels run: 1,1,16,16)")
    ap.add_argument("--n", type=int, default=300, help="calls a block")
    ap.add_argument("--reps", type=int, default=5, help="blocks (breakdown)")
    ap.add_argument("--modes", default="unpatched,gproj,auto", help="arms (calls)")
    ap.add_argument("--rounds", type=int, default=1, help="calls: the arms this many times, alternated")
    ap.add_argument("--fresh", action="store_true", help="calls: every arm in a process of its own")
    ap.add_argument("--cprofile", type=int, default=0, help="calls: then a cProfile of this many calls per arm")
    ap.add_argument("--library", choices=("sdpa", "fa4"), default="sdpa",
                    help="calls: SDPA, or FA4's flash_attn_func (installed; on the CPU the tests' stand-in)")
    ap.add_argument("--compile", action="store_true", help="calls: the call under torch.compile(fullgraph=True)")
    ap.add_argument("--trace", action="store_true", help="calls: a torch.profiler trace per arm")
    ap.add_argument("--stack", action="store_true", help="calls --trace: Python stacks, tables by the top 4 frames")
    ap.add_argument("--rows", type=int, default=20, help="calls --trace: rows of each table")
    ap.add_argument("--out", default=None, help="folder for host.json and traces (default $OUT/host)")
    args = ap.parse_args(argv)
    if args.trace and (args.fresh or args.library != "sdpa"):
        # the trace runs SDPA's calls in this process: it would not show the arms' processes or FA4's calls
        ap.error("--trace traces SDPA in this process: not with --fresh or --library fa4 (use --cprofile)")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    out = common.out_dir("host", args.out)
    cuda = torch.cuda.is_available() and not args.cpu
    if args.shape is None:  # the CPU's calls run the kernels through the interpreter: seconds a call at 1,2,128,64
        args.shape = "1,1,16,16" if args.mode == "calls" and not cuda else "1,2,128,64"
    log = common.Log()
    env = common.environment()
    log(common.banner(env))
    if args.mode == "calls":
        result = calls(args, cuda, out, log)
    else:
        result = breakdown(args, cuda)
        print_breakdown(result, log)
    result["environment"] = env
    common.save_json(os.path.join(out, "host.json"), result)
    log.write(os.path.join(out, "host.log"))
    return result


if __name__ == "__main__":
    main()
