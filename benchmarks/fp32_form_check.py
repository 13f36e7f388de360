"""The FP32 tier's kernel form under each fp32 ``tl.dot`` input precision Triton offers on the GPU: accuracy
against fp64 on the adversarial cases and time against the chunked FP32 tier, in one run (issue 11.2).

    python benchmarks/fp32_form_check.py [--precisions ieee,tf32x3,bf16x6] [--out DIR]

"ieee" is plain fp32 products (FMA units); "tf32x3" splits each operand into a TF32 head and tail and sums three
tensor-core products (fp32-level accuracy); "bf16x6" does the same with three BF16 pieces and six products. For
each precision: the relative error of dq/dk/dv against the fp64 oracle on the cases (inputs BF16, saved O BF16,
the saved LSE), the four-key witness, and the whole backward's time (do_bench median, after a warm-up call) for a
few block configs at 1·16·4096·D causal (``--sweep``) or the default config at 4·16·4096·D causal, D = 64 and
128, with the chunked tier's time at the same shape. Everything is printed as soon as it is measured.
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

from device_check import make_inputs, rel, saved_forward  # noqa: E402  (benchmarks/device_check.py)
from gproj_patch.backends import triton_bwd  # noqa: E402
from gproj_patch.backends.fp32_tier import fp32_backward  # noqa: E402
from gproj_patch.backends.reference import reference_backward, reference_forward  # noqa: E402
from gproj_patch.backends.triton_bwd import gproj_backward  # noqa: E402
from gproj_patch.audit.cases import get_case  # noqa: E402

CASES = ["key_offset_128", "key_offset_512", "sink_offset_64", "repeated_max", "causal_bottom_right", "window",
         "odd_lengths", "gqa", "varlen", "witness"]
CONFIGS = [(32, 32, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (64, 64, 4, 2)]
SHAPE = (1, 16, 4096)  # the config sweep's (--sweep)
TIMED_SHAPE = (4, 16, 4096)  # device_check's FP32 rows


def _bench(fn):
    import triton.testing as tt
    fn()
    torch.cuda.synchronize()
    return tt.do_bench(fn, warmup=5, rep=60, return_mode="median")


def accuracy():
    out = {}
    for name in CASES:
        inp = get_case(name).build(dtype=torch.bfloat16, device="cuda", quick=False)
        o, lse = reference_forward(inp.q, inp.k, inp.v, **inp.mask)
        ref = reference_backward(inp.q, inp.k, inp.v, inp.do, **inp.mask)
        got = gproj_backward(*(x.float() for x in (inp.do, inp.q, inp.k, inp.v)), o.to(torch.bfloat16), lse.float(),
                             **inp.mask)
        out[name] = max(rel(a, b) for a, b in zip(got, ref))
        if inp.expected.get("dq_index") is not None:
            out["witness_dq0"] = float(got[0][inp.expected["dq_index"]])
    return out


def timing(D, sweep):
    """ms of the kernel form (the default config, or each of CONFIGS with ``sweep``) and of the chunked tier."""
    shape = SHAPE if sweep else TIMED_SHAPE
    q, k, v, do = make_inputs(*shape, D)
    o, lse = saved_forward(q, k, v, True)
    f32 = [x.float() for x in (do, q, k, v, o)]
    res = {"chunked": _bench(lambda: fp32_backward(q, k, v, do, causal=True))}
    for c in (CONFIGS if sweep else [None]):
        cfg = None if c is None else {"dq": c, "dkdv": c}
        try:
            res[str(c)] = _bench(lambda cfg=cfg: gproj_backward(*f32, lse, causal=True, _config=cfg))
            print(f"  D={D} {shape} {c or 'default'}: {res[str(c)]:.2f} ms (chunked {res['chunked']:.2f}) "
                  f"{triton_bwd.LAST_KERNELS}", flush=True)
        except Exception as e:
            print(f"  D={D} {c} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="ieee,tf32x3,bf16x6")
    ap.add_argument("--sweep", action="store_true", help="time each of CONFIGS at SHAPE instead of the default")
    ap.add_argument("--out", default=os.environ.get("OUT", "fp32_form_out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    result = {"gpu": torch.cuda.get_device_name()}
    for prec in args.precisions.split(","):
        triton_bwd.FP32_DOT_PRECISION = prec
        print(f"precision {prec} ({time.time() - t0:.0f} s)", flush=True)
        try:
            err = accuracy()
            print(f"  error vs fp64 (worst of dq, dk, dv): {json.dumps(err)}", flush=True)
            result[prec] = {"error": err}
            result[prec]["ms"] = {D: timing(D, args.sweep) for D in (64, 128)}
        except Exception as e:
            result.setdefault(prec, {})["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(result[prec]["failed"], flush=True)
        with open(os.path.join(args.out, "fp32_form.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
