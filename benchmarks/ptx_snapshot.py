"""PTX of every shipped config of the GProj kernels, compiled for sm_90a on a machine without a GPU.

Why: a readability edit of ``triton_kernels.py`` / ``gluon_kernels.py`` (named constants, keyword flags, one tile
loop) must not change the code the H200 runs. This script compiles the kernels exactly as the shipped launches
specialize them and writes one PTX file per (kernel, config, flag set) with the line information stripped
(``.loc``/``.file`` directives and the ``.debug_*`` sections), so two snapshots diff cleanly:

    python benchmarks/ptx_snapshot.py --out /tmp/ptx_before     # before an edit
    python benchmarks/ptx_snapshot.py --out /tmp/ptx_after      # after it
    diff -r /tmp/ptx_before /tmp/ptx_after

How: ``triton_launch.kernel_arguments`` (the keyword arguments the launch passes) is built for CPU tensors shaped
like each job; those go through Triton's own JIT binder for a CUDA sm_90 backend (the same signature,
constexprs and divisibility attributes a real launch computes) and then ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` (warp size 32, what the H200 has; Triton's CUDA options fix it at 32 whatever
the target says). The Gluon KV-major kernel is compiled the same way from
``gluon_bwd.dkdv_arguments`` (tests/kernels/test_kv_major.py's CPU compile does the same with ``mangle_type``). The
LSE kernel's arguments mirror ``triton_lse.attention_lse``'s launch.

``--spills`` also runs Triton's ptxas (cubin) and ``cuobjdump -res-usage`` and prints registers and stack bytes
(spills) per kernel. Many shipped tl compiles spill (45 of 72 on Triton 3.6: the dkdv kernel at every head dim
under some flag set, dq at D = 128 and 256, most of the fp32 table; the H200's counts agree, e.g. run 20's
16 spills in the D = 128 dq kernel); the Gluon kernel spills nothing. ``--quick`` compiles only the default
flag set of each shipped config.

PTX, not SASS, is the thing to compare: ptxas is not deterministic run to run on some of these kernels (the
fp32 dq kernels: same PTX, different SASS on a second compile), and the ``.loc`` line info it receives can
move its scheduling and register choice by a little (one register on D = 256's uncorrected dkdv).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from tests.helpers.kernel_build import cubin_resources  # noqa: E402,F401  (also gluon_check's)

#: the compile target: sm_90a (the H200), warp size 32
TARGET_ARCH = 90
WARP_SIZE = 32


@dataclass(frozen=True)
class Variant:
    """One flag set of the tl kernels: the mask, the options and the shape class that select their constexprs."""
    name: str
    dtype: torch.dtype = torch.bfloat16
    sq: int = 1024
    sk: int = 1024
    causal: bool = False
    bottom_right: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    varlen: bool = False
    sink: bool = False
    correct: bool = True
    fused: bool = True


#: flag sets compiled for every shipped config of the bf16/fp16 table (every constexpr flag of both kernels
#: takes both values somewhere: SOFTCAP, BOTTOM_RIGHT, HAS_L, HAS_R, VARLEN, CORRECT, HAS_SINK, FUSED, EVEN_*)
VARIANTS = (
    Variant("dense"),
    Variant("causal_br_uneven", sq=1000, sk=1030, causal=True, bottom_right=True),
    Variant("window_softcap_varlen_twoprod_fp16", dtype=torch.float16, sq=1000, sk=1000, window=(64, 32),
            softcap=30.0, varlen=True, fused=False),
    Variant("sink_causal", causal=True, sink=True),
    Variant("uncorrected", correct=False),
)
#: flag sets of the fp32 table (the FP32 tier's kernel form, 3×TF32 products)
VARIANTS_FP32 = (
    Variant("fp32_dense", dtype=torch.float32),
    Variant("fp32_causal_uneven", dtype=torch.float32, sq=1000, sk=1030, causal=True),
)
#: query heads, KV heads (GQA: a group of 2, so GROUP is not specialized to 1) and batch of every job
HEADS, KV_HEADS, BATCH = 4, 2, 2


def _job(v: Variant, head_dim: int, fp32_configs: bool):
    """A ``triton_launch.Launch`` of CPU tensors shaped like variant ``v`` (the way ``gproj_backward`` builds it)."""
    from gproj_patch.backends import triton_bwd
    from gproj_patch.backends.triton_launch import Launch
    B = 1 if v.varlen else BATCH
    SQ = 2 * v.sq if v.varlen else v.sq
    SK = 2 * v.sk if v.varlen else v.sk
    q = torch.empty(B, HEADS, SQ, head_dim, dtype=v.dtype)
    k = torch.empty(B, KV_HEADS, SK, head_dim, dtype=v.dtype)
    lse = torch.empty(B, HEADS, SQ, dtype=torch.float32)
    if v.varlen:
        cu_q = torch.tensor([0, v.sq, SQ], dtype=torch.int32)
        cu_k = torch.tensor([0, v.sk, SK], dtype=torch.int32)
        n_problems, max_q, max_k = 2, v.sq, v.sk
    else:
        cu_q = cu_k = q
        n_problems, max_q, max_k = B, SQ, SK
    left, right = v.window
    if v.causal:
        right = 0
    bd = triton_bwd.block_d(head_dim)
    return Launch(
        do=torch.empty_like(q), q=q, k=k, v=torch.empty_like(k), o=torch.empty_like(q), lse=lse,
        dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(k),
        sink=torch.empty(HEADS, dtype=torch.float32) if v.sink else None, cu_q=cu_q, cu_k=cu_k, varlen=v.varlen,
        n_problems=n_problems, max_q=max_q, max_k=max_k, window=(left, right), bottom_right=v.bottom_right,
        alpha=head_dim ** -0.5, softcap=v.softcap, correct=v.correct, fused=v.fused,
        cfg_dq=triton_bwd.block_config("dq", bd, fp32_configs),
        cfg_dkdv=triton_bwd.block_config("dkdv", bd, fp32_configs),
        dot_precision=triton_bwd.FP32_DOT_PRECISION if v.dtype == torch.float32 else "tf32", kv_major="tl")


def _compile(fn, args: tuple, kwargs: dict):
    """``fn`` compiled for sm_90a as a launch with these arguments would compile it (Triton's JIT binder and
    argument packing for a CUDA backend; no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", TARGET_ARCH, WARP_SIZE)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(_ast_source(fn)(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def _ast_source(fn):
    """The AST source class of ``fn``'s language (Gluon kernels have their own)."""
    from triton.compiler import ASTSource
    try:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    except Exception:  # pragma: no cover - a triton without Gluon
        return ASTSource
    return GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource


_DEBUG_SECTION = re.compile(r"^\s*\.section\s+\.debug")
#: labels only the debug sections refer to (the start/end of each inlined function's code)
_DEBUG_LABEL = re.compile(r"^\$L__tmp\d+:$")


def strip_line_info(ptx: str) -> str:
    """PTX without ``.loc``/``.file`` directives, ``.debug_*`` sections and the ``$L__tmp`` labels they use (the
    bounds of each inlined helper's code): what moving code between lines and helpers changes."""
    out: List[str] = []
    depth = 0
    in_debug = False
    for line in ptx.splitlines():
        if in_debug:
            depth += line.count("{") - line.count("}")
            if depth <= 0:
                in_debug = False
            continue
        if _DEBUG_SECTION.match(line):
            in_debug = True
            depth = line.count("{") - line.count("}")
            if depth <= 0 and "{" in line:
                in_debug = False
            continue
        stripped = line.strip()
        if stripped.startswith(".loc") or stripped.startswith(".file") or _DEBUG_LABEL.match(stripped):
            continue
        out.append(line)
    return "\n".join(out) + "\n"


@dataclass
class Entry:
    """One kernel to compile: its file name in the snapshot, the JIT function and the launch's arguments."""
    name: str
    fn: object
    args: tuple
    kwargs: dict


def tl_entries(quick: bool = False, head_dims: Optional[Tuple[int, ...]] = None) -> List[Entry]:
    """Both tl launches of every shipped config (``triton_bwd.CONFIGS`` and ``CONFIGS_FP32``, per padded head
    dim) under every flag set of ``VARIANTS`` / ``VARIANTS_FP32`` (``quick``: the first of each only), plus a
    head dim that is not a power of two (EVEN_D false). Arguments from ``triton_launch.kernel_arguments``, the
    launch's own builder."""
    from gproj_patch.backends import triton_bwd, triton_launch
    km = triton_bwd.kernel_module(False)
    dims = sorted(triton_bwd.CONFIGS["dq"]) if head_dims is None else head_dims
    jobs = []
    for table_fp32, variants in ((False, VARIANTS), (True, VARIANTS_FP32)):
        for d in dims:
            for v in variants[:1] if quick else variants:
                jobs.append((f"d{d}_{v.name}", v, d, table_fp32))
    if not quick and head_dims is None:
        jobs.append(("d96_dense", VARIANTS[0], 96, False))
    entries = []
    for tag, v, d, table_fp32 in jobs:
        job = _job(v, d, table_fp32)
        scratch = triton_launch.allocate_scratch(job)
        for kind, kname in triton_launch.KERNELS.items():
            kwargs = triton_launch.kernel_arguments(kind, job, scratch, block_d=triton_bwd.block_d(d))
            entries.append(Entry(f"{kname}_{tag}", getattr(km, kname), (), kwargs))
    return entries


def lse_entries() -> List[Entry]:
    """The LSE kernel as ``triton_lse.attention_lse`` launches it on CUDA (64 × 64 tiles), dense and causal."""
    from gproj_patch.backends import triton_bwd
    km = triton_bwd.kernel_module(False, "triton_lse_kernels")
    entries = []
    for d in (64, 128):
        for causal in (False, True):
            q = torch.empty(BATCH, HEADS, 1024, d, dtype=torch.bfloat16)
            k = torch.empty(BATCH, KV_HEADS, 1024, d, dtype=torch.bfloat16)
            lse = torch.empty(BATCH, HEADS, 1024, dtype=torch.float32)
            args = (q, k, lse, *q.stride(), *k.stride(), *lse.stride(), HEADS // KV_HEADS, 1024, 1024, d,
                    d ** -0.5 * 1.4426950408889634)
            kwargs = dict(CAUSAL=causal, BLOCK_M=64, BLOCK_N=64, BLOCK_D=triton_bwd.block_d(d), num_warps=4)
            entries.append(Entry(f"_lse_fwd_d{d}_{'causal' if causal else 'dense'}", km._lse_fwd, args, kwargs))
    return entries


def gluon_entries() -> List[Entry]:
    """The Gluon KV-major kernel for each shipped ``gluon_bwd.CONFIGS`` entry (causal, as the launch builds its
    arguments), with the launch's num_warps and maxnreg; none where Gluon is unavailable."""
    from gproj_patch.backends import gluon_bwd
    if gluon_bwd.UNAVAILABLE_REASON is not None:
        print(f"gluon skipped: {gluon_bwd.UNAVAILABLE_REASON}")
        return []
    from gproj_patch.backends import gluon_kernels
    entries = []
    for d, cfg in sorted(gluon_bwd.CONFIGS.items()):
        for causal in (False, True):
            v = Variant("gluon", causal=causal)
            job = _job(v, d, False)
            f = torch.empty(BATCH * HEADS, v.sq, dtype=torch.float32)
            kwargs = gluon_bwd.dkdv_arguments(replace(job, kv_major="gluon"), f, f, f, cfg)
            kwargs.update(num_warps=gluon_bwd.NUM_WARPS, maxnreg=gluon_bwd.MAXNREG)
            entries.append(Entry(f"_dkdv_kernel_gluon_d{d}_{'causal' if causal else 'dense'}",
                                 gluon_kernels._dkdv_kernel, (), kwargs))
    return entries


def snapshot(entries: List[Entry], out: Optional[str], spills: bool,
             log: Callable[[str], None] = print) -> List[dict]:
    """Compile every entry; write ``<name>.ptx`` (line info stripped) under ``out`` when given; one row each
    (name, seconds, and with ``spills`` registers and stack bytes)."""
    if out:
        os.makedirs(out, exist_ok=True)
    rows = []
    for e in entries:
        t0 = time.perf_counter()
        try:
            kernel = _compile(e.fn, e.args, e.kwargs)
        except Exception as exc:
            rows.append(dict(name=e.name, error=f"{type(exc).__name__}: {exc}"[:300]))
            log(f"{e.name}: ERROR {rows[-1]['error']}")
            continue
        row = dict(name=e.name)
        if out:
            with open(os.path.join(out, f"{e.name}.ptx"), "w") as fh:
                fh.write(strip_line_info(kernel.asm["ptx"]))
        if spills:
            row.update(cubin_resources(kernel))
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        log(str(row))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for the stripped PTX files")
    ap.add_argument("--spills", action="store_true", help="also report registers / stack bytes (ptxas)")
    ap.add_argument("--quick", action="store_true", help="only the default flag set of each shipped config")
    ap.add_argument("--only", default="tl,lse,gluon", help="comma-separated: tl, lse, gluon")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this script compiles for sm_90a")
        return 2
    parts = set(args.only.split(","))
    entries = (tl_entries(args.quick) if "tl" in parts else []) + (lse_entries() if "lse" in parts else []) + \
        (gluon_entries() if "gluon" in parts else [])
    rows = snapshot(entries, args.out, args.spills)
    errors = [r for r in rows if "error" in r]
    spilling = [r for r in rows if r.get("stack", 0) > 0]
    print(f"{len(rows) - len(errors)} kernels compiled, {len(errors)} errors"
          + (f", {len(spilling)} with stack bytes (spills)" if args.spills else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
