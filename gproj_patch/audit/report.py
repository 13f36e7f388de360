"""The audit's output: the table of errors per case and backend, the criteria lines, the plot.

One plain-text table format whatever is installed (no optional pretty-printer changes it): fixed columns, and a
``note`` column holding each n/a or error reason, wrapped onto continuation lines so no line grows past
``NOTE_WIDTH`` characters of note.
"""
from __future__ import annotations

import math
import sys
import textwrap
from typing import List, Optional

HEADER = ("case", "backend", "dq err", "dk err", "dv err", "gauge err", "note")
NOTE_WIDTH = 44


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
    """One row per (case, backend), then one continuation row per further line of a wrapped note."""
    rows = []
    for c in cases:
        for i, b in enumerate(backends):
            r = c["results"][b]
            label = c["name"] + ("" if c["gauge_regime"] else " (not gauge)") if i == 0 else ""
            if r["status"] == "ok":
                cells, note = [_pct(r["dq"], r["dq_abs"]), _pct(r["dk"], r["dk_abs"]), _pct(r["dv"], r["dv_abs"]),
                               _pct(r["gauge"])], ""
            else:
                cells, note = [r["status"], "", "", ""], r.get("reason", "")
            lines = textwrap.wrap(note, NOTE_WIDTH) or [""]
            rows.append([label, b] + cells + [lines[0]])
            rows += [["", "", "", "", "", "", more] for more in lines[1:]]
    return rows


