"""The interception end to end on a small Llama: forward bits, per-layer attention gradients against fp64, step time.

    python -m benchmarks.model                 # GPU: BF16, seq 2048, cuDNN SDPA vs patched
    python -m benchmarks.model --cpu --small   # the same code path on a CPU

What it measures, for a randomly initialised Llama whose layer ``--offset-layer`` gets a large common key offset
(a constant added to that layer's ``k_proj`` bias on the lowest-frequency RoPE pair of every head, so RoPE
barely rotates it: ``--offset-sigma`` times the measured key spread):

1. forward bitwise equality: logits of the patched model (``gproj_patch.enable()``) against the unpatched
   model (HF "sdpa", PyTorch's default fused SDPA: cuDNN on the H200), with gradients on;
2. per-layer attention gradient error: every SDPA call's q, k, v and upstream gradient dO are recorded during
   the BF16 backward, and the fp64 oracle (``reference_backward``) is run on exactly those inputs; the table
   gives ‖dX − dX_fp64‖/‖dX_fp64‖ for dq, dk, dv, unpatched and patched. (This isolates the attention backward;
   comparing against an fp64 copy of the whole model would mix in the BF16 rounding of every other layer —
   that number is printed too, as "model grads vs fp64 model".)
3. step time (forward + backward, median of ``--iters``) of the patched model against the unpatched one.

4. per SDPA backend (forced with ``sdpa_kernel``; cuDNN, flash and efficient on CUDA): forward bits, the tiers
   that ran, and dq against fp64 at a 64σ key offset, unpatched and patched.

Writes ``model.json`` and ``model.log`` under ``--out`` (default ``$OUT/model``); the table last.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import gproj_patch
from benchmarks import common
from gproj_patch.backends.reference import reference_backward
from gproj_patch.runtime.config import TIERS

log = logging.getLogger("benchmarks.model")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU")
    p.add_argument("--small", action="store_true", help="a much smaller model and sequence (smoke test)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--offset-layer", type=int, default=1)
    p.add_argument("--offset-sigma", type=float, default=128.0, help="key offset in units of the key spread")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--mode", default="gproj", help="patch mode for the patched runs")
    p.add_argument("--out", default=None, help="folder for model.json and model.log (default $OUT/model)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_config(args):
    from transformers import LlamaConfig
    if args.small:
        dims = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=256)
    else:
        dims = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                    vocab_size=1024)
    seq = args.seq or (128 if args.small else 2048)
    return LlamaConfig(num_hidden_layers=args.layers, max_position_embeddings=seq, attention_bias=True,
                       **dims), seq


class Recorder:
    """Wraps whatever ``F.scaled_dot_product_attention`` is now; records q, k, v, dO and the grads it saw."""

    def __init__(self):
        self.calls = []
        self.prev = None

    def __enter__(self):
        self.prev = prev = F.scaled_dot_product_attention
        calls = self.calls

        def recorded(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
            rec = dict(q=query.detach(), k=key.detach(), v=value.detach(), mask=attn_mask, causal=is_causal,
                       scale=scale)
            for name, t in (("dq", query), ("dk", key), ("dv", value)):
                if t.requires_grad:
                    t.register_hook(lambda g, name=name: rec.__setitem__(name, g.detach()))
            out = prev(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                       scale=scale, enable_gqa=enable_gqa)
            if out.requires_grad:
                out.register_hook(lambda g: rec.__setitem__("do", g.detach()))
            rec["out"] = out.detach()
            calls.append(rec)
            return out
        F.scaled_dot_product_attention = recorded
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self.prev


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def attention_errors(calls):
    rows = []
    for rec in calls:
        ref = reference_backward(rec["q"], rec["k"], rec["v"], rec["do"], attn_mask=rec["mask"],
                                 scale=rec["scale"], causal=rec["causal"])
        rows.append({n: rel(rec[n], r) for n, r in zip(("dq", "dk", "dv"), ref)})
    return rows


def induce_offset(model, layer, sigma, ids):
    """Zero every bias, measure the key spread of ``layer``, put ``sigma`` spreads on its lowest RoPE pair."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
            torch.nn.init.zeros_(mod.bias)
    attn = model.model.layers[layer].self_attn
    seen = {}
    h = attn.k_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o.detach().float()))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    spread = seen["k"].std().item()
    D = attn.head_dim
    nkv = attn.k_proj.out_features // D
    with torch.no_grad():
        b = attn.k_proj.bias.view(nkv, D)
        b[:, D // 2 - 1] = sigma * spread
        b[:, D - 1] = sigma * spread
    return spread, sigma * spread


def step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def timed(model, ids, iters, device):
    for _ in range(3):
        step(model, ids)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(model, ids)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(args):
    from transformers import AutoModelForCausalLM
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    cfg, seq = build_config(args)
    batch = args.batch or (1 if args.small else 2)
    iters = args.iters or (3 if args.small else 20)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa",
                                             dtype=torch.bfloat16).to(device)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device,
                        generator=torch.Generator(device=device).manual_seed(args.seed))
    spread, offset = induce_offset(model, args.offset_layer, args.offset_sigma, ids)
    log.info("device %s, torch %s, seq %d, batch %d, key spread %.4g, offset %.4g on layer %d", device,
             torch.__version__, seq, batch, spread, offset, args.offset_layer)

    results = {"device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
               "torch": torch.__version__, "seq": seq, "batch": batch, "layers": cfg.num_hidden_layers,
               "offset_layer": args.offset_layer, "offset_sigma": args.offset_sigma, "mode": args.mode}

    # 1 + 2: unpatched, then patched, both recorded
    with Recorder() as rec_plain:
        loss_plain = step(model, ids)
        logits_plain = model(input_ids=ids).logits.detach()
    grads_plain = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    gproj_patch.reset_stats()
    with gproj_patch.enable(mode=args.mode, targets=("sdpa",)):
        with Recorder() as rec_patch:
            loss_patch = step(model, ids)
            logits_patch = model(input_ids=ids).logits.detach()
        stats = gproj_patch.stats()
    grads_patch = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    n_layers = cfg.num_hidden_layers
    results["forward_bitwise_equal"] = bool(torch.equal(logits_plain, logits_patch))
    results["attention_outputs_bitwise_equal"] = all(
        torch.equal(a["out"], b["out"]) for a, b in zip(rec_plain.calls[:n_layers], rec_patch.calls[:n_layers]))
    results["loss"] = {"unpatched": loss_plain.item(), "patched": loss_patch.item()}
    results["stats"] = stats
    err_plain = attention_errors(rec_plain.calls[:n_layers])
    err_patch = attention_errors(rec_patch.calls[:n_layers])
    results["attention_grad_error"] = {"unpatched": err_plain, "patched": err_patch}

    # model-level context: the same weights in fp64
    m64 = copy.deepcopy(model).double()
    m64.config._attn_implementation = "eager"
    step(m64, ids)
    g64 = {n: p.grad for n, p in m64.named_parameters()}
    results["model_grad_error_vs_fp64_model"] = {
        name: max(rel(g[n], g64[n]) for n in g64 if ".self_attn." in n and f"layers.{args.offset_layer}." in n)
        for name, g in (("unpatched", grads_plain), ("patched", grads_patch))}
    del m64, g64

    # 3: step time
    t_plain = timed(model, ids, iters, device)
    with gproj_patch.enable(mode=args.mode, targets=("sdpa",)):
        t_patch = timed(model, ids, iters, device)
    results["step_ms"] = {"unpatched": t_plain, "patched": t_patch, "overhead": t_patch / t_plain - 1.0}

    results["backends"] = backend_check(args, device)

    L = args.offset_layer
    results["done_when"] = {
        "offset_layer_dq_patched_le_0.5pct": err_patch[L]["dq"] <= 5e-3,
        "offset_layer_dq_unpatched_ge_10pct": err_plain[L]["dq"] >= 0.10,
        "forward_bitwise_equal": results["forward_bitwise_equal"]}
    with open(os.path.join(args.out, "model.json"), "w") as f:
        json.dump(results, f, indent=2)
    return results, err_plain, err_patch


