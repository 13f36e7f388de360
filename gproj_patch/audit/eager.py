"""The audit's HF-eager backends: HF's eager attention arithmetic (a BF16/FP16 QKᵀ, the softmax in fp32 cast back
to the input dtype, a BF16/FP16 PV; autograd differentiates those ops), as every ``modeling_*.eager_attention_forward``
computes it, uncorrected and through the eager hook's corrected backward (``hooks/hf_eager.py``)."""
from __future__ import annotations

from typing import Optional

import torch

from ..backends.spec import MaskSpec, default_scale
from .cases import CaseInputs


def case_visibility(inp: CaseInputs) -> Optional[torch.Tensor]:
    """The case's causal/window pattern as a boolean (Sq, Sk) mask, True where a key is visible (None: dense).
    Shared by HF's eager mask here and the plugin backends' SDPA ``attn_mask``."""
    m = inp.mask
    spec = MaskSpec(causal=bool(m.get("causal", False)), causal_align=m.get("causal_align", "top_left"),
                    window=tuple(m.get("window", (-1, -1))))
    if spec.is_dense:
        return None
    sq, sk = inp.q.shape[2], inp.k.shape[2]
    i = torch.arange(sq, device=inp.q.device)[:, None]
    j = torch.arange(sk, device=inp.q.device)[None, :]
    return spec.visible(i, j, sq, sk)


def _additive_mask(inp: CaseInputs) -> Optional[torch.Tensor]:
    """HF's eager mask for the case's pattern: 0 where a key is visible, the dtype's minimum elsewhere."""
    visible = case_visibility(inp)
    if visible is None:
        return None
    sq, sk = visible.shape
    return torch.zeros(sq, sk, dtype=inp.q.dtype, device=inp.q.device).masked_fill(
        ~visible, torch.finfo(inp.q.dtype).min)


def eager_reason(inp: CaseInputs) -> Optional[str]:
    m = inp.mask
    if m.get("cu_seqlens_q") is not None:
        return "HF eager attention takes no varlen offsets"
    mask = _additive_mask(inp)
    if mask is not None and bool((mask.amin(-1) < 0).logical_and(mask.amax(-1) < 0).any()):
        return "a row sees no key (HF eager gives such rows uniform weights, the oracle zero)"
    return None


def hf_eager_math(q, k, v, sink, *, scale, mask, softcap):
    """HF's eager attention (``eager_attention_forward``): returns ((B, Sq, Hq, D), weights)."""
    del sink
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap:
        w = torch.tanh(w / softcap) * softcap
    if mask is not None:
        w = w + mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v).transpose(1, 2).contiguous(), w


def eager_run(corrected: bool):
    def run(inp: CaseInputs, k: torch.Tensor, saved):
        from ..runtime.config import Config
        from ..hooks import hf_eager as op
        q, kk, v = (x.detach().clone().requires_grad_(True) for x in (inp.q, k, inp.v))
        scale = default_scale(q.shape[-1], inp.mask.get("scale"))
        mask, softcap = _additive_mask(inp), float(inp.mask.get("softcap", 0.0))
        kwargs = dict(scale=scale, mask=mask, softcap=softcap)
        if corrected:
            from ..runtime import config
            call = op.EagerCall(fn=lambda a, b, c, s: hf_eager_math(a, b, c, s, **kwargs), scale=scale, mask=mask,
                                softcap=softcap, source="audit:hf_eager")
            previous = config.active()
            config.set_active(previous or Config(mode="gproj"))
            try:
                out = op.run_eager(call, q, kk, v)[0]
            finally:
                config.set_active(previous)
        else:
            out = hf_eager_math(q, kk, v, None, **kwargs)[0]
        out.backward(inp.do.transpose(1, 2))
        return q.grad, kk.grad, v.grad
    return run
