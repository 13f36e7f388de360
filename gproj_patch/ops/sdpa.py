"""SDPA with its own fused forward and the corrected backward (eager path; ``sdpa_compiled.py`` under compile).

``sdpa(...)`` has ``F.scaled_dot_product_attention``'s semantics. When a gradient is needed and the inputs are
plain BF16/FP16 tensors, ``_SdpaFunction`` runs the *original* SDPA itself, on detached aliases of q, k, v that
require grad, so PyTorch picks and runs exactly the kernel it would have picked (``sdpa_kernel``, head-dim
padding, mask handling): the output is the unpatched output, bit for bit. The LSE is read from the fused node
that call created (``compat.fused_sdpa_lse``). That inner graph is dropped at once, except in ``auto``/``audit``,
where ``torch.autograd.grad`` on it *is* the original backward when the policy picks it.

The call's record (``record.py``) and its backward plan (``plan.py``) are made here, at the forward; the backward
hands them to the router, which carries the plan out.

Everything that cannot be corrected exactly runs the original function untouched (reason counted): tensor
subclasses (DTensor, nested, FakeTensor, ...), dropout > 0 (a fused kernel's dropout mask cannot be replayed by
another backward), empty inputs, non-4-D inputs, broadcast batches, masks that require grad, a mask together
with ``is_causal``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..runtime import config as _config, telemetry
from .. import policy
from ..backends.compat import saved_tensors_default_hooks_active
from ..backends.spec import LOW_PRECISION
from ..runtime.config import POLICY_MODES, Config
from ..layers.scope import backward_ran, traced_layer
from ..dispatch.autograd import once_differentiable, transform_reason
from ..dispatch.plan import ForwardTensors, make_plan
from ..dispatch.record import CallRecord, make_context
from ..dispatch.router import graph_backward, run_backward
from .masks import packed_call, padding_as_varlen, unpack_grads
from .sdpa_call import C_SDPA, backward_tensors, original_sdpa, problem_for, run_original_with_lse, set_original
from .sdpa_compiled import compiled_sdpa

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _SdpaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, record: CallRecord, call: Tuple[bool, Optional[float], bool]):
        # call: (is_causal, scale, enable_gqa) as the caller gave them, one argument (each argument of apply
        # costs host time: torch unwraps and checks it, and the backward returns a gradient slot for it)
        is_causal, scale, enable_gqa = call
        inner, lse, aliases = run_original_with_lse(q, k, v, attn_mask, is_causal, scale, enable_gqa)
        keep_original = record.context.mode in POLICY_MODES
        out = inner.detach()
        ctx.record = make_plan(record, ForwardTensors(q, k, v, out, lse), has_original=keep_original)
        ctx.inner = (inner, aliases) if keep_original and ctx.record.plan.tier == "original" else None
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, do):
        return _backward(ctx, do)


@once_differentiable
def _backward(ctx, do):
    q, k, v, out, lse = ctx.saved_tensors
    original = graph_backward(ctx.inner, do)
    tensors, record = backward_tensors(ctx.record, do, q, k, v, out, lse)
    pad = None
    if record.problem.padded:  # not right padding: maybe left padding, as varlen segments (exact)
        pad = padding_as_varlen(record.problem.attn_mask, do, q.shape[2], k.shape[2], empty_rows_inert=True)
    if pad is None:
        if record.problem.padded:  # the mask stayed a dense tensor: the plan made for that case
            record = CallRecord(record.problem, record.context, record.plan.dense)
        grads = run_backward(record, tensors, original)
    else:
        tensors, packed = packed_call(pad, record.problem, do=do, q=q, k=k, v=v, out=out, lse=lse)
        packed_original = None if original is None else (lambda: tuple(pad.pack(g) for g in original()))
        grads = unpack_grads(pad, run_backward(CallRecord(packed, record.context, record.plan), tensors,
                                               packed_original))
    ctx.inner = None
    return grads[0], grads[1], grads[2], None, None, None


def unsupported_reason(q, k, v, attn_mask, dropout_p=0.0, is_causal=False) -> Optional[str]:
    """Why this SDPA call keeps the original path (None: it gets the corrected backward). Checked in this order;
    plain ``or`` chains rather than generators (this runs on every hooked call)."""
    if not (type(q) in _PLAIN and type(k) in _PLAIN and type(v) in _PLAIN
            and (attn_mask is None or type(attn_mask) in _PLAIN)):
        subclass = [type(t).__name__ for t in (q, k, v, attn_mask) if t is not None and type(t) not in _PLAIN]
        return f"tensor subclass {', '.join(dict.fromkeys(subclass))} (dispatches SDPA itself)"
    if q.is_nested or k.is_nested or v.is_nested:
        return "nested tensors"
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return "empty input"
    if dropout_p > 0.0:
        return "dropout > 0 (the fused kernel's dropout mask cannot be replayed by another backward)"
    if not dropout_p >= 0.0:
        return "dropout_p < 0 or NaN (the original decides: its own error, at the call)"
    if q.is_cuda and torch.are_deterministic_algorithms_enabled():
        return ("torch.use_deterministic_algorithms is on: the original runs its own determinism check (PyTorch's "
                "fused backwards warn or raise there)")
    if attn_mask is not None and is_causal:
        return "attn_mask together with is_causal (the original decides what that means)"
    qs, ks, vs = q.shape, k.shape, v.shape  # read once: each ``.shape``/``.device`` builds a new object
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return "inputs are not 4-D (B, H, S, D)"
    if not (qs[0] == ks[0] == vs[0]):
        return "broadcast batch dimensions"
    if ks[:3] != vs[:3] or qs[3] != ks[3]:
        return "k and v disagree in (B, H, S) or q and k in head dim (the original decides)"
    device = q.device
    if not (q.dtype == k.dtype == v.dtype) or not (device == k.device == v.device):
        return "q, k, v differ in dtype or device (the original decides)"
    if device.type == "meta":
        return "meta tensors (no values to correct)"
    if attn_mask is not None and attn_mask.device != device:
        return "attn_mask on another device than q (the original decides)"
    if attn_mask is not None and attn_mask.requires_grad:
        return "attn_mask requires grad"
    return None


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The low-precision dtype autocast would run SDPA in on this device, or None."""
    try:
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            return dtype if dtype in LOW_PRECISION else None
    except (AttributeError, RuntimeError, TypeError):  # torch without per-device autocast queries
        pass
    return None


