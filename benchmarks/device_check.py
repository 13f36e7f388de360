"""One device call: correctness of the GProj Triton backward (BF16 vs fp64), a small block-config sweep, and
timings against cuDNN / flash SDPA backwards and the FP32 fallback.

    python benchmarks/device_check.py [--sweep] [--skip-suite] [--configs JSON] [--out DIR]

Writes the full log and JSON to ``--out`` (default $OUT or ./device_out), a Markdown section for
BENCHMARKS.md (``bench_section.md``) and prints a short table last. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gproj_patch.backends import triton_bwd  # noqa: E402
from gproj_patch.backends.reference import reference_backward, reference_forward  # noqa: E402
from gproj_patch.backends.triton_bwd import gproj_backward  # noqa: E402
from tests.helpers.adversarial import SUITE, _keys, make_case, rel, witness  # noqa: E402,F401  (gluon_check, fp32_form_check)

LOG = []
#: indices into SHAPES where the FP32 tier is timed too (D = 64 and 128, causal)
FP32_SHAPES = (0, 1)
T_START = time.time()
SWEEP_DEADLINE = float(os.environ.get("SWEEP_DEADLINE", 330))


def log(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


# the adversarial suite (make_case, witness, SUITE, rel): tests/helpers/adversarial.py, shared with the GPU tests


def run_suite(device="cuda", dtype=torch.bfloat16, cases=SUITE):
    rows = []
    triton_bwd._POISON_OUTPUTS = True
    try:
        for name in cases:
            inp, kw, gauge = make_case(name, device, dtype)
            q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
            out, lse = reference_forward(q, k, v, **kw)
            o = out.to(dtype)  # the saved low-precision output (forward channel included)
            lse = lse.float()
            ref = reference_backward(q, k, v, do, **kw)
            row = dict(case=name, gauge=gauge)
            for tag, extra in (("two", dict(dk_form="two_product")), ("fused", dict(dk_form="fused")),
                               ("unc", dict(correct=False))):
                g1 = gproj_backward(do, q, k, v, o, lse, **kw, **extra)
                torch.cuda.synchronize()
                finite = all(bool(torch.isfinite(x).all()) for x in g1)
                for nm, a, b in zip("qkv", g1, ref):
                    row[f"{tag}_d{nm}"] = rel(a, b) if finite else float("nan")
                if tag == "two":
                    g2 = gproj_backward(do, q, k, v, o, lse, **kw, **extra)
                    row["deterministic"] = all(torch.equal(x, y) for x, y in zip(g1, g2))
                    row["finite"] = finite
                if name == "witness":
                    row[f"{tag}_dq0"] = float(g1[0][0, 0, 0, 0])
            rows.append(row)
            log(json.dumps(row))
    finally:
        triton_bwd._POISON_OUTPUTS = False
    return rows


# ----------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------

# (B, H, S, D, causal[, KV heads]): issue 11's shapes, GQA last
SHAPES = [(4, 16, 4096, 64, True), (4, 16, 4096, 128, True), (2, 16, 8192, 128, False), (1, 16, 16384, 128, True),
          (2, 32, 8192, 128, True, 8)]


def make_inputs(B, H, S, D, dtype=torch.bfloat16, seed=0, hkv=None):
    """q, k, v, dO drawn N(0, 1) in fp32 on the GPU from ``seed``, rounded to ``dtype`` (k, v with ``hkv`` heads)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hk = H if hkv is None else hkv
    mk = lambda h: torch.randn(B, h, S, D, generator=g, device="cuda", dtype=torch.float32).to(dtype)  # noqa: E731
    return mk(H), mk(hk), mk(hk), mk(H)


def tflops(shape, ms, products=5):
    """TFLOP/s of a backward counted as ``products`` S×S×D matrix products (cuDNN's count is 5; causal: half)."""
    B, H, S, D, causal = shape[:5]
    flop = products * 2.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    return flop / (ms * 1e-3) / 1e12


