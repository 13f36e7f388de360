"""What the H200 runs, compiled for sm_90a on a machine without a GPU: the PTX of every shipped config of the
GProj kernels, their registers and spills, how their dots were lowered and scheduled, and the Gluon launches'
resource tables.

Why: a readability edit of ``triton_kernels.py`` / ``gluon_kernels.py`` (named constants, keyword flags, one tile
loop) must not change the code the H200 runs. This compiles the kernels exactly as the shipped launches
specialize them and writes one PTX file per (kernel, config, flag set) with the line information stripped
(``.loc``/``.file`` directives and the ``.debug_*`` sections), so two snapshots diff cleanly:

    python -m benchmarks.ptx --out /tmp/ptx_before     # before an edit
    python -m benchmarks.ptx --out /tmp/ptx_after      # after it
    diff -r /tmp/ptx_before /tmp/ptx_after
    python -m benchmarks.ptx --gluon                   # the Gluon launches' builds: regs, stack, smem, serialized

How: ``triton_launch.kernel_arguments`` (the keyword arguments the launch passes) is built for CPU tensors shaped
like each job; those go through Triton's own JIT binder for a CUDA sm_90 backend (the same signature,
constexprs and divisibility attributes a real launch computes) and then ``triton.compile`` for
``GPUTarget("cuda", 90, 32)`` (warp size 32, what the H200 has; Triton's CUDA options fix it at 32 whatever
the target says). The Gluon KV-major kernel is compiled the same way from ``gluon_bwd.dkdv_arguments``.

``--spills`` also runs Triton's ptxas (cubin) and ``cuobjdump -res-usage`` and prints registers and stack bytes
(spills) per kernel. Many shipped tl compiles spill (the dkdv kernel at every head dim under some flag set, dq at
D = 128 and 256, most of the fp32 table; the H200's counts agree); the Gluon kernel spills nothing.
``--quick`` compiles only the default flag set of each shipped config.

``--wgmma`` (with ``--dims``, ``--flags default``, ``--json``) also reports how the dots were lowered and
scheduled (``tests/helpers/kernel_build.mma_report``: HGMMA/HMMA counts, wgmma serialized read from the SASS and
from ptxas' own C75xx log) and prints a table last (tests/kernels/test_tl_build.py runs it).

``--gluon`` prints, instead of a snapshot, the Gluon KV-major kernel's builds (tile rows × ring slots × slot
release × retired tiles) and the dQ-major kernel's shipped builds, with registers, stack bytes, shared memory
and whether ptxas serialized their wgmmas (``kernel_build.gluon_compile_report``).

PTX, not SASS, is the thing to compare: ptxas is not deterministic run to run on some of these kernels (the
fp32 dq kernels: same PTX, different SASS on a second compile), and the ``.loc`` line info it receives can
move its scheduling and register choice by a little (one register on D = 256's uncorrected dkdv).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

import torch

from tests.helpers.kernel_build import cubin_resources, gluon_compile_report, gluon_dq_compile_report, mma_report

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
#: the default flag set of a call (corrected, fused dk form, no softcap/window/sink), dense and causal: what
#: ``--flags default`` compiles (``--wgmma``'s survey and tests/kernels/test_tl_build.py)
DEFAULT_FLAG_SETS = (Variant("dense"), Variant("causal", causal=True))
#: flag sets of the fp32 table (the FP32 tier's kernel form, 3×TF32 products)
VARIANTS_FP32 = (
    Variant("fp32_dense", dtype=torch.float32),
    Variant("fp32_causal_uneven", dtype=torch.float32, sq=1000, sk=1030, causal=True),
)
#: query heads, KV heads (GQA: a group of 2, so GROUP is not specialized to 1) and batch of every job
HEADS, KV_HEADS, BATCH = 4, 2, 2


def _job(v: Variant, head_dim: int, fp32_configs: bool):
    """A ``triton_launch.Launch`` of CPU tensors shaped like variant ``v`` (the way ``gproj_backward`` builds it)."""
    from gproj_patch.backends import configs
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
    bd = configs.block_d(head_dim)
    return Launch(
        do=torch.empty_like(q), q=q, k=k, v=torch.empty_like(k), o=torch.empty_like(q), lse=lse,
        dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(k),
        sink=torch.empty(HEADS, dtype=torch.float32) if v.sink else None, cu_q=cu_q, cu_k=cu_k, varlen=v.varlen,
        n_problems=n_problems, max_q=max_q, max_k=max_k, window=(left, right), bottom_right=v.bottom_right,
        alpha=head_dim ** -0.5, softcap=v.softcap, correct=v.correct, fused=v.fused,
        cfg_dq=configs.block_config("dq", bd, fp32_configs),
        cfg_dkdv=configs.block_config("dkdv", bd, fp32_configs),
        dot_precision=configs.dot_precision(v.dtype), kv_major="tl")


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
    config: str = ""  # the block config, for ``--wgmma``'s table: 64x32x4x3 (tl), m64s2r (Gluon)


def tl_entries(quick: bool = False, head_dims: Optional[Tuple[int, ...]] = None,
               variants: Optional[Tuple[Variant, ...]] = None) -> List[Entry]:
    """Both tl launches of every shipped config (``configs.TL_CONFIGS`` and ``TL_CONFIGS_FP32``, per padded head
    dim) under every flag set of ``VARIANTS`` / ``VARIANTS_FP32`` (``quick``: the first of each only), plus a
    head dim that is not a power of two (EVEN_D false). Arguments from ``triton_launch.kernel_arguments``, the
    launch's own builder. ``variants``: these flag sets of the bf16 table only (no fp32 table, no D = 96)."""
    from gproj_patch.backends import configs
    dims = sorted(configs.TL_CONFIGS["dq"]) if head_dims is None else head_dims
    jobs = []
    tables = ((False, VARIANTS), (True, VARIANTS_FP32)) if variants is None else ((False, variants),)
    for table_fp32, flag_sets in tables:
        for d in dims:
            for v in flag_sets[:1] if quick else flag_sets:
                jobs.append((f"d{d}_{v.name}", v, d, table_fp32))
    if not quick and head_dims is None and variants is None:
        jobs.append(("d96_dense", VARIANTS[0], 96, False))
    entries = []
    for tag, v, d, table_fp32 in jobs:
        entries += _launch_entries(_job(v, d, table_fp32), d, tag)
    return entries


