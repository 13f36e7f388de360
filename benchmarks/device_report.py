"""The Markdown section ``device_check.py`` writes for BENCHMARKS.md from its result dict (suite errors, timings
at every shape, one launch at a time, the FP32 tier two ways)."""
import datetime
import json

from device_check import tflops
from gproj_patch.backends import triton_bwd


NOTES = {"sharp_p1": " (P==1 rows: beyond fp32)", "query_offset": " (not a gauge symmetry)",
         "softcap": " (softcap 5: no exact gauge)"}


def _pct(x):
    return "nan" if x != x else f"{100 * x:.3g}%"


def markdown(r):
    lines = [f"### Kernel run {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M')} UTC — {r['gpu']}, "
             f"torch {r['torch']}, triton {r['triton']}", ""]
    if r["suite"]:
        lines += ["BF16, error ‖x − ref‖/‖ref‖ vs fp64 (inputs BF16, saved O BF16). two = GProj two-product dk, "
                  "fused = GProj fused dk, unc = same kernel correct=False.", "",
                  "| case | two dq | two dk | two dv | fused dq | fused dk | unc dq | unc dk | det |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for s in r["suite"]:
            if s["case"] == "witness":
                lines.append(f"| witness dq[0] (exact 0) | {s['two_dq0']:g} | | | {s['fused_dq0']:g} | | "
                             f"{s['unc_dq0']:g} | | {s['deterministic']} |")
                continue
            note = "" if s["gauge"] else NOTES.get(s["case"], " (not gauge)")
            lines.append(f"| {s['case']}{note} | {_pct(s['two_dq'])} | "
                         f"{_pct(s['two_dk'])} | {_pct(s['two_dv'])} | {_pct(s['fused_dq'])} | "
                         f"{_pct(s['fused_dk'])} | {_pct(s['unc_dq'])} | {_pct(s['unc_dk'])} | "
                         f"{s['deterministic']} |")
        lines.append("")
    if r["timings"]:
        lines += [f"Configs (BLOCK_M, BLOCK_N, warps, stages): {json.dumps(r['configs'])}", "",
                  "Median ms (`triton.testing.do_bench`), BF16 backward; FP32 = forward+backward.", "",
                  f"GProj = default dk form ({triton_bwd.DEFAULT_DK_FORM}).", "",
                  "| B,H,S,D,causal | GProj | two-product dk | fused dk | uncorrected | cuDNN bwd | flash bwd "
                  "| FA4 bwd | FP32 eff fwd+bwd | GProj/cuDNN | GProj/FA4 | GProj/unc "
                  "| TFLOP/s 5-product count (GProj / cuDNN) | TFLOP/s 8-product count (GProj) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for t in r["timings"]:
            g = t.get("gproj", float("nan"))
            f = lambda k: t.get(k, float("nan"))  # noqa: E731
            lines.append(f"| {','.join(str(int(x)) if not isinstance(x, bool) else 'T' if x else 'F' for x in t['shape'])} "
                         f"| {g:.3f} | {f('gproj_two'):.3f} | {f('gproj_fused'):.3f} | {f('uncorrected'):.3f} | "
                         f"{f('cudnn'):.3f} | "
                         f"{f('flash'):.3f} | {f('fa4'):.3f} | {f('fp32_efficient_fwdbwd'):.2f} | "
                         f"×{g / f('cudnn'):.2f} | ×{g / f('fa4'):.2f} | ×{g / f('uncorrected'):.2f} | "
                         f"{tflops(t['shape'], g):.0f} / "
                         f"{tflops(t['shape'], f('cudnn')):.0f} | {tflops(t['shape'], g, 8):.0f} |")
        lines += ["", "One launch at a time (ms): dq kernel (with D and the LSE) / dkdv kernel, GProj vs uncorrected.",
                  "", "| B,H,S,D,causal | dq GProj | dq unc | dkdv GProj | dkdv unc |", "|---|---|---|---|---|"]
        for t in r["timings"]:
            f = lambda k: t.get(k, float("nan"))  # noqa: E731
            lines.append(f"| {','.join(str(x) for x in t['shape'])} | "
                         f"{f('part_dq_gproj'):.3f} | {f('part_dq_unc'):.3f} | {f('part_dkdv_gproj'):.3f} | "
                         f"{f('part_dkdv_unc'):.3f} |")
        fp32 = [t for t in r["timings"] if "fp32_kernel_bwd" in t]
        if fp32:
            lines += ["", "FP32 tier backward (ms): the kernel on fp32 copies (IEEE dots) vs chunked fp32 GEMMs; FP32 "
                      "efficient attention fwd+bwd for scale; kernel-form error vs fp64 (dq, dk, dv; one head).", "",
                      "| B,H,S,D,causal | kernel form | chunked | chunked / kernel | FP32 eff fwd+bwd | error |",
                      "|---|---|---|---|---|---|"]
            for t in fp32:
                f = lambda k: t.get(k, float("nan"))  # noqa: E731
                err = ", ".join(f"{e:.1e}" for e in t.get("fp32_kernel_err", []))
                lines.append(f"| {','.join(str(x) for x in t['shape'])} | {f('fp32_kernel_bwd'):.2f} | "
                             f"{f('fp32_chunked_bwd'):.2f} | ×{f('fp32_chunked_bwd') / f('fp32_kernel_bwd'):.1f} | "
                             f"{f('fp32_efficient_fwdbwd'):.2f} | {err} |")
        lines.append("")
    return "\n".join(lines)