def saved_forward(q, k, v, causal):
    """(O, LSE) of PyTorch's flash forward: what a fused forward saves for the backward. The flash op has no GQA:
    with fewer KV heads it runs on repeated KV heads (the same O and LSE)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    return out[0], out[1]


def bench(fn):
    """Median ms of ``fn`` (``triton.testing.do_bench``; its first call, which compiles, is not timed)."""
    import triton.testing as tt
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def fa4_backward_ms(q, k, v, do, causal):
    """FA4's backward (flash-attn-4's CuTe kernels, when installed: DESIGN.md §4), or nan."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as e:  # not carried in this call
        log(f"fa4 not timed: {type(e).__name__}: {str(e)[:120]}")
        return float("nan")
    try:
        qq, kk, vv = (x.transpose(1, 2).contiguous().detach().requires_grad_() for x in (q, k, v))
        y = flash_attn_func(qq, kk, vv, causal=causal)
        y = y[0] if isinstance(y, tuple) else y
        dot = do.transpose(1, 2).contiguous()
        fn = lambda: torch.autograd.grad(y, (qq, kk, vv), dot, retain_graph=True)  # noqa: E731
        fn()
        return bench(fn)
    except Exception as e:  # pragma: no cover
        log(f"fa4 failed: {type(e).__name__}: {str(e)[:200]}")
        return float("nan")


def fp32_tier_ms(q, k, v, do, o, lse, causal):
    """The FP32 tier's backward two ways (chunked fp32 GEMMs; the kernel on fp32 copies, IEEE dots, as the router
    runs it: copies included), and its error against fp64 on the first batch entry and head."""
    from gproj_patch.backends.fp32_tier import fp32_backward
    res = {}
    kernel_form = lambda: gproj_backward(*(x.float() for x in (do, q, k, v, o)), lse, causal=causal)  # noqa
    chunked = lambda: fp32_backward(q, k, v, do, causal=causal)  # noqa: E731
    for tag, fn in (("fp32_kernel_bwd", kernel_form), ("fp32_chunked_bwd", chunked)):
        try:
            fn()  # compiles the kernel form: not timed
            torch.cuda.synchronize()
            t0 = time.time()
            fn()
            torch.cuda.synchronize()
            res[tag] = bench(fn) if time.time() - t0 < 5.0 else (time.time() - t0) * 1e3
        except Exception as e:  # pragma: no cover
            res[tag] = float("nan")
            log(f"{tag} failed: {type(e).__name__}: {str(e)[:300]}")
    try:
        sl = lambda x: x[:1, :1]  # noqa: E731  (k, v: the KV head of query head 0)
        ref = reference_backward(sl(q), sl(k), sl(v), sl(do), causal=causal)
        got = gproj_backward(*(sl(x).float() for x in (do, q, k, v, o)), sl(lse), causal=causal)
        res["fp32_kernel_err"] = [rel(a, b) for a, b in zip(got, ref)]
    except Exception as e:  # pragma: no cover
        log(f"fp32 kernel accuracy failed: {type(e).__name__}: {str(e)[:300]}")
    return res


