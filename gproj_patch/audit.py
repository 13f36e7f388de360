"""``python -m gproj_patch audit``: attention-gradient errors of every backend on the named synthetic suite.

For each case of ``gproj_patch.cases`` and each backend available on the device, the audit computes (dq, dk,
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
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import __version__
from .backends.emulation import emulated_backward, emulated_forward
from .backends.fp32_tier import fp32_backward
from .backends.reference import reference_backward
from .cases import CaseInputs, select_cases

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TRANSLATION_SIGMA = 16.0
LEAK_MIN_U = 51.2  # the uncorrected dq error at 128σ must reach 51.2·u (BF16: 20%)
GPROJ_MAX_U = 1.28  # emulated GProj's dq error stays within 1.28·u (BF16: 0.5%)
FP32_TIER_MAX = 1e-3  # the FP32 tier computes in FP32: one bound for every input format
EXIT_FAILED, EXIT_NOTHING_RAN = 1, 3
Grads = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class NotApplicable(Exception):
    """A backend cannot express this case (reported as n/a, not as an error)."""


@dataclass
class Backend:
    name: str
    run: Callable[[CaseInputs, torch.Tensor, "_Saved"], Grads]
    reason: Callable[[CaseInputs], Optional[str]] = lambda inp: None


class _Saved:
    """Per (case, key variant) lazily computed emulated forward (saved O and LSE)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.cache: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, inp: CaseInputs, k: torch.Tensor):
        key = id(k)
        if key not in self.cache:
            self.cache[key] = emulated_forward(inp.q, k, inp.v, fmt=self.fmt, **inp.mask)
        return self.cache[key]


def _fmt(inp: CaseInputs) -> str:
    return "fp16" if inp.q.dtype == torch.float16 else "bf16"


def _emulated(correct: bool, dk_form: str = "two_product"):
    def run(inp: CaseInputs, k, saved: _Saved) -> Grads:
        o, lse = saved.get(inp, k)
        return emulated_backward(inp.q, k, inp.v, o, inp.do, lse, fmt=_fmt(inp), correct=correct,
                                 dk_form=dk_form, **inp.mask)
    return run


def _fp32(project: bool):
    def run(inp: CaseInputs, k, saved) -> Grads:
        return fp32_backward(inp.q, k, inp.v, inp.do, project=project, **inp.mask)
    return run


# ---------------------------------------------------------------------------------------------- CUDA backends
def _sdpa_reason(inp: CaseInputs) -> Optional[str]:
    m = inp.mask
    if "cu_seqlens_q" in m:
        return "SDPA has no varlen (cu_seqlens) interface"
    if tuple(m.get("window", (-1, -1))) != (-1, -1):
        return "SDPA has no sliding window"
    if m.get("softcap", 0.0):
        return "SDPA has no softcap"
    if m.get("causal") and m.get("causal_align") == "bottom_right" and inp.q.shape[2] != inp.k.shape[2]:
        return "SDPA's is_causal is top-left aligned only"
    return None


def _sdpa(backend_name: str):
    def run(inp: CaseInputs, k, saved) -> Grads:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
        which = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
        q, kk, v = (x.detach().clone().requires_grad_(True) for x in (inp.q, k, inp.v))
        kw = {"is_causal": bool(inp.mask.get("causal", False)), "scale": inp.mask.get("scale")}
        if q.shape[1] != kk.shape[1]:
            kw["enable_gqa"] = True
        try:
            with sdpa_kernel([which]):
                out = F.scaled_dot_product_attention(q, kk, v, **kw)
        except RuntimeError as e:
            raise NotApplicable(str(e).splitlines()[0][:160]) from None
        out.backward(inp.do)
        return q.grad, kk.grad, v.grad
    return run


def _flash_reason(inp: CaseInputs) -> Optional[str]:
    m = inp.mask
    if m.get("causal") and m.get("causal_align", "top_left") == "top_left" and inp.q.shape[2] != inp.k.shape[2]:
        return "flash-attn's causal is bottom-right aligned only"
    return None


