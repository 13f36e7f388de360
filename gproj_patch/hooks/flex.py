"""Hook: FlexAttention — torch's ``flex_attention`` (every binding of it) and HF's ``"flex_attention"``.

``install()``:

* swaps the code of ``torch.nn.attention.flex_attention.flex_attention`` for the code of this module's
  ``flex_attention`` (``flex_reach.py``):
  the function keeps its identity, and every caller reaches the hook — call-time lookups, names bound before
  ``enable()`` (``from torch.nn.attention.flex_attention import flex_attention``), ``torch.compile(flex_attention)``
  objects made before it, class attributes, partials. The hook's forward and pass-throughs run
  ``flex_reach``'s copy of the original (``original_flex``). Where the swap is refused, only the module
  attribute is replaced, and the bindings that keep the original are named once (WARNING) and in
  ``Handle.installed["flex"]``;
* replaces HF's ``AttentionInterface`` entry ``"flex_attention"`` (looked up at every layer call) by
  ``hf_flex_attention_forward`` — now if ``transformers.modeling_utils`` is loaded, else right after it is
  imported. HF's own function asks flex for its LSE as an output and builds its ``score_mod`` as a closure that
  a compiled region cannot read; this hook knows the softcap from its arguments, builds the same ``score_mod``
  and runs HF's own (compiled) flex call as the forward, asking it for the LSE where HF itself would (not on
  CPU, where Inductor's flex returns none). Calls it does not take (an additive score mask, a position bias,
  attention sinks ``s_aux``, dropout, no gradient) go to HF's function unchanged.

``uninstall()`` restores both by identity (a later replacement by someone else is left in place, with a
warning). ``flex_is_supported()`` says whether this torch has FlexAttention at all.

Why one module: the interception (the code swap's target, HF's entry), the call it recognises, and its autograd
side — eager and compiled, which share the call's ``Problem``, pass-through reasons and routed backward — are one
path; a reader follows a flex call from top to bottom here. The compiled path's custom ops are defined at import
(which imports Dynamo). ``flex_reach.py`` (how every binding of torch's function is reached: a code swap) and
``flex_masks.py`` (what a ``BlockMask`` is as the backends take it) are separate thoughts, each a module of its
own.

The call. ``flex(...)`` — what the hook's ``flex_attention`` and HF's entry run — has
``torch.nn.attention.flex_attention.flex_attention``'s signature. When a gradient is needed, the inputs are plain
BF16/FP16 tensors and the call's math is one the backends compute exactly, ``_FlexFunction`` runs the *original*
flex forward itself (the same function with the same arguments, asking it for the LSE) and routes the backward
(``router.run_backward``). Exact means:

* ``score_mod``: none (or flex's identity), or a softcap: ``softcap_score_mod(c)`` (below), HF's
  ``flex_attention_forward`` closure with only ``softcap`` set (read from its cells), or a softcap the caller
  declares (``declared_softcap``: the HF hook, which builds the closure itself);
* ``block_mask``: none, or one ``flex_masks.analyse`` proves to be causal / sliding-window flags, documents
  (varlen), or a dense mask small enough for the FP32 tier.

Anything else runs the original function untouched, reason counted (``telemetry.record_forward``): other
score_mods, masks with no exact form, the LSE or max scores asked as outputs (their gradients are not the
attention backward's), tensor subclasses, nested tensors. PyTorch's flex has no CPU backward; through this hook a
CPU call gets the FP32 tier (the original backward is unreachable there: ``original`` is None).

Forward bits (eager calls: ``_FlexFunction``). On CUDA the original runs with grad on detached aliases (the same
graph and kernel as the unpatched call; its saved tensors kept by ``dispatch/autograd.inner_saved_tensors_hooks``,
so an enclosing activation checkpoint never packs them); the inner graph is dropped at once except in
``auto``/``audit``, where its backward *is* the original. On CPU (no flex backward) it runs without grad.

Under ``torch.compile`` (``compiled_flex``): the forward stays in the graph, the backward is a custom op. Dynamo
traces ``_CompiledFlexFunction`` (an autograd Function): its forward is the original flex call (the flex
higher-order op, lowered by Inductor to the same fused kernel as an unpatched compiled call) plus
``gproj::flex_context``, an opaque op that makes the call's record and plan at run time (``record.make_context``,
``plan.make_plan``, from the forward's q, k, v, output, LSE and mask summaries; filed in the runtime state under
a call number that travels through the graph); its backward is ``gproj::flex_bwd``, an opaque op that carries the
plan out at run time (``router.run_backward``). The original fused backward is unreachable from inside an op: in
``auto``/``audit`` a policy choice of "original" runs an uncorrected stand-in, with that reason logged.

What is decided at trace time (a non-supported call keeps the original compiled forward *and* backward; its
reason is logged once per trace, the compiled calls themselves are not counted):

* ``score_mod``: none, flex's identity, or a softcap declared by the caller (the HF hook). Closures made
  inside the compiled region cannot be read there, so other score_mods pass through;
* ``block_mask``: any whose (b, h, q, kv) grid has at most ``MAX_COMPILED_MASK_ELEMENTS`` elements. Its
  ``mask_mod`` is evaluated *in the graph* at the forward (vmapped over the grid, as ``create_block_mask``
  does; closures and captured tensors included, a transient bool grid unless Inductor fuses the reductions)
  and reduced to per-row summaries (first/last visible key, count) plus a block-structure consistency flag,
  which the backward op reads at run time (``flex_masks.classify``): flags, documents, or the dense mask
  rebuilt from row intervals. A mask with no exact form there (rows that are not key intervals beyond the
  dense budget, a block structure that disagrees with its mask_mod) raises in the backward, never a silent
  wrong gradient; eager calls handle those (dense mask or pass-through).
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import sys
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..backends import compat
from ..backends.compat import (CUDAGRAPH_UNSAFE_TAGS, FLEX_SLICED_MASK_MOD, assume_constant_result,
                               flex_identity_score_mod)
from ..backends.spec import LOW_PRECISION, default_scale
from ..dispatch.autograd import has_backward, inner_saved_tensors_hooks, once_differentiable, transform_reason
from ..dispatch.plan import ForwardTensors, kernel_reason, make_plan
from ..dispatch.record import BackwardPlan, CallRecord, Context, Problem, make_context
from ..dispatch.router import BackwardTensors, graph_backward, run_backward
from ..layers.scope import module_layer
from ..runtime import config as _config
from ..runtime import telemetry
from ..runtime.config import POLICY_MODES, Config
from ..runtime.import_hooks import call_after_import
from ..runtime.state import STATE
from . import flex_reach
from .flex_masks import (INCONSISTENT, NO_MASK, BlockMaps, BlockStructure, MaskVerdict, Rows, analyse, classify,
                         evaluate_chunk, grid, structure_reason)
from .restore import restore_by_identity

logger = logging.getLogger("gproj_patch")

HF_NAME = "flex_attention"
_MISSING = object()
SOURCE = "flex"
SLICED_MASK_MOD = FLEX_SLICED_MASK_MOD  # the stub flex puts in a sliced BlockMask (compat)
NO_FLEX_BACKWARD = ("cpu", "mps")  # devices where PyTorch's flex raises when inputs require grad
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_HF_SCORE_MOD_NAME = "score_mod"
DEFAULT_CONFIG = Config()  # made once: a compiled region cannot construct it
STAND_IN_REASON = "flex under torch.compile: original fused backward unreachable in a custom op; uncorrected stand-in"
MAX_COMPILED_MASK_ELEMENTS = 1 << 28  # b·h·Sq·Sk mask_mod evaluations in one compiled forward


@dataclass
class InstalledFlex:
    """What ``install()`` did, to be undone by ``uninstall()`` (hook bookkeeping, not runtime state: ``reset()``
    leaves it alone). One instance, ``INSTALLED``, mutated in place and never re-bound."""
    reach: Optional[flex_reach.Reach] = None  # what install() did to torch's flex_attention
    last_report: Optional[str] = None  # the fallback's status last logged (logged again only when it changes)
    hf_saved: Any = _MISSING  # HF's registry entry before install() (restored by identity)
    pending: Any = None  # the import hook waiting for transformers.modeling_utils (import_hooks.AfterImport)


INSTALLED = InstalledFlex()


def flex_is_supported() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


# ---- one flex call: what the hook recognises (eager and compiled paths alike) -------------------------------------
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


class _Original:
    """The flex_attention function the hook replaced (``install()`` sets it, ``uninstall()`` clears it)."""
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
    under compile, closures are not readable (``compiled_flex`` accepts only none or a declared softcap)."""
    _identity = flex_identity_score_mod()
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