def _autocast_cast(t, low: torch.dtype, device_type: str):
    """``t`` as autocast casts an argument of a low-precision op: floating tensors on its device, except FP64
    (an FP64 or integer key stays as it is, and the original raises its own dtype error)."""
    eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
    return t.to(low) if eligible and t.device.type == device_type else t


def _needs_correction(query, key, value, mode: str) -> bool:
    return (mode != "off" and torch.is_grad_enabled() and query.dtype in LOW_PRECISION
            and (query.requires_grad or key.requires_grad or value.requires_grad))


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
         *, cfg: Optional[Config] = None, layer: Optional[str] = None, source: str = "sdpa"):
    """SDPA's semantics; the corrected backward when a gradient is needed and the inputs are BF16/FP16.

    ``cfg``: the options when the patch is not enabled (``gproj_patch.attention``); ``layer`` names the call for
    the policy when no ``layer_scope`` is open (else ``call{n}``); ``source`` labels its reasons and shape class
    (HF's ``"gproj"`` attention: ``"hf_gproj"``)."""
    cfg = _config.active() or cfg or Config()
    orig = original_sdpa()
    mode = cfg.mode
    if query.dtype == torch.float32 and mode != "off" and torch.is_grad_enabled() and type(query) in _PLAIN:
        low = _autocast_dtype(query.device.type)
        if low is not None:  # autocast would run SDPA in low precision (and leak): cast as autocast does
            query, key, value = (_autocast_cast(t, low, query.device.type) for t in (query, key, value))
    if not _needs_correction(query, key, value, mode):
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    reason = unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal)
    compiling = torch.compiler.is_compiling()
    if reason is not None:
        if not compiling:
            telemetry.record_forward("original", f"{source}: {reason}", telemetry.shape_class(source, query, key))
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    if compiling:
        return compiled_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa, cfg=cfg,
                             layer=traced_layer() or layer)  # the traced module's name: a graph constant
    if k_heads_mismatch(query, key, enable_gqa):
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)  # the original raises its own error
    reason = transform_reason(query, key, value, attn_mask)
    if reason is not None:  # torch.func / forward AD: the original, which takes them (or raises) as unpatched
        telemetry.record_forward("original", f"{source}: {reason}", telemetry.shape_class(source, query, key))
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    context = make_context(source, layer, cfg)
    # not under saved-tensor hooks: a non-reentrant checkpoint recomputes this forward during the backward and
    # needs the same saved tensors, but sampling at the forward can flip keeps_original before the recompute
    if policy.keeps_original(context) and not saved_tensors_default_hooks_active():
        return _original_counted(orig, context, query, key, value, attn_mask, is_causal, scale, enable_gqa)
    telemetry.record_forward("patched")
    record = CallRecord(problem_for(query, key, attn_mask, is_causal, scale), context)
    return _SdpaFunction.apply(query, key, value, attn_mask, record, (bool(is_causal), scale, bool(enable_gqa)))


def _original_counted(orig, context, query, key, value, attn_mask, is_causal, scale, enable_gqa):
    """The original SDPA for a call whose backward the policy keeps original (decided at the forward); its
    backward is counted when the fused node runs."""
    telemetry.record_forward("patched")
    out = orig(query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
               enable_gqa=enable_gqa)

    def counted(_grad_inputs, _grad_outputs):
        backward_ran()
        telemetry.record_backward("original")  # no reason: the shape class is only a log key
        policy.count_original(context)
    if out.grad_fn is not None:
        out.grad_fn.register_hook(counted)
    return out


def k_heads_mismatch(query, key, enable_gqa) -> bool:
    """True for a call the original SDPA rejects (different head counts without ``enable_gqa``)."""
    return key.shape[1] != query.shape[1] and not enable_gqa