def _launch_entries(job, head_dim: int, tag: str, kinds=("dq", "dkdv")) -> List[Entry]:
    """An ``Entry`` per launch ``kinds`` of ``job`` (``triton_launch.kernel_arguments``), named kernel_tag."""
    from gproj_patch.backends import configs, triton_bwd, triton_launch
    km = triton_bwd.kernel_module(False)
    scratch = triton_launch.allocate_scratch(job)
    return [Entry(f"{triton_launch.KERNELS[kind]}_{tag}", getattr(km, triton_launch.KERNELS[kind]), (),
                  triton_launch.kernel_arguments(kind, job, scratch, block_d=configs.block_d(head_dim)),
                  "x".join(map(str, getattr(job, f"cfg_{kind}"))))
            for kind in kinds]


def config_entries(candidates: dict, variants: Tuple[Variant, ...] = DEFAULT_FLAG_SETS) -> List[Entry]:
    """The bf16 tl launch of each candidate block config, ``{head_dim: {"dq"|"dkdv": [(BLOCK_M, BLOCK_N,
    num_warps, num_stages), ...]}}`` (the form of ``benchmarks.kernel.SWEEP``), under each flag set of
    ``variants``; named kernel_d{D}_{flags}_m{M}n{N}w{W}s{S}. The other launch keeps its shipped config (it is
    not compiled)."""
    entries = []
    for d, kinds in sorted(candidates.items()):
        for kind, cfgs in kinds.items():
            for cfg in cfgs:
                for v in variants:
                    job = replace(_job(v, d, False), **{f"cfg_{kind}": tuple(cfg)})
                    entries += _launch_entries(job, d, f"d{d}_{v.name}_m{cfg[0]}n{cfg[1]}w{cfg[2]}s{cfg[3]}",
                                               kinds=(kind,))
    return entries


def gluon_entries() -> List[Entry]:
    """The Gluon KV-major kernel for each shipped ``configs.GLUON_KV_CONFIGS`` entry (causal, as the launch builds
    its arguments), with the launch's num_warps and maxnreg; none where Gluon is unavailable."""
    from gproj_patch.backends import configs, gluon_bwd
    if gluon_bwd.UNAVAILABLE_REASON is not None:
        print(f"gluon skipped: {gluon_bwd.UNAVAILABLE_REASON}")
        return []
    from gproj_patch.backends import gluon_kernels
    entries = []
    for d, cfg in sorted(configs.GLUON_KV_CONFIGS.items()):
        for causal in (False, True):
            v = Variant("gluon", causal=causal)
            job = _job(v, d, False)
            f = torch.empty(BATCH * HEADS, v.sq, dtype=torch.float32)
            kwargs = gluon_bwd.dkdv_arguments(replace(job, kv_major="gluon"), f, f, f, cfg)
            kwargs.update(num_warps=gluon_bwd.NUM_WARPS, maxnreg=gluon_bwd.MAXNREG)
            entries.append(Entry(f"_dkdv_kernel_gluon_d{d}_{'causal' if causal else 'dense'}",
                                 gluon_kernels._dkdv_kernel, (), kwargs,
                                 f"m{cfg.block_m}s{cfg.num_stages}{'p' * cfg.release_pairs}{'r' * cfg.retire_tiles}"))
    return entries


def snapshot(entries: List[Entry], out: Optional[str], spills: bool,
             log: Callable[[str], None] = print, wgmma: bool = False) -> List[dict]:
    """Compile every entry; write ``<name>.ptx`` (line info stripped) under ``out`` when given; one row each
    (name, seconds, and with ``spills`` registers and stack bytes; with ``wgmma`` also
    ``kernel_build.mma_report``'s lowering and wgmma serialization)."""
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
        if spills or wgmma:
            row.update(cubin_resources(kernel))
        if wgmma:
            row["config"] = e.config
            row.update(mma_report(kernel))
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        log(str(row))
    return rows


