"""The Python API of the audit: ``check(fn) -> Report``, for kernel authors.

    from gproj_patch.audit import check
    report = check(my_attention, dtype="bf16", device="cuda")   # fn(q, k, v, attn_mask=None, is_causal=False,
    assert report.passed, report.explain()                      #    scale=None) -> out, like SDPA
    report.to_json(); report.plot("audit.png")

``fn`` runs forward and backward on the adversarial suite (``cases.py``) and is held to the conservation-law
criteria (``run.plugin_checks``): dq within 1.28·u of fp64 on the gauge-regime cases, dq blind to a common key
translation, and the four-key witness's exact-zero coordinate — properties the exact gradient has and a backward
that rounds dS before its products loses, on inputs where reference-vs-random tests see nothing.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from ..version import __version__
from .cases import select_cases
from .plugin import LAYOUTS, plugin_backend
from .run import DTYPES, criteria, finite_json, plugin_checks, resolve_device, run_case, torch_threads

DEFAULT_CASES = None  # every case of the suite (quick shapes: seconds on a CPU for an eager BF16 attention)


@dataclass
class CaseResult:
    """One case's figures for the audited function (errors relative to fp64; None where it did not run)."""
    name: str
    status: str  # "ok" | "n/a" | "error"
    gauge_regime: bool
    dq: Optional[float] = None
    dk: Optional[float] = None
    dv: Optional[float] = None
    gauge: Optional[float] = None
    witness_dq0: Optional[float] = None
    reason: Optional[str] = None
    seconds: float = 0.0


@dataclass
class Report:
    """What ``check`` measured: per-case figures, the criteria (True / False / None = could not run) and the
    figures they were judged on (worst case, bounds, witness)."""
    backend: str
    dtype: str
    device: str
    cases: List[CaseResult]
    criteria: Dict[str, Optional[bool]]
    figures: dict
    raw_cases: List[dict] = field(default_factory=list, repr=False)

    @property
    def passed(self) -> bool:
        """Every criterion that could run passed, and at least one ran."""
        ran = [v for v in self.criteria.values() if v is not None]
        return bool(ran) and all(ran)

    def explain(self) -> str:
        """Plain-English lines: each criterion with its measured figure and bound (or why it did not run), then
        the n/a cases."""
        f = self.figures
        pct = lambda x: f"{100 * x:.3g}%"  # noqa: E731
        verdict = lambda v: "PASS" if v else "FAIL"  # noqa: E731
        ran = any(v is not None for v in self.criteria.values())
        outcome = "passed" if self.passed else ("FAILED" if ran else "no criterion could run")
        gauge_cases = [c for c in self.cases if c.gauge_regime]
        no_gauge_case = ("not run: no gauge-regime case was selected" if not gauge_cases else
                         "not run: no gauge-regime case the format can hold ran (see the n/a lines)")
        witness = [c for c in self.cases if c.name == "witness"]
        lines = [f"{self.backend} ({self.dtype} on {self.device}): {outcome}"]
        if f["worst_dq"] is None:
            lines.append(f"  dq error, worst gauge-regime case: {no_gauge_case}")
        else:
            lines.append(f"  dq error, worst gauge-regime case: {pct(f['worst_dq'])} [{f['worst_dq_case']}] "
                         f"(bound {pct(f['dq_max'])}) {verdict(self.criteria['pass_dq'])}")
        if f["worst_gauge"] is None:
            lines.append(f"  gauge error (dq under a common key translation): {no_gauge_case}")
        else:
            lines.append(f"  gauge error (dq under a common key translation): {pct(f['worst_gauge'])} "
                         f"[{f['worst_gauge_case']}] (bound {pct(f['gauge_max'])}) "
                         f"{verdict(self.criteria['pass_gauge'])}")
        if f["witness_dq0"] is None:
            lines.append("  witness dq[0,0,0,0]: not run: " + ("the witness case did not run (see its n/a line)"
                                                                   if witness else "the witness case was not selected"))
        else:
            lines.append(f"  witness dq[0,0,0,0]: {f['witness_dq0']} (exact 0, bound ±{f['witness_max']:.3g}) "
                         f"{verdict(self.criteria['pass_witness'])}")
        if f["worst_do_layout"] is None:
            lines.append("  dO layouts (contiguous vs a (B, S, H, D) view): not run: "
                         + ("no do_layout_* case ran (see the n/a lines)"
                            if any(c.name.startswith("do_layout_") for c in self.cases)
                            else "no do_layout_* case was selected"))
        else:
            lines.append(f"  dO layouts (contiguous vs a (B, S, H, D) view), gradients apart: "
                         f"{pct(f['worst_do_layout'])} [{f['worst_do_layout_case']}] (bound {pct(f['do_layout_max'])}) "
                         f"{verdict(self.criteria['pass_do_layout'])}")
        lines += [f"  n/a {name}: {why}" for name, why in f["not_run"].items()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def to_dict(self) -> dict:
        return {"tool": "gproj_patch audit check", "version": __version__, "backend": self.backend,
                "dtype": self.dtype, "device": self.device, "passed": self.passed, "criteria": self.criteria,
                "figures": self.figures, "cases": [asdict(c) for c in self.cases]}

    def to_json(self, indent: Optional[int] = 1) -> str:
        """Strict JSON (non-finite floats as "inf"/"nan")."""
        return json.dumps(finite_json(self.to_dict()), indent=indent, allow_nan=False)

    def plot(self, path: str) -> None:
        """The dq and gauge errors against the key offset (needs the sweep cases and matplotlib)."""
        from .report import write_plot
        write_plot(path, self.raw_cases, [self.backend], f"{self.backend}: {self.dtype} on {self.device}")


def _dtype_name(dtype: Union[str, torch.dtype]) -> str:
    for name, dt in DTYPES.items():
        if dtype in (name, dt):
            return name
    raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)} or torch.bfloat16 / torch.float16")


