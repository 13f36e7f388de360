"""Hook: replace ``torch.nn.functional.scaled_dot_product_attention`` by a Python wrapper.

Why this level. ``F.scaled_dot_product_attention`` is a C builtin looked up as a module attribute by callers that
write ``F.scaled_dot_product_attention(...)`` at call time (HF's "sdpa" attention, ``nn.MultiheadAttention``
through ``F.multi_head_attention_forward``). A Python wrapper can run the original forward itself (so PyTorch
picks the same fused kernel and the output is the same, bit for bit) and still reach the original backward when
the policy wants it. Dispatcher-level overrides of the ``aten::_scaled_dot_product_*_backward`` CUDA kernels
would reach every caller but make the original backward unreachable while registered (calling it re-enters the
override) and would not cover the CPU path.

Transparency. The wrapper dispatches ``__torch_function__`` first, exactly as the builtin does: tensor
subclasses (``torch.nn.attention.bias.CausalBias``, user subclasses) and ``TorchFunctionMode``s see the call with
``func is torch.nn.functional.scaled_dot_product_attention`` (the wrapper, while installed) and the arguments as
given, and take over as they would without the patch. A mode that forwards the call re-enters the wrapper with
the mode off and gets the corrected backward. Subclasses without ``__torch_function__`` (DTensor, FakeTensor)
take the original path (``ops/sdpa.unsupported_reason``).

Names bound before ``enable()``. Code that bound the function at import time (``from torch.nn.functional import
scaled_dot_product_attention``, ``sdpa = F.scaled_dot_product_attention``, ``torch._C._nn.scaled_dot_product_attention``
under any name) holds the C builtin, which the wrapper on ``F`` does not reach. ``install()`` therefore scans
the globals of every module in ``sys.modules`` for that very object (identity, never equality; nothing is
imported, module ``__getattr__`` never runs), rebinds each hit to the wrapper, logs the list once, and
``uninstall()`` puts back exactly those bindings that still hold the wrapper. Excluded (``EXCLUDED_PACKAGES``):
``torch`` and its submodules — ``torch._C._nn`` and ``torch.nn.functional`` define the function (the latter is
the attribute patched above), and torch's internals that hold or compare it (``torch.nn.attention.bias``'s
``__torch_function__`` implementation, the tracing and export identity tables of dynamo, fx, onnx) must keep
seeing the builtin —, and ``gproj_patch`` itself, whose ``ops/sdpa.C_SDPA`` *is* the original the wrapper calls
(rebinding it would make the wrapper call itself). Modules imported while the hook is installed read ``F``'s
attribute and bind the wrapper themselves; after ``uninstall()`` the wrapper they hold passes every call to the
original untouched, so ``disable()`` turns them off too. Not reached: references held elsewhere than a module
global (class attributes, closures, ``functools.partial``, containers); call ``gproj_patch.attention`` there, or
look the function up at call time. To call the unpatched builtin while enabled, look it up at call time from
``torch._C._nn`` (excluded from the scan).
"""
from __future__ import annotations

import functools
import logging
import operator
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from ..runtime import telemetry
from ..backends import compat
from ..runtime.state import STATE
from .restore import restore_by_identity
from ..ops import sdpa as sdpa_op

logger = logging.getLogger("gproj_patch")


@dataclass(frozen=True)
class BoundName:
    """One module global that held the original function and now holds the wrapper."""
    module_name: str
    name: str
    module: Callable[[], Optional[types.ModuleType]]  # weak reference: a module dropped from sys.modules is freed


@dataclass
class InstalledSdpa:
    """What ``install()`` did, to be undone by ``uninstall()`` (hook bookkeeping, not runtime state: ``reset()``
    leaves it alone). One instance, ``INSTALLED``, mutated in place and never re-bound."""
    saved: Optional[Callable] = None  # the object F.scaled_dot_product_attention held before install()
    bound: List[BoundName] = field(default_factory=list)  # the module globals install() rebound
    last_report: Tuple[str, ...] = ()  # the rebound names last logged (logged again only when they change)


INSTALLED = InstalledSdpa()


_TENSOR_ARGS = ("query", "key", "value", "attn_mask")
#: the builtin's signature: ``(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
#: enable_gqa=False)`` — six positional parameters, the last two keyword-only
_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_KEYWORDS = frozenset(_POSITIONAL + ("scale", "enable_gqa"))
_BOOL = (bool, torch.SymBool)
_NUMBER = (float, int, bool, torch.SymFloat, torch.SymInt)


MALFORMED_REASON = "sdpa: arguments in a form the hook does not take (passed to the builtin untouched)"


