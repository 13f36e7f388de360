"""SDPA with the corrected backward whether or not the patch is enabled: ``gproj_patch.attention`` and HF's
``"gproj"`` attention.

With the SDPA seam installed (``enable()`` with the ``sdpa`` target): the call *is*
``F.scaled_dot_product_attention``; the seam (``integrations/sdpa.py``) corrects its backward. Otherwise:
``_Attention`` runs SDPA on detached aliases that require grad (PyTorch picks and runs
its own fused kernel: the same output bits) and, in its backward, gives the fused node's own backward call — the
op and the arguments autograd would pass it (``compat.fused_node_backward``) — to the seam's ``corrected``: the
same decision, made in one place. PyTorch's backward ("original") is that op run below autograd. The gradients
reach the caller's tensors through whatever SDPA did before its fused op (autocast's cast, a head-dim pad): the
node's saved inputs keep their graph back to the aliases.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..backends import compat
from ..backends.spec import LOW_PRECISION
from ..dispatch.autograd import once_differentiable, transform_reason
from ..layers.scope import layer_scope
from ..runtime import config as _config
from ..runtime import telemetry
from ..dispatch.autograd import inner_saved_tensors_hooks

MATH_BACKEND = "SDPA chose no fused op (math backend): its backward is PyTorch's composite"


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, call):
        dropout_p, is_causal, scale, enable_gqa, cfg, source = call
        with torch.enable_grad(), inner_saved_tensors_hooks():
            aliases = tuple(t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
            inner = F.scaled_dot_product_attention(*aliases, attn_mask=attn_mask, dropout_p=dropout_p,
                                                   is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        ctx.inner = (inner, aliases, compat.fused_sdpa_node(inner.grad_fn))
        ctx.cfg, ctx.source = cfg, source
        return inner.detach()

    @staticmethod
    def backward(ctx, do):
        return _backward(ctx, do)


@once_differentiable
def _backward(ctx, do):
    inner, aliases, node = ctx.inner
    ctx.inner = None  # nothing of the call outlives its backward
    wanted = tuple(a for a in aliases if a.requires_grad)
    if node is None:
        telemetry.record_pass_through(f"{ctx.source}: {MATH_BACKEND}", telemetry.shape_class(ctx.source))
        grads = iter(torch.autograd.grad(inner, wanted, do))
        return tuple(next(grads) if a.requires_grad else None for a in aliases) + (None, None)
    from ..integrations.sdpa import corrected, spec_of, bind
    op, args = compat.fused_node_backward(node, do, grad_input_mask=(True, True, True, False))
    spec = spec_of(op)

    def original():
        with compat.below_autograd():
            return op(*args)
    grads = corrected(spec, bind(op, args, {}), original, ctx.cfg, node, source=ctx.source)
    saved = (node._saved_query, node._saved_key, node._saved_value)
    # from the fused op's inputs back to the caller's (casts, head-dim padding SDPA made in between)
    pairs = [(s, g) for s, g, a in zip(saved, grads[:3], aliases) if a.requires_grad]
    back = iter(torch.autograd.grad([s for s, _ in pairs], wanted, [g for _, g in pairs]))
    return tuple(next(back) if a.requires_grad else None for a in aliases) + (None, None)


def _needs_correction(query, key, value, mode: str) -> bool:
    return (mode != "off" and torch.is_grad_enabled()
            and (query.requires_grad or key.requires_grad or value.requires_grad))


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
         *, cfg: Optional[_config.Config] = None, layer: Optional[str] = None, source: str = "sdpa"):
    """SDPA's semantics with the corrected backward, enabled or not. ``cfg``: the options when the patch is not
    enabled (else the environment's); ``layer`` names the call for the ``auto`` policy when no ``layer_scope`` is
    open; ``source`` labels its reasons (HF's ``"gproj"`` attention: ``"hf_gproj"``)."""
    if layer is None or torch.compiler.is_compiling():  # traced: no per-call scope (backward-order names)
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, cfg, source)
    with layer_scope(layer):
        return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, cfg, source)


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, cfg, source):
    from ..integrations.sdpa import is_installed
    args = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    cfg = _config.active() or cfg or _config.Config()
    if is_installed() or not _needs_correction(query, key, value, cfg.mode):
        return F.scaled_dot_product_attention(query, key, value, **args)  # the seam (when installed) corrects it
    plain = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (query, key, value, attn_mask)
                if t is not None)
    reason = None if plain else "a tensor subclass (it dispatches SDPA itself)"
    reason = reason or transform_reason(query, key, value, attn_mask)
    if reason is not None or not (query.dtype in LOW_PRECISION or torch.is_autocast_enabled(query.device.type)):
        if reason is not None:
            telemetry.record_forward("original", f"{source}: {reason}", telemetry.shape_class(source, query, key))
        return F.scaled_dot_product_attention(query, key, value, **args)
    telemetry.record_forward("patched")
    return _Attention.apply(query, key, value, attn_mask,
                            (dropout_p, bool(is_causal), scale, bool(enable_gqa), cfg, source))
