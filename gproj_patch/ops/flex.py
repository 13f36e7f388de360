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
unpatched call; its saved tensors kept by the same detaching hooks as ``sdpa.run_original_with_lse``, so an
enclosing activation checkpoint never packs them); the inner graph is dropped at once except in
``auto``/``audit``, where its backward *is* the original. On CPU (no flex backward) it runs without grad.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import telemetry
from ..backends.spec import LOW_PRECISION, default_scale
from ..config import POLICY_MODES, Config
from ..record import CallRecord, Problem, make_context
from ..router import BackwardTensors, graph_backward, run_backward
from .flex_masks import NO_MASK, BlockStructure, MaskVerdict, analyse
from .sdpa import _detach_pack, _identity_unpack

SOURCE = "flex"
SLICED_MASK_MOD = "_sliced_mask_mod_error"  # the stub flex puts in a sliced BlockMask
NO_FLEX_BACKWARD = ("cpu", "mps")  # devices where PyTorch's flex raises when inputs require grad
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_HF_SCORE_MOD_NAME = "score_mod"
DEFAULT_CONFIG = Config()  # made once: a compiled region cannot construct it


class _Original:
    """The flex_attention function the hook replaced (``integrations/flex.py`` sets it while installed)."""
    fn: Optional[Callable] = None


def original_flex() -> Callable:
    if _Original.fn is None:
        from torch.nn.attention.flex_attention import flex_attention
        _Original.fn = flex_attention
    return _Original.fn


def set_original(fn: Optional[Callable]) -> None:
    _Original.fn = fn


def softcap_score_mod(cap: float) -> Callable:
    """A score_mod ``cap · tanh(score / cap)`` this hook recognises exactly (eager calls)."""
    cap = float(cap)
    if not cap > 0.0:
        raise ValueError(f"softcap must be > 0, got {cap!r}")

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap


_SOFTCAP_CODE = softcap_score_mod(1.0).__code__


def _hf_score_mod_code():
    """The code object of HF's ``flex_attention_forward`` score_mod closure, when Transformers is loaded."""
    import sys
    module = sys.modules.get("transformers.integrations.flex_attention")
    fn = getattr(module, "flex_attention_forward", None)
    for const in getattr(getattr(fn, "__code__", None), "co_consts", ()):
        if getattr(const, "co_name", None) == _HF_SCORE_MOD_NAME:
            return const
    return None


def _cells(fn) -> Dict[str, object]:
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())}


def score_mod_softcap(score_mod, declared_softcap: Optional[float] = None) -> Tuple[float, Optional[str]]:
    """(softcap, None) for a score_mod this hook computes exactly (0 = none), else (0, reason). Eager only:
    under compile, closures are not readable (``flex_compiled`` accepts only none or a declared softcap)."""
    from torch.nn.attention.flex_attention import _identity
    if declared_softcap is not None:
        return float(declared_softcap), None
    if score_mod is None or score_mod is _identity:
        return 0.0, None
    code = getattr(score_mod, "__code__", None)
    if code is _SOFTCAP_CODE:
        return float(_cells(score_mod)["cap"]), None
    if code is not None and code is _hf_score_mod_code():
        cells = _cells(score_mod)
        if cells.get("score_mask") is None and cells.get("position_bias") is None:
            cap = cells.get("softcap")
            return (0.0 if cap is None else float(cap)), None
        return 0.0, "flex: HF score_mod with an additive score mask or position bias"
    return 0.0, f"flex: score_mod {getattr(score_mod, '__name__', type(score_mod).__name__)} not recognised"


_VERDICTS: Dict[Tuple[int, int, int], MaskVerdict] = {}


def mask_verdict(block_mask, q: Tensor, k: Tensor) -> MaskVerdict:
    """The block mask's exact form for this call, computed once per (BlockMask object, batch, heads)."""
    if block_mask is None:
        return NO_MASK
    key = (id(block_mask), q.shape[0], q.shape[1])
    verdict = _VERDICTS.get(key)
    if verdict is None:
        verdict = analyse(block_mask.mask_mod, BlockStructure.of(block_mask), q.shape[0], q.shape[1], q.shape[2],
                          k.shape[2], q.device)
        _VERDICTS[key] = verdict
        weakref.finalize(block_mask, _VERDICTS.pop, key, None)
    return verdict


def unsupported_reason(q, k, v, block_mask, enable_gqa: bool, return_lse: bool, return_aux) -> Optional[str]:
    """Why this flex call keeps the original path, before its score_mod and mask are looked at."""
    subclass = [type(t).__name__ for t in (q, k, v) if type(t) not in _PLAIN]
    if subclass:
        return f"flex: tensor subclass {', '.join(dict.fromkeys(subclass))}"
    if any(t.is_nested for t in (q, k, v)):
        return "flex: nested tensors"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or any(t.numel() == 0 for t in (q, k, v)):
        return "flex: inputs are not non-empty 4-D (B, H, S, D)"
    if q.shape[0] != k.shape[0] or k.shape[1] == 0 or q.shape[1] % k.shape[1] or q.dtype != k.dtype:
        return "flex: broadcast batch, head counts or dtypes the backends do not take"
    if q.shape[1] != k.shape[1] and not enable_gqa:
        return "flex: different head counts without enable_gqa (the original decides)"
    if return_lse or (return_aux is not None and (return_aux.lse or return_aux.max_scores)):
        return "flex: LSE / max scores requested as outputs (their gradients are not the corrected backward's)"
    if block_mask is not None and tuple(block_mask.seq_lengths) != (q.shape[2], k.shape[2]):
        return "flex: BlockMask made for other sequence lengths (the original decides)"
    if block_mask is not None and getattr(block_mask.mask_mod, "__name__", "") == SLICED_MASK_MOD:
        return "flex: sliced BlockMask (no mask_mod; the original decides)"
    return None


