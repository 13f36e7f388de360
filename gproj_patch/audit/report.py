"""The audit's output: the table of errors per case and backend, the done-criteria lines, the plot."""
from __future__ import annotations

import math
import sys
from typing import List, Optional

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