#: bounded cache: a BlockMask's verdict per (id, batch, heads), each entry dropped when its BlockMask is freed
#: (weakref.finalize), so it holds no more entries than there are live BlockMask objects (× batch/head shapes)
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


class _OwnForward(threading.local):
    """``active`` while the hook runs its forward function itself. A compiled flex it calls (HF's
    ``torch.compile(flex_attention)``) runs this hook again, traced, and passes the call through (it asks for the
    LSE, or runs without grad): a pass-through that is the hook's own, not a fallback to report
    (``_note_trace_reason`` reads this at trace time only, so no Dynamo guard depends on it)."""
    active = False


OWN_FORWARD = _OwnForward()


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


# ---- the eager path -----------------------------------------------------------------------------------------------
def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """``flex_attention`` through the hook: the corrected backward where it is exact (``flex``). Its code is what
    ``install()`` swaps into torch's function; the function itself is the module attribute where the swap is
    refused (``flex_reach``).

    While installed this function's code also runs as torch's ``flex_attention``, with that module's globals: the
    hook is therefore imported by its absolute name, not looked up as a global here."""
    from gproj_patch.hooks.flex import flex as hooked_flex
    return hooked_flex(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                       return_aux=return_aux)


flex_attention.__gproj_patched__ = True


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
    """The patch on, BF16/FP16 inputs (FP32/FP64 flex has nothing to repair) and a backward to correct."""
    return mode != "off" and getattr(q, "dtype", None) in LOW_PRECISION and has_backward(q, k, v)


