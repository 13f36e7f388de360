"""Does the patch reach attention the way production code holds it? A flex_attention bound or compiled before
``enable()``, real FA4 layers under ``auto``, and training steps captured in CUDA graphs.

    python -m benchmarks.reach [--check flex,fa4,graphs] [--out DIR]          # GPU (FA4: external_gpu.sh records)
    python -m benchmarks.reach --cpu --check flex,fa4                         # CPU: flex and the FA4 stand-in

``flex``. Each way of holding flex_attention that production code uses is set up *before* ``enable()``: a module
global (``from torch.nn.attention.flex_attention import flex_attention``) compiled by the caller's own
``torch.compile`` of a step function; torchtitan's class attribute ``flex_attn = torch.compile(flex_attention)``;
HF's ``"flex_attention"`` attention function. Per binding and case (the audit's ``key_offset_128`` and
``sink_offset_64``): dq/dk/dv error against fp64 unpatched and patched, forward bits equal, the tiers that ran.
Fails when a patched error is above 0.5%, a forward differs, or an unpatched CUDA error is not above 5% (the
input would prove nothing). On the CPU PyTorch's flex has no backward: the unpatched column is the emulated fused
BF16 backward, and the HF case runs Inductor's CPU flex.

``fa4``. Two FA4 layers through ``flash_attn.cute.interface.flash_attn_func`` (the caller keeps ``out`` only, as
models do), one with benign keys, one with a common key offset of ``--offset`` (300) key spreads; each runs
unpatched (FA4's own backward), then under ``enable(mode="auto", sample_every=1)`` for ``--steps`` steps, each
forward in its ``layer_scope``, one backward per step after both forwards. Checked: two policy records under the
two layer names (a backward that missed its forward's record would be filed under the source: one record); the
healthy layer on FA4's backward every step, the sick one corrected from the first step (the GProj kernel on a
GPU, the FP32 tier on the CPU); the sick layer's patched dq, dk, dv within ``--bound`` (1%) of fp64 and its
unpatched dq at least 10× worse; the healthy layer's patched error at most twice its unpatched one; no "no
forward record" logged or counted; no forward record alive after the last backward. ``--cpu`` runs the tests'
CPU stand-in of FA4 4.0.0b36 (small sizes).

``graphs`` (CUDA). ``torch.cuda.graph`` capture of SDPA fwd + ``autograd.grad`` in mode "gproj" at D = 128 (the
Gluon launches) and D = 96 (tl), with a boolean key-padding mask (the FP32 tier) and in mode "auto", keys at a
128σ offset: the replayed gradients on new values against the eager patched ones (bitwise) and against fp64;
and ``torch.compile(mode="reduce-overhead")`` of the step, four steps against fp64, the tiers counted.

Writes ``reach.json`` and ``reach.log`` under ``--out`` (default ``$OUT/reach``). Exit status 1 when a check
failed, 2 when FA4 (asked for) is not importable.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import logging
import os
import traceback
import types

import torch
import torch.nn.attention.flex_attention as fam
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention as EARLY_FLEX  # bound before enable()

import gproj_patch
from benchmarks import common
from gproj_patch import policy
from gproj_patch.audit.cases import get_case
from gproj_patch.backends.emulation import emulated_backward, emulated_forward
from gproj_patch.backends.reference import reference_backward
from gproj_patch.hooks import fa_records

log = common.Log()
FLEX_CASES = ("key_offset_128", "sink_offset_64")
#: an unpatched CUDA error below this proves nothing about the correction
FAR_OFF = 0.05
NO_RECORD = "no forward record"
#: the sick FA4 layer's unpatched dq error: at least this many times its patched one
FAR = 10.0
GRAPH_SHAPE = (2, 8, 512)  # B, H, S

# ------------------------------------------------------------------------------------------------------- flex --


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _grads(fn, inp):
    q, k, v = (t.detach().clone().requires_grad_() for t in (inp.q, inp.k, inp.v))
    out = fn(q, k, v)
    out.backward(inp.do)
    return out.detach(), (q.grad, k.grad, v.grad)


def _uncorrected(fn, inp, device: str):
    """Unpatched gradients: the real flex backward on CUDA, the emulated fused BF16 backward on CPU (none there)."""
    if device == "cuda":
        return _grads(fn, inp)
    with torch.no_grad():
        out = fn(inp.q, inp.k, inp.v)
    o, lse = emulated_forward(inp.q, inp.k, inp.v, causal=True)
    return out, emulated_backward(inp.q, inp.k, inp.v, o, inp.do, lse, correct=False, causal=True)


class _HFModule(torch.nn.Module):
    layer_idx = 0


def _bindings(block_mask):
    """name -> callable (q, k, v) -> out, each bound before enable()."""
    early = types.SimpleNamespace(flex_attention=EARLY_FLEX)
    step = torch.compile(lambda q, k, v: early.flex_attention(q, k, v, block_mask=block_mask), fullgraph=True)

    class TitanAttention:
        flex_attn = torch.compile(fam.flex_attention, fullgraph=True)
    out = {"early": step, "titan": functools.partial(TitanAttention.flex_attn, block_mask=block_mask)}
    try:
        from transformers.modeling_utils import AttentionInterface
        module = _HFModule()

        def hf(q, k, v):  # looked up at each call, as HF's attention layers do
            return AttentionInterface()["flex_attention"](module, q, k, v, block_mask)[0].transpose(1, 2)
        out["hf"] = hf
    except ImportError:
        pass
    return out


def check_flex(args, device: str) -> dict:
    rows, failures = [], []
    log(f"{'binding':8} {'case':16} {'unpatched dq/dk/dv %':>24} {'patched dq/dk/dv %':>24} {'fwd':>5} tiers")
    for case in FLEX_CASES:
        inp = get_case(case).build(seed=0, dtype=torch.bfloat16, device=device, quick=device == "cpu")
        S = inp.q.shape[2]
        bm = fam.create_block_mask(_causal, None, None, S, S, device=device)
        ref = reference_backward(inp.q, inp.k, inp.v, inp.do, causal=True)
        bindings = _bindings(bm)
        before = {name: _uncorrected(fn, inp, device) for name, fn in bindings.items()}
        with gproj_patch.enable(targets=("flex",)):
            for name, fn in bindings.items():
                gproj_patch.reset_stats()
                out, grads = _grads(fn, inp)
                base = [common.rel(g, r) for g, r in zip(before[name][1], ref)]
                errs = [common.rel(g, r) for g, r in zip(grads, ref)]
                same = torch.equal(out, before[name][0])
                tiers = {t: n for t, n in common.tiers().items() if n}
                log(f"{name:8} {case:16} {'/'.join(f'{e * 100:.3g}' for e in base):>24} "
                    f"{'/'.join(f'{e * 100:.3g}' for e in errs):>24} {str(same):>5} {tiers}")
                rows.append(dict(binding=name, case=case, unpatched=base, patched=errs, forward_equal=same,
                                 tiers=tiers))
                if max(errs) >= common.TARGET or not same or (device == "cuda" and base[0] <= FAR_OFF):
                    failures.append(f"{name}/{case}")
        torch._dynamo.reset()
    log("flex: FAIL " + ", ".join(failures) if failures else "flex: every binding corrected")
    return dict(rows=rows, failures=failures, passed=not failures)

# -------------------------------------------------------------------------------------------------------- fa4 --


class Lines(logging.Handler):
    """Keeps every message logged to ``gproj_patch``."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _bhsd(t):
    return t.transpose(1, 2)


