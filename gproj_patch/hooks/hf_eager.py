"""Hook: HF Transformers' eager attention (``eager_attention_forward`` of every modeling module).

Each ``transformers.models.<model>.modeling_<name>`` module defines its own ``eager_attention_forward`` and its
attention classes look it up as a module global at call time (``ALL_ATTENTION_FUNCTIONS.get_interface(impl,
eager_attention_forward)``), so replacing that global reaches every model on ``attn_implementation="eager"``,
``output_attentions=True`` included. ``install()`` wraps it in every modeling module already imported and, through
``import_hooks.call_after_import`` (one pending callback per modeling module name, listed from the installed
package's files without importing anything), in each one imported later. ``uninstall()`` restores each global
by identity (only where it still holds our wrapper, else it warns and leaves it) and withdraws the pending
callbacks.

What a wrapped call does. The wrapper calls the model's own function, same arguments, same ops: the forward is
the unpatched forward bit for bit and the attention weights are still returned (``run_eager`` below). Whether
its backward can be corrected depends on what the function computes — probed once per function against the fp64
oracle (``hf_eager_forms.form_of``) — and on the arguments of the call: one bound to a parameter (or landing in a
``**kwargs``) that the function's code never reads cannot change what it computes
(``hf_eager_forms.parameters``), so the Trainer's ``num_items_in_batch``, ``position_ids``, ``use_cache``, a
collator's ``cu_seq_lens_*``, ... leave the call correctable. An argument the function does read is covered only
by the probe's own (``scaling``, ``dropout``, ``softcap``) or at its parameter's default (``position_bias=None``).
Calls of a function without a form, with another argument it reads, with no ``scaling``, or with dropout keep
their original backward (reason counted).

Dropout (training with ``attention_dropout > 0``): passed through untouched, reason counted. The keep mask is
only partly recoverable from the outputs — a weight that rounds to 0 in BF16/FP16 (any probability below 6e-8
in FP16) hides whether it was dropped — and reading it from the dropout node would touch private autograd
attributes; the SDPA and flash-attn paths pass dropout through the same way.

The autograd side (``run_eager``), shared by every eager forward of known math: this hook's wrapped functions and
the ``"gproj"`` attention's softcap and sink paths (``hooks/transformers.py``), which is why it is public.
``run_eager(call, query, key, value, sink)`` runs ``call.fn`` — the model's own eager function, or another
forward of known math — on detached aliases, without a graph (the same ops, so the same bits as unpatched),
and returns what it returns: ``(attn_output (B, Sq, Hq, D), attn_weights)``. The call's record is made now;
the backward routes it (``router.run_backward``) as attention with the record's scale, softcap and sink:

* masks. HF's eager masks are additive floats (0 / the dtype's minimum, ``masking_utils.eager_mask``). One that
  only holds 0 and values ≤ ``MASKED_ADDITIVE`` is read as a boolean pattern: exactly causal / windowed →
  flags (at the forward); padding around those → flags + dead rows (right padding) or varlen segments (left
  padding), checked at the backward against the zero-dO rows (``dispatch/masks.py``); anything else → the FP32 tier
  with the mask itself, whose additive semantics are eager's (a fully masked row gets uniform weights, as in
  eager). A pattern is never taken from a float mask with fully masked rows at the forward: those rows differ
  between the float semantics (uniform) and the flags (empty), so they must be dead rows.
* the LSE and output the kernel needs are recomputed in FP32 at the backward, only when the kernel will run
  (``backends.fp32_tier.fp32_forward``: the scores the kernel recomputes, not the eager forward's BF16-rounded
  ones, which differ from them by far more than the kernel's tolerance when keys carry a large offset).
* the attention weights the function returns stay an output; when they receive a gradient (a loss on them) the
  call's original backward runs instead (the forward is recomputed under autograd; reason counted).
* the original backward (policy choice in ``auto``/``audit``) is the same recomputation.

Dropout is not handled here: callers pass dropout > 0 through untouched (above: why).
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..backends.spec import LOW_PRECISION
from ..dispatch.autograd import has_backward, once_differentiable, transform_reason
from ..dispatch.masks import mask_as_flags, packed_call, padding_as_flags, padding_as_varlen, unpack_grads
from ..dispatch.plan import ForwardTensors, kernel_reason, make_plan
from ..dispatch.record import CallRecord, Problem, make_context
from ..dispatch.router import BackwardTensors, run_backward
from ..layers.scope import backward_ran, module_layer_name
from ..runtime import config, telemetry
from ..runtime.config import POLICY_MODES
from .hf_eager_forms import EagerForm, form_of, parameters
from .restore import restore_by_identity

logger = logging.getLogger("gproj_patch")

ATTRIBUTE = "eager_attention_forward"
PACKAGE = "transformers.models"
MODELING_UTILS = "transformers.modeling_utils"
SOURCE = "hf_eager"
#: explicit parameters the routed math covers (the first five positional ones are module, q, k, v, mask)
ROUTED_PARAMETERS = ("scaling", "dropout", "softcap")
#: an additive mask value at or below this hides its key: HF uses the dtype's minimum (−65504 for FP16 models,
#: about −3.4e38 for BF16/FP32), and exp(s + m − rowmax) is 0 in fp32 once m is below −104 minus the spread of
#: a row's scores (assumed below 6.5e4 here; FP16 scores cannot exceed it)
MASKED_ADDITIVE = -65504.0
#: why a call keeps its original backward when its attention weights receive a gradient
WEIGHTS_GRAD_REASON = "eager: the attention weights receive a gradient (original backward, recomputed)"

_lock = threading.RLock()


class _Installed:
    """What ``install()`` did, for ``uninstall()`` (hook bookkeeping, not runtime statistics): one instance,
    mutated under ``_lock``, never re-bound."""

    def __init__(self) -> None:
        self.on = False
        self.patched: List[Tuple[object, Callable, Callable]] = []  # (module, original, wrapper)
        self.pending: List[object] = []                             # import_hooks.AfterImport handles


INSTALLED = _Installed()


# ------------------------------------------------------------------------------------------- one call
@dataclass(frozen=True, eq=False)
class _Bound:
    """An eager call's arguments, read through the function's signature."""
    module: object
    query: object
    key: object
    value: object
    mask: object
    scaling: Optional[float]
    dropout: float
    softcap: Optional[float]
    others: Dict[str, object]   # every other argument given that the function reads, not at its default


def _at_default(value, default) -> bool:
    """Whether an argument's value is its parameter's default (the probe ran with the defaults)."""
    if value is default:
        return True
    if default is inspect.Parameter.empty or isinstance(value, torch.Tensor) or type(value) is not type(default):
        return False
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - an odd __eq__: not known to be the default
        return False


def _bind(fn, args, kwargs) -> Optional[_Bound]:
    try:
        params = parameters(fn)
        bound = params.signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    sig = list(params.signature.parameters.values())
    positional = [p.name for p in sig[:5]]
    if len(positional) < 5 or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in sig[:5]):
        return None
    given = dict(bound.arguments)
    read = {n for n in given if n not in params.unread}  # the explicit parameters given that the code reads
    for p in sig:
        if p.kind == p.VAR_KEYWORD:
            extra = given.pop(p.name, {})
            given.update(extra)
            read.discard(p.name)
            if p.name not in params.unread:  # keywords in a **kwargs the code never reads are inert
                read.update(extra)
        elif p.kind == p.VAR_POSITIONAL and given.pop(p.name, ()):
            return None
    defaults = {p.name: p.default for p in sig if p.default is not p.empty}
    get = lambda name, default=None: given.get(name, defaults.get(name, default))  # noqa: E731
    others = {n: x for n, x in given.items() if n in read and n not in positional and n not in ROUTED_PARAMETERS
              and not _at_default(x, defaults.get(n, inspect.Parameter.empty))}
    return _Bound(*(given.get(n) for n in positional), scaling=get("scaling"), dropout=get("dropout", 0.0) or 0.0,
                  softcap=get("softcap"), others=others)


def _argument_reason(b: _Bound, form: EagerForm) -> Optional[str]:
    for name, value in b.others.items():
        if name == "s_aux" and form.sink and value is getattr(b.module, "sinks", None):
            continue  # gpt-oss passes its sinks both ways; the probe found the function reading module.sinks
        return f"argument {name!r} that the function reads (not covered by the probe)"
    if b.scaling is None:
        return "no scaling given"
    if isinstance(b.mask, torch.Tensor) and b.mask.dtype == torch.bool:
        return "boolean attention_mask (an eager function adds it to the scores as 0/1)"
    if b.dropout > 0.0 and getattr(b.module, "training", False):
        return "dropout > 0 (the eager dropout mask is not replayed; passed through)"
    if b.softcap is not None and form.softcap == "unknown":
        return "softcap given to a function whose softcap the probe could not establish"
    if b.query.shape[1] != b.key.shape[1] and not form.gqa:
        return "key heads differ from query heads and the function showed no GQA"
    return None


def unsupported_reason(fn, b: _Bound) -> Optional[str]:
    """Why this eager call keeps its original backward (None: it is corrected)."""
    form = form_of(fn)
    if isinstance(form, str):
        return form
    tensors = (b.query, b.key, b.value)
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return "query/key/value are not plain tensors"
    if any(t.dim() != 4 or t.numel() == 0 for t in tensors):
        return "inputs are not non-empty 4-D (B, H, S, D)"
    return (transform_reason(*tensors) or _argument_reason(b, form)
            or mask_unsupported_reason(b.mask, b.query.shape[2], b.key.shape[2]))


def eager_call(fn, args, kwargs):
    """One call of the wrapped eager function ``fn``: the original, or the same forward with the corrected
    backward."""
    cfg = config.active()
    if cfg is None or cfg.mode == "off" or torch.compiler.is_compiling():
        return fn(*args, **kwargs)  # under torch.compile: traced as it is (uncorrected; see the report)
    b = _bind(fn, args, kwargs)
    if b is None or not all(hasattr(t, "requires_grad") for t in (b.query, b.key, b.value)):
        return fn(*args, **kwargs)
    form = form_of(fn)
    sink = getattr(b.module, "sinks", None) if isinstance(form, EagerForm) and form.sink else None
    if not needs_correction(b.query, b.key, b.value, sink):
        return fn(*args, **kwargs)
    reason = unsupported_reason(fn, b)
    if reason is not None:
        telemetry.record_forward("original", f"{SOURCE}: {reason}", telemetry.shape_class(SOURCE, b.query, b.key))
        return fn(*args, **kwargs)
    sig = parameters(fn).signature
    names = list(sig.parameters)[1:4]

    def forward(q, k, v, _sink):
        bound = sig.bind(*args, **kwargs)
        for name, t in zip(names, (q, k, v)):
            bound.arguments[name] = t
        return fn(*bound.args, **bound.kwargs)
    call = EagerCall(fn=forward, scale=float(b.scaling), mask=b.mask,
                     softcap=float(b.softcap) if b.softcap is not None and form.softcap == "applied" else 0.0,
                     sink=sink, sink_is_argument=False, layer=module_layer_name(b.module), source=SOURCE)
    return run_eager(call, b.query, b.key, b.value)


# --------------------------------------------------------------- the corrected backward of one call
EagerFn = Callable[[Tensor, Tensor, Tensor, Optional[Tensor]], Tuple[Tensor, Optional[Tensor]]]


@dataclass(frozen=True, eq=False)
class EagerCall:
    """One eager attention call. ``fn(q, k, v, sink)`` returns ``(attn_output (B, Sq, Hq, D), weights or None)``;
    ``sink_is_argument``: ``fn`` reads the sink it is given (else it reads the very tensor ``sink`` itself, as
    gpt-oss's eager function reads ``module.sinks``). ``mask``: the mask ``fn`` applies (float additive,
    boolean, or None); ``causal``: ``fn`` applies a top-left causal pattern besides ``mask``."""
    fn: EagerFn
    scale: float
    mask: Optional[Tensor] = None
    causal: bool = False
    softcap: float = 0.0
    sink: Optional[Tensor] = None
    sink_is_argument: bool = True
    layer: Optional[str] = None
    source: str = "hf_eager"


def _pattern(mask: Optional[Tensor]) -> Optional[Tensor]:
    """The boolean pattern of a mask (True = attend), or None when it is not one (a float bias)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    visible = mask == 0
    return visible if bool((visible | (mask <= MASKED_ADDITIVE)).all()) else None


