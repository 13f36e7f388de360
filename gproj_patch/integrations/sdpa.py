"""Hook: replace ``torch.nn.functional.scaled_dot_product_attention`` by a Python wrapper.

Why this level. ``F.scaled_dot_product_attention`` is a C builtin looked up as a module attribute by callers that
write ``F.scaled_dot_product_attention(...)`` or ``torch.nn.functional.scaled_dot_product_attention(...)`` at call
time (HF's "sdpa" attention, ``nn.MultiheadAttention`` through ``F.multi_head_attention_forward``). A Python
wrapper can run the original forward itself (so PyTorch picks the same fused kernel and the output is the same,
bit for bit) and still reach the original backward when the policy wants it. Dispatcher-level overrides of the
``aten::_scaled_dot_product_*_backward`` CUDA kernels would reach every caller but make the original backward
unreachable while registered (calling it re-enters the override) and would not cover the CPU path.

Limitation. Code that bound the function before ``enable()`` (``from torch.nn.functional import
scaled_dot_product_attention`` at import time, or ``torch._C._nn.scaled_dot_product_attention``) keeps the
original, uncorrected backward. Call ``gproj_patch.attention`` there instead (same signature).
"""
from __future__ import annotations

import functools
import logging

import torch.nn.functional as F

from .. import autograd

logger = logging.getLogger("gproj_patch")

_saved = None  # the object F.scaled_dot_product_attention held before install()


@functools.wraps(autograd._C_SDPA)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    return autograd.sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)


scaled_dot_product_attention.__gproj_patched__ = True


def is_installed() -> bool:
    return _saved is not None


def install() -> str:
    global _saved
    if _saved is not None:
        return "installed"
    current = F.scaled_dot_product_attention
    _saved = current
    autograd.ORIGINAL[0] = autograd._C_SDPA if getattr(current, "__gproj_patched__", False) else current
    F.scaled_dot_product_attention = scaled_dot_product_attention
    return "installed"


def uninstall() -> None:
    global _saved
    if _saved is None:
        return
    if F.scaled_dot_product_attention is scaled_dot_product_attention:
        F.scaled_dot_product_attention = _saved
    else:
        logger.warning("gproj_patch: torch.nn.functional.scaled_dot_product_attention was replaced after enable() "
                       "by %r; left as it is", F.scaled_dot_product_attention)
    autograd.ORIGINAL[0] = autograd._C_SDPA
    _saved = None
