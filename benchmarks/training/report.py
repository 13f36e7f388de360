"""Reporting of ``python -m benchmarks.training``: progress bar, summary figures, compact JSON, the PNG, the table.

Summary figures per arm (``summarize``): mean training loss over the last ``TAIL_FRACTION`` of the steps, the last
held-out loss and its difference to the FP32-attention arm, the pre-clip gradient norm (median of the tail and
max), per layer R_k and max |logit| at the end, the last checkpoint's dq error against the fp64 oracle (worst
offset layer, worst other layer), the last checkpoint's gradient gap to the FP32 backward (cosine, relative
difference, norm ratio), and for ``auto`` the layers it holds off ``original`` at the end and at any time.
"""
from __future__ import annotations

import math
import statistics
import sys
from typing import Dict, List, Optional

TAIL_FRACTION = 0.1
SIGNIFICANT_DIGITS = 6
SMOOTH_WINDOW_FRACTION = 0.02
ARM_COLORS = {"unpatched": "tab:red", "gproj": "tab:blue", "auto": "tab:green", "fp32": "black"}
REFERENCE_ARM = "fp32"


class Progress:
    """tqdm when installed, else one line per update on stderr."""

    def __init__(self, total: int):
        self.total = total
        self.bar = None
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="lockstep steps", mininterval=5.0, file=sys.stderr)
        except ImportError:
            pass
        self.done = 0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, step: int, losses: Dict[str, float]) -> None:
        text = " ".join(f"{k}={v:.3f}" for k, v in losses.items())
        if self.bar is not None:
            self.bar.update(step - self.done)
            self.bar.set_postfix_str(text, refresh=False)
        else:
            print(f"step {step}/{self.total} {text}", file=sys.stderr, flush=True)
        self.done = step


def _tail(values: List[float]) -> List[float]:
    n = max(1, int(len(values) * TAIL_FRACTION))
    return values[-n:]


def _worst(errors: List[Dict[str, float]], layers, key="dq") -> Optional[float]:
    vals = [errors[i][key] for i in layers if i < len(errors)]
    return max(vals) if vals else None


def summarize(results: dict) -> Dict[str, dict]:
    cfg = results["config"]
    offset = set(cfg["offset_layers"])
    others = [i for i in range(cfg["layers"]) if i not in offset]
    arms = results["arms"]
    ref_heldout = arms[REFERENCE_ARM]["heldout_loss"][-1]
    out = {}
    for name, c in arms.items():
        last = c["checkpoints"][-1]
        row = {"train_loss_tail": statistics.fmean(_tail(c["loss"])) if c["loss"] else None,
               "heldout_loss": c["heldout_loss"][-1],
               "heldout_minus_fp32": c["heldout_loss"][-1] - ref_heldout,
               "grad_norm_tail_median": statistics.median(_tail(c["grad_norm"])) if c["grad_norm"] else None,
               "grad_norm_max": max(c["grad_norm"]) if c["grad_norm"] else None,
               "r_k_end": c["r_k"][-1] if c["r_k"] else None,
               "max_logit_end": c["max_logit"][-1] if c["max_logit"] else None,
               "final_checkpoint_step": last["step"],
               "dq_err_offset_layers": _worst(last["oracle"], sorted(offset)),
               "dq_err_other_layers": _worst(last["oracle"], others),
               "dk_err_offset_layers": _worst(last["oracle"], sorted(offset), "dk"),
               "gap_vs_fp32_backward": last.get("gap_vs_fp32_backward"),
               "seconds_per_step": c["seconds"] / max(1, len(c["step"])),
               "backward_calls": c["backward_calls"], "fallback_reasons": c["fallback_reasons"]}
        if c["auto_tier"]:
            row["auto_off_original_end"] = [i for i, t in enumerate(c["auto_tier"][-1]) if t not in (None, "original")]
            row["auto_off_original_ever"] = sorted({i for tiers in c["auto_tier"] for i, t in enumerate(tiers)
                                                    if t not in (None, "original")})
        out[name] = row
    return out