def fa4_layer(offset: float, shape: dict, seed: int, device: str):
    """(q, k, v, do) in FA4's (B, S, H, D) layout, BF16, the keys shifted by ``offset``; fp64 dq, dk, dv."""
    g = torch.Generator().manual_seed(seed)
    lead = (shape["batch"], shape["seqlen"])
    q, k, v, do = (torch.randn(*lead, h, shape["head_dim"], generator=g)
                   for h in (shape["heads"], shape["kv_heads"], shape["kv_heads"], shape["heads"]))
    inputs = tuple(t.bfloat16().to(device) for t in (q, k + offset, v, do))
    oracle = reference_backward(*(_bhsd(t) for t in inputs), causal=True, causal_align="bottom_right")
    return inputs, tuple(oracle)


def fa4_step(iface, layers: dict, scoped: bool) -> dict:
    """One step: every layer's forward (``flash_attn_func``, ``out`` kept only), then one backward."""
    leaves, loss = {}, 0.0
    for name, (inputs, _) in layers.items():
        q, k, v, do = inputs
        leaves[name] = [t.clone().requires_grad_() for t in (q, k, v)]
        with gproj_patch.layer_scope(name) if scoped else contextlib.nullcontext():
            out = iface.flash_attn_func(*leaves[name], causal=True)[0]
        loss = loss + (out.float() * do.float()).sum()
    loss.backward()
    return {name: [common.rel(_bhsd(t.grad), w) for t, w in zip(ts, layers[name][1])] for name, ts in leaves.items()}


