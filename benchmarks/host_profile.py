"""The package's own Python on the path of one hooked SDPA call, on CPU, with the backend compute stubbed out.

Times N forward+backward calls of ``F.scaled_dot_product_attention`` at a tiny shape (default B1 H2 S16 D16,
FP16, causal: CPU compute ~170 µs a call, the H200 benchmark's 1·2·128·64 costs ~4 ms on CPU) per arm, and cProfiles the patched arms:

* ``unpatched``   — the builtin alone (the patch disabled; its backward computes, the stubbed arms' do not);
* ``floor``       — no package code: a bare autograd Function doing the torch work the hook cannot avoid (the
                    original forward on aliases, the LSE read, saved tensors) and returning zero gradients;
* ``gproj``       — ``enable(mode="gproj")``, tier option ``triton``: the record, the LSE lookup, the kernel tier
                    choice (kernel_reason → ``kernel_unsupported_reason``), telemetry — the kernel launch stubbed;
* ``auto``        — ``enable(mode="auto")``, benign keys: after its first (sampled) call the layer stays on
                    ``original`` and the hook passes the forward through (``policy.keeps_original``);
* ``auto-gproj``  — ``auto`` with ``gproj_enter = gproj_exit = 0``: the layer is on ``gproj`` and every call
                    goes through ``policy.decide`` and the (stubbed) kernel tier;
* ``gproj-host``  — ``gproj`` with the real ``router._run_kernel``: ``backends.triton_bwd.gproj_backward``'s own
                    host work (checks, allocations, the launch description) runs, only its launches
                    (``triton_bwd._launch``) are stubbed. CPU tensors take its interpreter branch (block sizes
                    fixed, no CUDA config lookup); on CUDA the launches' own Python (~45 µs each) adds to it.

MEASUREMENT HARNESS, not package behaviour: inside this script only, ``gproj_patch.dispatch.router._run_kernel`` and
``_run_fp32`` are replaced by stubs returning zero gradients (no Triton launch, no FP32 recompute; in
``gproj-host`` only ``triton_bwd._launch`` is: the gradients are then uninitialised memory), and
``GPROJ_TIER=triton`` makes the kernel tier choosable for CPU FP16 tensors (as the tests do). What the patched arms
(``gproj``, ``auto-gproj``) cost over ``floor`` is the package's Python.

    PYTHONPATH=. python benchmarks/host_profile.py [--n 2000 --reps 5 --top 20 --shape 1,2,16,16]
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

os.environ["GPROJ_TIER"] = "triton"  # before the package reads its options: the kernel tier on CPU FP16

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gproj_patch  # noqa: E402
from gproj_patch.dispatch import router  # noqa: E402
from gproj_patch.backends import triton_bwd  # noqa: E402

ARMS = ("unpatched", "floor", "gproj", "auto", "auto-gproj", "gproj-host")
_REAL = {"_run_kernel": router._run_kernel, "_run_fp32": router._run_fp32}


class _Floor(torch.autograd.Function):
    """The ``floor`` arm: the torch work the hook cannot avoid, without any of the package's Python — the
    original forward on aliases that require grad (its LSE read from the fused node), the saved tensors, and a
    backward that returns the stub's zero gradients."""

    @staticmethod
    def forward(ctx, q, k, v):
        with torch.enable_grad():
            qi, ki, vi = (t.detach().requires_grad_() for t in (q, k, v))
            inner = torch._C._nn.scaled_dot_product_attention(qi, ki, vi, is_causal=True)
        lse = inner.grad_fn._saved_logsumexp
        out = inner.detach()
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, _out, _lse = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _stub(t, problem, kv_major_option="auto"):
    """Measurement stub for the backend compute: zero gradients of the right dtypes (sink: none here)."""
    return torch.zeros_like(t.q), torch.zeros_like(t.k), torch.zeros_like(t.v)


def _launch_stub(km, interpret, job):
    """Measurement stub for the Triton launches of ``backends.triton_bwd`` (``gproj-host`` arm)."""
    return job.lse