def _empty_rows_inert(mask: Tensor, sink: Optional[Tensor]) -> bool:
    """Whether a row whose keys are all masked contributes nothing (output 0, zero gradients, whatever its dO):
    under a boolean mask (no weight at all), or with a sink (all the weight on the sink logit, which the
    additive minimum cannot reach). Not under an additive mask without a sink: eager then spreads the row's
    weight uniformly over every key."""
    return mask.dtype == torch.bool or sink is not None


def mask_unsupported_reason(mask, sq: int, sk: int) -> Optional[str]:
    """Why an eager call's mask cannot be routed (None: it can)."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        return f"attention_mask of type {type(mask).__name__}"
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (sq, sk):
        return f"attention_mask of shape {tuple(mask.shape)} (not (B, H, {sq}, {sk}))"
    if mask.requires_grad:
        return "attention_mask requires grad"
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return f"attention_mask of dtype {mask.dtype}"
    return None


def problem_for(call: EagerCall, sq: int, sk: int) -> Tuple[Problem, Optional[Tensor]]:
    """(Problem, boolean pattern for the backward's padding check or None), made at the forward."""
    base = dict(scale=call.scale, softcap=call.softcap, sink=call.sink)
    if call.causal:
        if call.mask is not None:
            raise ValueError("EagerCall: causal together with a mask")
        return Problem(causal=True, **base), None
    if call.mask is None:
        return Problem(**base), None
    pattern = _pattern(call.mask)
    if pattern is None:
        return Problem(attn_mask=call.mask, **base), None
    empty_rows = bool((~pattern).all(-1).any())
    if not empty_rows or _empty_rows_inert(call.mask, call.sink):
        rest, causal, align, window = mask_as_flags(pattern, sq, sk)
        if rest is None:
            return Problem(causal=causal, causal_align=align, window=window, **base), None
    return Problem(attn_mask=call.mask, padded=True, **base), pattern


def _lse_and_output(q, k, v, problem: Problem):
    from ..backends.fp32_tier import fp32_forward
    extra = {} if problem.sink is None else {"sink": problem.sink}
    out, lse = fp32_forward(q, k, v, scale=problem.scale, check_finite=False, **problem.flags, **extra)
    return out.to(q.dtype), lse


def route(record: CallRecord, pattern: Optional[Tensor], *, do: Tensor, q: Tensor, k: Tensor, v: Tensor,
          original=None, saved: Optional[Tuple[Tensor, Tensor]] = None):
    """Gradients (dq, dk, dv[, dsink]) of one eager call through the router; ``do`` (B, Hq, Sq, D). ``saved``:
    the (output, LSE) the forward already computed in FP32 for the policy (a call without a mask)."""
    problem, pad = record.problem, None
    if problem.padded and pattern is not None:
        flags = padding_as_flags(pattern, do, q.shape[2], k.shape[2])
        if flags is not None:
            window, dead = flags
            problem = Problem(scale=problem.scale, causal=True, window=window, softcap=problem.softcap,
                              sink=problem.sink)
            return _routed(CallRecord(problem, record.context, record.plan), do, q, k, v, dead, original)
        pad = padding_as_varlen(pattern, do, q.shape[2], k.shape[2],
                                empty_rows_inert=_empty_rows_inert(problem.attn_mask, problem.sink))
    if pad is None:
        if problem.padded:  # the mask stayed a dense tensor: the plan made for that case
            record = CallRecord(problem, record.context, record.plan.dense)
        return _routed(record, do, q, k, v, None, original, saved)
    tensors, packed = packed_call(pad, problem, do=do, q=q, k=k, v=v, out=None, lse=None)
    packed_original = None
    if original is not None:
        def packed_original():
            return tuple(pad.pack(g) if i < 3 else g for i, g in enumerate(original()))
    grads = _routed(CallRecord(packed, record.context, record.plan), tensors.do, tensors.q, tensors.k, tensors.v,
                    pad.dead_rows, packed_original)
    return unpack_grads(pad, grads)


def _routed(record: CallRecord, do, q, k, v, dead, original, saved=None):
    out, lse = None, None
    plan = record.plan
    if (plan.tier == "gproj" or (plan.tier == "fp32" and plan.fp32_kernel is not None)
            or (record.context.mode == "audit" and plan.fp32_kernel is not None)):
        # the kernel forms take them: planned so (computed at the forward already when the policy sampled them)
        out, lse = saved if saved is not None else _lse_and_output(q, k, v, record.problem)
    return run_backward(record, BackwardTensors(do, q, k, v, out, lse, dead_rows=dead), original)


def _recompute_original(call: EagerCall, q, k, v, sink, d_out, d_weights):
    """The call's own (uncorrected) backward: its forward again under autograd, then ``autograd.grad``."""
    with torch.enable_grad():
        qi, ki, vi = (t.detach().requires_grad_() for t in (q, k, v))
        si = sink
        if sink is not None and call.sink_is_argument:
            si = sink.detach().requires_grad_()
        out, weights = call.fn(qi, ki, vi, si)
        inputs = [qi, ki, vi] + ([si] if si is not None and si.requires_grad else [])
        outputs, grads = [out], [d_out if d_out is not None else torch.zeros_like(out)]
        if d_weights is not None and weights is not None:
            outputs.append(weights)
            grads.append(d_weights)
        got = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    got = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(got, inputs))
    return got if sink is None else (got + (torch.zeros_like(sink),))[:4]