def _round(x):
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return float(f"{x:.{SIGNIFICANT_DIGITS}g}")
    if isinstance(x, dict):
        return {str(k): _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


def compact(results: dict) -> dict:
    """The results with floats rounded to SIGNIFICANT_DIGITS and non-finite floats as strings (valid JSON)."""
    return _round(results)


def _fmt(x, spec=".4f") -> str:
    return "—" if x is None else format(x, spec)


def table(results: dict) -> str:
    cfg, env, summ = results["config"], results["environment"], results["summary"]
    lines = [f"training evidence  {env['device']}  torch {env['torch']}  transformers {env['transformers']}  "
             f"{results['parameters'] / 1e6:.1f}M params  {results['steps']} steps × {cfg['batch']}×{cfg['seq']} "
             f"bytes  offset R_k {cfg['offset_rk']:g} on layers {cfg['offset_layers']} of {cfg['layers']}",
             f"step-0 forward bitwise equal across arms: {results['step0_forward_bitwise_equal']}",
             "arm        | train loss | held-out | Δ vs fp32 | gnorm med/max   | dq err offset / other "
             "(fp64 oracle) | grad vs fp32 bwd: cos / rel | s/step"]
    for name, r in summ.items():
        gap = r["gap_vs_fp32_backward"] or {}
        lines.append(
            f"{name:10s} | {_fmt(r['train_loss_tail'])} | {_fmt(r['heldout_loss'])} | "
            f"{_fmt(r['heldout_minus_fp32'], '+.4f')} | {_fmt(r['grad_norm_tail_median'], '.3g')}/"
            f"{_fmt(r['grad_norm_max'], '.3g')} | {_fmt(r['dq_err_offset_layers'], '.3%')} / "
            f"{_fmt(r['dq_err_other_layers'], '.3%')} | {_fmt(gap.get('cosine'), '.5f')} / "
            f"{_fmt(gap.get('rel_diff'), '.3%')} | {r['seconds_per_step']:.3f}")
    for name, r in summ.items():
        lines.append(f"{name:10s} backward calls {r['backward_calls']} fallbacks {r['fallback_reasons']}")
        if "auto_off_original_end" in r:
            lines.append(f"{name:10s} layers off 'original' at the end: {r['auto_off_original_end']}, ever: "
                         f"{r['auto_off_original_ever']} (offset layers {cfg['offset_layers']})")
    for name, r in summ.items():
        lines.append(f"{name:10s} at the end, per layer: R_k " + " ".join(f"{v:.3g}" for v in r["r_k_end"] or [])
                     + " | max|logit| " + " ".join(f"{v:.3g}" for v in r["max_logit_end"] or []))
    return "\n".join(lines)


def _smooth(values: List[float]) -> List[float]:
    w = max(1, int(len(values) * SMOOTH_WINDOW_FRACTION))
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= w:
            acc -= values[i - w]
        out.append(acc / min(i + 1, w))
    return out


TIER_RANK = {"original": 0, "gproj": 1, "fp32": 2}


def _per_layer(ax, steps, rows, layer, offset, color, label):
    ax.plot(steps, [r[layer] for r in rows], color=color, lw=0.9 if layer in offset else 0.5,
            ls="-" if layer in offset else ":", label=label if layer == min(offset) else None)


def plot(results: dict, path: str) -> Optional[str]:
    """Eight panels: loss, loss − fp32 arm, pre-clip gradient norm, full-model gradient vs the FP32 backward,
    per-layer dq error vs the fp64 oracle, R_k, max |logit|, and the tier ``auto`` held per layer."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cfg, arms = results["config"], results["arms"]
    offset = set(cfg["offset_layers"])
    fig, ax = plt.subplots(2, 4, figsize=(24, 10))
    ref = arms[REFERENCE_ARM]
    for name, c in arms.items():
        col = ARM_COLORS.get(name, None)
        ax[0, 0].plot(c["step"], _smooth(c["loss"]), color=col, lw=1, label=name)
        ax[0, 0].plot(c["heldout_step"], c["heldout_loss"], color=col, ls="--", marker=".", ms=3)
        n = min(len(c["loss"]), len(ref["loss"]))
        diff = [a - b for a, b in zip(c["loss"][:n], ref["loss"][:n])]
        ax[0, 1].plot(c["step"][:n], _smooth(diff), color=col, lw=1, label=name)
        hd = [a - b for a, b in zip(c["heldout_loss"], ref["heldout_loss"])]
        ax[0, 1].plot(c["heldout_step"][:len(hd)], hd, color=col, ls="--", marker=".", ms=3)
        ax[0, 2].plot(c["step"], c["grad_norm"], color=col, lw=0.6, alpha=0.8, label=name)
        steps = [e["step"] for e in c["checkpoints"]]
        gaps = [e.get("gap_vs_fp32_backward") for e in c["checkpoints"]]
        if all(gaps):
            ax[0, 3].plot(steps, [g["rel_diff"] for g in gaps], color=col, marker="o", ms=3, label=name)
        for i in range(cfg["layers"]):
            dq = [[e["oracle"][j]["dq"] for j in range(cfg["layers"])] for e in c["checkpoints"]]
            _per_layer(ax[1, 0], steps, dq, i, offset, col, name)
            _per_layer(ax[1, 1], c["step"], c["r_k"], i, offset, col, name)
            _per_layer(ax[1, 2], c["step"], c["max_logit"], i, offset, col, name)
        if c["auto_tier"]:
            grid = [[TIER_RANK.get(t, -1) for t in tiers] for tiers in c["auto_tier"]]
            im = ax[1, 3].imshow(list(map(list, zip(*grid))), aspect="auto", interpolation="nearest",
                                 cmap=matplotlib.colors.ListedColormap(["lightgrey", "tab:green", "tab:purple"]),
                                 vmin=0, vmax=2, extent=(c["step"][0], c["step"][-1] + 1, cfg["layers"] - 0.5, -0.5))
            cbar = fig.colorbar(im, ax=ax[1, 3], ticks=[1 / 3, 1, 5 / 3])
            cbar.ax.set_yticklabels(["original", "gproj", "fp32"])
    ax[0, 0].set(title="loss (solid: train, smoothed; dashed: held-out)", xlabel="step", ylabel="nats/byte")
    ax[0, 1].set(title="loss − fp32-attention arm (solid: train, smoothed; dashed: held-out)", xlabel="step")
    ax[0, 1].axhline(0, color="grey", lw=0.5)
    ax[0, 2].set(title="pre-clip global gradient norm", xlabel="step", yscale="log")
    ax[0, 3].set(title="‖g − g_FP32-bwd‖/‖g_FP32-bwd‖, same weights and batch", xlabel="step", yscale="log")
    ax[1, 0].set(title="attention dq error vs fp64 oracle (solid: offset layers)", xlabel="step", yscale="log")
    ax[1, 1].set(title="key offset ratio R_k per layer (solid: offset layers)", xlabel="step", yscale="log")
    ax[1, 2].set(title="max |attention logit| per layer (solid: offset layers)", xlabel="step", yscale="log")
    ax[1, 3].set(title=f"tier held by auto (offset layers {sorted(offset)})", xlabel="step", ylabel="layer")
    for a in list(ax.flat)[:-1]:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    env = results["environment"]
    fig.suptitle(f"training evidence: {env['device']}, {results['parameters'] / 1e6:.1f}M-param Llama, "
                 f"{results['steps']} steps, key offset R_k={cfg['offset_rk']:g} at init on layers "
                 f"{cfg['offset_layers']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
