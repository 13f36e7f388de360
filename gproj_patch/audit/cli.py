"""``python -m gproj_patch audit``: attention-gradient errors of every backend on the named synthetic suite.

For each case of ``gproj_patch.audit.cases`` and each backend available on the device, the audit computes (dq, dk,
dv) for the loss ⟨dO, attention(q, k, v)⟩ and compares them with the fp64 oracle (``reference_backward``).

Backends. Always: ``emulated-uncorrected`` (tiled model of an FA-style low-precision backward), ``emulated-gproj``
(the same with the GProj projection, two-product dk), ``emulated-gproj-fused`` (fused one-product dk),
``fp32-tier`` (FP32 recompute with the projection: the fallback tier), ``fp32-plain`` (FP32 recompute
without it, for contrast) and ``sdpa-flash`` (PyTorch's fused flash backward through
``torch.nn.attention.sdpa_kernel`` + autograd; PyTorch has one on the CPU too). The emulated backends take
the saved O and LSE from ``emulated_forward``. On CUDA also ``sdpa-efficient``, ``sdpa-cudnn``, ``fa2``
(flash_attn), ``fa3`` (flash_attn_interface), ``fa4`` (flash_attn.cute) when importable, and
``triton-uncorrected`` / ``triton-gproj`` when ``gproj_patch.backends.triton_bwd`` imports (on CPU only with
GPROJ_TIER=triton, TRITON_INTERPRET=1 and ``--dtype fp16``; given the emulated forward's O and LSE, and
``kernel_unsupported_reason`` decides n/a). A backend that cannot express a case (e.g. SDPA with a sliding
window) is reported as ``n/a`` with the reason. The fused kernels return gradients in the input dtype, so
their errors include that final rounding (≈ u/2); the emulation and the FP32 tier return fp32.

Metrics (all in fp64):
  * ``dq``, ``dk``, ``dv``: relative error ‖x − ref‖ / ‖ref‖. When ‖ref‖ = 0 exactly (e.g. Sk = 1, where the
    true dq and dk vanish) the absolute error ‖x − ref‖ is reported instead and ``*_abs`` is true.
  * ``gauge``: the change of dq under a random common key translation k → k' = round(k + b), beyond the exact
    change: ‖(dq(k') − dq(k)) − (ref(k') − ref(k))‖ / ‖ref(k)‖. b has i.i.d. N(0, (16·σ_k)²) coordinates
    (σ_k: the keys' spread about their mean), one vector for all keys and heads. 0 for an exactly
    gauge-invariant backend; an uncorrected kernel leaks ≈ α·ρ·b.

JSON (``--json PATH``), one object:
  ``tool``: "gproj_patch audit"; ``version``; ``torch``; ``device``; ``dtype`` ("bf16"|"fp16"); ``quick``;
  ``seed``; ``threads``; ``elapsed_s``; ``translation_sigma`` (16);
  ``backends``: names that ran; ``skipped_backends``: {name: reason} for those not available here;
  ``cases``: [{``name``, ``description``, ``gauge_regime``, ``key_offset`` (σ units or null), ``sweep``,
  ``shape`` {B, Hq, Hkv, Sq, Sk, D}, ``mask`` (the case's mask kwargs, cu_seqlens as lists),
  ``expected`` (exact facts, the witness), ``format_in_range`` (``Case.in_range`` for the dtype),
  ``results``: {backend: {``status`` "ok"|"n/a"|"error", ``reason`` (for n/a and error), ``dq``, ``dk``,
  ``dv``, ``gauge`` (floats, for ok), ``dq_abs``, ``dk_abs``, ``dv_abs`` (bools), ``seconds``, and for the
  witness ``witness_dq0`` (the computed dq[0,0,0,0])}}}];
  ``checks``: {``unit_roundoff``, the bounds ``uncorrected_dq_min``, ``gproj_dq_max``, ``fp32_tier_dq_max``;
  ``uncorrected_dq_at_128sigma``, ``gproj_worst_gauge_regime_dq`` and its ``..._case``,
  ``gproj_out_of_range_cases`` (gauge-regime cases left out of the GProj criterion, see below),
  ``fp32_tier_worst_gauge_regime_dq`` and its ``..._case``; ``pass_uncorrected_leaks``, ``pass_gproj``,
  ``pass_fp32_tier``: true / false, or null where the case or backend it needs did not run}.
  The file is strict JSON: a non-finite error (a backend returning inf/NaN) is written as "inf" or "nan".

Done criteria (``checks``). An uncorrected kernel's leak and GProj's residual error both come from rounding
dS and P to the low format, so both scale with its unit roundoff u; the BF16 bounds (u = 2^-8) are multiples
of u, and FP16's (u = 2^-11) are the same multiples:

  * the uncorrected emulation's dq error at the 128σ key offset is at least 51.2·u (BF16 20%, FP16 2.5%):
    the audit really shows the leak (measured: BF16 34% ≈ 87u, FP16 4.5% ≈ 92u);
  * emulated GProj's dq error is at most 1.28·u (BF16 0.5%, FP16 0.0625%) on every gauge-regime case whose
    gradient-carrying probabilities the format can hold (``Case.in_range``; measured worst: BF16 0.19% ≈ 0.5u,
    FP16 0.027% ≈ 0.56u). Left out, and listed: FP16 on ``sink_offset_64``, whose e^-20 probabilities lie
    below FP16's smallest subnormal 2^-24 and flush to 0 (a range limit: ≈ 1.4% dq with or without GProj);
  * the FP32 tier's dq error is at most 1e-3 on every gauge-regime case, for both formats: it computes in
    FP32 whatever the input format, so its bound does not depend on u (measured worst: 1.3e-4).

Exit status: 0 when the audit ran (whatever the errors it measured); with ``--strict`` 1 when a criterion
that ran failed and 3 when none could run (the selected cases or backends leave every criterion without its
input); 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from typing import List, Optional, Tuple

import torch

from .. import __version__
from ..backends.reference import reference_backward
from .backends import Backend, NotApplicable, _fmt, _Saved, available_backends  # noqa: F401  (Backend: API)
from .backends import _emulated  # noqa: F401  (tests build backends from it)
from .report import render_checks, render_table, write_plot
from .cases import CaseInputs, select_cases

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TRANSLATION_SIGMA = 16.0
LEAK_MIN_U = 51.2  # the uncorrected dq error at 128σ must reach 51.2·u (BF16: 20%)
GPROJ_MAX_U = 1.28  # emulated GProj's dq error stays within 1.28·u (BF16: 0.5%)
FP32_TIER_MAX = 1e-3  # the FP32 tier computes in FP32: one bound for every input format
EXIT_FAILED, EXIT_NOTHING_RAN = 1, 3


def _rel(x: torch.Tensor, ref: torch.Tensor) -> Tuple[float, bool]:
    x = x.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    n = float(ref.norm())
    err = float((x - ref).norm())
    if not math.isfinite(err):
        return float("inf"), n == 0.0
    return (err / n, False) if n > 0 else (err, True)


def _translated_keys(inp: CaseInputs, seed: int) -> torch.Tensor:
    k = inp.k.detach().to("cpu", torch.float64)
    spread = float((k - k.mean(dim=2, keepdim=True)).std()) if k.shape[2] > 1 else 1.0
    spread = spread if spread > 0 else 1.0
    gen = torch.Generator().manual_seed(10007 + seed)
    b = torch.randn(k.shape[-1], generator=gen, dtype=torch.float64) * TRANSLATION_SIGMA * spread
    return (k + b).to(inp.k.dtype).to(inp.k.device)


def _finite(x):
    """JSON-safe copy: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _mask_json(mask: dict) -> dict:
    return {n: (v.tolist() if isinstance(v, torch.Tensor) else (list(v) if isinstance(v, tuple) else v))
            for n, v in mask.items()}


