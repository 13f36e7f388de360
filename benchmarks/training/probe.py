"""Instruments of ``python -m benchmarks.training``: what one training step's attention calls looked like.

* ``AttentionRecorder`` wraps whatever ``torch.nn.functional.scaled_dot_product_attention`` is while it is active
  (the unpatched function or the gproj_patch hook, which it calls unchanged) and keeps each call's q, k, v
  (after RoPE, as the kernel saw them); with ``grads=True`` also the output gradient dO and the dq, dk, dv the
  backward returned (tensor hooks), for the first ``keep_seqs`` sequences of the batch.
* ``layer_statistics``: per call, the key offset ratio R_k = ‖mean key‖ / RMS_j ‖k_j − mean key‖ (worst
  (sequence, KV head)), the largest |attention logit| and the mean of the row maxima of P (sharpness), on the
  first ``STATS_SEQS`` sequences. Computed here from the recorded tensors, independently of ``detector.py``.
* ``oracle_errors``: ‖g − g₆₄‖ / ‖g₆₄‖ of dq, dk, dv against ``backends.reference.reference_backward`` (fp64) on
  exactly the recorded inputs.
* ``gradient_gap``: cosine, relative difference and norm ratio of two flattened full-model gradients.

Only the public numerics (``backends/reference.py``) are imported from the package.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from gproj_patch.backends.reference import reference_backward

#: Sequences of the batch the per-step statistics read (the logits are (STATS_SEQS, H, S, S) fp32).
STATS_SEQS = 4
#: Floor of denominators (a zero spread or a zero reference gradient must not divide by zero).
TINY = 1e-30
GRAD_NAMES = ("dq", "dk", "dv")


@dataclass
class AttentionCall:
    """One SDPA call: inputs as the kernel saw them and, when recorded, dO and the backward's gradients."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    is_causal: bool
    scale: Optional[float]
    grads: Dict[str, torch.Tensor] = field(default_factory=dict)


class AttentionRecorder:
    """Context manager: records every SDPA call made while active (see the module docstring)."""

    def __init__(self, *, grads: bool = False, keep_seqs: int = STATS_SEQS):
        self.record_grads = grads
        self.keep_seqs = keep_seqs
        self.calls: List[AttentionCall] = []
        self._inner = None

    def __enter__(self) -> "AttentionRecorder":
        self._inner = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._inner

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        out = self._inner(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, **kwargs)
        n = self.keep_seqs
        # Under autocast SDPA casts FP32 inputs to the autocast dtype (HF's RoPE returns FP32 q, k there): the
        # kernel saw the output's dtype. The gradients reach the FP32 tensors with exactly those values.
        seen = [t.detach()[:n].to(out.dtype) for t in (query, key, value)]
        mask = attn_mask[:n] if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[0] > 1 \
            else attn_mask
        call = AttentionCall(q=seen[0], k=seen[1], v=seen[2], attn_mask=mask, is_causal=bool(is_causal),
                             scale=scale)
        if self.record_grads and out.requires_grad:
            for name, t in (("dq", query), ("dk", key), ("dv", value), ("do", out)):
                if t.requires_grad:
                    t.register_hook(lambda g, name=name: call.grads.__setitem__(name, g.detach()[:n].clone()))
        self.calls.append(call)
        return out


