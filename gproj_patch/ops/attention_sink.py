"""Attention with a learnable sink (a per-head logit in every row's softmax denominator with no value row), as
HF's ``"gproj"`` attention runs it for models that pass ``s_aux`` (gpt-oss).

Forward: ``sink_attention_forward`` performs the operations of gpt-oss's eager attention in their order —
``QKᵀ·scaling`` in the input dtype (keys repeated per query-head group when heads differ), the mask added as
HF's eager mask (0 / the dtype's minimum), the sink logit concatenated as a last column, each row's maximum
subtracted, softmax in that dtype, the sink column dropped, the weights cast to V's dtype, ``P·V`` — so its
output is HF's own sink forward bit for bit (``tests/test_hf_sinks_softcap.py``). A row whose keys are all
masked puts all its weight on the sink (output 0), which is what the backends' sink convention says
(``backends/spec.py``), so the boolean mask (or the causal flag) is the problem's mask as given.

Backward: ``ops/hf_eager.run_eager`` with the sink — the router with ``Problem.sink``, the sink's gradient
returned to ``s_aux`` (a Parameter). Dropout > 0 keeps this forward under plain autograd (uncorrected, reason
counted), as the other paths pass dropout through; so does a call traced by ``torch.compile`` (not counted: no
side effects inside a traced graph).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..runtime import telemetry
from . import hf_eager

SOURCE = "hf_gproj_sink"
DROPOUT_REASON = f"{SOURCE}: dropout > 0 (uncorrected autograd of the sink forward)"


def causal_pattern(sq: int, sk: int, device) -> Tensor:
    """(1, 1, Sq, Sk) bool, top-left causal (SDPA's ``is_causal``)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return (j <= i)[None, None]


def additive_mask(pattern: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """HF's eager mask of a boolean pattern: 0 where visible, the dtype's minimum elsewhere."""
    if pattern is None:
        return None
    return torch.where(pattern, torch.zeros((), dtype=dtype, device=pattern.device), torch.finfo(dtype).min)


def _repeat_heads(x: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def sink_attention_forward(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], *, scaling: float,
                           sink: Tensor, dropout: float = 0.0, training: bool = False) -> Tuple[Tensor, Tensor]:
    """(attn_output (B, Sq, Hq, D), weights (B, Hq, Sq, Sk)); ``mask`` additive (HF's eager mask) or None."""
    groups = query.shape[1] // key.shape[1]
    keys, values = _repeat_heads(key, groups), _repeat_heads(value, groups)
    logits = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if mask is not None:
        logits = logits + mask
    column = sink.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
    combined = torch.cat([logits, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    weights = torch.nn.functional.dropout(probs, p=dropout, training=training).to(values.dtype)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights


def sink_attention(query: Tensor, key: Tensor, value: Tensor, pattern: Optional[Tensor], *, scaling: float,
                   sink: Tensor, causal: bool = False, dropout: float = 0.0, layer: Optional[str] = None):
    """Sink attention with HF's eager sink forward and the corrected backward. ``pattern``: a boolean mask
    (True = attend), or None with ``causal`` for a top-left causal pattern. Returns (attn_output (B, Sq, Hq, D),
    weights)."""
    if causal and pattern is None:
        mask = additive_mask(causal_pattern(query.shape[2], key.shape[2], query.device), query.dtype)
    else:
        mask = pattern if pattern is None or pattern.dtype != torch.bool else additive_mask(pattern, query.dtype)
    if torch.compiler.is_compiling() or not hf_eager.needs_correction(query, key, value, sink):
        return sink_attention_forward(query, key, value, mask, scaling=scaling, sink=sink, dropout=dropout,
                                      training=dropout > 0)
    reason = hf_eager.mask_unsupported_reason(pattern, query.shape[2], key.shape[2])
    if dropout > 0:
        reason = DROPOUT_REASON
    if reason is not None:
        telemetry.record_forward("original", reason if reason == DROPOUT_REASON else f"{SOURCE}: {reason}",
                                 telemetry.shape_class(SOURCE, query, key))
        return sink_attention_forward(query, key, value, mask, scaling=scaling, sink=sink, dropout=dropout,
                                      training=dropout > 0)

    def forward(q, k, v, s):
        return sink_attention_forward(q, k, v, mask, scaling=scaling, sink=s)
    call = hf_eager.EagerCall(fn=forward, scale=float(scaling), mask=pattern, causal=causal and pattern is None,
                              sink=sink, sink_is_argument=True, layer=layer, source=SOURCE)
    return hf_eager.run_eager(call, query, key, value)