def _policy_lse(record: CallRecord, q: Tensor, k: Tensor, v: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """(output, LSE) in FP32 for ``auto``/``audit``'s detector at the forward (its LSE statistics: sink weight,
    LSE gap), where the kernel tier could run and would need them anyway (no mask tensor); else None."""
    problem, ctx = record.problem, record.context
    if ctx.mode not in POLICY_MODES or ctx.tier_option == "fp32" or problem.attn_mask is not None:
        return None
    if kernel_reason(ForwardTensors(q, k, v, None, None, recomputed_lse=True), problem,
                     cpu_kernel=ctx.cpu_kernel) is not None:
        return None
    with torch.no_grad():
        return _lse_and_output(q.detach(), k.detach(), v.detach(), problem)


class _EagerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, call: EagerCall, record: CallRecord, pattern):
        with torch.no_grad():
            out, weights = call.fn(q.detach(), k.detach(), v.detach(), None if sink is None else sink.detach())
        ctx.set_materialize_grads(False)
        # planned as if output and LSE were there: the backward recomputes both in FP32 where the plan runs a
        # kernel form (this forward has no LSE)
        ctx.saved_lse = _policy_lse(record, q, k, v)
        o, lse = ctx.saved_lse if ctx.saved_lse is not None else (None, None)
        ctx.record = make_plan(record, ForwardTensors(q, k, v, o, lse, recomputed_lse=True), has_original=True)
        ctx.call, ctx.pattern = call, pattern
        ctx.save_for_backward(q, k, v, sink)
        return out, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_weights):
        q, k, v, sink = ctx.saved_tensors
        call, record = ctx.call, ctx.record
        if d_weights is not None:
            backward_ran()
            grads = _recompute_original(call, q, k, v, sink, d_out, d_weights)
            telemetry.record_backward("original", WEIGHTS_GRAD_REASON, telemetry.shape_class(call.source, q, k))
        elif d_out is None:
            return None, None, None, None, None, None, None
        else:
            do = d_out.transpose(1, 2)

            def original():
                return _recompute_original(call, q, k, v, sink, d_out, None)
            grads = route(record, ctx.pattern, do=do, q=q, k=k, v=v, original=original, saved=ctx.saved_lse)
        ctx.saved_lse = None
        dsink = None
        if sink is not None and len(grads) > 3 and ctx.needs_input_grad[3]:
            dsink = grads[3].to(sink.dtype)
        return grads[0], grads[1], grads[2], dsink, None, None, None