def backend_check(args, device):
    """Per SDPA backend (forced with ``sdpa_kernel``): forward bits, which tier ran, dq error vs fp64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = ([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
                if device.type == "cuda" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
    S = 256 if args.small else 1024
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(2, 8, S, 64, device=device, generator=g)
    k = torch.randn(2, 4, S, 64, device=device, generator=g) + 64.0
    v = torch.randn(2, 4, S, 64, device=device, generator=g)
    do = torch.randn(2, 8, S, 64, device=device, generator=g).bfloat16()
    q, k, v = (t.bfloat16() for t in (q, k, v))
    ref = reference_backward(q, k, v, do, causal=True)
    rows = []
    for backend in backends:
        row = {"backend": backend.name}
        try:
            with sdpa_kernel(backend):
                qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                plain = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
                plain.backward(do)
                row["dq_err_unpatched"] = rel(qq.grad, ref[0])
                gproj_patch.reset_stats()
                with gproj_patch.enable(mode=args.mode, targets=("sdpa",)):
                    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
                    out.backward(do)
                row["forward_bitwise_equal"] = bool(torch.equal(out, plain))
                row["dq_err_patched"] = rel(qq.grad, ref[0])
                st = gproj_patch.stats()
                row["tiers"] = {t: st[t] for t in TIERS}
                row["fallbacks"] = st["fallback_reasons"]
        except RuntimeError as exc:  # backend not available for these inputs
            row["error"] = str(exc).splitlines()[0][:160]
        rows.append(row)
        log.info("backend %s", row)
    return rows


def table(results, err_plain, err_patch):
    lines = [f"model check  {results['device']}  torch {results['torch']}  seq {results['seq']}  "
             f"batch {results['batch']}  mode {results['mode']}  offset {results['offset_sigma']:g} sigma on "
             f"layer {results['offset_layer']}",
             "layer | attention grad error vs fp64 oracle, unpatched dq / dk / dv | patched dq / dk / dv"]
    for i, (a, b) in enumerate(zip(err_plain, err_patch)):
        mark = "*" if i == results["offset_layer"] else " "
        lines.append(f"{i:>4}{mark} | {a['dq']:9.3%} {a['dk']:9.3%} {a['dv']:9.3%} | "
                     f"{b['dq']:9.3%} {b['dk']:9.3%} {b['dv']:9.3%}")
    m = results["model_grad_error_vs_fp64_model"]
    s = results["step_ms"]
    st = results["stats"]
    lines += [f"model grads of the offset layer's attention vs an fp64 model (includes all other BF16 rounding): "
              f"unpatched {m['unpatched']:.3%}, patched {m['patched']:.3%}",
              f"forward logits bitwise equal: {results['forward_bitwise_equal']}; attention outputs bitwise equal: "
              f"{results['attention_outputs_bitwise_equal']}",
              f"step (fwd+bwd) ms: unpatched {s['unpatched']:.2f}, patched {s['patched']:.2f}, "
              f"overhead {s['overhead']:+.1%}",
              f"backward tiers: gproj {st['gproj']}, fp32 {st['fp32']}, original {st['original']}; "
              f"fallbacks {st['fallback_reasons']}",
              "done-when: " + ", ".join(f"{k}={v}" for k, v in results["done_when"].items())]
    for row in results.get("backends", []):
        if "error" in row:
            lines.append(f"  sdpa backend {row['backend']}: unavailable ({row['error']})")
        else:
            lines.append(f"  sdpa backend {row['backend']}: forward bitwise {row['forward_bitwise_equal']}, "
                         f"dq err (key offset 64) unpatched {row['dq_err_unpatched']:.3%} -> patched "
                         f"{row['dq_err_patched']:.3%}, tiers {row['tiers']}, fallbacks {row['fallbacks']}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    args.out = common.out_dir("model", args.out)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.FileHandler(os.path.join(args.out, "model.log")),
                                  logging.StreamHandler(sys.stderr)])
    results, err_plain, err_patch = run(args)
    text = table(results, err_plain, err_patch)
    with open(os.path.join(args.out, "model.log"), "a") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
