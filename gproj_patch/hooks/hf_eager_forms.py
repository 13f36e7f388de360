"""What an HF eager attention function computes and which of its arguments it reads, found once per function.

Whether an eager call's backward can be corrected (``hooks/hf_eager.py``) depends on what the model's
function computes, which differs between models (GQA or not, softcap, gpt-oss's sink column, T5's position bias,
...), and on which of the arguments it is given it reads.

The probe (``form_of``). Each function runs once on a tiny fp64 problem and is compared with the fp64 oracle
(``backends.reference``): ``softmax(scaling·QKᵀ [+softcap] + mask) V`` with additive masks, with GQA through
``module.num_key_value_groups`` or not, with ``module.sinks`` as a sink column or not, applying its ``softcap``
argument or ignoring it. A function that matches none of these, or raises on the probe module, has no form (the
reason instead): its calls keep their original backward.

The arguments it reads (``parameters``). HF's attention modules pass their ``**kwargs`` on to the attention
function: besides ``dropout`` and ``scaling``, the Trainer's ``num_items_in_batch``, ``position_ids``,
``use_cache``, ``output_attentions``, a padding-free collator's ``cu_seq_lens_q/k``, ``max_length_q/k`` and
``seq_idx``, ``is_causal``, a model's ``sliding_window``, ``s_aux``/``sinks``, ``position_bias``, ... (the set
changes with every release and model). So the rule is read from the function's code, not from a list of names:
an argument bound to a parameter its code never refers to — or landing in a ``**kwargs`` its code never refers
to — cannot change what it computes (every eager function of Transformers 5.17 and 5.25 ignores its
``**kwargs``; the mask carries causality, windows and packed documents). Where the code cannot be read (no
Python code object, a wrapper whose code is not the signature's, a reference to the frame's locals), every
parameter counts as read.
"""
from __future__ import annotations

import dis
import inspect
import threading
import weakref
from dataclasses import dataclass
from types import MappingProxyType
from typing import FrozenSet, Optional

#: names through which code reads its arguments without naming them (the frame's locals): a function whose code
#: (or a function defined in it) refers to one of them is taken to read every argument
FRAME_READERS = frozenset({"locals", "vars", "eval", "exec", "_getframe", "currentframe", "f_locals"})

_lock = threading.RLock()


@dataclass(frozen=True)
class EagerForm:
    """What a probed eager function computes. ``softcap``: "applied", "ignored" or "unknown"."""
    gqa: bool
    sink: bool
    softcap: str


#: bounded cache: each eager function's probed form (or why it has none), dropped with the function (weak keys):
#: at most one entry per live modeling module's eager_attention_forward
_forms: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

PROBE_SHAPE = MappingProxyType(dict(batch=2, heads=4, kv_heads=2, sq=5, sk=7, dim=8))
PROBE_SCALE = 0.3
PROBE_SOFTCAP = 1.5
PROBE_TOLERANCE = 1e-5     # eager softmaxes in fp32: the fp64 probe agrees to fp32's precision
PROBE_MASKED = -1e4        # a masked key in the probe's additive mask (no row fully masked)


def _probe_module(heads: int, kv_heads: int, dim: int):
    import torch

    class _ProbeAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.num_key_value_groups = heads // kv_heads
            self.head_dim = dim
            self.scaling = PROBE_SCALE
            self.is_causal = False
            self.sinks = torch.nn.Parameter(torch.linspace(-1.0, 2.5, heads, dtype=torch.float64))
    return _ProbeAttention().eval()


def _probe_inputs(kv_heads: int):
    import torch
    p = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    q = torch.randn(p["batch"], p["heads"], p["sq"], p["dim"], generator=g, dtype=torch.float64) * 2
    k = torch.randn(p["batch"], kv_heads, p["sk"], p["dim"], generator=g, dtype=torch.float64) * 2
    v = torch.randn(p["batch"], kv_heads, p["sk"], p["dim"], generator=g, dtype=torch.float64)
    bias = torch.rand(p["batch"], 1, p["sq"], p["sk"], generator=g, dtype=torch.float64) - 0.5
    hidden = torch.rand(p["batch"], 1, p["sq"], p["sk"], generator=g) < 0.3
    hidden[..., 0] = False
    return q, k, v, bias.masked_fill(hidden, PROBE_MASKED)