def time_shape(B, H, S, D, causal, hkv=None, cfg=None, fp32_tier=True):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    q, k, v, do = make_inputs(B, H, S, D, hkv=hkv)
    gqa = hkv is not None and hkv != H
    res = {}
    o, lse = saved_forward(q, k, v, causal)
    # "gproj": the KV-major kernel the patch's plan picks for this call (Gluon at D=128 on sm_90, else tl);
    # "gproj_tl": the portable tl kernel for both launches
    from gproj_patch.dispatch.plan import ForwardTensors, kv_major_choice
    from gproj_patch.dispatch.record import Problem
    routed = kv_major_choice(ForwardTensors(q, k, v, o, lse), Problem(scale=D ** -0.5, causal=causal), "auto")[0]
    res["kv_major"] = routed
    for tag, extra in (("gproj", dict(kv_major=routed)), ("gproj_tl", dict(kv_major="tl")),
                       ("gproj_two", dict(dk_form="two_product")),
                       ("gproj_fused", dict(dk_form="fused")), ("uncorrected", dict(correct=False))):
        fn = lambda extra=extra: gproj_backward(do, q, k, v, o, lse, causal=causal, _config=cfg, **extra)  # noqa
        fn()
        res[tag] = bench(fn)
    # one launch at a time (results invalid, timing only): dq kernel (with D and the LSE), dkdv kernel
    for corr in (True, False):
        for part in ("dq", "dkdv"):
            triton_bwd._RUN = (part,)
            try:
                fn = lambda corr=corr: gproj_backward(do, q, k, v, o, lse, causal=causal, _config=cfg,  # noqa
                                                      correct=corr)
                fn()
                res[f"part_{part}_{'gproj' if corr else 'unc'}"] = bench(fn)
            finally:
                triton_bwd._RUN = ("dq", "dkdv")
    for tag, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(be):
                y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=gqa)
            fn = lambda y=y, qq=qq, kk=kk, vv=vv: torch.autograd.grad(y, (qq, kk, vv), do, retain_graph=True)  # noqa
            fn()
            res[tag] = bench(fn)
        except Exception as e:  # pragma: no cover
            res[tag] = float("nan")
            log(f"{tag} failed: {e!r}")
    res["fa4"] = fa4_backward_ms(q, k, v, do, causal)
    try:
        qf, kf, vf = (x.float().detach().requires_grad_() for x in (q, k, v))
        dof = do.float()

        def fp32_eff():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                y = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=gqa)
            return torch.autograd.grad(y, (qf, kf, vf), dof)
        fp32_eff()
        res["fp32_efficient_fwdbwd"] = bench(fp32_eff)
    except Exception as e:  # pragma: no cover
        res["fp32_efficient_fwdbwd"] = float("nan")
        log(f"fp32 efficient failed: {e!r}")
    if fp32_tier:
        res.update(fp32_tier_ms(q, k, v, do, o, lse, causal))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--skip-suite", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-fp32-tier", action="store_true")
    ap.add_argument("--configs", default=None, help='JSON {"64": {"dq": [...], "dkdv": [...]}, ...}')
    ap.add_argument("--out", default=os.environ.get("OUT", "device_out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import triton
    dev = torch.cuda.get_device_name()
    log(f"date {datetime.datetime.now(datetime.timezone.utc).isoformat()}Z  gpu {dev}  torch {torch.__version__}  "
        f"triton {triton.__version__}")
    result = dict(gpu=dev, torch=torch.__version__, triton=triton.__version__)
    if args.configs:
        for d, c in json.loads(args.configs).items():
            for which in ("dq", "dkdv"):
                if which in c:
                    triton_bwd.CONFIGS[which][int(d)] = tuple(c[which])
    suite = []
    if not args.skip_suite:
        t0 = time.time()
        try:
            suite = run_suite()
        except Exception:
            log(traceback.format_exc())
        log(f"suite took {time.time() - t0:.1f} s")
    result["suite"] = suite
    if args.sweep:
        from kernel_sweep import sweep  # benchmarks/kernel_sweep.py
        for D in (64, 128):
            t0 = time.time()
            try:
                best = sweep(D, deadline=T_START + SWEEP_DEADLINE)
                triton_bwd.CONFIGS["dq"][D], triton_bwd.CONFIGS["dkdv"][D] = best["dq"], best["dkdv"]
            except Exception:
                log(traceback.format_exc())
            log(f"sweep D={D} took {time.time() - t0:.1f} s")
    result["configs"] = {w: {str(d): c for d, c in triton_bwd.CONFIGS[w].items()} for w in ("dq", "dkdv")}
    timings = []
    if not args.skip_timing:
        for i, shp in enumerate(SHAPES):
            t0 = time.time()
            try:
                r = time_shape(*shp, fp32_tier=i in FP32_SHAPES and not args.skip_fp32_tier)
            except Exception:
                log(traceback.format_exc())
                r = {}
            r["shape"] = shp
            timings.append(r)
            log(json.dumps(r), f"({time.time() - t0:.1f} s)")
    result["timings"] = timings
    with open(os.path.join(args.out, "device_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    from device_report import markdown  # benchmarks/device_report.py
    section = markdown(result)
    with open(os.path.join(args.out, "bench_section.md"), "w") as f:
        f.write(section)
    with open(os.path.join(args.out, "device_check.log"), "w") as f:
        f.write("\n".join(LOG))
    print("\n" + section)


if __name__ == "__main__":
    main()