def render_table(cases: List[dict], backends: List[str], stream=None) -> None:
    stream = stream or sys.stdout
    rows = table_rows(cases, backends)
    widths = [max(len(r[i]) for r in rows + [list(HEADER)]) for i in range(len(HEADER))]

    def line(r):
        cells = [x.ljust(w) if i < 2 or i == len(HEADER) - 1 else x.rjust(w)
                 for i, (x, w) in enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()
    print(line(HEADER), file=stream)
    print("  ".join("-" * w for w in widths), file=stream)
    for n, r in enumerate(rows):
        if r[0] and n:
            print("", file=stream)
        print(line(r), file=stream)


def _criterion(label: str, value: Optional[float], case: Optional[str], want: str, verdict: Optional[bool],
               needs: str) -> str:
    """One criterion's words: its figure [case] (want ...) PASS/FAIL, or that it did not run and what it needs."""
    if value is None:
        return f"{label}: not run (needs {needs}) — want {want}"
    return f"{label}: {_pct(value)}{f' [{case}]' if case else ''} (want {want}) {'PASS' if verdict else 'FAIL'}"


def render_checks(ch: dict, dtype: str = "bf16", stream=None) -> None:
    """The criteria lines: the built-in backends' (each with its figure, or what it needed to run) and each
    plugin's."""
    stream = stream or sys.stdout
    print(_criterion("uncorrected emulation dq @128σ", ch["uncorrected_dq_at_128sigma"], None,
                     f"≥ {_pct(ch['uncorrected_dq_min'])}", ch["pass_uncorrected_leaks"],
                     "key_offset_128 with emulated-uncorrected"), file=stream)
    skipped = ch["gproj_out_of_range_cases"]
    print(_criterion("emulated GProj worst gauge-regime dq", ch["gproj_worst_gauge_regime_dq"],
                     ch["gproj_worst_gauge_regime_case"], f"≤ {_pct(ch['gproj_dq_max'])}", ch["pass_gproj"],
                     f"a gauge-regime case within {dtype}'s range with emulated-gproj")
          + (f"; beyond {dtype}'s range, not held to it: {', '.join(skipped)}" if skipped else ""), file=stream)
    print(_criterion("FP32 tier worst gauge-regime dq", ch["fp32_tier_worst_gauge_regime_dq"],
                     ch["fp32_tier_worst_gauge_regime_case"], f"≤ {_pct(ch['fp32_tier_dq_max'])}",
                     ch["pass_fp32_tier"], "a gauge-regime case with fp32-tier"), file=stream)
    spread = ch.get("do_layout_spread", {})
    worst = max(spread.items(), key=lambda kv: kv[1]) if spread else (None, None)
    failed = ch.get("do_layout_failed", [])
    print(_criterion("same gradients for dO contiguous and as a (B, S, H, D) view, worst backend",
                     worst[1], worst[0], f"≤ {_pct(ch['do_layout_max'])}", ch["pass_do_layout"],
                     "a do_layout_* case with a built-in backend")
          + (f"; beyond it: {', '.join(f'{b} {_pct(spread[b])}' for b in failed)}" if failed else ""), file=stream)
    for name, pc in ch.get("plugins", {}).items():
        parts = [_criterion("worst gauge-regime dq", pc["worst_dq"], pc["worst_dq_case"], f"≤ {_pct(pc['dq_max'])}",
                            pc["pass_dq"], "a gauge-regime case"),
                 _criterion("gauge", pc["worst_gauge"], pc["worst_gauge_case"], f"≤ {_pct(pc['gauge_max'])}",
                            pc["pass_gauge"], "a gauge-regime case"),
                 ("witness dq[0,0,0,0]: not run (needs the witness case) — want 0" if pc["witness_dq0"] is None else
                  f"witness dq[0,0,0,0] {pc['witness_dq0']} (want 0, within ±{pc['witness_max']:.3g}) "
                  f"{'PASS' if pc['pass_witness'] else 'FAIL'}"),
                 _criterion("dO layouts", pc["worst_do_layout"], pc["worst_do_layout_case"],
                            f"≤ {_pct(pc['do_layout_max'])}", pc["pass_do_layout"], "a do_layout_* case")]
        print(f"{name}: " + "; ".join(parts), file=stream)


def _series(sweep: List[dict], backends: List[str], metric: str):
    """[(label, points)] with backends whose points are identical merged into one series (their names joined):
    identical curves drawn on top of each other would hide all but the last."""
    merged: List[list] = []
    for b in backends:
        pts = [(c["key_offset"], c["results"][b][metric]) for c in sweep if c["results"][b].get("status") == "ok"]
        pts = tuple((x, max(y, 1e-9)) for x, y in pts if y is not None and math.isfinite(y))
        if not pts:
            continue
        for entry in merged:
            if entry[1] == pts:
                entry[0].append(b)
                break
        else:
            merged.append([[b], pts])
    return [(" = ".join(names), pts) for names, pts in merged]


COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan", "tab:gray")
MARKERS = "os^vDP*X<>h"  # 11 markers, 10 colours: (i % 10, i % 11) never repeats within 110 series


def _style(i: int):
    return COLOURS[i % len(COLOURS)], MARKERS[i % len(MARKERS)]


def write_plot(path: str, cases: List[dict], backends: List[str], title: str,
               dq_bound: Optional[float] = None, gauge_bound: Optional[float] = None) -> None:
    """Two panels against the common key offset: (a) dq error vs fp64, (b) gauge error; one style per series
    (colour and marker, never reused), identical series merged, the legend below the panels, each panel's
    bound drawn and named in the legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = sorted((c for c in cases if c["sweep"]), key=lambda c: c["key_offset"])
    if not sweep:
        raise ValueError("the plot needs the key-offset sweep cases (diffuse, key_offset_*)")
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    style = {}
    panels = ((axes[0], "dq", "(a) dq relative error vs fp64", "dq error", dq_bound, "dq bound", ":"),
              (axes[1], "gauge", "(b) gauge error: dq change under a common key translation", "gauge error",
               gauge_bound, "gauge bound", "-."))
    offsets = [c["key_offset"] for c in sweep]
    for ax, metric, title_, ylabel, bound, bound_name, bound_ls in panels:
        for name, pts in _series(sweep, backends, metric):
            colour, marker = style.setdefault(name, _style(len(style)))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=colour, label=name, ms=6,
                    ls="--" if "fused" in name or "plain" in name else "-", alpha=0.85, mfc="none", mew=1.4)
        if bound is not None:
            ax.axhline(bound, color="black", ls=bound_ls, lw=1.0, label=f"{bound_name} {_pct(bound)}")
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlim(-0.6, 1.6 * max(offsets))
        ax.set_xticks(offsets, [f"{x:g}" for x in offsets])
        ax.set_yscale("log")
        ax.set_xlabel("common key offset (σ of the key spread; 0 = diffuse)")
        ax.set_ylabel(ylabel)
        ax.set_title(title_, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = {}, []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.suptitle(title)
    fig.legend([handles[lab] for lab in labels], labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    rows = math.ceil(len(labels) / 3)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
