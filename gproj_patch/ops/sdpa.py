"""SDPA with its own fused forward and the corrected backward (eager path; ``sdpa_compiled.py`` under compile).

``sdpa(...)`` has ``F.scaled_dot_product_attention``'s semantics. When a gradient is needed and the inputs are
plain BF16/FP16 tensors, ``_SdpaFunction`` runs the *original* SDPA itself, on detached aliases of q, k, v that
require grad, so PyTorch picks and runs exactly the kernel it would have picked (``sdpa_kernel``, head-dim
padding, mask handling): the output is the unpatched output, bit for bit. The LSE is read from the fused node
that call created (``compat.fused_sdpa_lse``). That inner graph is dropped at once, except in ``auto``/``audit``,
where ``torch.autograd.grad`` on it *is* the original backward when the policy picks it.

The call's record (``record.py``) is made here, at the forward; the backward hands it to the router.

Everything that cannot be corrected exactly runs the original function untouched (reason counted): tensor
subclasses (DTensor, nested, FakeTensor, ...), dropout > 0 (a fused kernel's dropout mask cannot be replayed by
another backward), empty inputs, non-4-D inputs, broadcast batches, masks that require grad, a mask together
with ``is_causal``.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from .. import config as _config, policy, telemetry
from ..backends.compat import fused_sdpa_lse
from ..backends.spec import LOW_PRECISION, default_scale
from ..config import POLICY_MODES, Config
from ..record import CallRecord, Problem, make_context
from ..layer_context import backward_ran, traced_layer
from ..router import BackwardTensors, graph_backward, run_backward
from .masks import mask_as_flags, packed_call, padding_as_flags, padding_as_varlen, unpack_grads

C_SDPA = torch._C._nn.scaled_dot_product_attention
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Original:
    """The SDPA function the hook replaced (``integrations/sdpa.py`` sets it while installed)."""
    fn: Callable = C_SDPA


def original_sdpa() -> Callable:
    return _Original.fn


def set_original(fn: Optional[Callable]) -> None:
    _Original.fn = C_SDPA if fn is None else fn


_detach_pack = torch.Tensor.detach  # the saved-tensor pack hook (a C method: no Python frame per saved tensor)


def _identity_unpack(t: Tensor) -> Tensor:
    return t


def run_original_with_lse(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    """(inner output with its graph, lse or None, (qi, ki, vi)): the original SDPA on aliases that require grad.

    Saved-tensor hooks: under activation checkpointing the inner node's saved tensors would be packed by the
    checkpoint, and reading its LSE would re-run the checkpointed block; these hooks keep them. The pack hook
    stores a *detached* alias: storing the tensor itself would put an output inside its own grad_fn, a reference
    cycle through C++ that Python's collector cannot see (every call's tensors would leak)."""
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_detach_pack, _identity_unpack):
        qi, ki, vi = q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_()
        inner = _Original.fn(qi, ki, vi, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                             enable_gqa=enable_gqa)
    return inner, fused_sdpa_lse(inner.grad_fn), (qi, ki, vi)


def problem_for(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool, scale: Optional[float]) -> Problem:
    """The call's problem: a mask that is exactly a causal / window pattern becomes flags (at the forward)."""
    mask, causal, align, window = mask_as_flags(attn_mask, q.shape[2], k.shape[2])
    if is_causal:
        causal, align = True, "top_left"
    scale = default_scale(q.shape[-1], scale)
    if mask is None and type(scale) is float:  # (a symbolic scale under tracing is built, not interned)
        return _flags_problem(scale, causal, align, window)
    return Problem(scale=scale, causal=causal, causal_align=align, window=window, attn_mask=mask,
                   padded=mask is not None)


@functools.lru_cache(maxsize=256)
def _flags_problem(scale: float, causal: bool, align: str, window: Tuple[int, int]) -> Problem:
    """The Problem of a call without a mask tensor, one frozen instance per (scale, flags): pure (immutable
    key, immutable value, no tensor), so calls share it instead of building 14 fields each time."""
    return Problem(scale=scale, causal=causal, causal_align=align, window=window)