def problem_for(verdict: MaskVerdict, softcap: float, scale: Optional[float], head_dim: int) -> Problem:
    return Problem(scale=default_scale(head_dim, scale), causal=verdict.causal, causal_align=verdict.causal_align,
                   window=verdict.window, softcap=softcap, cu_seqlens_q=verdict.cu_seqlens,
                   cu_seqlens_k=verdict.cu_seqlens, max_seqlen_q=verdict.max_seqlen, max_seqlen_k=verdict.max_seqlen,
                   attn_mask=verdict.dense)


def _pack(t: Tensor) -> Tensor:
    """(B, H, S, ...) -> (1, H, B·S, ...): the batch packed along the sequence (varlen documents)."""
    return t.transpose(0, 1).reshape(1, t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:])


def _unpack(t: Tensor, batch: int) -> Tensor:
    return t.reshape(t.shape[1], batch, t.shape[2] // batch, *t.shape[3:]).transpose(0, 1)


def routed_backward(record: CallRecord, do, q, k, v, out, lse, original=None, stand_in_reason=None):
    """(dq, dk, dv) through the router; documents over a batch > 1 run packed as one varlen sequence."""
    batch = q.shape[0]
    packed = record.problem.cu_seqlens_q is not None and batch > 1
    if packed:
        do, q, k, v, out = (_pack(t) for t in (do, q, k, v, out))
        lse = None if lse is None else _pack(lse.reshape(batch, q.shape[1], -1))
        if original is not None:  # the caller's backward returns unpacked gradients: pack them like the others
            unpacked_original = original

            def original():
                return tuple(_pack(g) for g in unpacked_original()[:3])
    grads = run_backward(record, BackwardTensors(do, q, k, v, out, lse), original, stand_in_reason=stand_in_reason)
    return tuple(_unpack(g, batch) for g in grads[:3]) if packed else tuple(grads[:3])


@dataclass(frozen=True, eq=False)
class FlexCall:
    """The original call's arguments (what the forward runs again) and how to run it."""
    score_mod: Optional[Callable]
    block_mask: object
    scale: Optional[float]
    enable_gqa: bool
    kernel_options: Optional[dict]
    forward_fn: Callable  # (q, k, v, score_mod=, block_mask=, scale=, enable_gqa=, kernel_options=, return_aux=)
    forward_lse: bool = True  # ask forward_fn for the LSE (HF's Inductor-compiled flex on CPU has none)


class _OwnForward(threading.local):
    """``active`` while the hook runs its forward function itself. A compiled flex it calls (HF's
    ``torch.compile(flex_attention)``) runs this hook again, traced, and passes the call through (it asks for the
    LSE, or runs without grad): a pass-through that is the hook's own, not a fallback to report
    (``flex_compiled._note_trace_reason`` reads this at trace time only, so no Dynamo guard depends on it)."""
    active = False


OWN_FORWARD = _OwnForward()


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
        with grad_mode, torch.autograd.graph.saved_tensors_hooks(_detach_pack, _identity_unpack):
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
        ctx.record, ctx.inner = record, kept
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        original = graph_backward(ctx.inner, do)
        grads = routed_backward(ctx.record, do, q, k, v, out, lse, original)
        ctx.inner = None
        return grads[0], grads[1], grads[2], None, None


def needs_correction(q, k, v, mode: str) -> bool:
    return (mode != "off" and torch.is_grad_enabled() and getattr(q, "dtype", None) in LOW_PRECISION
            and (q.requires_grad or k.requires_grad or v.requires_grad))


@dataclass(frozen=True)
class Caller:
    """What a hook that is not torch's ``flex_attention`` itself tells ``flex`` (the HF hook).

    ``declared_softcap``: it built ``score_mod`` as exactly that softcap. ``forward_fn``: the function that
    computes the forward (None: the original flex_attention; the HF hook passes HF's compiled one).
    ``forward_lse``: whether to ask that function for the LSE (eager calls; False where it has none).
    ``layer``: the call's name for the policy when no ``layer_scope`` is open."""
    declared_softcap: Optional[float] = None
    forward_fn: Optional[Callable] = None
    forward_lse: bool = True
    layer: Optional[str] = None


FLEX_ATTENTION = Caller()  # a call of flex_attention itself


def flex(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
         kernel_options=None, *, return_aux=None, caller: Caller = FLEX_ATTENTION, cfg: Optional[Config] = None):
    """``flex_attention``'s semantics; the corrected backward where it is exact (module docstring). ``caller``:
    see ``Caller``; ``cfg``: the options when the patch is not enabled (the audit)."""
    from .. import config
    cfg = config.active() or cfg or DEFAULT_CONFIG
    fwd = caller.forward_fn or original_flex()

    def passthrough():
        return fwd(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                   return_lse=return_lse, kernel_options=kernel_options, return_aux=return_aux)
    if not needs_correction(query, key, value, cfg.mode):
        return passthrough()
    if torch.compiler.is_compiling():
        from .flex_compiled import compiled_flex
        return compiled_flex(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                             kernel_options, return_aux, caller=caller, forward_fn=fwd, cfg=cfg,
                             passthrough=passthrough)
    reason = unsupported_reason(query, key, value, block_mask, enable_gqa, return_lse, return_aux)
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