def check_fa4(args, device: str) -> dict:
    try:
        iface, version = common.fa4_interface(cpu=device == "cpu")
    except Exception as exc:  # nothing to check without FA4
        log(f"fa4: flash-attn-4 not importable: {exc!r}")
        return dict(passed=False, missing=repr(exc))
    small = device == "cpu"  # the CPU stand-in computes in fp64 and emulates the backward: a small problem
    shape = dict(batch=args.batch or (1 if small else 2), seqlen=args.seqlen or (64 if small else 2048),
                 heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim or (32 if small else 128))
    healthy, sick = "fa4.healthy", "fa4.sick"
    layers = {healthy: fa4_layer(0.0, shape, 1, device), sick: fa4_layer(args.offset, shape, 2, device)}
    off = fa4_step(iface, layers, scoped=False)
    lines = Lines()
    logger = logging.getLogger("gproj_patch")
    logger.addHandler(lines)
    gproj_patch.reset_stats()
    tiers = {name: [] for name in layers}
    try:
        with gproj_patch.enable(mode="auto", targets=("flash_attn",), sample_every=1) as handle:
            installed = handle.installed["flash_attn"]
            for _ in range(args.steps):
                on = fa4_step(iface, layers, scoped=True)
                for name, rec in gproj_patch.stats()["layers"].items():
                    tiers.setdefault(name, []).append(rec["tier"])
        stats = gproj_patch.stats()
    finally:
        logger.removeHandler(lines)
    gc.collect()
    live = fa_records.live_records()
    expected = "fp32" if device == "cpu" else "gproj"
    checks = {
        "two records under the layer names": sorted(policy.stats()) == sorted(tiers) == sorted(layers),
        "healthy layer on FA4's backward every step": tiers.get(healthy) == ["original"] * args.steps,
        f"sick layer corrected ({expected}) every step": tiers.get(sick) == [expected] * args.steps,
        "sick layer within bound": max(on[sick]) < args.bound,
        "sick layer's unpatched dq far off": off[sick][0] > FAR * on[sick][0],
        "healthy layer as accurate as unpatched": all(a <= 2 * b + 1e-6 for a, b in zip(on[healthy], off[healthy])),
        "no 'no forward record' logged": not any(NO_RECORD in m for m in lines.messages)
        and not any(NO_RECORD in r for r in stats["fallback_reasons"]),
        "no record alive after the backward": live == 0,
    }
    log(f"fa4: flash-attn-4 {version}; {installed}; shape {shape}, causal, BF16, sick offset {args.offset}σ, "
        f"{args.steps} steps in auto (sample_every=1)")
    log("| layer | tier per step | dq / dk / dv error, FA4 unpatched | dq / dk / dv error, auto |\n|---|---|---|---|")
    for name in layers:
        log(f"| {name} | {', '.join(tiers.get(name, []))} | {' / '.join(f'{e:.2e}' for e in off[name])} | "
            f"{' / '.join(f'{e:.2e}' for e in on[name])} |")
    log(f"policy records: {sorted(policy.stats())}; backwards per tier: {common.tiers()}; "
        f"fallback reasons: {dict(stats['fallback_reasons'])}")
    for name, ok in checks.items():
        log(f"{'PASS' if ok else 'FAIL'}  {name}")
    return dict(version=version, shape=shape, offset=args.offset, steps=args.steps, tiers=tiers, errors_off=off,
                errors_on=on, fallback_reasons=dict(stats["fallback_reasons"]), log_lines=lines.messages,
                checks=checks, passed=all(checks.values()))

# ----------------------------------------------------------------------------------------------------- graphs --


