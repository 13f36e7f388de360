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
``triton-uncorrected`` / ``triton-gproj`` when ``gproj_patch.backends.triton_bwd`` imports (on CPU through
Triton's interpreter, with ``--dtype fp16`` and GPROJ_TIER=triton or TRITON_INTERPRET=1 — the rule ``enable()``
applies — and never in bf16, which the interpreter computes wrongly; given the emulated forward's O and LSE, and
``kernel_unsupported_reason`` decides n/a). A backend that cannot express a case (e.g. SDPA with a sliding
window) is reported as ``n/a`` with the reason. The fused kernels return gradients in the input dtype, so
their errors include that final rounding (≈ u/2); the emulation and the FP32 tier return fp32.

Plugin backends (``--backend MODULE:FUNCTION``, repeatable; ``plugin.py``): your attention function, SDPA's
signature, ``--layout bhsd|bshd``, in ``--dtype``; run forward and backward on every selected case and reported
like a built-in backend. With ``--backend`` only the built-in backends ``--backends`` names run. A plugin that
raises on a case, or a case its signature cannot express, is n/a with the reason. Each plugin is held to the
conservation-law criteria (``run.plugin_checks``): dq within 1.28·u on the gauge-regime cases, gauge error
within 2.56·u, the witness's exact-zero coordinate within 1.28·u·‖exact dq‖.