def _flash(variant: str):
    def run(inp: CaseInputs, k, saved) -> Grads:
        if variant == "fa2":
            import flash_attn as mod
        elif variant == "fa3":
            import flash_attn_interface as mod
        else:
            import flash_attn.cute as mod
        m = inp.mask
        q, kk, v = (x.detach().clone().requires_grad_(True) for x in (inp.q, k, inp.v))
        kw = {"causal": bool(m.get("causal", False)), "softmax_scale": m.get("scale")}
        if tuple(m.get("window", (-1, -1))) != (-1, -1):
            kw["window_size"] = tuple(m["window"])
        if m.get("softcap"):
            kw["softcap"] = float(m["softcap"])
        bshd = lambda x: x.transpose(1, 2)
        if "cu_seqlens_q" in m:
            cq, ck = m["cu_seqlens_q"].to(torch.int32), m["cu_seqlens_k"].to(torch.int32)
            kw.update(max_seqlen_q=int((cq[1:] - cq[:-1]).max()), max_seqlen_k=int((ck[1:] - ck[:-1]).max()))
            res = mod.flash_attn_varlen_func(bshd(q)[0], bshd(kk)[0], bshd(v)[0], cq, ck, **kw)
            out = (res[0] if isinstance(res, tuple) else res).unsqueeze(0)
        else:
            res = mod.flash_attn_func(bshd(q), bshd(kk), bshd(v), **kw)
            out = res[0] if isinstance(res, tuple) else res
        out.backward(bshd(inp.do))
        return q.grad, kk.grad, v.grad
    return run


def _triton_reason(inp: CaseInputs) -> Optional[str]:
    from .backends import triton_bwd
    return triton_bwd.kernel_unsupported_reason(inp.q, inp.k, inp.v, **inp.mask)


def _triton(correct: bool):
    def run(inp: CaseInputs, k, saved: _Saved) -> Grads:
        from .backends import triton_bwd
        o, lse = saved.get(inp, k)
        return triton_bwd.gproj_backward(inp.do, inp.q, k, inp.v, o.to(inp.q.dtype), lse, correct=correct,
                                         **inp.mask)
    return run


def available_backends(device: torch.device, dtype: torch.dtype) -> Tuple[List[Backend], Dict[str, str]]:
    """The backends that run on ``device`` and, for the rest, why not."""
    backends = [Backend("emulated-uncorrected", _emulated(False)), Backend("emulated-gproj", _emulated(True)),
                Backend("emulated-gproj-fused", _emulated(True, "fused")), Backend("fp32-tier", _fp32(True)),
                Backend("fp32-plain", _fp32(False))]
    skipped: Dict[str, str] = {}
    cuda = device.type == "cuda"
    for name in ("flash", "efficient", "cudnn"):
        if cuda or name == "flash":  # PyTorch also has a fused flash backward on the CPU
            backends.append(Backend(f"sdpa-{name}", _sdpa(name), _sdpa_reason))
        else:
            skipped[f"sdpa-{name}"] = "needs CUDA"
    for variant, module in (("fa2", "flash_attn"), ("fa3", "flash_attn_interface"), ("fa4", "flash_attn.cute")):
        if not cuda:
            skipped[variant] = "needs CUDA"
            continue
        try:
            __import__(module)
        except Exception as e:  # ImportError, or a broken CUDA extension
            skipped[variant] = f"{module} not importable ({type(e).__name__})"
            continue
        backends.append(Backend(variant, _flash(variant), _flash_reason))
    interp = os.environ.get("GPROJ_TIER") == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if not cuda and not interp:
        skipped["triton"] = "needs CUDA (or GPROJ_TIER=triton TRITON_INTERPRET=1 with --dtype fp16)"
    elif not cuda and dtype != torch.float16:
        skipped["triton"] = "Triton's CPU interpreter is exact for fp16 only"
    else:
        try:
            from .backends import triton_bwd  # noqa: F401
            backends.append(Backend("triton-uncorrected", _triton(False), _triton_reason))
            backends.append(Backend("triton-gproj", _triton(True), _triton_reason))
        except Exception as e:
            skipped["triton"] = f"gproj_patch.backends.triton_bwd not importable ({type(e).__name__}: {e})"
    return backends, skipped


# ---------------------------------------------------------------------------------------------------- metrics
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
    from .backends.spec import unit_roundoff

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
def _pct(x: Optional[float], absolute: bool = False) -> str:
    if x is None:
        return "-"
    if absolute:
        return f"{x:.1e} abs"
    if not math.isfinite(x):
        return "inf"
    p = 100.0 * x
    if p == 0:
        return "0"
    return f"{p:.3g}%" if p >= 0.001 else f"{p:.1e}%"


