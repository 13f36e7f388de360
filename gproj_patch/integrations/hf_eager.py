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
the unpatched forward bit for bit and the attention weights are still returned (``ops/hf_eager.py``). Whether
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

from ..layers.scope import module_layer_name
from .hf_eager_forms import EagerForm, form_of, parameters
from .restore import restore_by_identity

logger = logging.getLogger("gproj_patch")

ATTRIBUTE = "eager_attention_forward"
PACKAGE = "transformers.models"
MODELING_UTILS = "transformers.modeling_utils"
SOURCE = "hf_eager"
#: explicit parameters the routed math covers (the first five positional ones are module, q, k, v, mask)
ROUTED_PARAMETERS = ("scaling", "dropout", "softcap")

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
    import torch
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
    import torch
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
    import torch

    from ..ops.hf_eager import mask_unsupported_reason
    from ..dispatch.autograd import transform_reason
    form = form_of(fn)
    if isinstance(form, str):
        return form
    tensors = (b.query, b.key, b.value)
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return "query/key/value are not plain tensors"
    if any(t.dim() != 4 or t.numel() == 0 for t in tensors):
        return "inputs are not non-empty 4-D (B, H, S, D)"
    return transform_reason(*tensors) or _argument_reason(b, form) or mask_unsupported_reason(b.mask, b.query.shape[2], b.key.shape[2])


def eager_call(fn, args, kwargs):
    """One call of the wrapped eager function ``fn``: the original, or the same forward with the corrected
    backward."""
    from ..runtime import config, telemetry
    from ..ops import hf_eager as op
    import torch
    cfg = config.active()
    if cfg is None or cfg.mode == "off" or torch.compiler.is_compiling():
        return fn(*args, **kwargs)  # under torch.compile: traced as it is (uncorrected; see the report)
    b = _bind(fn, args, kwargs)
    if b is None or not all(hasattr(t, "requires_grad") for t in (b.query, b.key, b.value)):
        return fn(*args, **kwargs)
    form = form_of(fn)
    sink = getattr(b.module, "sinks", None) if isinstance(form, EagerForm) and form.sink else None
    if not op.needs_correction(b.query, b.key, b.value, sink):
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
    call = op.EagerCall(fn=forward, scale=float(b.scaling), mask=b.mask,
                        softcap=float(b.softcap) if b.softcap is not None and form.softcap == "applied" else 0.0,
                        sink=sink, sink_is_argument=False, layer=module_layer_name(b.module), source=SOURCE)
    return op.run_eager(call, b.query, b.key, b.value)


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