Metrics (all in fp64):
  * ``dq``, ``dk``, ``dv``: relative error ‖x − ref‖ / ‖ref‖. When ‖ref‖ = 0 exactly (e.g. Sk = 1, where the
    true dq and dk vanish) the absolute error ‖x − ref‖ is reported instead and ``*_abs`` is true.
  * ``gauge``: the change of dq under a random common key translation k → k' = round(k + b), beyond the exact
    change: ‖(dq(k') − dq(k)) − (ref(k') − ref(k))‖ / ‖ref(k)‖. b has i.i.d. N(0, (16·σ_k)²) coordinates
    (σ_k: the keys' spread about their mean), one vector for all keys and heads. 0 for an exactly
    gauge-invariant backend; an uncorrected kernel leaks ≈ α·ρ·b.

JSON (``--json PATH``), one object:
  ``tool``: "gproj_patch audit"; ``version``; ``torch``; ``device``; ``dtype`` ("bf16"|"fp16"); ``quick``;
  ``seed``; ``threads``; ``elapsed_s``; ``translation_sigma`` (16); ``plugins`` (the ``--backend`` specs);
  ``layout``; ``backends``: names that ran; ``skipped_backends``: {name: reason} for those not available here;
  ``cases``: [{``name``, ``description``, ``gauge_regime``, ``key_offset`` (σ units or null), ``sweep``,
  ``shape`` {B, Hq, Hkv, Sq, Sk, D}, ``mask`` (the case's mask kwargs, cu_seqlens as lists),
  ``expected`` (exact facts, the witness), ``format_in_range`` (``Case.in_range`` for the dtype),
  ``results``: {backend: {``status`` "ok"|"n/a"|"error", ``reason`` (for n/a and error), ``dq``, ``dk``,
  ``dv``, ``gauge`` (floats, for ok), ``dq_abs``, ``dk_abs``, ``dv_abs`` (bools), ``seconds``, and for the
  witness ``witness_dq0`` (the computed dq[0,0,0,0]), for the dO-layout cases ``do_layouts`` ([{``layout``,
  ``dq``, ``dk``, ``dv``}] per backward, in the order run; ``dq``/``dk``/``dv`` above are the worst of them) and
  ``do_layout_spread`` (max over dq, dk, dv of ‖g(2nd layout) − g(1st)‖ / ‖ref‖), ``warnings`` (distinct
  warning lines the call raised, kept here instead of printed)}}}];
  ``checks``: {``unit_roundoff``, the bounds ``uncorrected_dq_min``, ``gproj_dq_max``, ``fp32_tier_dq_max``;
  ``uncorrected_dq_at_128sigma``, ``gproj_worst_gauge_regime_dq`` and its ``..._case``,
  ``gproj_out_of_range_cases`` (gauge-regime cases left out of the GProj criterion, see below),
  ``fp32_tier_worst_gauge_regime_dq`` and its ``..._case``; ``do_layout_max``, ``do_layout_spread`` ({backend:
  worst spread} of the built-in backends), ``do_layout_failed``; ``pass_uncorrected_leaks``, ``pass_gproj``,
  ``pass_fp32_tier``, ``pass_do_layout``: true / false, or null where the case or backend it needs did not run;
  ``plugins``: {spec: ``run.plugin_checks``'s fields (``worst_dq``, ``worst_gauge``, ``witness_dq0``,
  ``worst_do_layout``, the bounds, ``not_run``, ``pass_dq``, ``pass_gauge``, ``pass_witness``,
  ``pass_do_layout``)}}.
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
    FP32 whatever the input format, so its bound does not depend on u (measured worst: 1.3e-4);
  * every built-in backend that ran the dO-layout cases (``do_layout_bhsd_bshd``, ``do_layout_bshd_bhsd``:
    diffuse inputs at a shape no other case uses, one backward with dO contiguous (B, H, S, D) and one with
    the same values as a (B, S, H, D) view, in both orders) gives gradients within 2.56·u of each other (two
    backwards, each within 1.28·u of fp64). A backend that keeps per-shape state and reads the second call's
    dO with the first call's strides is off by O(1). Measured on a CPU: 0 for every backend.

Exit status: 0 when the audit ran (whatever the errors it measured); with ``--strict`` 1 when a criterion
that ran failed (a plugin's included) and 3 when none could run (the selected cases or backends leave every
criterion without its input); 2 for a bad argument, found before anything runs (``plan``).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import os
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..version import __version__
from .backends import Backend, available_backends
from .cases import Case, select_cases
from .plugin import LAYOUTS, PluginError, load_backend
from .report import render_checks, render_table, write_plot
from .run import (DTYPES, GAUGE_MAX_U, GPROJ_MAX_U, TRANSLATION_SIGMA, DeviceUnavailableError, checks, finite_json,
                  plural, resolve_device, run_case, strict_status, torch_threads)

DESCRIPTION = ("Attention-gradient errors of every backend available here (and of your own attention functions, "
               "--backend MODULE:FUNCTION) on a named adversarial suite, against an fp64 oracle.")
EPILOG = ("exit status: 0 when the audit ran, whatever it measured; with --strict 1 when a criterion that ran "
          "failed and 3 when none could run; 2 for a bad argument (checked before anything runs). "
          "Metrics, criteria and JSON fields: the docstring of gproj_patch/audit/cli.py.")


class OneLineParser(argparse.ArgumentParser):
    """An argument error is one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = parser or OneLineParser(prog="python -m gproj_patch audit")  # main() passes the name it was invoked as
    p.description, p.epilog = DESCRIPTION, EPILOG
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input precision (default bf16)")
    p.add_argument("--quick", action="store_true",
                   help="small shapes: about 10 s on a 2-core CPU with the default backends; with "
                        "GPROJ_TIER=triton TRITON_INTERPRET=1 (the Triton kernel, interpreted) 5 to 15 minutes")
    p.add_argument("--cases", default=None, help="comma-separated case names or fnmatch patterns (--list)")
    p.add_argument("--backends", default=None,
                   help="comma-separated built-in backend names or fnmatch patterns (default: all of them, or "
                        "none when --backend is given)")
    p.add_argument("--backend", dest="plugins", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="audit your own attention function: FUNCTION(q, k, v, attn_mask=None, is_causal=False, "
                        "scale=None) -> out, like SDPA (MODULE may be a PATH.py); repeatable")
    p.add_argument("--layout", default="bhsd", choices=LAYOUTS,
                   help="tensor layout --backend functions take: bhsd (SDPA's, default) or bshd (flash-attn's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the suite's random inputs (default 0)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="plot dq and gauge error vs key offset (needs matplotlib and the key_offset_* cases)")
    p.add_argument("--list", action="store_true", help="list cases and backends, then exit")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if a criterion that ran fails, 3 if no criterion could run")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress report (on stderr: a bar on a terminal, else one line per case)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="CPU threads for torch (default 1: the audit runs many small tile products, and on a "
                        "shared 2-core machine more threads spin and run up to 10x slower; 0 keeps torch's default)")
    p.add_argument("--version", action="version", version=f"gproj_patch {__version__}")
    return p


@dataclass
class Plan:
    """Everything the run needs, checked before it starts."""
    device: torch.device
    dtype: torch.dtype
    cases: List[Case]
    backends: List[Backend]
    skipped: Dict[str, str]
    plugins: List[str]


def _parse_device(p: argparse.ArgumentParser, name: Optional[str]) -> torch.device:
    try:
        return resolve_device(name)
    except DeviceUnavailableError as e:
        p.error(f"--device {name}: {e.why}")
    except ValueError as e:
        p.error(f"--device {name}: {e}")


def _check_output(p: argparse.ArgumentParser, flag: str, path: Optional[str]) -> None:
    """An output file's directory must exist (a mistyped path fails now, not after the run)."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        p.error(f"{flag} {path}: directory {directory} does not exist")
    if os.path.isdir(path):
        p.error(f"{flag} {path}: is a directory")


def plan(args: argparse.Namespace, p: argparse.ArgumentParser) -> Plan:
    """Check every argument (exit 2 with one line on the first bad one) and resolve cases and backends."""
    device = _parse_device(p, args.device)
    if args.threads < 0:
        p.error("--threads must be >= 0")
    try:
        cases = select_cases(args.cases)
    except ValueError as e:
        p.error(str(e))
    try:
        backends, skipped = available_backends(device, DTYPES[args.dtype])
    except ValueError as e:  # a bad GPROJ_TIER
        p.error(str(e))
    if args.backends or args.plugins:
        pats = [x.strip() for x in (args.backends or "").split(",") if x.strip()]
        bad = [pt for pt in pats if not any(fnmatch.fnmatchcase(b.name, pt) for b in backends)]
        if bad:
            p.error(f"no available backend matches {bad}; available: {', '.join(b.name for b in backends)}")
        backends = [b for b in backends if any(fnmatch.fnmatchcase(b.name, pt) for pt in pats)]
    for spec in args.plugins:
        try:
            backends.append(load_backend(spec, args.layout))
        except PluginError as e:
            p.error(str(e))
    _check_output(p, "--json", args.json_path)
    if args.plot:
        if not args.plot.lower().endswith(".png"):
            p.error("--plot expects a .png path")
        _check_output(p, "--plot", args.plot)
        if not any(c.sweep for c in cases):
            p.error("--plot needs the key-offset sweep cases (diffuse, key_offset_*) in --cases")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install 'gproj_patch[plot]'")
    return Plan(device, DTYPES[args.dtype], cases, backends, skipped, list(args.plugins))


class _BarLog(logging.Handler):
    """While the bar is drawn, this package's log lines are written through tqdm, above the bar (not over it)."""

    def __init__(self, bar):
        super().__init__(logging.NOTSET)
        self.bar = bar
        self.setFormatter(logging.Formatter("gproj_patch: %(message)s"))

    def emit(self, record):
        self.bar.write(self.format(record), file=sys.stderr)


def _progress(items, enabled: bool):
    """Progress on stderr: a bar (tqdm) only when stderr is a terminal — redrawn with carriage returns, it
    would otherwise share a line with what follows in a log; elsewhere one whole line per case."""
    if not enabled:
        yield from items
        return
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None:
            bar = tqdm(items, desc="audit", unit="case", file=sys.stderr, leave=False)
            handler = _BarLog(bar)
            logger = logging.getLogger("gproj_patch")
            logger.addHandler(handler)
            try:
                yield from bar
            finally:
                logger.removeHandler(handler)
                bar.close()
            return
    for i, x in enumerate(items):
        print(f"[{i + 1}/{len(items)}] {x.name}", file=sys.stderr, flush=True)
        yield x


def _list(pl: Plan) -> int:
    for c in pl.cases:
        print(f"case     {c.name:22s} {'gauge' if c.gauge_regime else 'not-gauge':9s} {c.description}")
    for b in pl.backends:
        print(f"backend  {b.name}")
    for n, why in pl.skipped.items():
        print(f"skipped  {n:22s} {why}")
    return 0


def _report_warnings(results: List[dict], json_path: Optional[str]) -> None:
    """Where the audited calls' warnings went: with --json, that file's ``warnings`` fields; without, each
    distinct line printed here once, with the results it came from (never to stderr: the audit makes these
    calls on purpose with unusual inputs, so their advice is about the audit's call, not the user's code)."""
    by_line: Dict[str, List[str]] = {}
    warned = 0
    for c in results:
        for backend, r in c["results"].items():
            warned += bool(r.get("warnings"))
            for line in r.get("warnings", ()):
                by_line.setdefault(line, []).append(f"{c['name']}/{backend}")
    if not warned:
        return
    head = f"{plural(warned, 'result')} came with warnings from the audited calls"
    if json_path:
        print(f"{head} (kept in {json_path}, field 'warnings' of each result)")
        return
    print(f"{head} (raised by the audited functions on the audit's inputs; --json PATH keeps them with each "
          "result):")
    for line, where in by_line.items():
        shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        print(textwrap.fill(f"{line} [{shown}]", 116, initial_indent="  ", subsequent_indent="    ",
                            break_long_words=False, break_on_hyphens=False))  # names and paths stay whole


def run_audit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    pl = plan(args, parser)
    if args.list:
        return _list(pl)
    with torch_threads(args.threads):
        return _run(args, pl)


def _run(args: argparse.Namespace, pl: Plan) -> int:
    t0 = time.perf_counter()
    names = [b.name for b in pl.backends]
    results = [run_case(c, pl.backends, pl.dtype, pl.device, args.quick, args.seed)
               for c in _progress(pl.cases, not args.no_progress)]
    elapsed = time.perf_counter() - t0
    ch = checks(results, args.dtype, pl.plugins)
    render_table(results, names)
    render_checks(ch, args.dtype)
    print(textwrap.fill(f"{plural(len(results), 'case')} × {plural(len(names), 'backend')} on {pl.device} "
                        f"({args.dtype}{', quick' if args.quick else ''}) in {elapsed:.1f} s; not run here: "
                        + (", ".join(f"{n} ({w})" for n, w in pl.skipped.items()) or "none"), 116))
    _report_warnings(results, args.json_path)
    doc = {"tool": "gproj_patch audit", "version": __version__, "torch": torch.__version__,
           "device": str(pl.device), "dtype": args.dtype, "quick": bool(args.quick), "seed": args.seed,
           "threads": torch.get_num_threads(), "elapsed_s": round(elapsed, 3),
           "translation_sigma": TRANSLATION_SIGMA, "backends": names, "plugins": pl.plugins,
           "layout": args.layout, "skipped_backends": pl.skipped, "cases": results, "checks": ch}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(finite_json(doc), f, indent=1, allow_nan=False)
        print(f"wrote {args.json_path}")
    if args.plot:
        u = ch["unit_roundoff"]
        write_plot(args.plot, results, names, f"gproj_patch audit — {args.dtype} on {pl.device}"
                   + (" (quick)" if args.quick else ""), dq_bound=GPROJ_MAX_U * u,
                   gauge_bound=GAUGE_MAX_U * u if pl.plugins else None)
        print(f"wrote {args.plot}")
    if args.strict:
        status, why = strict_status(ch)
        print(f"--strict: {why}", file=sys.stderr if status else sys.stdout)
        return status
    return 0


def invoked_as(argv0: Optional[str] = None) -> str:
    """The command the user typed, for usage and error lines (argparse's rule, the basename of argv[0], with two
    exceptions): ``python -m gproj_patch.audit.cli`` for this module run with -m (argv[0] is then its path),
    and ``gproj-audit`` where argv[0] names no script (``python -c``, an embedding)."""
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    if name == "cli.py":
        return "python -m gproj_patch.audit.cli"
    if not name or name in ("-c", "-m"):
        return "gproj-audit"
    return name[:-4] if name.lower().endswith(".exe") else name  # pip's launchers on Windows


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    """``gproj-audit`` and ``python -m gproj_patch.audit.cli``: the audit's own command line. ``prog``: the name
    usage and error lines give the command (default: as invoked, ``invoked_as``)."""
    parser = build_parser(OneLineParser(prog=prog or invoked_as()))
    args = parser.parse_args(argv)
    return run_audit(args, parser)


if __name__ == "__main__":
    sys.exit(main())
