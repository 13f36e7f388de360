"""What every entry point of ``benchmarks/`` shares: output folders and logs, the machine's versions, timing,
the issue shapes and their FLOP counts, inputs and the saved forward, the fp64 comparisons, the patch's arms,
host µs per call and the 0.5B training step (both measured by more than one entry point), and FA4's interface.

Entry points import this module and nothing else of ``benchmarks/`` (tests/scripts/test_entry_points.py checks
it), so that no two of them can import each other in a circle.
"""
from __future__ import annotations

import contextlib
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
import types
from importlib import metadata
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

import gproj_patch
from gproj_patch.runtime.config import TIERS
from tests.helpers.adversarial import TARGET  # noqa: F401  (re-exported: the 0.5% bound every gate uses)
from tests.helpers.numerics import rel  # noqa: F401  (re-exported: the relative error every table reports)

# ------------------------------------------------------------------------------------------------------ output --

#: where results go when neither ``--out`` nor ``$OUT`` says otherwise (git ignores it)
DEFAULT_OUT_ROOT = ".out"


def out_dir(name: str, given: Optional[str] = None) -> str:
    """The folder an entry point writes to, created: ``given`` (its ``--out``), else ``$OUT/<name>``, else
    ``.out/<name>`` under the working directory."""
    path = given or os.path.join(os.environ.get("OUT", DEFAULT_OUT_ROOT), name)
    os.makedirs(path, exist_ok=True)
    return path


class Log:
    """Lines printed as they come (flushed: a run cut by its time limit keeps them) and kept for the log file."""

    def __init__(self):
        self.lines: List[str] = []

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.lines.append(line)

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            f.write("\n".join(self.lines) + "\n")