def _expand_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k.repeat_interleave(heads // k.shape[1], dim=1) if k.shape[1] != heads else k


def offset_ratio(k: torch.Tensor) -> torch.Tensor:
    """R_k per (sequence, KV head): ‖mean key‖ / RMS_j ‖k_j − mean key‖ (fp32, shape (B, Hkv))."""
    kf = k.float()
    mean = kf.mean(dim=2, keepdim=True)
    spread = (kf - mean).pow(2).sum(-1).mean(-1).sqrt()
    return mean.squeeze(2).norm(dim=-1) / spread.clamp_min(TINY)


def _logits(call: AttentionCall) -> torch.Tensor:
    q = call.q.float()
    k = _expand_kv(call.k.float(), q.shape[1])
    scale = call.scale if call.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if call.is_causal:
        sq, sk = s.shape[-2:]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    if call.attn_mask is not None:
        m = call.attn_mask
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    return s


def layer_statistics(calls: List[AttentionCall]) -> Dict[str, List[float]]:
    """Per call (= per layer, in forward order): R_k (worst sequence/KV head), max |logit|, mean row max of P.
    One device-to-host transfer."""
    rows = []
    for call in calls:
        s = _logits(call)
        finite = torch.isfinite(s)
        max_abs = torch.where(finite, s.abs(), torch.zeros_like(s)).amax()
        p_max = torch.exp(s.amax(-1) - torch.logsumexp(s, dim=-1)).mean()
        rows.append(torch.stack([offset_ratio(call.k).amax(), max_abs, p_max]))
    if not rows:
        return {"r_k": [], "max_logit": [], "p_max": []}
    values = torch.stack(rows).cpu().tolist()
    return {"r_k": [r[0] for r in values], "max_logit": [r[1] for r in values], "p_max": [r[2] for r in values]}


def relative_error(g: torch.Tensor, ref: torch.Tensor) -> float:
    return ((g.double() - ref).norm() / ref.norm().clamp_min(TINY)).item()


def oracle_errors(calls: List[AttentionCall]) -> List[Dict[str, float]]:
    """Per call: relative error of the recorded dq, dk, dv against the fp64 oracle on the recorded inputs."""
    out = []
    for call in calls:
        missing = [n for n in GRAD_NAMES + ("do",) if n not in call.grads]
        if missing:
            raise RuntimeError(f"attention call without recorded {missing}: record with grads=True and run the "
                               "backward inside the recorder's lifetime")
        ref = reference_backward(call.q, call.k, call.v, call.grads["do"], attn_mask=call.attn_mask,
                                 scale=call.scale, causal=call.is_causal)
        out.append({n: relative_error(call.grads[n], r) for n, r in zip(GRAD_NAMES, ref)})
    return out


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """All parameter gradients, fp32, one flat vector (zeros for parameters without a gradient)."""
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().reshape(-1)
             for p in model.parameters() if p.requires_grad]
    return torch.cat(parts)


def gradient_gap(g: torch.Tensor, ref: torch.Tensor) -> Dict[str, float]:
    """cosine(g, ref), ‖g − ref‖/‖ref‖ and ‖g‖/‖ref‖ (one transfer)."""
    g64, r64 = g.double(), ref.double()
    rn = r64.norm().clamp_min(TINY)
    vals = torch.stack([torch.dot(g64, r64) / (g64.norm().clamp_min(TINY) * rn), (g64 - r64).norm() / rn,
                        g64.norm() / rn]).cpu().tolist()
    return {"cosine": vals[0], "rel_diff": vals[1], "norm_ratio": vals[2]}


def main(argv=None) -> int:
    """``python -m benchmarks.training.probe SAVED.pt``: the statistics of attention inputs saved with
    ``torch.save`` (a dict: ``calls``, a list of dicts of ``AttentionCall``'s fields without grads, and/or
    ``gaps``, a list of pairs (g, ref) of flat gradients), as JSON: per call R_k per (sequence, KV head) and
    ``layer_statistics`` over the calls; ``gradient_gap(g, ref)`` of each pair."""
    import argparse
    import json
    ap = argparse.ArgumentParser(description="statistics of saved attention inputs, as benchmarks.training logs them")
    ap.add_argument("saved", help="a torch.save'd dict with 'calls' and/or 'gaps'")
    args = ap.parse_args(argv)
    saved = torch.load(args.saved, weights_only=True)
    out = {}
    if "calls" in saved:
        calls = [AttentionCall(**c) for c in saved["calls"]]
        out["offset_ratio"] = [offset_ratio(c.k).tolist() for c in calls]
        out["layer_statistics"] = layer_statistics(calls)
    if "gaps" in saved:
        out["gradient_gap"] = [gradient_gap(g, ref) for g, ref in saved["gaps"]]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