def needs_correction(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor] = None) -> bool:
    """BF16/FP16 inputs (FP32/FP64 eager attention has nothing to repair) and a backward to correct (the sink's
    gradient counts)."""
    return q.dtype in LOW_PRECISION and has_backward(q, k, v, sink)


def run_eager(call: EagerCall, query: Tensor, key: Tensor, value: Tensor):
    """``call.fn``'s output (same bits), with the corrected backward. The caller checked ``needs_correction``
    and every pass-through reason (``mask_unsupported_reason``, dropout, ...)."""
    problem, pattern = problem_for(call, query.shape[2], key.shape[2])
    record = CallRecord(problem, make_context(call.source, call.layer))
    telemetry.record_forward("patched")
    return _EagerFunction.apply(query, key, value, call.sink, call, record, pattern)


# ------------------------------------------------------------------------------------------ install
def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def eager_attention_forward(*args, **kwargs):
        return eager_call(original, args, kwargs)
    eager_attention_forward.__gproj_original__ = original
    return eager_attention_forward


def original_of(fn: Callable) -> Callable:
    """The unwrapped eager function (``fn`` itself when it is not our wrapper)."""
    return getattr(fn, "__gproj_original__", fn)


def _patch_module(name: str) -> None:
    module = sys.modules.get(name)
    fn = getattr(module, ATTRIBUTE, None)
    if module is None or not callable(fn) or hasattr(fn, "__gproj_original__"):
        return
    with _lock:
        if not INSTALLED.on:
            return
        wrapper = _wrap(fn)
        setattr(module, ATTRIBUTE, wrapper)
        INSTALLED.patched.append((module, fn, wrapper))