def _arm(arm):
    """Enable the patch as the arm says; install the measurement stubs (module docstring)."""
    gproj_patch.disable()
    gproj_patch.reset_stats()
    gproj_patch.policy.reset(keep_config=False)
    router._run_fp32 = _stub
    router._run_kernel = _REAL["_run_kernel"] if arm == "gproj-host" else _stub
    triton_bwd._launch = _launch_stub
    if arm in ("unpatched", "floor"):
        return
    mode = "gproj" if arm.startswith("gproj") else "auto"
    # auto-gproj: thresholds 0 through the environment (as keywords, gproj_enter below the default gproj_exit
    # is refused one option at a time by config.policy_options)
    for var in ("GPROJ_AUTO_ENTER", "GPROJ_AUTO_EXIT"):
        if arm == "auto-gproj":
            os.environ[var] = "0"
        else:
            os.environ.pop(var, None)
    gproj_patch.enable(mode=mode, sample_every=1000)


def _inputs(shape, dtype):
    torch.manual_seed(0)
    B, H, S, D = shape
    q, k, v = (torch.randn(B, H, S, D, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(B, H, S, D, dtype=dtype)


def _step(arm, q, k, v, do):
    call = (lambda: _Floor.apply(q, k, v)) if arm == "floor" else \
        (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def step():
        call().backward(do)
        q.grad = k.grad = v.grad = None
    return step


def _block(step, n):
    """(wall µs, CPU µs) per call of ``n`` calls (CPU: ``time.process_time``, torch on one thread)."""
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n * 1e6, (time.process_time() - c) / n * 1e6


def measure(arms, args):
    """{arm: (median wall, best wall, best CPU) µs per call}, {arm: tiers counted}. The arms take turns, one
    block of ``n`` calls each per repetition (after ``enable``/``disable`` and a short warm-up), so that other
    load on a shared machine falls on every arm alike; the best block is the figure least disturbed."""
    q, k, v, do = _inputs(args.shape, torch.float16)
    blocks = {arm: [] for arm in arms}
    counts = {}
    for _rep in range(args.reps):
        for arm in arms:
            _arm(arm)
            step = _step(arm, q, k, v, do)
            for _ in range(20):
                step()
            blocks[arm].append(_block(step, args.n))
            s = gproj_patch.stats()
            counts[arm] = {t: s[t] for t in ("gproj", "fp32", "original")}
    gproj_patch.disable()
    times = {arm: (statistics.median(w for w, _ in b), min(w for w, _ in b), min(c for _, c in b))
             for arm, b in blocks.items()}
    return times, counts


def profile(arm, args) -> str:
    """cProfile of ``n // 4`` calls of one arm, top ``args.top`` functions by tottime."""
    _arm(arm)
    step = _step(arm, *_inputs(args.shape, torch.float16))
    for _ in range(20):
        step()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.n // 4 or 1):
        step()
    pr.disable()
    gproj_patch.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(args.top)
    return buf.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500, help="calls per block (one block per arm and repetition)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=20, help="functions by tottime per profile (0: no profile)")
    ap.add_argument("--shape", default="1,2,16,16", help="B,H,S,D (CPU FP16 SDPA at 1,2,128,64 costs ~4 ms)")
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    args.shape = tuple(int(x) for x in args.shape.split(","))
    torch.set_num_threads(1)
    arms = args.arms.split(",")
    for arm in arms if args.top else ():
        if arm not in ("unpatched", "floor"):
            print(f"--- profile, {arm} ({args.n // 4} calls, by tottime) ---\n{profile(arm, args).strip()}\n")
    times, counts = measure(arms, args)
    rows = {arm: times[arm] + (counts[arm],) for arm in arms}
    base = rows.get("floor", (0.0, 0.0, 0.0, None))[2]
    print(f"torch {torch.__version__}, shape {args.shape} fp16 causal, {args.n} calls x {args.reps} reps, 1 thread")
    print(f"{'arm':12s} {'wall med':>9s} {'wall best':>9s} {'cpu best':>9s} {'cpu-floor':>9s}  backward tiers counted"
          " (µs per forward+backward call)")
    for arm, (med, best, cpu, counts) in rows.items():
        print(f"{arm:12s} {med:9.1f} {best:9.1f} {cpu:9.1f} {cpu - base:+9.1f}  {counts}")


if __name__ == "__main__":
    main()