def _well_formed(args: tuple, kwargs: dict) -> bool:
    """True when the builtin's argument parser would accept this call (names, counts, tensors where it takes
    tensors, Python types of the scalars). Any other call goes to the original untouched, which raises its own ``TypeError``, at the call,
    with its own message (``scaled_dot_product_attention() got an unexpected keyword argument ...``)."""
    if len(args) > len(_POSITIONAL) or len(args) + len(kwargs) < 3:
        return False
    for name in kwargs:
        if name not in _KEYWORDS or name in _POSITIONAL[:len(args)]:
            return False
    if len(args) < 3 and any(n not in kwargs for n in _POSITIONAL[len(args):3]):
        return False
    bound = dict(zip(_POSITIONAL, args))
    bound.update(kwargs)
    return (isinstance(bound["query"], torch.Tensor) and isinstance(bound["key"], torch.Tensor)
            and isinstance(bound["value"], torch.Tensor)
            and (bound.get("attn_mask") is None or isinstance(bound["attn_mask"], torch.Tensor))
            and isinstance(bound.get("dropout_p", 0.0), _NUMBER)
            and isinstance(bound.get("is_causal", False), _BOOL)
            and isinstance(bound.get("enable_gqa", False), _BOOL)
            and (bound.get("scale") is None or isinstance(bound["scale"], _NUMBER)))


@functools.wraps(sdpa_op.C_SDPA)
def scaled_dot_product_attention(*args, **kwargs):
    """``F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
    scale=None, enable_gqa=False)`` with the corrected backward (arguments passed on exactly as given).
    While the hook is not installed (a module bound this wrapper during ``enable()``, then ``disable()`` ran)
    every call goes to the original function untouched."""
    if INSTALLED.saved is None:
        return sdpa_op.original_sdpa()(*args, **kwargs)
    if not _well_formed(args, kwargs):
        # a call the builtin's parser rejects (its own error, at the call) or takes in a form the hook does not
        # (a tensor scale, ...): the builtin untouched; reported when it computed something that needs a gradient
        out = sdpa_op.original_sdpa()(*args, **kwargs)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            telemetry.record_forward("original", MALFORMED_REASON, telemetry.shape_class("sdpa"))
        return out
    # a tuple, built so: dynamo traces this wrapper, and a list here broke compiled CausalBias calls (PyTorch's
    # TestAttnBiasCPU compile variants in tests/test_external_torch_sdpa.py)
    relevant = tuple(a for a in args[:4] if a is not None) + \
        tuple(kwargs[n] for n in _TENSOR_ARGS if kwargs.get(n) is not None)
    if any(getattr(t, "is_nested", False) for t in relevant):
        # nested tensors dispatch on the builtin itself (their table is keyed by it): hand the call over untouched
        if torch.is_grad_enabled():
            telemetry.record_forward("original", "sdpa: nested tensors", telemetry.shape_class("sdpa", *relevant[:2]))
        return sdpa_op.original_sdpa()(*args, **kwargs)
    if has_torch_function(relevant):
        return _dispatch_override(relevant, args, kwargs)
    if not torch.compiler.is_compiling():
        # counted for _dispatch_override only; under tracing a thread-local write would become a Dynamo guard
        # that fails on the next call (a recompile per call)
        reentry = STATE.sdpa_reentry
        reentry.count = getattr(reentry, "count", 0) + 1
    return sdpa_op.sdpa(*args, **kwargs)



# Pickled by reference, as every function is: ``functools.wraps`` gave the wrapper the builtin's module
# (``torch._C._nn``), whose attribute is the builtin, so pickle refused it ("not the same object") — and with it
# ``torch.save`` of a module holding ``F.scaled_dot_product_attention``, or a spawn worker's arguments. Named after
# where the wrapper is installed instead, it pickles as ``torch.nn.functional.scaled_dot_product_attention``: the
# patched function where the pickle is loaded with the patch on, the builtin where it is off.
scaled_dot_product_attention.__module__ = "torch.nn.functional"

def _dispatch_override(relevant, args, kwargs):
    """Let the subclass or mode handle the call, as the builtin does. A subclass that computes attention without
    calling SDPA back (CausalBias lower-right on an efficient kernel) is counted as passed through."""
    reentry = STATE.sdpa_reentry
    before = getattr(reentry, "count", 0)
    out = handle_torch_function(scaled_dot_product_attention, relevant, *args, **kwargs)
    subclasses = [type(t).__name__ for t in relevant if compat.overrides_torch_function(type(t))]
    if subclasses and getattr(reentry, "count", 0) == before and torch.is_grad_enabled():
        telemetry.record_forward("original", f"sdpa: __torch_function__ of {', '.join(dict.fromkeys(subclasses))} "
                                 "computed attention without SDPA: passed through", telemetry.shape_class("sdpa"))
    return out


scaled_dot_product_attention.__gproj_patched__ = True


# ------------------------------------------------------------------------------------------------------------
# names bound before install() (module docstring)