def save_json(path: str, obj) -> None:
    """``obj`` as indented JSON (what JSON cannot hold, as its ``str``)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment() -> Dict[str, str]:
    """Date (UTC), the card (or "cpu"), and the versions every table names."""
    cuda = torch.cuda.is_available()
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "cuda": str(torch.version.cuda), "triton": _version("triton"),
            "transformers": _version("transformers"), "flash-attn-4": _version("flash-attn-4"),
            "gproj_patch": gproj_patch.__version__, "python": platform.python_version(),
            "cpus": str(os.cpu_count())}


def banner(env: Dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in env.items())


# ------------------------------------------------------------------------------------------------------ timing --

def sync(device="cuda") -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def bench(fn: Callable[[], object], device="cuda", cpu_reps: int = 2) -> float:
    """Median ms of ``fn``: ``triton.testing.do_bench`` on CUDA (warm-up and repetitions by time; its first
    call, which compiles, is not timed); on the CPU the median of ``cpu_reps`` wall-clock calls (a check of the
    plumbing, not a measurement)."""
    if str(device).startswith("cuda"):
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(cpu_reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def per_call_us(fn: Callable[[], object], n: int, reps: int, *, warm: int = 50,
                sync_fn: Callable[[], None] = lambda: None) -> float:
    """Median over ``reps`` blocks of µs per call of ``fn`` (``warm`` calls first, ``n`` calls a block,
    ``sync_fn()`` after the warm-up and after each block). At a shape whose GPU work is a few µs this is host
    time."""
    for _ in range(warm):
        fn()
    sync_fn()
    blocks = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync_fn()
        blocks.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(blocks)


def cprofile_table(fn: Callable[[], object], calls: int, top: int, *, order: str = "tottime",
                   sync_fn: Callable[[], None] = lambda: None) -> str:
    """cProfile's table (by ``order``, the first ``top`` rows) of ``calls`` calls of ``fn`` and one
    ``sync_fn()``."""
    with cProfile.Profile() as profile:
        for _ in range(calls):
            fn()
        sync_fn()
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats(order).print_stats(top)
    return buf.getvalue()


@contextlib.contextmanager
def only_launch(part: str):
    """While active, a GProj backward runs only its ``part`` launch ("dq": the dQ-major one, "dkdv": the KV-major
    one): a timing of that launch alone (the other launch's outputs are stale, the results meaningless)."""
    from gproj_patch.backends import triton_bwd
    saved = triton_bwd._RUN
    triton_bwd._RUN = (part,)
    try:
        yield
    finally:
        triton_bwd._RUN = saved


def launch_alone_ms(fn: Callable[[], object], part: str, device="cuda") -> float:
    """Median ms of ``fn``'s ``part`` launch alone (``only_launch``)."""
    with only_launch(part):
        return bench(fn, device)


@contextlib.contextmanager
def poisoned_outputs():
    """While active, the GProj kernels' outputs are filled with NaN before every launch: an element a launch
    does not write shows up as non-finite."""
    from gproj_patch.backends import triton_bwd
    saved = triton_bwd._POISON_OUTPUTS
    triton_bwd._POISON_OUTPUTS = True
    try:
        yield
    finally:
        triton_bwd._POISON_OUTPUTS = saved


# ------------------------------------------------------------------------------------------ shapes and inputs --

#: (B, Hq, S, D, causal[, KV heads]): the shapes every speed table reports, GQA last
SHAPES: List[tuple] = [(4, 16, 4096, 64, True), (4, 16, 4096, 128, True), (2, 16, 8192, 128, False),
                       (1, 16, 16384, 128, True), (2, 32, 8192, 128, True, 8)]


def label(shape) -> str:
    """``GQA 2·32(8)·8192·128 causal`` for (2, 32, 8192, 128, True, 8)."""
    B, H, S, D, causal = shape[:5]
    heads = f"{H}({shape[5]})" if len(shape) > 5 else f"{H}"
    return f"{'GQA ' if len(shape) > 5 else ''}{B}·{heads}·{S}·{D} {'causal' if causal else 'full'}"


def parse_indices(text: Optional[str], items: Sequence) -> list:
    """The items ``text`` ("0,2") indexes, or all of them for None / ""."""
    return list(items) if not text else [items[int(i)] for i in text.split(",")]


def tflops(shape, ms: float, products: int = 5) -> float:
    """TFLOP/s of ``products`` S×S×D matrix products (2·B·Hq·S²·D FLOP each, halved when causal) in ``ms``. A
    standard fused backward has 5 (S, dP, dV, dK, dQ), a forward 2, the GProj backward 8 (its dQ-major launch
    recomputes S and dP, and adds the correction's r·K)."""
    B, H, S, D, causal = shape[:5]
    flop = products * 2.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    return flop / (ms * 1e-3) / 1e12


def make_inputs(B: int, H: int, S: int, D: int, *, dtype=torch.bfloat16, seed: int = 0, hkv: Optional[int] = None,
                device="cuda") -> Tuple[torch.Tensor, ...]:
    """q, k, v, dO drawn N(0, 1) in fp32 from ``seed`` on ``device``, rounded to ``dtype`` (k, v with ``hkv``
    heads)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hk = H if hkv is None else hkv

    def draw(h):
        return torch.randn(B, h, S, D, generator=g, device=device, dtype=torch.float32).to(dtype)
    return draw(H), draw(hk), draw(hk), draw(H)


def saved_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """(O, LSE) of PyTorch's flash forward: what a fused forward saves for its backward. The flash op has no GQA:
    with fewer KV heads it runs on repeated KV heads (the same O and LSE). On the CPU: the fp64 oracle's output
    rounded to q's dtype and its LSE (the CPU has no fused op that returns both for every dtype)."""
    if q.device.type != "cuda":
        from tests.helpers.numerics import saved_forward as oracle_forward
        return oracle_forward(q, k, v, causal=causal)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    return out[0], out[1]


def routed_launches(q, k, v, do) -> Tuple[str, str]:
    """(KV-major, dQ-major) launch the patch's plan picks for an unmasked or causal call: Gluon where its
    predicate takes the call and the head dim is one it was measured faster at, else tl."""
    from gproj_patch.backends import gluon_bwd, gluon_dq
    from gproj_patch.backends.configs import gluon_measured_faster
    d = q.shape[-1]
    kv = "gluon" if gluon_bwd.kv_major_reason(q, k, v, do=do) is None and gluon_measured_faster("kv_major", d) else "tl"
    dq = "gluon" if gluon_dq.dq_major_reason(q, k, v, do=do) is None and gluon_measured_faster("dq_major", d) else "tl"
    return kv, dq


def sdpa_backward_fn(q, k, v, do, causal: bool, backend: str = "cudnn") -> Callable[[], object]:
    """A closure running SDPA's ``backend`` ("cudnn", "flash") backward once (the forward run here, untimed)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]):
        y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return lambda: torch.autograd.grad(y, (qq, kk, vv), do, retain_graph=True)


def same(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> bool:
    """Bitwise equal, tensor by tensor."""
    return all(torch.equal(x, y) for x, y in zip(a, b))


def finite(tensors: Iterable[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in tensors)


# ------------------------------------------------------------------------------------------------ patch arms --

#: the arms every host and step measurement compares
ARMS = ("unpatched", "gproj", "auto")


def arm(mode: str, **options) -> None:
    """Counters reset and the patch off (``unpatched``) or on in ``mode`` (``auto`` samples every 1000th step:
    benign keys stay on the original backward, and a timing is not one of the sampled calls)."""
    gproj_patch.disable()
    gproj_patch.reset_stats()
    if mode != "unpatched":
        gproj_patch.enable(mode=mode, **({"sample_every": 1000} | options))


def tiers() -> Dict[str, int]:
    """How many backwards each tier ran since the last reset."""
    s = gproj_patch.stats()
    return {t: s[t] for t in TIERS}


def _attend(q, k, v):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _fa4_attend(device: str):
    """FA4's ``flash_attn_func`` (B, S, H, D), causal, its output alone (the release returns (out, lse))."""
    iface, _ = fa4_interface(cpu=device == "cpu")

    def attend(q, k, v):
        out = iface.flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out
    return attend


#: ``host_calls`` times its calls in this many blocks and reports the fastest: the host time of the call itself,
#: whatever else the machine's CPUs did meanwhile (the blocks' spread was 2× on a shared GPU host)
HOST_BLOCKS = 5


def host_calls(mode: str, shape: Tuple[int, int, int, int], device: str, n: int, compiled: bool = False,
               library: str = "sdpa", profile: int = 0) -> dict:
    """µs per causal forward+backward call at ``shape`` (B, H, S, D) in arm ``mode``, the fastest of
    ``HOST_BLOCKS`` blocks of ``n / HOST_BLOCKS`` calls (every block's in ``blocks``): with a synchronize after
    each call (``serial``: host and GPU in series) and one per block (``batched``: host-bound calls overlap
    the GPU, so at a tiny shape this is host time); the tiers and KV-major launches that ran. BF16 on CUDA, FP16
    on the CPU (there the kernel tier runs through Triton's interpreter when ``GPROJ_TIER=triton``).
    ``compiled``: the call under ``torch.compile(fullgraph=True)``, compiled by the warm-up calls. ``library``:
    ``"sdpa"`` (``F.scaled_dot_product_attention``) or ``"fa4"`` (FA4's ``flash_attn_func`` on (B, S, H, D)
    tensors of the same sizes; on the CPU the tests' stand-in). ``profile``: then a cProfile of that many calls,
    its tables by tottime and by cumulative time (``profile`` in the result)."""
    if library not in ("sdpa", "fa4"):
        raise ValueError(f"library must be 'sdpa' or 'fa4', got {library!r}")
    if library == "fa4" and compiled:
        raise ValueError("the FA4 arms run eagerly (its CuTe functions are not compiled here)")
    attend = _fa4_attend(device) if library == "fa4" else _attend  # imported first: enable() finds it
    arm(mode)
    if compiled:
        attend = torch.compile(own_code(attend, mode), fullgraph=True)
    if library == "fa4":
        B, H, S, D = shape
        shape = (B, S, H, D)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    do = torch.randn(*shape, generator=g, device=device, dtype=dtype)

    def call():
        attend(q, k, v).backward(do)
    for _ in range(5):
        call()
    sync(device)
    blocks = {"serial": [], "batched": []}
    size = max(1, n // HOST_BLOCKS)
    for _ in range(HOST_BLOCKS):
        t = time.perf_counter()
        for _ in range(size):
            call()
            sync(device)
        blocks["serial"].append((time.perf_counter() - t) / size * 1e6)
        t = time.perf_counter()
        for _ in range(size):
            call()
        sync(device)
        blocks["batched"].append((time.perf_counter() - t) / size * 1e6)
    out = dict(serial=min(blocks["serial"]), batched=min(blocks["batched"]), blocks=blocks, tiers=tiers(),
               kv_major=dict(gproj_patch.stats().get("kv_major", {})))
    if profile:
        out["profile"] = {order: cprofile_table(call, profile, 40, order=order, sync_fn=lambda: sync(device))
                          for order in ("tottime", "cumulative")}
    gproj_patch.disable()
    return out


def fresh_host_calls(mode: str, shape: Tuple[int, int, int, int], n: int, out: str, *, cpu: bool = False,
                     compiled: bool = False, library: str = "sdpa", profile: int = 0) -> dict:
    """``host_calls`` of one arm in a process of its own (``python -m benchmarks.host --mode calls``, its files
    under ``out``): no other arm's state, caches or CUDA backwards before it, as in a script that enables the
    patch before it trains. In one process an arm enabled after another arm's CUDA backwards finds cuDNN plans it
    did not build, and the cuDNN guard sends ``auto``'s original calls to the corrected tier."""
    result = run_entry_point("host", ["--mode", "calls", "--modes", mode, "--shape", ",".join(map(str, shape)),
                                      "--n", str(n), "--library", library, "--cprofile", str(profile)]
                             + (["--compile"] if compiled else []) + (["--cpu"] if cpu else []), out)
    return result["arms"][mode][0]


def run_entry_point(name: str, options: List[str], out: str) -> dict:
    """``python -m benchmarks.<name> <options> --out <out>`` in a new process; the ``<name>.json`` it wrote there
    (RuntimeError with the end of its output when it fails)."""
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *options, "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    with open(os.path.join(out, f"{name}.json")) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------- training step --

#: the 0.5B Llama-style model of the step tables (hidden 2048, 16 query heads of 128, 8 KV heads, 8 layers)
LLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=8)
#: the same shape of model at a size a CPU runs in seconds (``--smoke``)
LLAMA_SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


def build_llama(seq: int, device: str = "cuda", small: bool = False):
    """A BF16 Llama from a config (seed 0) on HF's "sdpa" attention, and its config."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(max_position_embeddings=seq, **(LLAMA_SMALL if small else LLAMA))
    model = LlamaForCausalLM(cfg).to(device, torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    return model, cfg


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def own_code(fn, tag: str):
    """``fn`` with a code object of its own: Dynamo caches compiled graphs per code object, so each arm's graph
    is its own first compile (not a recompile of another arm's) and the counts per arm mean what they say."""
    return types.FunctionType(fn.__code__.replace(co_name=f"{fn.__name__}_{tag}"), fn.__globals__, fn.__name__)


def step_times(seq: int, batch: int, *, reps: int, steps: int, compile_loss: bool = False, device: str = "cuda",
               small: bool = False, arms: Sequence[str] = ARMS) -> dict:
    """The training step (forward, backward, AdamW step) of ``build_llama`` at ``seq`` × ``batch``, per arm: the
    median ms of the timed steps (arms alternated ``reps`` times, ``steps`` timed steps a block after one warm-up
    step), the peak allocated MiB, the MiB allocated after every timed step (flat when nothing leaks), and with
    ``compile_loss`` (the loss under ``torch.compile(fullgraph=True)``, one compiled function per arm) Dynamo's
    graphs and recompiles per arm."""
    from torch._dynamo.utils import counters
    cuda = device == "cuda"
    model, cfg = build_llama(seq, device, small)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    times: Dict[str, List[float]] = {a: [] for a in arms}
    allocated: Dict[str, List[float]] = {a: [] for a in arms}
    peak = {a: 0.0 for a in arms}
    loss_fn = {a: torch.compile(own_code(loss_of, a), fullgraph=True) if compile_loss else loss_of for a in arms}
    compiles = {a: [0, 0] for a in arms}  # graphs, recompiles
    torch._dynamo.reset()
    for _rep in range(reps):
        for mode in arms:
            arm(mode)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
            for i in range(steps + 1):
                sync(device)
                t = time.perf_counter()
                loss_fn[mode](model, ids).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync(device)
                if i:  # the first step of each block warms up
                    times[mode].append((time.perf_counter() - t) * 1e3)
                    if cuda:
                        allocated[mode].append(torch.cuda.memory_allocated() / 2 ** 20)
            if cuda:
                peak[mode] = max(peak[mode], torch.cuda.max_memory_allocated() / 2 ** 20)
            compiles[mode][0] += counters["stats"]["unique_graphs"] - graphs
            compiles[mode][1] += sum(counters["recompiles"].values()) - recompiles
    gproj_patch.disable()
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return {"ms": {m: statistics.median(v) for m, v in times.items()}, "times_ms": times,
            "peak_mib": peak if cuda else None,
            "allocated_mib": allocated if cuda else None, "graphs_recompiles": compiles if compile_loss else None}


def step_line(context: str, r: dict) -> str:
    """One line of a ``step_times`` result: ms per arm, the patched arms' change, peak MiB, growth, compiles."""
    s = r["ms"]
    base = s.get("unpatched")  # a block of one patched arm alone (``benchmarks.step --fresh``'s processes) has none
    line = f"step {context}: " + ", ".join(
        f"{m} {s[m]:.1f}" + (f" ({100 * (s[m] / base - 1):+.1f}%)" if base and m != "unpatched" else "")
        for m in s) + (" ms" if base is None else "")
    if r.get("peak_mib"):
        line += "; peak MiB " + " / ".join(f"{v:.0f}" for v in r["peak_mib"].values())
    if r.get("allocated_mib"):
        line += "; allocated growth MiB " + " / ".join(
            f"{v[-1] - v[0]:+.1f}" if v else "n/a" for v in r["allocated_mib"].values())
    if r.get("graphs_recompiles"):
        line += "; graphs/recompiles " + ", ".join(f"{m} {g}/{c}" for m, (g, c) in r["graphs_recompiles"].items())
    return line


# ------------------------------------------------------------------------------------------------------- FA4 --

def fa4_interface(cpu: bool = False):
    """(module, version) of FA4's ``flash_attn.cute.interface``: the installed release (ImportError where it is
    not importable: the GPU machine has it only after ``external_gpu.sh`` installed the carried wheels), or with
    ``cpu`` the tests' CPU stand-in of 4.0.0b36, left installed in ``sys.modules``."""
    if cpu:
        from tests.helpers import fa4_standin

        class _Keep:  # fa4_standin.load takes a monkeypatch; here the stand-in modules simply stay installed
            @staticmethod
            def setitem(mapping, key, value):
                mapping[key] = value
        return fa4_standin.load(_Keep()), f"stand-in of {fa4_standin.RELEASE}"
    import flash_attn.cute.interface as iface
    version = _version("flash-attn-4")
    return iface, version if version != "not installed" else "unknown (no metadata)"