def wgmma_table(rows: List[dict]) -> str:
    """One line per compiled kernel: config, registers, stack bytes, HGMMA/HMMA/DEPBAR counts, serialized (SASS /
    ptxas' word), ptxas' C75xx codes."""
    lines = [f"{'kernel':52s} {'config':11s} {'regs':>4s} {'stack':>5s} {'hgmma':>5s} {'hmma':>4s} {'depbar':>6s} "
             f"{'serialized':>11s} C75xx"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:52s} ERROR {r['error'][:80]}")
            continue
        ser = f"{'yes' if r['serialized'] else 'no'}/{'yes' if r['ptxas_serialized'] else 'no'}"
        lines.append(f"{r['name']:52s} {r['config']:11s} {r['regs']:4d} {r['stack']:5d} {r['hgmma']:5d} {r['hmma']:4d} "
                     f"{r['depbar']:6d} {ser:>11s} {','.join(r['c75']) or '-'}")
    return "\n".join(lines)


def gluon_tables() -> str:
    """The Gluon KV-major kernel's builds (every tile-row, ring and slot-release combination, plain and with retired
    tiles, causal) and the dQ-major kernel's shipped builds (causal and full): registers, stack bytes (spills),
    shared memory, serialized wgmma."""
    lines = ["| KV-major D | rows | slots | release | retired | regs | stack B | smem B | serialized |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in gluon_compile_report(stages=(2, 3, 4), release_pairs=(False, True), retire_tiles=(False, True)):
        tail = r.get("error") or f"{r['regs']} | {r['stack']} | {r['smem']} | {r['serialized']}"
        lines.append(f"| {r['D']} | {r['block_m']} | {r['stages']} | {'pairs' if r.get('release_pairs') else 'each'} "
                     f"| {bool(r.get('retire_tiles'))} | {tail} |")
    lines += ["", "| dQ-major D | mask | keys a tile | slots | regs | stack B | smem B | serialized |",
              "|---|---|---|---|---|---|---|---|"]
    for causal in (True, False):
        for r in gluon_dq_compile_report(causal=causal):
            tail = r.get("error") or f"{r['regs']} | {r['stack']} | {r['smem']} | {r['serialized']}"
            lines.append(f"| {r['D']} | {'causal' if causal else 'full'} | {r['block_n']} | {r['stages']} | {tail} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for the stripped PTX files")
    ap.add_argument("--spills", action="store_true", help="also report registers / stack bytes (ptxas)")
    ap.add_argument("--wgmma", action="store_true",
                    help="also registers, stack and the dots' lowering: HGMMA/HMMA counts, wgmma serialized "
                         "(SASS DEPBAR per HGMMA) and ptxas' C75xx info; prints a table last")
    ap.add_argument("--quick", action="store_true", help="only the default flag set of each shipped config")
    ap.add_argument("--only", default="tl,gluon", help="comma-separated: tl, gluon")
    ap.add_argument("--dims", default="", help="tl head dims (comma-separated; default: every shipped one)")
    ap.add_argument("--flags", choices=("all", "default"), default="all",
                    help="tl flag sets: all (VARIANTS, VARIANTS_FP32) or default (DEFAULT_FLAG_SETS: bf16 dense, "
                         "causal)")
    ap.add_argument("--candidates", default=None,
                    help='tl: also these block configs (default flag sets), JSON {"128": {"dq": [[128, 64, 8, 3]]}}')
    ap.add_argument("--gluon", action="store_true",
                    help="print the Gluon launches' builds (regs, stack, smem, serialized) instead of a snapshot")
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this script compiles for sm_90a")
        return 2
    if args.gluon:
        print(gluon_tables())
        return 0
    parts = set(args.only.split(","))
    dims = tuple(int(d) for d in args.dims.split(",") if d) or None
    flag_sets = DEFAULT_FLAG_SETS if args.flags == "default" else None
    entries = tl_entries(args.quick, dims, flag_sets) if "tl" in parts else []
    if "tl" in parts and args.candidates:
        entries += config_entries({int(d): c for d, c in json.loads(args.candidates).items()})
    entries += gluon_entries() if "gluon" in parts else []
    rows = snapshot(entries, args.out, args.spills, wgmma=args.wgmma)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    errors = [r for r in rows if "error" in r]
    spilling = [r for r in rows if r.get("stack", 0) > 0]
    if args.wgmma:
        print(wgmma_table(rows))
    print(f"{len(rows) - len(errors)} kernels compiled, {len(errors)} errors"
          + (f", {len(spilling)} with stack bytes (spills)" if args.spills or args.wgmma else "")
          + (f", {sum(bool(r.get('serialized')) for r in rows)} with serialized wgmma" if args.wgmma else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