#: packages whose module globals are never rebound: torch (defines the function; its internals must see the
#: builtin) and this package (``ops/sdpa.C_SDPA`` is the original the wrapper calls)
EXCLUDED_PACKAGES = frozenset(("torch", "gproj_patch"))


def excluded_module(module_name: str) -> bool:
    """True for a module of ``EXCLUDED_PACKAGES`` (its globals are never rebound)."""
    return module_name.partition(".")[0] in EXCLUDED_PACKAGES


def _namespace(module) -> Optional[dict]:
    """A module's globals, read without running any ``__getattr__``/``__getattribute__`` of the object (None
    for entries of ``sys.modules`` that are not modules)."""
    if not issubclass(type(module), types.ModuleType):
        return None
    try:
        namespace = object.__getattribute__(module, "__dict__")
    except Exception:  # noqa: BLE001 - an exotic module without a namespace is skipped
        return None
    return namespace if type(namespace) is dict else None


def _weak(module: types.ModuleType) -> Callable[[], Optional[types.ModuleType]]:
    try:
        return weakref.ref(module)
    except TypeError:  # a module subclass without weak references: held strongly
        return lambda: module


def find_bound_names(target) -> List[Tuple[types.ModuleType, str, str]]:
    """(module, module name, attribute) of every global, outside ``EXCLUDED_PACKAGES``, that *is* ``target``.
    One identity pass over each module's values (no equality, no import); modules without it are skipped."""
    is_target = functools.partial(operator.is_, target)
    hits = []
    for module_name, module in list(sys.modules.items()):
        if not isinstance(module_name, str) or excluded_module(module_name):
            continue
        namespace = _namespace(module)
        if namespace is None or not any(map(is_target, list(namespace.values()))):
            continue
        hits.extend((module, module_name, name) for name, value in list(namespace.items()) if value is target)
    return hits


def _rebind_bound_names(original) -> List[BoundName]:
    bound = []
    for module, module_name, name in find_bound_names(original):
        namespace = _namespace(module)
        if namespace.get(name) is original:  # still the original (another thread may have changed it)
            namespace[name] = scaled_dot_product_attention
            bound.append(BoundName(module_name=module_name, name=name, module=_weak(module)))
    return bound


def _report(bound: List[BoundName]) -> None:
    names = tuple(f"{b.module_name}.{b.name}" for b in bound)
    if names and names != INSTALLED.last_report:
        logger.warning("scaled_dot_product_attention was bound before enable() in %d module global(s), now "
                       "patched (restored by disable()): %s", len(names), ", ".join(names))
        INSTALLED.last_report = names


def _restore_bound_names(original) -> None:
    while INSTALLED.bound:
        b = INSTALLED.bound.pop()
        module = b.module()
        namespace = None if module is None else _namespace(module)
        if namespace is None:
            continue
        restore_by_identity(namespace, b.name, scaled_dot_product_attention, original, f"{b.module_name}.{b.name}",
                            change="rebound")


def bound_names() -> List[str]:
    """``"module.attribute"`` of each global ``install()`` rebound to the wrapper (empty when not installed)."""
    return [f"{b.module_name}.{b.name}" for b in INSTALLED.bound]


# ------------------------------------------------------------------------------------------------------------

def is_installed() -> bool:
    return INSTALLED.saved is not None


def install() -> str:
    """Put the wrapper on ``F`` and on every module global that held the original (``find_bound_names``)."""
    if INSTALLED.saved is not None:
        return "installed"
    current = F.scaled_dot_product_attention
    if compat.is_context_parallel_wrapper(current):
        logger.warning("context_parallel is active: the SDPA hook is not installed inside it (its backward would "
                       "be computed from local shards); call enable() before entering context_parallel")
        return "skipped: context_parallel is active; enable() before entering it"
    ours = getattr(current, "__gproj_patched__", False)
    # TorchScript scripts F.multi_head_attention_forward, which reads this name: compile the wrapper as the aten op
    compat.register_torchscript_builtin(scaled_dot_product_attention, "aten::scaled_dot_product_attention")
    INSTALLED.saved = current
    sdpa_op.set_original(None if ours else current)
    F.scaled_dot_product_attention = scaled_dot_product_attention
    if not ours:
        INSTALLED.bound.extend(_rebind_bound_names(current))
        _report(INSTALLED.bound)
    return "installed"  # the rebound names: bound_names() and the log line


def uninstall() -> None:
    if INSTALLED.saved is None:
        return
    restore_by_identity(vars(F), "scaled_dot_product_attention", scaled_dot_product_attention, INSTALLED.saved,
                        "torch.nn.functional.scaled_dot_product_attention")
    _restore_bound_names(INSTALLED.saved)
    sdpa_op.set_original(None)
    INSTALLED.saved = None