def flex(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
         kernel_options=None, *, return_aux=None, caller: Caller = FLEX_ATTENTION, cfg: Optional[Config] = None):
    """``flex_attention``'s semantics; the corrected backward where it is exact (module docstring). ``caller``:
    see ``Caller``; ``cfg``: the options when the patch is not enabled (the audit)."""
    cfg = _config.active() or cfg or DEFAULT_CONFIG
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


# ---- under torch.compile (module docstring) -----------------------------------------------------------------------
def _note_trace_reason(reason: str) -> bool:
    """Log (once) and count a pass-through decided while tracing, unless it is the hook's own forward (a compiled
    flex the eager hook calls: ``OWN_FORWARD``; read here, at trace time, so that no guard depends on it)."""
    if not OWN_FORWARD.active:
        telemetry.note_reason(reason, (SOURCE, "compile"))
    return True


def _mask_grid(code: types.CodeType, block_batch: int, block_heads: int, batch: int, heads: int) -> Tuple[int, int]:
    """``flex_masks.grid`` at trace time (bytecode inspection is not traceable)."""
    return grid(code, block_batch, block_heads, batch, heads)


def _mark_trace_constants() -> None:
    """Dynamo evaluates these two once while it traces, their results constants of the graph
    (``assume_constant_result``). Marked when Dynamo is imported — ``torch.compile`` imports it before it traces
    anything — because the marker's import of Dynamo (~1 s) would otherwise fall on every ``enable()``, also in
    programs that never compile."""
    for fn in (_note_trace_reason, _mask_grid):
        assume_constant_result(fn)


call_after_import(compat.dynamo_module_name(), _mark_trace_constants)


def _mask_summary(block_mask, batch: int, heads: int, sq: int, sk: int, device):
    """(lo, hi, cnt, violation) of the block mask, computed by traced ops (module docstring)."""
    blocks = BlockStructure.of(block_mask)
    nb, nh = _mask_grid(block_mask.mask_mod.__code__, blocks.kv_num_blocks.shape[0], blocks.kv_num_blocks.shape[1],
                        batch, heads)
    _, rows, bad = evaluate_chunk(block_mask.mask_mod, BlockMaps(blocks, sk), nb, nh,
                                  torch.arange(sq, device=device), sk)
    return rows.lo, rows.hi, rows.cnt, bad


