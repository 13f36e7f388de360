"""Hook: replace ``torch.nn.functional.scaled_dot_product_attention`` by a Python wrapper.

Why this level. ``F.scaled_dot_product_attention`` is a C builtin looked up as a module attribute by callers that
write ``F.scaled_dot_product_attention(...)`` at call time (HF's "sdpa" attention, ``nn.MultiheadAttention``
through ``F.multi_head_attention_forward``). A Python wrapper can run the original forward itself (so PyTorch
picks the same fused kernel and the output is the same, bit for bit) and still reach the original backward when
the policy wants it. Dispatcher-level overrides of the ``aten::_scaled_dot_product_*_backward`` CUDA kernels
would reach every caller but make the original backward unreachable while registered (calling it re-enters the
override) and would not cover the CPU path.

Transparency. The wrapper dispatches ``__torch_function__`` first, exactly as the builtin does: tensor
subclasses (``torch.nn.attention.bias.CausalBias``, user subclasses) and ``TorchFunctionMode``s see the call with
``func is torch.nn.functional.scaled_dot_product_attention`` (the wrapper, while installed) and the arguments as
given, and take over as they would without the patch. A mode that forwards the call re-enters the wrapper with
the mode off and gets the corrected backward. Subclasses without ``__torch_function__`` (DTensor, FakeTensor)
take the original path (``ops/sdpa.unsupported_reason``).

Limitation. Code that bound the function before ``enable()`` (``from torch.nn.functional import
scaled_dot_product_attention`` at import time, or ``torch._C._nn.scaled_dot_product_attention``) keeps the
original, uncorrected backward. Call ``gproj_patch.attention`` there instead (same signature).
"""
from __future__ import annotations

import functools
import logging
import threading

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from .. import telemetry
from ..ops import sdpa as sdpa_op

logger = logging.getLogger("gproj_patch")

_saved = None  # the object F.scaled_dot_product_attention held before install()


_DEFAULT_TORCH_FUNCTION = torch.Tensor.__torch_function__.__func__


def _own_torch_function(cls) -> bool:
    """True for a tensor subclass with its own ``__torch_function__`` (it may take SDPA over, as CausalBias)."""
    fn = getattr(cls, "__torch_function__", None)
    return fn is not None and getattr(fn, "__func__", fn) not in (_DEFAULT_TORCH_FUNCTION,
                                                                  torch._C._disabled_torch_function_impl)


_reentry = threading.local()  # calls of the wrapper made while a __torch_function__ override runs


_TENSOR_ARGS = ("query", "key", "value", "attn_mask")


@functools.wraps(sdpa_op.C_SDPA)
def scaled_dot_product_attention(*args, **kwargs):
    """``F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
    scale=None, enable_gqa=False)`` with the corrected backward (arguments passed on exactly as given)."""
    relevant = tuple(a for a in args[:4] if a is not None) + \
        tuple(kwargs[n] for n in _TENSOR_ARGS if kwargs.get(n) is not None)
    if has_torch_function(relevant):
        return _dispatch_override(relevant, args, kwargs)
    _reentry.count = getattr(_reentry, "count", 0) + 1
    return sdpa_op.sdpa(*args, **kwargs)


def _dispatch_override(relevant, args, kwargs):
    """Let the subclass or mode handle the call, as the builtin does. A subclass that computes attention without
    calling SDPA back (CausalBias lower-right on an efficient kernel) is counted as passed through."""
    before = getattr(_reentry, "count", 0)
    out = handle_torch_function(scaled_dot_product_attention, relevant, *args, **kwargs)
    subclasses = [type(t).__name__ for t in relevant if _own_torch_function(type(t))]
    if subclasses and getattr(_reentry, "count", 0) == before and torch.is_grad_enabled():
        telemetry.record_forward("original", f"sdpa: __torch_function__ of {', '.join(dict.fromkeys(subclasses))} "
                                 "computed attention without SDPA: passed through", telemetry.shape_class("sdpa"))
    return out


scaled_dot_product_attention.__gproj_patched__ = True


def is_installed() -> bool:
    return _saved is not None


def install() -> str:
    global _saved
    if _saved is not None:
        return "installed"
    current = F.scaled_dot_product_attention
    _saved = current
    sdpa_op.set_original(None if getattr(current, "__gproj_patched__", False) else current)
    F.scaled_dot_product_attention = scaled_dot_product_attention
    return "installed"


def uninstall() -> None:
    global _saved
    if _saved is None:
        return
    if F.scaled_dot_product_attention is scaled_dot_product_attention:
        F.scaled_dot_product_attention = _saved
    else:
        logger.warning("torch.nn.functional.scaled_dot_product_attention was replaced after enable() by %r; "
                       "left as it is", F.scaled_dot_product_attention)
    sdpa_op.set_original(None)
    _saved = None
