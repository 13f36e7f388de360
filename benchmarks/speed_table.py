"""The summary of ``speed_run.py``: one line per gate, host and step result, then the table of ratios.

``summary(result)`` reads the dict ``speed_run.main`` saves as speed_run.json (its ``gate``, ``host_us``,
``host_shape``, ``steps`` and ``timing``); ``label(shape)`` names a (B, H, S, D, causal[, KV heads]) shape.
"""
from __future__ import annotations

import math

#: (column, numerator, denominator) of the summary's forward+backward ratios
RATIOS = (("FA4/cuDNN", "fa4", "cudnn"), ("tl/cuDNN", "sdpa_tl", "cudnn"), ("gluon/cuDNN", "sdpa_gluon", "cudnn"),
          ("routed/cuDNN", "sdpa_routed", "cudnn"), ("pFA4/FA4", "fa4_patched", "fa4"))
#: the backward alone (forward+backward minus forward)
BWD_RATIOS = (("routed/cuDNN", "sdpa_routed", "cudnn"), ("pFA4/FA4", "fa4_patched", "fa4"))
TFLOPS_OF = ("cudnn", "sdpa_routed", "fa4", "fa4_patched")
#: products each backward runs (cuDNN and FA4: S, dP, dV, dK, dQ; GProj adds the dq correction's r·K and its
#: dQ-major launch recomputes S and dP): ``bwd_tflops`` is saved on 5, the per-product rate rescales it
PRODUCTS = {"cudnn": 5, "fa4": 5, "sdpa_tl": 8, "sdpa_gluon": 8, "sdpa_routed": 8, "fa4_patched": 8}


def label(shape) -> str:
    B, H, S, D, causal = shape[:5]
    heads = f"{H}({shape[5]})" if len(shape) > 5 else f"{H}"
    return f"{'GQA ' if len(shape) > 5 else ''}{B}·{heads}·{S}·{D} {'causal' if causal else 'full'}"


def _ms(row, name, key="fwdbwd"):
    cell = row["cells"].get(name, {})
    return cell[key] if cell.get("status") == "ok" else float("nan")


def _fmt(x, spec):
    return "n/a" if not math.isfinite(x) else format(x, spec)


def summary(result: dict) -> str:
    lines = ["gate (128σ, fp64 oracle): " + ", ".join(f"{n} {g['status']}" for n, g in result["gate"].items())]
    h = result.get("host_us") or {}
    if h:
        base = h["unpatched"]["batched"]
        lines.append(f"host µs a call ({label(result['host_shape'] + [True])}, sync per batch): " + ", ".join(
            f"{m} {r['batched']:.0f}" + ("" if m == "unpatched" else f" (+{r['batched'] - base:.0f})")
            for m, r in h.items()))
    for ctx, r in (result.get("steps") or {}).items():
        s = r.get("ms")
        lines.append(f"step 0.5B {ctx}: " + (f"unpatched {s['unpatched']:.1f} ms, " + ", ".join(
            f"{m} {100 * (s[m] / s['unpatched'] - 1):+.1f}%" for m in ("gproj", "auto")) if s else str(r)))
    head = ["B·H·S·D", "cuDNN ms"] + [c for c, _, _ in RATIOS] + [f"bwd {c}" for c, _, _ in BWD_RATIOS] + \
        ["TFLOP/s " + " / ".join(TFLOPS_OF), "bwd TFLOP/s a product " + " / ".join(TFLOPS_OF)]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["timing"]:
        ratios = [_fmt(_ms(row, a) / _ms(row, b), ".3f") for _, a, b in RATIOS]
        bwd = " | ".join(_fmt(_ms(row, a, "bwd") / _ms(row, b, "bwd"), ".3f") for _, a, b in BWD_RATIOS)
        tf = " / ".join(_fmt(_ms(row, n, "tflops"), ".0f") for n in TFLOPS_OF)
        per_product = " / ".join(_fmt(_ms(row, n, "bwd_tflops") * PRODUCTS[n] / 5, ".0f") for n in TFLOPS_OF)
        lines.append(f"| {label(row['shape'])} | {_fmt(_ms(row, 'cudnn'), '.3f')} | " + " | ".join(ratios)
                     + f" | {bwd} | {tf} | {per_product} |")
    return "\n".join(lines)
