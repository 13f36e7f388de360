"""FlexAttention with its own forward and the corrected backward (eager calls; ``flex_compiled.py`` under compile).

``flex(...)`` has ``torch.nn.attention.flex_attention.flex_attention``'s signature. When a gradient is needed,
the inputs are plain BF16/FP16 tensors and the call's math is one the backends compute exactly, ``_FlexFunction``
runs the *original* flex forward itself (the same function with the same arguments, asking it for the LSE)
and routes the backward (``router.run_backward``). Exact means:

* ``score_mod``: none (or flex's identity), or a softcap: ``softcap_score_mod(c)`` (this module), HF's
  ``flex_attention_forward`` closure with only ``softcap`` set (read from its cells), or a softcap the caller
  declares (``declared_softcap``: the HF hook, which builds the closure itself);
* ``block_mask``: none, or one ``flex_masks.analyse`` proves to be causal / sliding-window flags, documents
  (varlen), or a dense mask small enough for the FP32 tier.

Anything else runs the original function untouched, reason counted (``telemetry.record_forward``): other
score_mods, masks with no exact form, the LSE or max scores asked as outputs (their gradients are not the
attention backward's), tensor subclasses, nested tensors. PyTorch's flex has no CPU backward; through this hook a
CPU call gets the FP32 tier (the original backward is unreachable there: ``original`` is None).

Forward bits. On CUDA the original runs with grad on detached aliases (the same graph and kernel as the
unpatched call; its saved tensors kept by the same detaching hooks as ``dispatch/autograd.inner_saved_tensors_hooks``, so an
enclosing activation checkpoint never packs them); the inner graph is dropped at once except in
``auto``/``audit``, where its backward *is* the original. On CPU (no flex backward) it runs without grad.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..runtime import telemetry
from ..backends.spec import LOW_PRECISION
from ..runtime.config import POLICY_MODES, Config
from ..dispatch.autograd import once_differentiable, transform_reason
from ..dispatch.plan import ForwardTensors, make_plan
from ..dispatch.record import CallRecord, make_context
from ..dispatch.router import graph_backward
from .flex_masks import NO_MASK
from .flex_call import (FLEX_ATTENTION, NO_FLEX_BACKWARD, OWN_FORWARD, SLICED_MASK_MOD, SOURCE, Caller, FlexCall,
                        mask_verdict,
                        original_flex, problem_for, routed_backward, score_mod_softcap, set_original,
                        softcap_score_mod, unsupported_reason)
from .flex_compiled import compiled_flex
from ..dispatch.autograd import inner_saved_tensors_hooks

DEFAULT_CONFIG = Config()  # made once: a compiled region cannot construct it


def run_forward(call: FlexCall, q, k, v, keep_graph: bool):
    """(output, LSE or None, (inner output, aliases) or None) of the original forward (module docstring). The LSE
    is asked for unless ``call.forward_lse`` is False (the kernel needs it; on CPU the Triton interpreter can run
    the kernel too; without it the router takes the FP32 tier)."""
    from torch.nn.attention.flex_attention import AuxRequest
    with_grad = q.device.type not in NO_FLEX_BACKWARD  # where flex has a backward: the unpatched graph
    kwargs = dict(score_mod=call.score_mod, block_mask=call.block_mask, scale=call.scale,
                  enable_gqa=call.enable_gqa, kernel_options=call.kernel_options)
    if call.forward_lse:
        kwargs["return_aux"] = AuxRequest(lse=True)
    grad_mode = torch.enable_grad() if with_grad else torch.no_grad()
    outer, OWN_FORWARD.active = OWN_FORWARD.active, True
    try:
        with grad_mode, inner_saved_tensors_hooks():
            aliases = tuple(t.detach().requires_grad_(with_grad) for t in (q, k, v))
            result = call.forward_fn(*aliases, **kwargs)
    finally:
        OWN_FORWARD.active = outer
    inner, lse = (result[0], result[1].lse.detach()) if call.forward_lse else (result, None)
    kept = (inner, aliases) if keep_graph and with_grad else None
    return inner.detach(), lse, kept


class _FlexFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: FlexCall, record: CallRecord):
        out, lse, kept = run_forward(call, q, k, v, keep_graph=record.context.mode in POLICY_MODES)
        ctx.record = make_plan(record, ForwardTensors(q, k, v, out, lse), has_original=kept is not None)
        ctx.inner = kept if ctx.record.plan.tier == "original" else None
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        original = graph_backward(ctx.inner, do)
        grads = routed_backward(ctx.record, do, q, k, v, out, lse, original)
        ctx.inner = None
        return grads[0], grads[1], grads[2], None, None


def needs_correction(q, k, v, mode: str) -> bool:
    return (mode != "off" and torch.is_grad_enabled() and getattr(q, "dtype", None) in LOW_PRECISION
            and (q.requires_grad or k.requires_grad or v.requires_grad))


def flex(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
         kernel_options=None, *, return_aux=None, caller: Caller = FLEX_ATTENTION, cfg: Optional[Config] = None):
    """``flex_attention``'s semantics; the corrected backward where it is exact (module docstring). ``caller``:
    see ``Caller``; ``cfg``: the options when the patch is not enabled (the audit)."""
    from ..runtime import config
    cfg = config.active() or cfg or DEFAULT_CONFIG
    fwd = caller.forward_fn or original_flex()

    def passthrough():
        return fwd(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                   return_lse=return_lse, kernel_options=kernel_options, return_aux=return_aux)
    if not needs_correction(query, key, value, cfg.mode):
        return passthrough()
    if torch.compiler.is_compiling():
        call = FlexCall(score_mod, block_mask, scale, bool(enable_gqa), kernel_options, fwd, caller.forward_lse)
        return compiled_flex(query, key, value, call, return_lse, return_aux, caller=caller, cfg=cfg,
                             passthrough=passthrough)
    reason = unsupported_reason(query, key, value, block_mask, enable_gqa, return_lse, return_aux)
    if reason is None:
        reason = transform_reason(query, key, value)
        reason = None if reason is None else f"flex: {reason}"
    softcap = 0.0
    if reason is None:
        softcap, reason = score_mod_softcap(score_mod, caller.declared_softcap)
    verdict = NO_MASK
    if reason is None:
        verdict = mask_verdict(block_mask, query, key)
        reason = None if verdict.reason is None else f"flex: {verdict.reason}"
    if reason is not None:
        telemetry.record_forward("original", reason, telemetry.shape_class(SOURCE, query, key))
        return passthrough()
    telemetry.record_forward("patched")
    record = CallRecord(problem_for(verdict, softcap, scale, query.shape[-1]),
                        make_context(SOURCE, caller.layer, cfg))
    call = FlexCall(score_mod, block_mask, scale, bool(enable_gqa), kernel_options, fwd, caller.forward_lse)
    return _FlexFunction.apply(query, key, value, call, record)