def _matches(fn, kv_heads: int, *, sink: bool, ref_softcap: float = 0.0, call_kwargs: Optional[dict] = None) -> bool:
    """Whether ``fn`` (given ``call_kwargs``) on the probe problem equals the oracle with a sink or not and
    softcap ``ref_softcap`` (fp64)."""
    import torch

    from ..backends.reference import reference_forward
    p = PROBE_SHAPE
    q, k, v, mask = _probe_inputs(kv_heads)
    module = _probe_module(p["heads"], kv_heads, p["dim"])
    with torch.no_grad():
        out, _ = fn(module, q, k, v, mask, scaling=PROBE_SCALE, dropout=0.0, **(call_kwargs or {}))
        want, _ = reference_forward(q, k, v, attn_mask=mask, scale=PROBE_SCALE, softcap=ref_softcap,
                                    sink=module.sinks.detach() if sink else None)
    out = out.transpose(1, 2).double()
    return out.shape == want.shape and float((out - want).norm() / want.norm()) < PROBE_TOLERANCE


def _probe(fn) -> "EagerForm | str":
    p = PROBE_SHAPE
    try:
        base = [s for s in (False, True) if _matches(fn, p["heads"], sink=s)]
        if not base:
            return "it computes something else than softmax(scaling·QKᵀ + mask)·V (with or without a sink)"
        sink = base[0]
        try:
            gqa = _matches(fn, p["kv_heads"], sink=sink)
        except Exception:  # noqa: BLE001 - a function without GQA fails on unequal head counts
            gqa = False
        softcap = "unknown"
        if not sink:
            try:
                capped = {"softcap": PROBE_SOFTCAP}
                if _matches(fn, p["heads"], sink=False, ref_softcap=PROBE_SOFTCAP, call_kwargs=capped):
                    softcap = "applied"
                elif _matches(fn, p["heads"], sink=False, call_kwargs=capped):
                    softcap = "ignored"
            except TypeError:
                pass
        return EagerForm(gqa=gqa, sink=sink, softcap=softcap)
    except Exception as exc:  # noqa: BLE001 - whatever the function needs that the probe lacks
        return f"the probe raised {type(exc).__name__}: {exc}"


def form_of(fn) -> "EagerForm | str":
    """The probed form of an eager function (cached per function object), or why it is not routed."""
    with _lock:
        try:
            return _forms[fn]
        except (KeyError, TypeError):
            pass
        form = _probe(fn)
        try:
            _forms[fn] = form
        except TypeError:  # not weak-referenceable: probed again next time
            pass
        return form


# ------------------------------------------------------------------------------ the arguments it reads
@dataclass(frozen=True)
class Parameters:
    """An eager function's signature and the parameters its code never refers to (the ``**kwargs`` one
    included): an argument bound to one of them cannot change what the function computes."""
    signature: inspect.Signature
    unread: FrozenSet[str]


#: bounded cache: each eager function's parameters, dropped with the function (weak keys)
_params: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _code_objects(code):
    """``code`` and every code object defined in it (nested functions, lambdas, comprehensions)."""
    yield code
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _code_objects(const)


def unread_parameters(fn, sig: inspect.Signature) -> FrozenSet[str]:
    """The parameters of ``fn`` its code never refers to, read from its bytecode: a name no instruction of
    ``fn``'s own code mentions (loads, stores, the super-instructions of newer Pythons whose argument is a tuple
    of names, a constant or attribute of that name — any mention counts, so a doubt counts as a read) and no
    nested function captures (a cell variable). Empty — every parameter read — when that cannot be told:
    ``fn`` has no Python code object, its code's parameters are not its signature's (a ``functools.wraps``
    wrapper passes them on), or it refers to its frame's locals (``FRAME_READERS``)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return frozenset()
    count = (code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
             + bool(code.co_flags & inspect.CO_VARKEYWORDS))
    names = set(code.co_varnames[:count])
    if names != set(sig.parameters) or any(FRAME_READERS & set(c.co_names) for c in _code_objects(code)):
        return frozenset()
    mentioned = set(code.co_cellvars)
    for ins in dis.get_instructions(code):
        value = ins.argval
        mentioned.update(v for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, str))
    return frozenset(names - mentioned)


def parameters(fn) -> Parameters:
    """``fn``'s signature and unread parameters, cached per function (they are read on every call)."""
    try:
        return _params[fn]
    except KeyError:
        sig = inspect.signature(fn)
        params = _params[fn] = Parameters(sig, unread_parameters(fn, sig))
        return params
    except TypeError:  # not weak-referenceable
        sig = inspect.signature(fn)
        return Parameters(sig, unread_parameters(fn, sig))