def graph_inputs(D, seed, offset=128.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, H, S = GRAPH_SHAPE
    q = torch.randn(B, H, S, D, device="cuda", generator=g)
    shift = offset * torch.randn(D, device="cuda", generator=g) / D ** 0.5  # a common key offset of ~offset σ
    k = torch.randn(B, H, S, D, device="cuda", generator=g) + shift
    v = torch.randn(B, H, S, D, device="cuda", generator=g)
    do = torch.randn(B, H, S, D, device="cuda", generator=g)
    return [x.to(torch.bfloat16) for x in (q, k, v, do)]


def graph_step(q, k, v, do, mask=None):
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return torch.autograd.grad(out, (q, k, v), do)


def capture(q, k, v, do, mask=None):
    """Warm up on a side stream, capture one fwd + grad, return (graph, static grads)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            graph_step(q, k, v, do, mask)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = graph_step(q, k, v, do, mask)
    return graph, grads


def _load(dst, src):
    with torch.no_grad():
        for x, y in zip(dst, src):
            x.copy_(y)


def manual(mode, D, padding=False):
    q, k, v, do = graph_inputs(D, seed=1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    mask = None
    if padding:  # HF's boolean key-padding form: the first sequence's last 100 keys are padding
        mask = torch.ones(GRAPH_SHAPE[0], 1, 1, GRAPH_SHAPE[2], dtype=torch.bool, device="cuda")
        mask[0, ..., -100:] = False
    gproj_patch.reset_stats()
    gproj_patch.enable(mode=mode)
    try:
        graph, grads = capture(*leaves, do, mask)
        res = {"tiers_after_capture": common.tiers()}
        for seed in (2, 3):  # new values into the captured inputs, replay, compare with an eager patched call
            _load(leaves + [do], graph_inputs(D, seed))
            graph.replay()
            torch.cuda.synchronize()
            replayed = [g.clone() for g in grads]
            eager = graph_step(*[x.detach().clone().requires_grad_() for x in leaves], do, mask)
            ref = reference_backward(*(x.detach() for x in leaves), do, attn_mask=mask, causal=mask is None)
            res[f"seed{seed}"] = {"bitwise_eager": common.same(replayed, eager),
                                  "replay_vs_fp64": [round(common.rel(a, r), 5) for a, r in zip(replayed, ref)],
                                  "eager_vs_fp64": [round(common.rel(a, r), 5) for a, r in zip(eager, ref)]}
        res["tiers_end"] = common.tiers()
        res["ok"] = all(res[f"seed{s}"]["bitwise_eager"] and max(res[f"seed{s}"]["replay_vs_fp64"]) < common.TARGET
                        for s in (2, 3))
        return res
    finally:
        gproj_patch.disable()


def reduce_overhead(D=128):
    q, k, v, do = graph_inputs(D, seed=1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    gproj_patch.reset_stats()
    gproj_patch.enable(mode="gproj")
    try:
        fn = torch.compile(lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True),
                           mode="reduce-overhead")
        res = {}
        for seed in (2, 3, 4, 5):
            _load(leaves + [do], graph_inputs(D, seed))
            for x in leaves:
                x.grad = None
            fn(*leaves).backward(do)
            torch.cuda.synchronize()
            ref = reference_backward(*(x.detach() for x in leaves), do, causal=True)
            res[f"seed{seed}"] = [round(common.rel(x.grad, r), 5) for x, r in zip(leaves, ref)]
        res["tiers"] = common.tiers()
        res["ok"] = res["tiers"]["gproj"] == 4 and all(max(res[f"seed{s}"]) < common.TARGET for s in (2, 3, 4, 5))
        return res
    finally:
        gproj_patch.disable()


def check_graphs(args, device: str) -> dict:
    if device != "cuda":
        log("graphs: needs CUDA (skipped)")
        return dict(skipped="no CUDA", passed=True)
    scenarios = {"manual-gproj-128": lambda: manual("gproj", 128), "manual-gproj-96": lambda: manual("gproj", 96),
                 "reduce-overhead": reduce_overhead, "manual-padding": lambda: manual("gproj", 128, padding=True),
                 "manual-auto": lambda: manual("auto", 128)}
    out = {}
    for name, run in scenarios.items():
        try:
            out[name] = run()
        except Exception as exc:  # each scenario reported on its own
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600],
                         "trace": traceback.format_exc()[-2500:]}
        torch.cuda.synchronize()
        log(f"graphs {name}: {'PASS' if out[name]['ok'] else 'FAIL'} "
            f"{ {k: v for k, v in out[name].items() if k != 'trace'} }"[:1500])
    out["passed"] = all(r["ok"] for r in out.values())
    return out

# ------------------------------------------------------------------------------------------------------- main --


CHECKS = {"flex": check_flex, "fa4": check_fa4, "graphs": check_graphs}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", default="flex,fa4,graphs", help="comma-separated: flex, fa4, graphs")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (flex; FA4's CPU stand-in)")
    ap.add_argument("--batch", type=int, default=None, help="fa4: batch (default 2; CPU 1)")
    ap.add_argument("--seqlen", type=int, default=None, help="fa4: sequence length (default 2048; CPU 64)")
    ap.add_argument("--heads", type=int, default=8, help="fa4: query heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="fa4: KV heads")
    ap.add_argument("--head-dim", type=int, default=None, help="fa4: head dim (default 128; CPU 32)")
    ap.add_argument("--offset", type=float, default=300.0, help="fa4: the sick layer's common key offset, in σ")
    ap.add_argument("--steps", type=int, default=3, help="fa4: steps in auto")
    ap.add_argument("--bound", type=float, default=1e-2, help="fa4: the sick layer's largest patched error")
    ap.add_argument("--out", default=None, help="folder for reach.json and reach.log (default $OUT/reach)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    out = common.out_dir("reach", args.out)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    result = {"environment": common.environment(), "device": device}
    log(common.banner(result["environment"]))
    for name in (c for c in args.check.split(",") if c):
        result[name] = CHECKS[name](args, device)
        common.save_json(os.path.join(out, "reach.json"), result)
    log.write(os.path.join(out, "reach.log"))
    if "missing" in result.get("fa4", {}):
        return 2
    return 0 if all(result[c]["passed"] for c in CHECKS if c in result) else 1


if __name__ == "__main__":
    raise SystemExit(main())
