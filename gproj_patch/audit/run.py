"""The audit's engine: every backend on one case against the fp64 oracle, and the criteria read from the results.

``run_case`` gives one case's JSON object (fields in ``cli.py``'s docstring); ``checks`` evaluates the done
criteria of the built-in backends and, for each plugin backend (a user's kernel, ``plugin.py``), the
conservation-law criteria; ``strict_status`` turns them into ``--strict``'s exit status. No printing here: the
CLI and ``check()`` share this code and present it their own way.
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings
from types import MappingProxyType
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch

from ..backends.reference import reference_backward
from ..backends.spec import unit_roundoff
from .backends import Backend, NotApplicable, SavedForwards, case_format
from .cases import CaseInputs, with_do_layout

DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16})
TRANSLATION_SIGMA = 16.0
LEAK_MIN_U = 51.2  # the uncorrected dq error at 128σ must reach 51.2·u (BF16: 20%)
GPROJ_MAX_U = 1.28  # emulated GProj's dq error stays within 1.28·u (BF16: 0.5%)
GAUGE_MAX_U = 2.56  # a plugin's gauge error: two backwards each within 1.28·u of the oracle
#: two backwards of the same inputs with dO in two layouts: each within 1.28·u of fp64, so at most 2.56·u apart
#: (a backend that reads one layout's dO with the other's strides is off by O(1))
DO_LAYOUT_MAX_U = GAUGE_MAX_U
FP32_TIER_MAX = 1e-3  # the FP32 tier computes in FP32: one bound for every input format
EXIT_FAILED, EXIT_NOTHING_RAN = 1, 3
MAX_WARNINGS = 3  # distinct warning lines kept per result


class DeviceUnavailableError(RuntimeError):
    """The audit was asked to run on a device this machine does not have (e.g. ``device="cuda"`` without a GPU).
    ``check`` raises it before anything runs, the pytest fixture turns it into a skip, the CLI into exit 2.
    ``device``: the device asked for; ``why``: what is missing and what to do instead."""

    def __init__(self, device: str, why: str):
        super().__init__(f"device {device!r}: {why}")
        self.device, self.why = device, why


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """The device the audit runs on: ``device``, or cuda if available, else cpu for None. ValueError for a name
    torch does not parse or a device type the audit does not run on; ``DeviceUnavailableError`` for a device
    this machine lacks, saying what to pass instead."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"bad device {device!r}: {e}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(dev)!r}: the audit runs on cpu or cuda")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise DeviceUnavailableError(str(dev), (
                f"CUDA is not available on this machine ({why}; torch {torch.__version__}). Run on a machine with "
                "a CUDA GPU, or on the CPU (device 'cpu'; with no device given, the audit picks cuda if available, "
                "else cpu)"))
        if dev.index is not None and dev.index >= count:
            raise DeviceUnavailableError(str(dev), f"this machine has {plural(count, 'CUDA device')} "
                                                   f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
    return dev


def _rel(x: torch.Tensor, ref: torch.Tensor) -> Tuple[float, bool]:
    x = x.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    n = float(ref.norm())
    err = float((x - ref).norm())
    if not math.isfinite(err):
        return float("inf"), n == 0.0
    return (err / n, False) if n > 0 else (err, True)


def _spread(x: torch.Tensor, y: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − y‖ / ‖ref‖ in fp64 (‖x − y‖ where ‖ref‖ = 0): how far two backwards of the same inputs differ."""
    cpu64 = lambda t: t.detach().to("cpu", torch.float64)  # noqa: E731
    n = float(cpu64(ref).norm())
    d = float((cpu64(x) - cpu64(y)).norm())
    if not math.isfinite(d):
        return float("inf")  # NaN compares False with any bound: count it as the worst spread
    return d / n if n > 0 else d


def _translated_keys(inp: CaseInputs, seed: int) -> torch.Tensor:
    k = inp.k.detach().to("cpu", torch.float64)
    spread = float((k - k.mean(dim=2, keepdim=True)).std()) if k.shape[2] > 1 else 1.0
    spread = spread if spread > 0 else 1.0
    gen = torch.Generator().manual_seed(10007 + seed)
    b = torch.randn(k.shape[-1], generator=gen, dtype=torch.float64) * TRANSLATION_SIGMA * spread
    return (k + b).to(inp.k.dtype).to(inp.k.device)


def finite_json(x):
    """JSON-safe copy: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x


def _mask_json(mask: dict) -> dict:
    return {n: (v.tolist() if isinstance(v, torch.Tensor) else (list(v) if isinstance(v, tuple) else v))
            for n, v in mask.items()}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _run_backend(be: Backend, inp: CaseInputs, k2: torch.Tensor, refs, saved: SavedForwards) -> dict:
    """One backend on one case: errors vs the oracle, gauge error, witness coordinate (or n/a / error)."""
    ref1, ref2 = refs
    res: dict = {}
    try:
        why = be.reason(inp)
        if why:
            raise NotApplicable(why)
        if inp.do_layouts:  # one backward per dO layout, in the case's order, before any other call at this shape
            runs = [(layout, be.run(with_do_layout(inp, layout), inp.k, saved)) for layout in inp.do_layouts]
            g1 = runs[0][1]
            g2 = be.run(with_do_layout(inp, inp.do_layouts[0]), k2, saved)
        else:
            runs = []
            g1 = be.run(inp, inp.k, saved)
            g2 = be.run(inp, k2, saved)
        res["status"] = "ok"
        for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):  # the worst call's error: a misread dO shows here
            res[name], res[f"{name}_abs"] = max((_rel(g[i], ref1[i]) for g in [g1] + [g for _, g in runs]),
                                                key=lambda e: e[0])
        if runs:
            res["do_layouts"] = [{"layout": layout, **{n: _rel(g[i], ref1[i])[0] for n, i in
                                                       (("dq", 0), ("dk", 1), ("dv", 2))}} for layout, g in runs]
            res["do_layout_spread"] = max(_spread(g[i], g1[i], ref1[i]) for _, g in runs[1:] for i in range(3))
        n1 = float(ref1[0].norm())
        cpu64 = lambda x: x.detach().to("cpu", torch.float64)  # noqa: E731
        dd = (cpu64(g2[0]) - cpu64(g1[0])) - (cpu64(ref2[0]) - cpu64(ref1[0]))
        res["gauge"] = float(dd.norm()) / (n1 if n1 > 0 else 1.0)
        if "dq_index" in inp.expected:
            res["witness_dq0"] = float(g1[0][inp.expected["dq_index"]])
    except NotApplicable as e:
        res = {"status": "n/a", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - a backend failing is a finding, not a crash of the audit
        res = {"status": "error", "reason": _first_line(e)}
    return res


def run_case(case, backends: List[Backend], dtype, device, quick: bool, seed: int) -> dict:
    """Every backend on one case: the case's JSON object (see ``cli.py``'s docstring). Warnings the backends'
    own calls raise (PyTorch's, a plugin's) are kept in the result's ``warnings``, not printed: the audit calls
    those functions on purpose with unusual inputs, and their advice is about the audit's call, not the user's."""
    inp = case.build(seed=seed, dtype=dtype, device=device, quick=quick)
    k2 = _translated_keys(inp, seed)
    refs = (reference_backward(inp.q, inp.k, inp.v, inp.do, **inp.mask),
            reference_backward(inp.q, k2, inp.v, inp.do, **inp.mask))
    saved = SavedForwards(case_format(inp))
    results = {}
    for be in backends:
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = _run_backend(be, inp, k2, refs, saved)
        lines = list(dict.fromkeys(f"{w.category.__name__}: {str(w.message).strip().splitlines()[0][:160]}"
                                   for w in caught if str(w.message).strip()))
        if lines:
            res["warnings"] = lines[:MAX_WARNINGS]
        res["seconds"] = round(time.perf_counter() - t0, 4)
        results[be.name] = res
    return {"name": case.name, "description": case.description, "gauge_regime": case.gauge_regime,
            "key_offset": case.key_offset, "sweep": case.sweep, "format_in_range": case.in_range(dtype),
            "shape": inp.shape, "mask": _mask_json(inp.mask),
            "expected": {n: (list(v) if isinstance(v, tuple) else v) for n, v in inp.expected.items()},
            "results": results}


def _ok(case: dict, backend: str, metric: str = "dq") -> Optional[float]:
    r = case["results"].get(backend, {})
    return r.get(metric) if r.get("status") == "ok" else None


def _worst(backend: str, chosen: List[dict], metric: str = "dq"):
    pairs = [(_ok(c, backend, metric), c["name"]) for c in chosen if _ok(c, backend, metric) is not None]
    return max(pairs, key=lambda p: p[0]) if pairs else (None, None)


def plugin_checks(cases: List[dict], backend: str, dtype: str) -> dict:
    """The conservation-law criteria of one plugin backend (a kernel under audit), on the cases that ran:

    * ``pass_dq``: dq within 1.28·u of fp64 on every gauge-regime case the format can hold — what a backward
      that keeps Σ_j dS_ij = 0 reaches (emulated GProj's bound);
    * ``pass_gauge``: dq blind to a common key translation, within 2.56·u (two backwards, each within 1.28·u);
    * ``pass_witness``: on the four-key witness, dq[0,0,0,0] (exactly 0; an uncorrected BF16 kernel returns
      −24) within 1.28·u of ‖exact dq‖;
    * ``pass_do_layout``: on the dO-layout cases, the backwards with dO contiguous and as a (B, S, H, D) view
      (same values, either order, at a shape met first there) within 2.56·u of each other (``worst_do_layout``).
    A criterion is None when no case it reads ran (n/a, error, or not selected)."""
    u = unit_roundoff(DTYPES[dtype])
    gauge = [c for c in cases if c["gauge_regime"] and c.get("format_in_range", True)]
    out: dict = {"dq_max": GPROJ_MAX_U * u, "gauge_max": GAUGE_MAX_U * u}
    out["worst_dq"], out["worst_dq_case"] = _worst(backend, gauge)
    out["worst_gauge"], out["worst_gauge_case"] = _worst(backend, gauge, "gauge")
    out["witness_dq0"], out["witness_max"] = None, None
    for c in cases:
        r = c["results"].get(backend, {})
        if c["name"] == "witness" and r.get("status") == "ok":
            out["witness_dq0"] = r["witness_dq0"]
            out["witness_max"] = GPROJ_MAX_U * u * abs(c["expected"]["dq_exact_coord1"])
    out["not_run"] = {c["name"]: c["results"][backend].get("reason", "")
                      for c in cases if c["results"].get(backend, {}).get("status") != "ok"}
    out["do_layout_max"] = DO_LAYOUT_MAX_U * u
    out["worst_do_layout"], out["worst_do_layout_case"] = _worst(backend, cases, "do_layout_spread")
    out["pass_dq"] = None if out["worst_dq"] is None else out["worst_dq"] <= out["dq_max"]
    out["pass_gauge"] = None if out["worst_gauge"] is None else out["worst_gauge"] <= out["gauge_max"]
    out["pass_witness"] = None if out["witness_dq0"] is None else abs(out["witness_dq0"]) <= out["witness_max"]
    out["pass_do_layout"] = (None if out["worst_do_layout"] is None
                             else out["worst_do_layout"] <= out["do_layout_max"])
    return out


def checks(cases: List[dict], dtype: str = "bf16", plugins: Iterable[str] = ()) -> dict:
    """The done criteria (``cli.py``'s docstring) evaluated on the results of ``run_case``, for ``dtype``; under
    ``"plugins"`` each plugin backend's ``plugin_checks``."""
    u = unit_roundoff(DTYPES[dtype])
    gauge = [c for c in cases if c["gauge_regime"]]
    in_range = [c for c in gauge if c.get("format_in_range", True)]
    out: dict = {"unit_roundoff": u, "uncorrected_dq_min": LEAK_MIN_U * u, "gproj_dq_max": GPROJ_MAX_U * u,
                 "fp32_tier_dq_max": FP32_TIER_MAX, "uncorrected_dq_at_128sigma": None}
    for c in cases:
        if c["name"] == "key_offset_128":
            out["uncorrected_dq_at_128sigma"] = _ok(c, "emulated-uncorrected")
    out["gproj_worst_gauge_regime_dq"], out["gproj_worst_gauge_regime_case"] = _worst("emulated-gproj", in_range)
    out["gproj_out_of_range_cases"] = [c["name"] for c in gauge if c not in in_range]
    out["fp32_tier_worst_gauge_regime_dq"], out["fp32_tier_worst_gauge_regime_case"] = _worst("fp32-tier", gauge)
    leak, g, f = (out["uncorrected_dq_at_128sigma"], out["gproj_worst_gauge_regime_dq"],
                  out["fp32_tier_worst_gauge_regime_dq"])
    out["pass_uncorrected_leaks"] = None if leak is None else leak >= out["uncorrected_dq_min"]
    out["pass_gproj"] = None if g is None else g <= out["gproj_dq_max"]
    out["pass_fp32_tier"] = None if f is None else f <= FP32_TIER_MAX
    out.update(do_layout_checks(cases, DO_LAYOUT_MAX_U * u, exclude=plugins))
    out["plugins"] = {name: plugin_checks(cases, name, dtype) for name in plugins}
    return out


def do_layout_checks(cases: List[dict], bound: float, exclude: Iterable[str] = ()) -> dict:
    """Every built-in backend that ran a dO-layout case (``Case.do_layouts``) gives the same gradients for both
    layouts, within ``bound``: ``do_layout_max``, ``do_layout_spread`` {backend: worst spread}, ``do_layout_failed``
    (backends beyond the bound), ``pass_do_layout`` (None when no such case ran). Plugins are held to it in
    ``plugin_checks``."""
    exclude = set(exclude)
    spread: Dict[str, float] = {}
    for c in cases:
        for name, r in c["results"].items():
            if name not in exclude and r.get("status") == "ok" and "do_layout_spread" in r:
                spread[name] = max(spread.get(name, 0.0), r["do_layout_spread"])
    failed = sorted(name for name, x in spread.items() if not x <= bound)
    return {"do_layout_max": bound, "do_layout_spread": spread, "do_layout_failed": failed,
            "pass_do_layout": None if not spread else not failed}


def criteria(ch: dict) -> Dict[str, Optional[bool]]:
    """Every criterion of ``checks`` by name (plugins' as "BACKEND: pass_..."): True, False, or None (not run)."""
    out = {n: v for n, v in ch.items() if n.startswith("pass_")}
    for name, pc in ch.get("plugins", {}).items():
        out.update({f"{name}: {n}": v for n, v in pc.items() if n.startswith("pass_")})
    return out


def plural(n: int, word: str, many: Optional[str] = None) -> str:
    """"1 case", "2 cases", "1 criterion", "3 criteria"."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def strict_status(ch: dict) -> Tuple[int, str]:
    """``--strict``: (exit status, why) from the checks: a failed criterion, or none that could run."""
    ran = {n: v for n, v in criteria(ch).items() if v is not None}
    if not ran:
        return EXIT_NOTHING_RAN, ("no criterion could run: they need key_offset_128 with emulated-uncorrected, "
                                  "a gauge-regime case with emulated-gproj, fp32-tier or a --backend plugin, "
                                  "the witness with a plugin, or a do_layout_* case with any backend")
    failed = sorted(n for n, v in ran.items() if not v)
    if failed:
        return EXIT_FAILED, "failed: " + ", ".join(failed)
    return 0, plural(len(ran), "criterion", "criteria") + " passed"


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