def table_rows(cases: List[dict], backends: List[str]) -> List[List[str]]:
    rows = []
    for c in cases:
        for i, b in enumerate(backends):
            r = c["results"][b]
            label = c["name"] + ("" if c["gauge_regime"] else " (not gauge)") if i == 0 else ""
            if r["status"] == "ok":
                cells = [_pct(r["dq"], r["dq_abs"]), _pct(r["dk"], r["dk_abs"]), _pct(r["dv"], r["dv_abs"]),
                         _pct(r["gauge"])]
            else:
                cells = [r["status"], "", "", r.get("reason", "")[:60]]
            rows.append([label, b] + cells)
    return rows


HEADER = ["case", "backend", "dq err", "dk err", "dv err", "gauge err"]


def render_table(cases: List[dict], backends: List[str], stream=None) -> None:
    stream = stream or sys.stdout
    rows = table_rows(cases, backends)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in rows + [HEADER]) for i in range(len(HEADER))]
        line = lambda r: "  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths)))
        print(line(HEADER), file=stream)
        print("  ".join("-" * w for w in widths), file=stream)
        for r in rows:
            if r[0]:
                print("", file=stream) if r is not rows[0] else None
            print(line(r), file=stream)
        return
    t = Table(title="attention gradient error vs fp64")
    for i, h in enumerate(HEADER):
        t.add_column(h, justify="left" if i < 2 else "right")
    for r in rows:
        if r[0] and r is not rows[0]:
            t.add_section()
        t.add_row(*r)
    Console(file=stream, width=None if stream.isatty() else 120).print(t)


def render_checks(ch: dict, dtype: str = "bf16", stream=None) -> None:
    stream = stream or sys.stdout
    fmt = lambda x: "-" if x is None else _pct(x)
    ok = lambda x: "(not run)" if x is None else ("PASS" if x else "FAIL")
    print(f"uncorrected emulation dq @128σ: {fmt(ch['uncorrected_dq_at_128sigma'])} "
          f"(want ≥ {_pct(ch['uncorrected_dq_min'])}) {ok(ch['pass_uncorrected_leaks'])}", file=stream)
    skipped = ch["gproj_out_of_range_cases"]
    print(f"emulated GProj worst gauge-regime dq: {fmt(ch['gproj_worst_gauge_regime_dq'])} "
          f"[{ch['gproj_worst_gauge_regime_case']}] (want ≤ {_pct(ch['gproj_dq_max'])}) {ok(ch['pass_gproj'])}"
          + (f"; beyond {dtype}'s range, not held to it: {', '.join(skipped)}" if skipped else ""), file=stream)
    print(f"FP32 tier worst gauge-regime dq: {fmt(ch['fp32_tier_worst_gauge_regime_dq'])} "
          f"[{ch['fp32_tier_worst_gauge_regime_case']}] (want ≤ {_pct(ch['fp32_tier_dq_max'])}) "
          f"{ok(ch['pass_fp32_tier'])}", file=stream)


def write_plot(path: str, cases: List[dict], backends: List[str], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = sorted((c for c in cases if c["sweep"]), key=lambda c: c["key_offset"])
    if not sweep:
        raise ValueError("--plot needs the key-offset sweep cases (diffuse, key_offset_*) in --cases")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, metric, label in ((axes[0], "dq", "dq relative error vs fp64"),
                              (axes[1], "gauge", "gauge error (dq change under key translation)")):
        for n, b in enumerate(backends):
            pts = [(c["key_offset"], c["results"][b][metric]) for c in sweep
                   if c["results"][b].get("status") == "ok"]
            pts = [(x, max(y, 1e-9)) for x, y in pts if y is not None and math.isfinite(y)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^vDx*P"[n % 8], label=b,
                        ls="--" if "fused" in b or "plain" in b else "-", alpha=0.85)
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_yscale("log")
        ax.set_xlabel("common key offset (σ of the key spread)")
        ax.set_ylabel(label)
        ax.axhline(0.005, color="grey", ls=":", lw=1)
        ax.annotate("0.5%", (0.0, 0.005), xycoords=("axes fraction", "data"), fontsize=7, color="grey")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------------------------- CLI
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