def backward_tensors(record: CallRecord, do, q, k, v, out, lse):
    """(tensors, problem) for the router: a recorded mask that is right padding around causal flags, with zero
    dO on the padded rows, goes to the kernel as flags plus dead rows (exact)."""
    problem, dead = record.problem, None
    if problem.padded:
        padded = padding_as_flags(problem.attn_mask, do, q.shape[2], k.shape[2])
        if padded is not None:
            window, dead = padded
            problem = Problem(scale=problem.scale, causal=True, causal_align="top_left", window=window)
            record = CallRecord(problem, record.context)
    return BackwardTensors(do, q, k, v, out, lse, dead_rows=dead), record


class _SdpaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, record: CallRecord, is_causal: bool, scale, enable_gqa: bool):
        inner, lse, aliases = run_original_with_lse(q, k, v, attn_mask, is_causal, scale, enable_gqa)
        ctx.record = record
        ctx.inner = (inner, aliases) if record.context.mode in POLICY_MODES else None
        out = inner.detach()
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, do):
        # once_differentiable: its no_grad and double-backward guard act only when the backward runs with grad
        # mode on (create_graph=True); in the usual backward grad mode is off and its wrapper would change nothing
        if torch.is_grad_enabled():
            return _backward_once(ctx, do)
        return _backward(ctx, do)


def _backward(ctx, do):
    q, k, v, out, lse = ctx.saved_tensors
    original = graph_backward(ctx.inner, do)
    tensors, record = backward_tensors(ctx.record, do, q, k, v, out, lse)
    pad = None
    if record.problem.padded:  # not right padding: maybe left padding, as varlen segments (exact)
        pad = padding_as_varlen(record.problem.attn_mask, do, q.shape[2], k.shape[2], empty_rows_inert=True)
    if pad is None:
        grads = run_backward(record, tensors, original)
    else:
        tensors, packed = packed_call(pad, record.problem, do=do, q=q, k=k, v=v, out=out, lse=lse)
        packed_original = None if original is None else (lambda: tuple(pad.pack(g) for g in original()))
        grads = unpack_grads(pad, run_backward(CallRecord(packed, record.context), tensors, packed_original))
    ctx.inner = None
    return grads[0], grads[1], grads[2], None, None, None, None, None


_backward_once = torch.autograd.function.once_differentiable(_backward)


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
    if dropout_p < 0.0:
        return "dropout_p < 0 (the original decides: its own error, at the call)"
    if q.is_cuda and torch.are_deterministic_algorithms_enabled():
        return ("torch.use_deterministic_algorithms is on: the original runs its own determinism check (PyTorch's "
                "fused backwards warn or raise there)")
    if attn_mask is not None and is_causal:
        return "attn_mask together with is_causal (the original decides what that means)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "inputs are not 4-D (B, H, S, D)"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return "broadcast batch dimensions"
    if k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]:
        return "k and v disagree in (B, H, S) or q and k in head dim (the original decides)"
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        return "q, k, v differ in dtype or device (the original decides)"
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
    orig = _Original.fn
    mode = cfg.mode
    if query.dtype == torch.float32 and mode != "off" and torch.is_grad_enabled() and type(query) in _PLAIN:
        low = _autocast_dtype(query.device.type)
        if low is not None:  # autocast would run SDPA in low precision (and leak): cast as autocast does
            query, key, value = (t.to(low) for t in (query, key, value))
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
        from .sdpa_compiled import compiled_sdpa
        return compiled_sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa, cfg=cfg,
                             layer=traced_layer() or layer)  # the traced module's name: a graph constant
    if k_heads_mismatch(query, key, enable_gqa):
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)  # the original raises its own error
    context = make_context(source, layer, cfg)
    if policy.keeps_original(context):
        return _original_counted(orig, context, query, key, value, attn_mask, is_causal, scale, enable_gqa)
    telemetry.record_forward("patched")
    record = CallRecord(problem_for(query, key, attn_mask, is_causal, scale), context)
    return _SdpaFunction.apply(query, key, value, attn_mask, record, bool(is_causal), scale, bool(enable_gqa))


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
