"""Issue 19 item 3 on the device: a flex_attention bound or compiled before enable() gets the corrected backward.

Each way of holding flex_attention that production code uses is set up *before* ``gproj_patch.enable()``:

* ``early``: a module global (``from torch.nn.attention.flex_attention import flex_attention``), compiled by
  the caller's own ``torch.compile`` of a step function that was already run once before enable();
* ``titan``: torchtitan's class attribute ``flex_attn = torch.compile(flex_attention)``, run before enable();
* ``hf``: HF's ``"flex_attention"`` attention function (HF's own Inductor-compiled flex).

For each, one line per case: dq/dk/dv error against the fp64 oracle unpatched (before enable) and patched, the
forward bits equal or not, and the tiers that ran. Exit status 1 if a patched error is above 0.5%, a forward
differs, or an unpatched CUDA error is not above 5% on the offset cases (the input would prove nothing).
With ``--cpu`` (no CUDA): CPU bf16, where PyTorch's flex has no backward (the unpatched column is the emulated
fused backward) and the HF case runs Inductor's CPU flex.

    python benchmarks/flex_reach_check.py            # H200
    python benchmarks/flex_reach_check.py --cpu      # any machine
"""
from __future__ import annotations

import argparse
import functools
import sys
import types

import torch

import torch.nn.attention.flex_attention as fam
from torch.nn.attention.flex_attention import flex_attention as EARLY_FLEX  # bound before enable()

import gproj_patch
from gproj_patch.audit.cases import get_case
from gproj_patch.backends.emulation import emulated_backward, emulated_forward
from gproj_patch.backends.reference import reference_backward

TARGET = 5e-3
FAR = 0.05
CASES = ("key_offset_128", "sink_offset_64")


def _rel(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


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


def _bindings(device: str, block_mask):
    """name -> callable (q, k, v) -> out, each bound before enable()."""
    early = types.SimpleNamespace(flex_attention=EARLY_FLEX)
    step = torch.compile(lambda q, k, v: early.flex_attention(q, k, v, block_mask=block_mask), fullgraph=True)

    class TitanAttention:
        flex_attn = torch.compile(fam.flex_attention, fullgraph=True)
    titan = functools.partial(TitanAttention.flex_attn, block_mask=block_mask)
    out = {"early": step, "titan": titan}
    try:
        from transformers.modeling_utils import AttentionInterface
        module = _HFModule()

        def hf(q, k, v):  # looked up at each call, as HF's attention layers do
            return AttentionInterface()["flex_attention"](module, q, k, v, block_mask)[0].transpose(1, 2)
        out["hf"] = hf
    except ImportError:
        pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (no CUDA needed)")
    args = ap.parse_args()
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    failures = []
    print(f"device={device} torch={torch.__version__}")
    print(f"{'binding':8} {'case':16} {'unpatched dq/dk/dv %':>24} {'patched dq/dk/dv %':>24} {'fwd':>5} tiers")
    for case in CASES:
        inp = get_case(case).build(seed=0, dtype=torch.bfloat16, device=device, quick=device == "cpu")
        S = inp.q.shape[2]
        bm = fam.create_block_mask(_causal, None, None, S, S, device=device)
        ref = reference_backward(inp.q, inp.k, inp.v, inp.do, causal=True)
        bindings = _bindings(device, bm)
        before = {name: _uncorrected(fn, inp, device) for name, fn in bindings.items()}
        with gproj_patch.enable(targets=("flex",)):
            for name, fn in bindings.items():
                gproj_patch.reset_stats()
                out, grads = _grads(fn, inp)
                st = gproj_patch.stats()
                base = [_rel(g, r) for g, r in zip(before[name][1], ref)]
                errs = [_rel(g, r) for g, r in zip(grads, ref)]
                same = torch.equal(out, before[name][0])
                tiers = {t: st[t] for t in ("gproj", "fp32", "original") if st[t]}
                print(f"{name:8} {case:16} {'/'.join(f'{e * 100:.3g}' for e in base):>24} "
                      f"{'/'.join(f'{e * 100:.3g}' for e in errs):>24} {str(same):>5} {tiers}")
                if max(errs) >= TARGET or not same or (device == "cuda" and base[0] <= FAR):
                    failures.append(f"{name}/{case}")
        torch._dynamo.reset()
    print("FAIL: " + ", ".join(failures) if failures else "all bindings corrected")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