def _is_modeling(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and name.startswith(PACKAGE + ".") and parts[3].startswith("modeling_")


def modeling_module_names() -> List[str]:
    """Every ``transformers.models.<model>.modeling_<name>`` module of the installed package (from its files;
    nothing is imported)."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return []
    names = []
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        models = os.path.join(root, "models")
        if not os.path.isdir(models):
            continue
        for model in sorted(os.listdir(models)):
            folder = os.path.join(models, model)
            if not os.path.isdir(folder):
                continue
            names += [f"{PACKAGE}.{model}.{f[:-3]}" for f in sorted(os.listdir(folder))
                      if f.startswith("modeling_") and f.endswith(".py")]
    return names


def install() -> str:
    """Wrap ``eager_attention_forward`` in the modeling modules imported so far and in each one right after it
    is imported. Armed once ``transformers.modeling_utils`` is imported (every modeling module imports it
    first): a process that never imports HF's modeling code pays nothing; one that does pays one pending
    after-import callback per modeling module (measured: about 0.1 ms per later import, 539 names)."""
    from ..runtime.import_hooks import call_after_import
    with _lock:
        if INSTALLED.on:
            return "installed"
        try:
            if importlib.util.find_spec("transformers") is None:
                return "skipped: transformers not installed"
        except (ImportError, ValueError) as exc:
            return f"skipped: transformers not importable ({exc})"
        INSTALLED.on = True
        hook = call_after_import(MODELING_UTILS, _arm)
        if hook is not None:
            INSTALLED.pending.append(hook)
    return "installed"


def _arm() -> None:
    """Wrap the modeling modules imported so far; watch every other one (``call_after_import`` also waits for
    a module whose import is still running, e.g. the one that imported ``modeling_utils``)."""
    from ..runtime.import_hooks import call_after_import
    with _lock:
        if not INSTALLED.on:
            return
        loaded = [n for n in list(sys.modules) if _is_modeling(n)]
        for name in dict.fromkeys(loaded + modeling_module_names()):
            hook = call_after_import(name, functools.partial(_patch_module, name))
            if hook is not None:
                INSTALLED.pending.append(hook)


def uninstall() -> None:
    """Restore every wrapped global by identity (where it still holds our wrapper); withdraw pending hooks."""
    with _lock:
        INSTALLED.on = False
        for hook in INSTALLED.pending:
            hook.cancel()
        INSTALLED.pending.clear()
        for module, original, wrapper in reversed(INSTALLED.patched):
            restore_by_identity(vars(module), ATTRIBUTE, wrapper, original,
                                where=f"{module.__name__}.{ATTRIBUTE}", change="rebound")
        INSTALLED.patched.clear()


def patched_modules() -> List[str]:
    """Names of the modules whose eager function is wrapped now."""
    with _lock:
        return [m.__name__ for m, _, w in INSTALLED.patched if getattr(m, ATTRIBUTE, None) is w]
