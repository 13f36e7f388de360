"""Hook: flash-attn's corrected backward — FA2/FA3 as the kernel of their backward custom ops, FA4 as a proxy.

FA2/FA3: the backward op decides. FA2 ≥ 2.7 defines its backward as ``torch.library.custom_op`` ops
(``flash_attn::_flash_attn_backward`` and ``flash_attn::_flash_attn_varlen_backward``; the ``flashattn``
namespace is taken too), called from the ``backward`` of every ``FlashAttn*Func`` (func, varlen, qkvpacked,
kvpacked); FA3 has one op for dense and varlen (``flash_attn_3::_flash_attn_backward``). ``install()``
re-registers the op's CUDA kernel (``CustomOpDef.register_kernel``, what ``torch.library.register_kernel``
calls), so references bound at import time (``torch.ops.flash_attn._flash_attn_backward`` captured in a module
global, HF's preloaded ``flash_attn_func``) are covered. The forward ops are not touched: no Python of this
package runs in an FA2/FA3 forward. The kernel is the one decision of the call, made from its own arguments, as
the SDPA seam makes it (``hooks/sdpa.py``): the ``Problem`` from the backward's arguments (scale, causal,
window, softcap, ``cu_seqlens_*`` / ``max_seqlen_*`` for varlen — every release passes all of them to the
backward op), the context with the options in force at the backward and the layer of the autograd node being run
(the ``FlashAttn*Func`` backward node whose forward ran in a named scope, else ``flash_attn{n}``:
``layers.scope.backward_op_layer``), then the plan (tier, kernel, ``auto``'s sample on q, k and the LSE).

Why the CUDA key and not an autograd key. The releases call their backward op inside ``FlashAttn*Func.backward``
— below autograd already: the op has no autograd formula, nothing above its device kernel is the
library's — and, under ``torch.compile``, from the compiled backward graph, which calls the op again when it runs.
Both paths reach the op's CUDA kernel with real tensors, and only they do: while AOTAutograd traces, the op's fake
kernel answers, so the corrected kernel never sees a FakeTensor and needs no tracing case. An autograd-key kernel
would add nothing that these callers reach, would be called with FakeTensors while tracing, and would sit over
``CustomOpDef``'s own autograd kernel. The kernel registered before is kept and restored by identity on
``uninstall()``; it is also the "original" backward (dropout > 0 — its RNG cannot be replayed elsewhere —,
ALiBi, seqused, an argument the replacement does not take, or the plan). Arguments are read by name (bound
against the op's signature), so the one replacement serves every schema. ``uninstall()`` puts the FA2/FA3
kernels back at once: a backward whose forward ran under the patch then runs the original, and one already on
its way that finds the patch disabled (``config.active()`` None) runs the original too.

FA4 (``flash_attn.cute.interface._flash_attn_bwd``, a plain Python function looked up as a module global by its
autograd Functions) has no op: its backward and its forward ``_flash_attn_fwd`` are replaced as module attributes
by proxies (``fa_records.FunctionProxy``) that forward attribute reads and writes to the function they replace
(FA4 keeps its JIT cache on the function object: ``_flash_attn_bwd.compile_cache``). The plan is made at the
forward: each ``_flash_attn_fwd`` call files its complete ``CallRecord`` (problem, learnable sink, context, plan)
under the storage of the LSE it returns (``fa_records``), and the backward, which receives that LSE, runs it. The
backward's own arguments are checked against it (a contradiction sends the call to the original backward) and
decide only what the record cannot know: seqused, an argument the replacement does not take, output buffers.
``uninstall()`` restores FA4's forward at once and its backward once no forward made under the patch awaits its
backward.

FA4's learnable sink. ``_flash_attn_fwd(..., learnable_sink=(Hq,) fp16/bf16/fp32)`` puts the sink logit in
every row's softmax denominator; the LSE it returns includes it. Since flash-attention #2706 (2026-08),
``_flash_attn_bwd(..., learnable_sink=...)`` computes the sink's gradient itself and returns
``(dq, dk, dv, dsink)``, dsink shaped and typed like the sink (``FlashAttnFunc.backward`` unpacks four values
then); earlier releases never passed the sink to the backward (no sink gradient; ``(dq, dk, dv)``). The
corrected path takes the sink from the backward's ``learnable_sink`` argument, else from the forward's record
(the forward wrapper files the sink it was given) — a sink-including LSE is never corrected towards the no-sink
target — and returns in the backward's own format: the fourth value, dsink, only when the backward was given
``learnable_sink``. A sink that the GProj tiers refuse (softcap together with a sink, a wrong shape or device)
sends the call to the original backward with the reason counted, and so does an earlier FA4's backward whose
forward left no record (it ran before ``enable()``): its LSE may include a sink that nothing passes on, and
correcting it without the sink would be far off.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..runtime import config, telemetry
from ..backends import compat
from ..backends.spec import sink_unsupported_reason
from ..dispatch.record import CallRecord, make_context
from ..dispatch.plan import settled_original
from ..dispatch.router import BackwardTensors, run_backward, run_settled_original
from ..layers.scope import backward_op_layer
from . import fa_records

logger = logging.getLogger("gproj_patch")

# the private upstream names (backends/compat/): read from this module at install() (tests point them elsewhere)
FA2_OPS = compat.FA2_BACKWARD_OPS
FA3_OPS = compat.FA3_BACKWARD_OPS
FA4_FWD = compat.FA4_FORWARD
FA_MODULES = ("flash_attn", "flash_attn_interface", "flash_attn_3", "flash_attn.cute")
FA4_MODULE, FA4_FN = compat.FA4_INTERFACE, compat.FA4_BACKWARD
FA4_LIBRARY = "flash_attn_4"
FA4_SINK = "learnable_sink"  # FA4's argument for the per-head sink logits (forward and backward)
DEVICE_TYPE = "cuda"  # the kernels install() replaces (flash-attn registers CUDA kernels only)

# names the replacement understands (and the values that mean "not used")
_KNOWN = frozenset({"dout", "do", "q", "k", "v", "out", "o", "softmax_lse", "lse", "dq", "dk", "dv", "cu_seqlens_q",
          "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "is_causal",
          "window_size_left", "window_size_right", "softcap", "deterministic", "sm_margin", "dropout_p",
          "rng_state", "zero_tensors", "m_block_size", "n_block_size", "num_threads", "pack_gqa",
          "num_stages_Q", "num_stages_dO", "SdP_swapAB", "dKV_swapAB", "dQ_swapAB", "AtomLayoutMSdP",
          "AtomLayoutNdKV", "AtomLayoutMdQ", "V_in_regs", FA4_SINK})

#: the prefix of an FA2/FA3 call's layer name when no scope named its forward (``flash_attn0``, ...)
UNNAMED = "flash_attn"

UNRECORDED_SINK_REASON = ("FA4 backward without learnable_sink and no forward record (the LSE may include a sink "
                          "it cannot see): original backward")



@dataclass
class InstalledFlashAttn:
    """What ``install()`` did, to be undone by ``uninstall()`` (hook bookkeeping, not runtime state: ``reset()``
    leaves it alone). One instance, ``INSTALLED``, mutated in place and never re-bound."""
    restores: List[Tuple[str, Callable[[], None]]] = field(default_factory=list)  # (what, restore), in order
    #: FA4's backward restore, deferred by ``uninstall()`` until no record of a forward made while on is alive
    draining: List[Callable[[], None]] = field(default_factory=list)


INSTALLED = InstalledFlashAttn()


_arg = fa_records.arg
SINK_DTYPE = fa_records.SINK_DTYPE


_to_bhsd = fa_records.to_bhsd


def _fallback_reason(b: dict) -> Optional[str]:
    if float(_arg(b, "dropout_p", default=0.0)) > 0.0:
        return "dropout > 0 (flash-attn's dropout RNG cannot be replayed): original backward"
    if _arg(b, "alibi_slopes") is not None:
        return "ALiBi slopes: original backward"
    if _arg(b, "sequed_q", "seqused_q", "sequed_k", "seqused_k") is not None:
        return "seqused_q/seqused_k: original backward"
    for name, value in b.items():
        if name not in _KNOWN and name != "alibi_slopes" and value is not None and value is not False \
                and not (isinstance(value, (int, float)) and value == 0):
            return f"unsupported flash-attn argument {name!r}: original backward"
    q = _arg(b, "q")
    if q is None or q.dtype not in (torch.bfloat16, torch.float16):
        return "flash-attn inputs not BF16/FP16: original backward"
    return None


def _sink_reason(sink: Optional[torch.Tensor], q4: torch.Tensor, softcap: float) -> Optional[str]:
    """Why the GProj tiers cannot take this learnable sink (None: no sink, or one they take)."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor) or not sink.is_floating_point():
        return f"learnable_sink of type {type(sink).__name__}, not a floating tensor: original backward"
    reason = sink_unsupported_reason(sink.detach().to(SINK_DTYPE), q4, softcap=softcap)
    return None if reason is None else f"learnable_sink: {reason}: original backward"