def run_case(case, backends: List[Backend], dtype, device, quick: bool, seed: int) -> dict:
    """Every backend on one case: the case's JSON object (see the module docstring)."""
    inp = case.build(seed=seed, dtype=dtype, device=device, quick=quick)
    k2 = _translated_keys(inp, seed)
    ref1 = reference_backward(inp.q, inp.k, inp.v, inp.do, **inp.mask)
    ref2 = reference_backward(inp.q, k2, inp.v, inp.do, **inp.mask)
    saved = _Saved(_fmt(inp))
    results = {}
    for be in backends:
        t0 = time.perf_counter()
        res: dict = {}
        try:
            why = be.reason(inp)
            if why:
                raise NotApplicable(why)
            g1 = be.run(inp, inp.k, saved)
            g2 = be.run(inp, k2, saved)
            res["status"] = "ok"
            for name, x, r in zip(("dq", "dk", "dv"), g1, ref1):
                res[name], res[f"{name}_abs"] = _rel(x, r)
            n1 = float(ref1[0].norm())
            cpu64 = lambda x: x.detach().to("cpu", torch.float64)
            dd = (cpu64(g2[0]) - cpu64(g1[0])) - (cpu64(ref2[0]) - cpu64(ref1[0]))
            res["gauge"] = float(dd.norm()) / (n1 if n1 > 0 else 1.0)
            if "dq_index" in inp.expected:
                res["witness_dq0"] = float(g1[0][inp.expected["dq_index"]])
        except NotApplicable as e:
            res = {"status": "n/a", "reason": str(e)}
        except Exception as e:  # a backend failing is a finding, not a crash of the audit
            res = {"status": "error", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        res["seconds"] = round(time.perf_counter() - t0, 4)
        results[be.name] = res
    return {"name": case.name, "description": case.description, "gauge_regime": case.gauge_regime,
            "key_offset": case.key_offset, "sweep": case.sweep, "format_in_range": case.in_range(dtype),
            "shape": inp.shape, "mask": _mask_json(inp.mask),
            "expected": {n: (list(v) if isinstance(v, tuple) else v) for n, v in inp.expected.items()},
            "results": results}


def checks(cases: List[dict], dtype: str = "bf16") -> dict:
    """The done criteria (module docstring) evaluated on the results of ``run_case``, for ``dtype``."""
    from ..backends.spec import unit_roundoff

    def get(case: dict, backend: str):
        r = case["results"].get(backend, {})
        return r.get("dq") if r.get("status") == "ok" else None

    def worst(backend: str, chosen: List[dict]):
        pairs = [(get(c, backend), c["name"]) for c in chosen if get(c, backend) is not None]
        return max(pairs, key=lambda p: p[0]) if pairs else (None, None)

    u = unit_roundoff(DTYPES[dtype])
    gauge = [c for c in cases if c["gauge_regime"]]
    in_range = [c for c in gauge if c.get("format_in_range", True)]
    out: dict = {"unit_roundoff": u, "uncorrected_dq_min": LEAK_MIN_U * u, "gproj_dq_max": GPROJ_MAX_U * u,
                 "fp32_tier_dq_max": FP32_TIER_MAX, "uncorrected_dq_at_128sigma": None}
    for c in cases:
        if c["name"] == "key_offset_128":
            out["uncorrected_dq_at_128sigma"] = get(c, "emulated-uncorrected")
    out["gproj_worst_gauge_regime_dq"], out["gproj_worst_gauge_regime_case"] = worst("emulated-gproj", in_range)
    out["gproj_out_of_range_cases"] = [c["name"] for c in gauge if c not in in_range]
    out["fp32_tier_worst_gauge_regime_dq"], out["fp32_tier_worst_gauge_regime_case"] = worst("fp32-tier", gauge)
    leak, g, f = (out["uncorrected_dq_at_128sigma"], out["gproj_worst_gauge_regime_dq"],
                  out["fp32_tier_worst_gauge_regime_dq"])
    out["pass_uncorrected_leaks"] = None if leak is None else leak >= out["uncorrected_dq_min"]
    out["pass_gproj"] = None if g is None else g <= out["gproj_dq_max"]
    out["pass_fp32_tier"] = None if f is None else f <= FP32_TIER_MAX
    return out


def strict_status(ch: dict) -> Tuple[int, str]:
    """``--strict``: (exit status, why) from the checks: a failed criterion, or none that could run."""
    ran = {n: v for n, v in ch.items() if n.startswith("pass_") and v is not None}
    if not ran:
        return EXIT_NOTHING_RAN, ("no criterion could run: they need key_offset_128 with emulated-uncorrected, "
                                  "a gauge-regime case with emulated-gproj, or one with fp32-tier")
    failed = sorted(n for n, v in ran.items() if not v)
    if failed:
        return EXIT_FAILED, "failed: " + ", ".join(failed)
    return 0, f"{len(ran)} criteria passed"


# ----------------------------------------------------------------------------------------------------- output
def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="python -m gproj_patch audit", description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input precision (default bf16)")
    p.add_argument("--quick", action="store_true", help="small shapes (seconds on a CPU)")
    p.add_argument("--cases", default=None, help="comma-separated case names or fnmatch patterns")
    p.add_argument("--backends", default=None, help="comma-separated backend names or fnmatch patterns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="plot dq error vs key offset (matplotlib)")
    p.add_argument("--list", action="store_true", help="list cases and backends, then exit")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if a done criterion that ran fails, 3 if no criterion could run")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress report (on stderr: a bar on a terminal, else one line per case)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="CPU threads for torch (default 1: the audit runs many small tile products, and on a "
                        "shared 2-core machine more threads spin and run up to 10x slower; 0 keeps torch's default)")
    return p


def _progress(items, enabled: bool):
    """Progress on stderr: a bar (tqdm) only when stderr is a terminal — redrawn with carriage returns, it
    would otherwise share a line with what follows in a log; elsewhere one whole line per case."""
    if not enabled:
        return items
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
            return tqdm(items, desc="audit", unit="case", file=sys.stderr, leave=False)
        except ImportError:
            pass

    def lines():
        for i, x in enumerate(items):
            print(f"[{i + 1}/{len(items)}] {x.name}", file=sys.stderr, flush=True)
            yield x
    return lines()


@contextlib.contextmanager
def torch_threads(n: int):
    """Run with ``n`` torch CPU threads (0: unchanged); the previous count is restored afterwards."""
    prev = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _parse_device(p: argparse.ArgumentParser, name: Optional[str]) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as e:
        p.error(f"bad --device {name!r}: {e}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {name}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        p.error(f"--device {name}: only cpu and cuda are supported")
    return dev


def run_audit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    device = _parse_device(parser, args.device)
    dtype = DTYPES[args.dtype]
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    with torch_threads(args.threads):
        return _run(args, parser, device, dtype)


def _run(args, parser, device, dtype) -> int:
    import fnmatch

    try:
        cases = select_cases(args.cases)
    except ValueError as e:
        parser.error(str(e))
    backends, skipped = available_backends(device, dtype)
    if args.backends:
        pats = [x.strip() for x in args.backends.split(",") if x.strip()]
        bad = [pt for pt in pats if not any(fnmatch.fnmatchcase(b.name, pt) for b in backends)]
        if bad:
            parser.error(f"no available backend matches {bad}; available: {', '.join(b.name for b in backends)}")
        backends = [b for b in backends if any(fnmatch.fnmatchcase(b.name, pt) for pt in pats)]
    if args.list:
        for c in cases:
            print(f"case     {c.name:22s} {'gauge' if c.gauge_regime else 'not-gauge':9s} {c.description}")
        for b in backends:
            print(f"backend  {b.name}")
        for n, why in skipped.items():
            print(f"skipped  {n:22s} {why}")
        return 0
    if args.plot and not args.plot.lower().endswith(".png"):
        parser.error("--plot expects a .png path")
    t0 = time.perf_counter()
    names = [b.name for b in backends]
    results = [run_case(c, backends, dtype, device, args.quick, args.seed)
               for c in _progress(cases, not args.no_progress)]
    elapsed = time.perf_counter() - t0
    ch = checks(results, args.dtype)
    render_table(results, names)
    render_checks(ch, args.dtype)
    print(f"{len(results)} cases × {len(names)} backends on {device} ({args.dtype}{', quick' if args.quick else ''}) "
          f"in {elapsed:.1f} s; not run here: " + (", ".join(f"{n} ({w})" for n, w in skipped.items()) or "none"))
    doc = {"tool": "gproj_patch audit", "version": __version__, "torch": torch.__version__, "device": str(device),
           "dtype": args.dtype, "quick": bool(args.quick), "seed": args.seed, "threads": torch.get_num_threads(),
           "elapsed_s": round(elapsed, 3),
           "translation_sigma": TRANSLATION_SIGMA, "backends": names, "skipped_backends": skipped,
           "cases": results, "checks": ch}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(_finite(doc), f, indent=1, allow_nan=False)
        print(f"wrote {args.json_path}")
    if args.plot:
        write_plot(args.plot, results, names, f"gproj_patch audit — {args.dtype} on {device}"
                   + (" (quick)" if args.quick else ""))
        print(f"wrote {args.plot}")
    if args.strict:
        status, why = strict_status(ch)
        print(f"--strict: {why}", file=sys.stderr if status else sys.stdout)
        return status
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_audit(args, parser)


if __name__ == "__main__":
    sys.exit(main())