def check(fn: Callable, cases: Union[str, Sequence[str], None] = DEFAULT_CASES,
          dtype: Union[str, torch.dtype] = "bf16", device: Union[str, torch.device, None] = None,
          layout: str = "bhsd", quick: bool = True, seed: int = 0, name: Optional[str] = None,
          threads: int = 1) -> Report:
    """Audit ``fn(q, k, v, attn_mask=None, is_causal=False, scale=None) -> out`` (SDPA's signature; ``layout``
    "bhsd" or "bshd") against the fp64 oracle on the suite's ``cases`` (names or fnmatch patterns, a comma
    string or a list; all by default), inputs in ``dtype`` on ``device`` (default: cuda if available, else
    cpu). ``quick``: the suite's small shapes. ``threads``: torch CPU threads during the run (0: unchanged).
    Bad arguments raise ValueError before anything runs; a device this machine lacks (``device="cuda"``
    without a GPU) raises ``DeviceUnavailableError`` (a RuntimeError), also before anything runs."""
    dtype_name = _dtype_name(dtype)
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    dev = resolve_device(device)
    chosen = select_cases(cases if cases is None or isinstance(cases, str) else ",".join(cases))
    label = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    backend = plugin_backend(label, fn, layout)
    with torch_threads(threads):
        raw = [run_case(c, [backend], DTYPES[dtype_name], dev, quick, seed) for c in chosen]
    figures = plugin_checks(raw, label, dtype_name)
    results = []
    for c in raw:
        r = c["results"][label]
        results.append(CaseResult(c["name"], r["status"], c["gauge_regime"], r.get("dq"), r.get("dk"),
                                  r.get("dv"), r.get("gauge"), r.get("witness_dq0"), r.get("reason"),
                                  r["seconds"]))
    crit = {n: v for n, v in criteria({"plugins": {label: figures}}).items()}
    crit = {n.split(": ", 1)[1]: v for n, v in crit.items()}
    return Report(label, dtype_name, str(dev), results, crit, figures, raw)