def _verdict(q, k, lo, hi, cnt, violation) -> MaskVerdict:
    """The call's mask as the backends take it, from the forward's in-graph summaries (``flex_masks.classify``):
    a pure function of forward data, evaluated by both ops."""
    if lo is None:
        return NO_MASK
    if bool(violation):
        return MaskVerdict(reason=INCONSISTENT)
    return classify(Rows(lo, hi, cnt), None, q.shape[0], q.shape[2], k.shape[2])


@dataclass(frozen=True)
class FlexCompiledCall:
    """What the forward op ``gproj::flex_context`` files for the backward op (no tensors): the call's context
    and plan, whether the uncorrected stand-in of an ``original`` plan can run on the kernel, and the mask's
    reason when it has no exact form (raised by the backward, as before plans existed)."""
    context: Context
    plan: Optional[BackwardPlan]
    stand_in_kernel: bool
    mask_error: Optional[str] = None


@torch.library.custom_op("gproj::flex_context", mutates_args=(), tags=CUDAGRAPH_UNSAFE_TAGS)
def _flex_context(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lo: Optional[Tensor],
                  hi: Optional[Tensor], cnt: Optional[Tensor], violation: Optional[Tensor], scale: Optional[float],
                  softcap: float, layer: str, mode: str) -> Tensor:
    """The call's record and plan, made at the forward (at run time: never a graph constant or a guard)."""
    cfg = _config.active() or _config.resolve(mode=mode)
    context = make_context(SOURCE, layer or None, cfg)
    verdict = _verdict(q, k, lo, hi, cnt, violation)
    if verdict.reason is not None:
        return _filed(FlexCompiledCall(context, None, False, mask_error=verdict.reason))
    record = CallRecord(problem_for(verdict, softcap, scale, q.shape[-1]), context)
    tensors = ForwardTensors(q, k, v, out, lse if lse.numel() else None)
    packed = record.problem.cu_seqlens_q is not None and q.shape[0] > 1
    # packed documents: the stand-in would need the packing too, so there is no "original" (the policy falls to FP32)
    record = make_plan(record, tensors, has_original=not packed)
    stand_in_kernel = (record.plan.tier == "original"
                       and kernel_reason(tensors, record.problem, cpu_kernel=context.cpu_kernel) is None)
    return _filed(FlexCompiledCall(context, record.plan, stand_in_kernel))


def _filed(call: FlexCompiledCall) -> Tensor:
    return torch.tensor([STATE.file_compiled_call(call)], dtype=torch.int64)


@_flex_context.register_fake
def _(q, k, v, out, lse, lo, hi, cnt, violation, scale, softcap, layer, mode):
    return torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("gproj::flex_bwd", mutates_args=(), tags=CUDAGRAPH_UNSAFE_TAGS)
def _flex_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: Tensor,
              lo: Optional[Tensor], hi: Optional[Tensor], cnt: Optional[Tensor], violation: Optional[Tensor],
              scale: Optional[float], softcap: float) -> Tuple[Tensor, Tensor, Tensor]:
    call = STATE.compiled_call(int(aux[0]))
    if call.mask_error is not None:
        raise RuntimeError(f"gproj flex backward: the mask checked at run time has no exact form "
                           f"({call.mask_error}); disable the patch for this call or use the eager flex_attention")
    problem = problem_for(_verdict(q, k, lo, hi, cnt, violation), softcap, scale, q.shape[-1])
    record = CallRecord(problem, call.context, call.plan)
    lse_or_none = lse if lse.numel() else None

    def stand_in():
        p = record.problem
        if call.stand_in_kernel:
            from ..backends.triton_bwd import gproj_backward
            return gproj_backward(do, q, k, v, out, lse_or_none, scale=p.scale, correct=False,
                                  max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k, **p.flags)
        from ..backends.fp32_tier import fp32_backward
        return fp32_backward(q, k, v, do, attn_mask=p.attn_mask, project=False, scale=p.scale, check_finite=False,
                             **p.flags)
    packed = problem.cu_seqlens_q is not None and q.shape[0] > 1
    dq, dk, dv = routed_backward(record, do, q, k, v, out, lse_or_none, None if packed else stand_in,
                                 stand_in_reason=STAND_IN_REASON)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_flex_bwd.register_fake
