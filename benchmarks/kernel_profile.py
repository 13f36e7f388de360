"""Where the GProj backward's time goes inside its kernels: Nsight Compute counters (stall reasons, tensor-pipe
activity, occupancy) of the GProj dq and dK/dV launches and of cuDNN's backward, at one shape, in one run.

On the GPU machine (ncu reads the counters there; clocks left alone, METHOD.md):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --csv --page raw \\
        python benchmarks/kernel_profile.py > $OUT/ncu_raw.csv

Then, anywhere: ``python benchmarks/kernel_profile.py --summarize ncu_raw.csv`` prints one row per kernel:
duration, SM and tensor-pipe throughput, achieved occupancy, registers, and the stall reasons that take most of
the cycles between two issued instructions of a warp.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE = (2, 16, 8192, 128, False)  # B, H, S, D, causal: the issue-11 shape at full attention
STALL_MARK = "issue_stalled_"  # smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio
STALL_SUFFIX = "_per_issue_active.ratio"
COLUMNS = {  # ncu raw metric -> short name
    "gpu__time_duration.sum": "ms",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM %",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "launch__registers_per_thread": "regs",
    "smsp__average_warp_latency_per_inst_issued.ratio": "cycles/issue",
}


def run_once():
    """Compile and warm up outside the profiled range, then inside it one GProj backward per launch pairing and one
    cuDNN backward: the KV-major launch tl and Gluon (where ``gluon_bwd.kv_major_reason`` allows it) with the tl dQ
    launch; then the Gluon dQ-major launch in its plain and ``overlap`` builds (where ``gluon_dq.dq_major_reason``
    allows it) with the routed KV launch. Kernel names tell the launches apart; the two Gluon dQ builds are the same
    kernel name with different ``OVERLAP``, profiled in that order (plain, then overlap)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from gproj_patch.backends.triton_bwd import gproj_backward
    from gproj_patch.backends.gluon_bwd import kv_major_reason
    from gproj_patch.backends.gluon_dq import CONFIGS, DqConfig, dq_major_reason
    from device_check import make_inputs, saved_forward  # benchmarks/device_check.py
    B, H, S, D, causal = SHAPE
    q, k, v, do = make_inputs(B, H, S, D)
    o, lse = saved_forward(q, k, v, causal)
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        y = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)

    kv_kernels = ("tl",) if kv_major_reason(q, k, v, do=do) else ("tl", "gluon")  # full or causal, no window/varlen
    kv_routed = kv_kernels[-1]
    dq_builds = []
    if dq_major_reason(q, k, v, do=do) is None:
        cfg = CONFIGS[D]
        dq_builds = [DqConfig(cfg.block_n, cfg.num_stages, overlap=False),
                     DqConfig(cfg.block_n, cfg.num_stages, overlap=True)]

    def all_launches():
        for kernel in kv_kernels:
            gproj_backward(do, q, k, v, o, lse, causal=causal, kv_major=kernel, dq_major="tl")
        for cfg in dq_builds:
            gproj_backward(do, q, k, v, o, lse, causal=causal, kv_major=kv_routed, dq_major="gluon",
                           _gluon_dq_config=cfg)
        torch.autograd.grad(y, (qq, kk, vv), do, retain_graph=True)
    all_launches()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    all_launches()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _number(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return float("nan")


def summarize(path, top=4):
    """Markdown rows from ncu's ``--csv --page raw`` output (one row per profiled kernel)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(line for line in f if line.startswith('"'))]
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    lines = ["| kernel | " + " | ".join(COLUMNS.values()) + " | top stall reasons (cycles per issued instruction) |",
             "|---|" + "---|" * len(COLUMNS) + "---|"]
    for r in data:
        name = r[col["Kernel Name"]][:48]
        vals = []
        for metric in COLUMNS:
            x = _number(r[col[metric]]) if metric in col else float("nan")
            if metric == "gpu__time_duration.sum":
                unit = units[col[metric]] if metric in col else "ns"
                x = x / {"ns": 1e6, "us": 1e3, "usecond": 1e3, "nsecond": 1e6, "ms": 1.0, "msecond": 1.0}.get(unit, 1e6)
            vals.append(f"{x:.3g}")
        stalls = sorted(((_number(r[i]), h.split(STALL_MARK, 1)[1][:-len(STALL_SUFFIX)]) for h, i in col.items()
                         if STALL_MARK in h and h.endswith(STALL_SUFFIX) and "not_issued" not in h), reverse=True)
        lines.append(f"| {name} | " + " | ".join(vals) + " | " +
                     ", ".join(f"{n} {v:.2g}" for v, n in stalls[:top] if v == v) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--summarize", default=None, help="ncu --csv --page raw output to summarize")
    args = ap.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
    else:
        run_once()