def _unknown_sink_reason(forward: fa_records.ForwardRecord, b: dict, forward_takes_sink: bool) -> Optional[str]:
    """Why a backward cannot know its sink: the forward takes sinks, left no record, and the backward has no
    ``learnable_sink`` argument (FA4 before #2706). None otherwise."""
    if forward_takes_sink and not forward.recorded and FA4_SINK not in b:
        return UNRECORDED_SINK_REASON
    return None


def _softmax_d(b: dict, q4: torch.Tensor, o4: torch.Tensor, do4: torch.Tensor, varlen: bool, fake=None):
    """flash-attn's auxiliary return value (rowsum(dO∘O)); callers discard it. Shaped by the op's own fake
    kernel when it has one (FA3's shape depends on its tile sizes), else as FA2 shapes it."""
    if fake is not None:
        try:
            return fake().zero_()
        except Exception:  # a fake that cannot run eagerly: fall back to FA2's shape
            pass
    D = (do4.float() * o4.float()).sum(-1)  # (B, H, S)
    if varlen:
        nseq = _arg(b, "cu_seqlens_q").numel() - 1
        out = D.new_zeros((D.shape[1], D.shape[2] + 128 * nseq))
        out[:, :D.shape[2]] = D[0]
        return out
    sq = D.shape[2]
    out = D.new_zeros((D.shape[0], D.shape[1], -(-sq // 128) * 128))
    out[..., :sq] = D
    return out


def op_backward(b: dict, original: Callable[[], object], library: str, cfg: config.Config, node=None,
                fake: Optional[Callable[[], torch.Tensor]] = None):
    """FA2/FA3's backward op, decided here from its own arguments ``b`` (every parameter of the op, defaults
    applied) and the options ``cfg`` in force now; ``original()`` runs the saved kernel; ``library`` names the
    release (``flash_attn``, ``flash_attn_3``); ``node`` is the autograd node being run (its forward's layer);
    ``fake()`` (optional) builds the op's auxiliary return value with the op's own shape."""
    source = _call_source(library, b)
    reason = _fallback_reason(b)
    if reason is not None or cfg.mode == "off":
        return _kept(reason, source, b, original)
    layer = backward_op_layer(node, unnamed=UNNAMED)
    if settled_original(cfg, layer, has_original=True):  # auto, a healthy layer between samples: no plan
        return run_settled_original(layer, original)
    context = make_context(source, layer, cfg, named=True, in_graph=compat.is_compiled_graph_node(node))
    record = fa_records.planned(CallRecord(fa_records.problem_of(b, None), context), b, _arg(b, "out"),
                                _arg(b, "softmax_lse"))
    return _carry_out(record, b, original, "softmax_d", fake)


def corrected_fa_backward(b: dict, original: Callable[[], object], source: str, returns: str = "softmax_d",
                          fake: Optional[Callable[[], torch.Tensor]] = None, *, forward_takes_sink: bool = False):
    """FA4's backward, running the record its forward filed: ``b`` holds the call's arguments by name (every
    parameter of the backward, defaults applied); ``original()`` runs the saved function; ``source`` names the
    library (``flash_attn_4``); ``fake()`` (optional) builds the auxiliary return value;
    ``forward_takes_sink``: the library's forward accepts a learnable sink."""
    q = _arg(b, "q")
    lse = _arg(b, "softmax_lse", "lse")
    given_sink = _arg(b, FA4_SINK)  # FA4 ≥ #2706 passes the sink and then returns its gradient too
    varlen = _arg(b, "cu_seqlens_q") is not None
    forward = fa_records.find(lse)
    if forward is not None and forward.settled is not None:
        if given_sink is None:
            # auto planned "original" at the forward (the layer settled, no sample due): its own backward
            reason = _fallback_reason(b)
            if reason is None:
                return run_settled_original(forward.settled, original)
            return _kept(reason, _call_source(source, b), b, original)
        forward = None  # a sink its forward did not have: not this call's record
    if forward is None:
        if config.active() is None:
            return original()  # disable() ran and this forward was not made under the patch: untouched
        forward = fa_records.unrecorded(b, _call_source(source, b), given_sink)
    problem = forward.call.problem
    reason = _fallback_reason(b) or \
        (fa_records.mismatch(problem, fa_records.problem_of(b, None)) if forward.recorded else None) or \
        _unknown_sink_reason(forward, b, forward_takes_sink) or \
        _sink_reason(given_sink if given_sink is not None else problem.sink, _to_bhsd(q, varlen), problem.softcap)
    if reason is not None or forward.context.mode == "off":
        return _kept(reason, forward.context.source, b, original)
    return _carry_out(forward.call, b, original, returns, fake, given_sink)


def _kept(reason: Optional[str], source: str, b: dict, original: Callable[[], object]):
    """The library's own backward for a call the hook does not correct (``reason``; None: mode off), counted
    as "original" with its reason (logged once per shape class)."""
    telemetry.record_backward("original", reason, telemetry.shape_class(source, _arg(b, "q"), _arg(b, "k")))
    return original()


def _carry_out(record: CallRecord, b: dict, original: Callable[[], object], returns: str,
               fake: Optional[Callable[[], torch.Tensor]], given_sink: Optional[torch.Tensor] = None):
    """The planned ``record`` run on the call ``b``; returns what the library's backward returns: the auxiliary
    value (``returns="softmax_d"``, FA2/FA3, gradients written into the dq/dk/dv buffers) or the gradients
    (``"grads"``, FA4's ``(dq, dk, dv[, dsink])``)."""
    q, k, v = _arg(b, "q"), _arg(b, "k"), _arg(b, "v")
    lse = _arg(b, "softmax_lse", "lse")
    varlen = _arg(b, "cu_seqlens_q") is not None
    do, o = _arg(b, "dout", "do"), _arg(b, "out", "o")
    if do.shape[-1] < v.shape[-1]:  # head dim padded to a multiple of 8 by the caller, dout not
        do = torch.nn.functional.pad(do, [0, v.shape[-1] - do.shape[-1]])
    q4, k4, v4, o4, do4 = (_to_bhsd(t, varlen) for t in (q, k, v, o, do))
    result = {}

    def run_original():
        result["ret"] = original()
        dq_b, dk_b, dv_b = (_arg(b, n) for n in ("dq", "dk", "dv"))
        if isinstance(result["ret"], tuple) and dq_b is None:  # FA4 returns (dq, dk, dv[, dsink])
            dq_b, dk_b, dv_b = result["ret"][:3]
        return tuple(_to_bhsd(t, varlen) for t in (dq_b, dk_b, dv_b))

    grads = run_backward(record, BackwardTensors(do4, q4, k4, v4, o4, lse), run_original)
    if "ret" in result:  # the original kernel ran and filled the buffers itself
        return result["ret"]
    outs = []
    for name, g, ref in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        buf = _arg(b, name)
        g = g.transpose(1, 2).squeeze(0) if varlen else g.transpose(1, 2)
        if buf is None:
            outs.append(g.to(ref.dtype))
        else:
            buf.copy_(g[..., :buf.shape[-1]]) if g.shape[-1] >= buf.shape[-1] else buf.copy_(g)
            outs.append(buf)
    if returns == "grads":
        if given_sink is not None:  # FA4's format: dsink shaped and typed like the sink it was given
            outs.append(grads[3].to(given_sink.dtype).view_as(given_sink))
        return tuple(outs)
    return _softmax_d(b, q4, o4, do4, varlen, fake)


# ------------------------------------------------------------------------------------------------------------
# custom-op kernels

def _opdef(qualname: str):
    return compat.custom_op_def(qualname)


def _library(qualname: str) -> str:
    """The library an op belongs to, as sources name it: ``flash_attn`` (both FA2 namespaces), ``flash_attn_3``."""
    return qualname.split("::")[0].replace("flashattn", "flash_attn")


def _call_source(library: str, b: dict) -> str:
    """The source of one call (its shape class; an unrecorded FA4 call's layer): library and dense/varlen."""
    return f"{library}:{'varlen' if _arg(b, 'cu_seqlens_q') is not None else 'dense'}"


def _takes_argument(fn: Optional[Callable], name: str) -> bool:
    try:
        return fn is not None and name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no readable signature
        return False


def _register(opdef, device_type: str, kernel: Callable) -> Callable[[], None]:
    """Register ``kernel`` for ``device_type``; returns ``restore`` (puts the previous kernel back by identity)."""
    previous = compat.custom_op_kernel(opdef, device_type)
    kernel.__gproj_patched__ = True
    opdef.register_kernel(device_type)(kernel)

    def restore():
        if compat.custom_op_kernel(opdef, device_type) is not previous:  # put back only over our own
            compat.set_custom_op_kernel(opdef, device_type, previous)
    return restore


def patch_op(qualname: str, device_type: str = "cuda") -> Callable[[], None]:
    """Re-register ``qualname``'s kernel for ``device_type`` with the corrected backward (``op_backward``);
    returns ``restore``.

    ``qualname`` must be a ``torch.library.custom_op`` with flash-attn's argument names (FA2 dense / varlen,
    FA3); the previous kernel stays reachable as the "original" backward and is put back by ``restore()``.
    """
    opdef = _opdef(qualname)
    if opdef is None:
        raise LookupError(f"{qualname} is not a torch.library.custom_op")
    previous = compat.custom_op_kernel(opdef, device_type)
    if previous is None:
        raise LookupError(f"{qualname} has no {device_type} kernel to replace")
    bind = fa_records.Binder(inspect.signature(compat.custom_op_signature_fn(opdef)))
    library = _library(qualname)

    def kernel(*args, **kwargs):
        cfg = config.active()
        if cfg is None:  # disable() ran while this call was on its way here: the original, untouched
            return previous(*args, **kwargs)
        fake = compat.custom_op_fake(opdef)
        return op_backward(bind(args, kwargs), lambda: previous(*args, **kwargs), library, cfg,
                           compat.current_autograd_node(),
                           fake=None if fake is None else (lambda: fake(*args, **kwargs)))
    return _register(opdef, device_type, kernel)


def _patch_attr(module, name: str, library: str, backward: bool) -> Callable[[], None]:
    """Replace FA4's module function ``name`` by a proxy: the corrected backward, or the recording forward."""
    previous = getattr(module, name)
    signature = inspect.signature(previous)
    if backward:
        takes_sink = _takes_argument(getattr(module, FA4_FWD, None), FA4_SINK)

        bind = fa_records.Binder(signature)

        def call(*args, **kwargs):
            return corrected_fa_backward(bind(args, kwargs), lambda: previous(*args, **kwargs), library,
                                         returns="grads", forward_takes_sink=takes_sink)
    else:
        call = fa_records.recording(previous, signature, lambda b: _call_source(library, b),
                                    sink_name=FA4_SINK if _takes_argument(previous, FA4_SINK) else None)
    replacement = fa_records.FunctionProxy(previous, call)
    setattr(module, name, replacement)

    def restore():
        if getattr(module, name) is replacement:
            setattr(module, name, previous)
    return restore


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _has_kernel(qualname: str) -> bool:
    opdef = _opdef(qualname)
    return opdef is not None and compat.custom_op_kernel(opdef, DEVICE_TYPE) is not None


def install() -> str:
    if INSTALLED.restores:
        return "installed"
    _finish_draining()  # a previous disable() still waiting: put FA4's backward back first, then patch anew
    for mod in FA_MODULES:
        if _importable(mod):
            try:
                importlib.import_module(mod)
            except Exception as exc:  # a broken build must not break enable()
                logger.warning("importing %s failed (%s); not patched", mod, exc)
    done: Dict[str, Callable[[], None]] = {}
    try:
        for qualname in FA2_OPS + FA3_OPS:
            if _has_kernel(qualname):
                done[qualname] = patch_op(qualname, DEVICE_TYPE)
        fa4 = compat.fa4_interface()
        if fa4 is not None:
            done[f"{FA4_MODULE}.{FA4_FN}"] = _patch_attr(fa4, FA4_FN, FA4_LIBRARY, backward=True)
            if hasattr(fa4, FA4_FWD):
                done[f"{FA4_MODULE}.{FA4_FWD}"] = _patch_attr(fa4, FA4_FWD, FA4_LIBRARY, backward=False)
    except BaseException:
        for restore in reversed(list(done.values())):
            restore()
        raise
    INSTALLED.restores.extend(done.items())
    if not done:
        return "skipped: flash-attn not installed"
    return "installed: " + ", ".join(done)


def _awaits_records(what: str) -> bool:
    """FA4's backward: it runs the records its forwards filed (FA2/FA3's backward ops need none)."""
    return what.endswith("." + FA4_FN)


def uninstall() -> None:
    """Restore FA2/FA3's backward kernels and FA4's forward now; FA4's backward once no FA4 forward made under
    the patch awaits its backward (that backward runs what its forward recorded)."""
    deferred = []
    while INSTALLED.restores:
        what, restore = INSTALLED.restores.pop()
        if _awaits_records(what):
            deferred.append(restore)
        else:
            restore()
    if deferred:
        INSTALLED.draining.extend(deferred)
        fa_records.when_no_records(_finish_draining)


def _finish_draining() -> None:
    while INSTALLED.draining:
        INSTALLED.draining.pop()()