def _(do, q, k, v, out, lse, aux, lo, hi, cnt, violation, scale, softcap):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class _CompiledFlexFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: FlexCall, softcap, layer, mode):
        """``call``: the original call's arguments and forward (its ``forward_lse`` is not read here: the LSE is
        asked for on CUDA); ``softcap``, ``layer``, ``mode``: what the record is made of."""
        block_mask, scale = call.block_mask, call.scale
        want_lse = q.device.type == "cuda"
        kwargs = dict(score_mod=call.score_mod, block_mask=block_mask, scale=scale, enable_gqa=call.enable_gqa,
                      kernel_options=call.kernel_options)
        if want_lse:
            from torch.nn.attention.flex_attention import AuxRequest
            out, aux_out = call.forward_fn(q.detach(), k.detach(), v.detach(), return_aux=AuxRequest(lse=True),
                                           **kwargs)
            lse = aux_out.lse
        else:
            out = call.forward_fn(q.detach(), k.detach(), v.detach(), **kwargs)
            lse = q.new_empty((0,), dtype=torch.float32)
        summary = (None,) * 4 if block_mask is None else \
            _mask_summary(block_mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
        aux = _flex_context(q, k, v, out, lse, *summary, scale, softcap, layer, mode)
        ctx.save_for_backward(q, k, v, out, lse, aux, *summary)
        ctx.args = (scale, softcap)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, aux, *summary = ctx.saved_tensors
        dq, dk, dv = _flex_bwd(do, q, k, v, out, lse, aux, *summary, *ctx.args)
        return dq, dk, dv, None, None, None, None


def _compiled_reason(q, k, score_mod, block_mask, declared_softcap) -> Optional[str]:
    """Why a call inside a compiled region passes through (trace-time decision; module docstring)."""
    if declared_softcap is None and score_mod is not None and score_mod is not flex_identity_score_mod():
        return "flex under torch.compile: score_mod is not readable inside the compiled region"
    if block_mask is None:
        return None
    blocks = BlockStructure.of(block_mask)
    reason = structure_reason(blocks, q.shape[0], q.shape[1])
    if reason is not None:
        return f"flex: {reason}"
    nb, nh = _mask_grid(block_mask.mask_mod.__code__, blocks.kv_num_blocks.shape[0], blocks.kv_num_blocks.shape[1],
                        q.shape[0], q.shape[1])
    if nb * nh * q.shape[2] * k.shape[2] > MAX_COMPILED_MASK_ELEMENTS:
        return "flex under torch.compile: BlockMask grid too large to check in the graph (eager calls check it)"
    return None


def compiled_flex(query, key, value, call: FlexCall, return_lse, return_aux, *, caller: Caller, cfg: Config,
                  passthrough):
    """``flex`` inside a compiled region (module docstring); ``call``: the call's arguments and the forward
    ``flex`` resolved; ``return_lse``/``return_aux``: what the caller asked for besides the output."""
    reason = unsupported_reason(query, key, value, call.block_mask, call.enable_gqa, return_lse, return_aux)
    if reason is None:
        reason = _compiled_reason(query, key, call.score_mod, call.block_mask, caller.declared_softcap)
    if reason is not None:
        _note_trace_reason(reason)
        return passthrough()
    softcap = 0.0 if caller.declared_softcap is None else float(caller.declared_softcap)
    return _CompiledFlexFunction.apply(query, key, value, call, softcap, caller.layer or "", cfg.mode)


# ---- HF's "flex_attention" entry, install / uninstall -------------------------------------------------------------
def _hf_unsupported_reason(query, attention_mask, s_aux, position_bias, kwargs) -> Optional[str]:
    from torch.nn.attention.flex_attention import BlockMask
    if attention_mask is not None and not isinstance(attention_mask, BlockMask):
        return "hf flex: additive score mask (not a BlockMask)"
    if position_bias is not None:
        return "hf flex: position bias"
    if s_aux is not None:
        return "hf flex: attention sinks (s_aux) are applied outside flex through its LSE"
    if kwargs.get("dropout", 0.0) > 0:
        return "hf flex: dropout"
    return None


def hf_flex_attention_forward(module, query, key, value, attention_mask, scaling=None, softcap=None, s_aux=None,
                              position_bias=None, **kwargs):
    """HF's ``flex_attention_forward`` contract: (B, H, S, D) inputs, returns ((B, S, H, D), None)."""
    import transformers.integrations.flex_attention as hf_flex
    saved = INSTALLED.hf_saved
    original = saved if saved is not _MISSING else hf_flex.flex_attention_forward
    cfg_mode = (_config.active() or DEFAULT_CONFIG).mode

    def passthrough():
        return original(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, s_aux=s_aux,
                        position_bias=position_bias, **kwargs)
    if not needs_correction(query, key, value, cfg_mode):
        return passthrough()
    reason = _hf_unsupported_reason(query, attention_mask, s_aux, position_bias, kwargs)
    if reason is not None:
        if not torch.compiler.is_compiling():
            telemetry.record_forward("original", reason, telemetry.shape_class(SOURCE, query, key))
        return passthrough()
    enable_gqa = True
    heads = query.shape[1]
    if heads & (heads - 1):  # as HF: repeat the KV heads when the head count is not a power of two
        key = hf_flex.repeat_kv(key, heads // key.shape[1])
        value = hf_flex.repeat_kv(value, heads // value.shape[1])
        enable_gqa = False
    layer = module_layer(module)  # track_layers' scope (also the traced one under torch.compile), else Class.idx
    score_mod = None if softcap is None else softcap_score_mod(softcap)
    forward_fn = functools.partial(hf_flex.compile_friendly_flex_attention, training=module.training)
    caller = Caller(declared_softcap=None if softcap is None else float(softcap), forward_fn=forward_fn,
                            forward_lse=query.device.type != "cpu", layer=layer)  # HF's own rule for the LSE
    out = flex(query, key, value, score_mod=score_mod, block_mask=attention_mask, scale=scaling,
                       enable_gqa=enable_gqa, kernel_options=kwargs.get("kernel_options"), caller=caller)
    return out.transpose(1, 2).contiguous(), None


def is_installed() -> bool:
    return INSTALLED.reach is not None


def _module_globals_holding(fn) -> List[str]:
    """"module.name" of every module global (torch's and this package's excepted) that holds ``fn``, HF's flex
    module excepted (its calls go through the registry entry hooked below)."""
    return [f"{module_name}.{name}" for _, module_name, name in flex_reach.find_bound_names(fn)
            if module_name != "transformers.integrations.flex_attention"]


def _report(reach: flex_reach.Reach) -> None:
    """Log once (again only when it changes) what the fallback did not reach; nothing when the swap was made."""
    status = reach.status()
    if reach.swapped or status == INSTALLED.last_report:
        return
    logger.warning("flex: %s", status)
    INSTALLED.last_report = status


def install() -> str:
    if INSTALLED.reach is not None:
        return "installed"
    if not flex_is_supported():
        return "skipped: this torch has no torch.nn.attention.flex_attention"
    import torch.nn.attention.flex_attention as fa_module

    reach = INSTALLED.reach = flex_reach.install(fa_module, flex_attention, _module_globals_holding)
    set_original(reach.original)
    _report(reach)
    status = reach.status()
    if "transformers.modeling_utils" in sys.modules:
        _register_hf()
    elif importlib.util.find_spec("transformers") is not None:
        INSTALLED.pending = call_after_import("transformers.modeling_utils", _register_on_import)
        if reach.swapped:
            return "installed (HF's 'flex_attention' hooked when transformers.modeling_utils is imported)"
    return status


def _register_on_import() -> None:
    INSTALLED.pending = None
    _register_hf()


def _register_hf() -> None:
    try:
        from transformers.modeling_utils import AttentionInterface
        mapping = compat.hf_registry_mapping(AttentionInterface)
    except (ImportError, compat.CompatError) as exc:
        logger.warning("could not hook HF's 'flex_attention': %s", exc)
        return
    INSTALLED.hf_saved = mapping.get(HF_NAME, _MISSING)
    if INSTALLED.hf_saved is _MISSING:
        return  # this Transformers has no flex implementation
    mapping[HF_NAME] = hf_flex_attention_forward
    hf_flex = sys.modules.get("transformers.integrations.flex_attention")
    if getattr(hf_flex, "flex_attention", None) is flex_attention:
        # Transformers imported after install() bound this wrapper; HF's own function (the pass-through of the
        # hook above, and the forward it runs) must see the original, as it would have without the patch
        hf_flex.flex_attention = original_flex()


def uninstall() -> None:
    if INSTALLED.pending is not None:
        INSTALLED.pending.cancel()
        INSTALLED.pending = None
    if INSTALLED.hf_saved is not _MISSING:
        from transformers.modeling_utils import AttentionInterface
        mapping = compat.hf_registry_mapping(AttentionInterface)
        restore_by_identity(mapping, HF_NAME, hf_flex_attention_forward, INSTALLED.hf_saved,
                            "HF's 'flex_attention' entry")
        INSTALLED.hf_saved = _MISSING
    if INSTALLED.reach is None:
        return
    import torch.nn.attention.flex_attention as fa_module
    flex_reach.uninstall(fa_module, INSTALLED.reach)
    set_original(None)
    INSTALLED.reach = None


# ---- the audit's flex backends (``audit.backends.available_backends`` adds what ``audit_backends`` returns)
def _case_mask_mod(mask: dict, sq: int, sk: int):
    """The audit case's flags as a mask_mod (None: no mask)."""
    causal, left, right = bool(mask.get("causal")), *tuple(mask.get("window", (-1, -1)))
    if not causal and left < 0 and right < 0:
        return None
    shift = sk - sq if mask.get("causal_align", "top_left") == "bottom_right" else 0

    def case_mask(b, h, q_idx, kv_idx):
        diag = q_idx + shift
        ok = kv_idx <= diag if causal else kv_idx >= 0
        if left >= 0:
            ok = ok & (kv_idx >= diag - left)
        if right >= 0:
            ok = ok & (kv_idx <= diag + right)
        return ok
    return case_mask


#: bounded cache: one entry, (original flex, its torch.compile wrapper) for the audit's uncorrected backend;
#: replaced when the original changes (each install() may hand out a new copy of it), never grows
_COMPILED_ORIGINAL: List[Tuple[Callable, Callable]] = []


def _compiled_original():
    """The compiled original flex (the audit's uncorrected backend), compiled once per original function."""
    fn = original_flex()
    if not _COMPILED_ORIGINAL or _COMPILED_ORIGINAL[0][0] is not fn:
        _COMPILED_ORIGINAL[:] = [(fn, torch.compile(fn, dynamic=False))]
    return _COMPILED_ORIGINAL[0][1]


def _audit_reason(corrected: bool):
    def reason(inp) -> Optional[str]:
        if not flex_is_supported():
            return "this torch has no FlexAttention"
        if "cu_seqlens_q" in inp.mask:
            return "the varlen case packs unequal query/key lengths (flex documents need Sq == Sk per segment)"
        if not corrected and inp.q.device.type != "cuda":
            return "PyTorch's flex_attention has no CPU backward"
        return None
    return reason


def _audit_run(corrected: bool):
    def run(inp, k, saved):
        from torch.nn.attention.flex_attention import create_block_mask
        q, kk, v = (x.detach().clone().requires_grad_(True) for x in (inp.q, k, inp.v))
        sq, sk = q.shape[2], kk.shape[2]
        mask_mod = _case_mask_mod(inp.mask, sq, sk)
        bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, sq, sk, device=q.device)
        cap = float(inp.mask.get("softcap", 0.0))
        args = dict(score_mod=softcap_score_mod(cap) if cap else None, block_mask=bm,
                    scale=inp.mask.get("scale"), enable_gqa=q.shape[1] != kk.shape[1])
        if corrected:  # the hook's eager path: the GProj kernel or the FP32 tier
            out = flex(q, kk, v, cfg=_config.Config(mode="gproj"), **args)
            if type(out.grad_fn).__name__ != "_FlexFunctionBackward":
                raise RuntimeError(f"the flex hook passed this case through: {telemetry.stats()['fallback_reasons']}")
        else:  # what an unpatched user gets: compiled flex and its fused backward
            out = _compiled_original()(q, kk, v, **args)
        out.backward(inp.do)
        return q.grad, kk.grad, v.grad
    return run


def audit_backends(device) -> list:
    """[(name, run(inp, k, saved) -> (dq, dk, dv), reason(inp) -> str or None)] for ``audit.Backend``:
    ``flex-uncorrected`` (compiled flex, CUDA only) and ``flex-gproj`` (flex through this hook)."""
    del device  # the reasons decide per case input
    return [("flex-uncorrected", _audit_run(False), _audit_reason(False)),
            ("flex-gproj", _audit_run(True), _audit_reason(True))]
