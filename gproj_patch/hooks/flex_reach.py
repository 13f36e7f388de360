"""Reach every binding of torch's ``flex_attention``: the function keeps its identity, its code is swapped.

Why this level. ``flex_attention`` is a plain Python function, and real code holds it in places no attribute
replacement reaches: ``from torch.nn.attention.flex_attention import flex_attention`` at import time (a module
global of any module), ``flex_attention = torch.compile(flex_attention)`` made before ``enable()`` (torchtitan:
a class attribute; the compiled wrapper closes over the function object), ``functools.partial``, HF's
``WrappedFlexAttention`` singleton. Every one of them calls the *same function object*, so every one of them
runs whatever code object that function holds at call time. ``install()`` therefore replaces
``flex_attention.__code__`` by the code of the hook's function (``hooks/flex.py``'s ``flex_attention``:
same parameters, names, kinds and order; the defaults stay the function's own), whose body hands the call to the
hook. Under ``torch.compile`` Dynamo runs the frame of that code: a ``torch.compile(flex_attention)`` wrapper
made before ``enable()`` compiles the hook afresh (its cache lives on the old code object, which is back in use
after ``disable()``), and a compiled region that inlined ``flex_attention`` recompiles once, because Dynamo guards
an inlined function by its ``__code__`` (``GuardBuilder.CLOSURE_MATCH``).

This module is the mechanism only and imports nothing of the hook: the hook hands its function to ``install()``,
so the hook's module imports this one and its function imports the hook, with no import circle.

The original behaviour stays reachable through ``original``: a new function object with torch's original code,
globals, defaults and attributes. The hook calls it for the forward and for every pass-through, so errors,
warnings and outputs are the original's (the traceback has two more frames).

Identity is unchanged: ``torch.nn.attention.flex_attention.flex_attention`` is the same object while enabled
(``is`` comparisons, ``inspect.signature``, pickling by name). ``uninstall()`` puts the original code back if the
function still holds the swapped one (by identity), else leaves it and warns.

When the swap is refused (``swap_reason``: the module attribute is not a plain function — another library
replaced it —, or its parameters differ from the hook function's), the fallback replaces the module attribute
with the hook's function only, and ``Reach.not_reached`` names every module global that still holds the function
(those keep the uncorrected backward), logged once by the caller.
"""
from __future__ import annotations

import functools
import inspect
import logging
import operator
import sys
import types
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

logger = logging.getLogger("gproj_patch")

ATTRIBUTE = "torch.nn.attention.flex_attention.flex_attention"


def _parameters(fn) -> Tuple[Tuple[str, object], ...]:
    """(name, kind) of each parameter, read from the code object (what a code swap must preserve)."""
    return tuple((p.name, p.kind) for p in inspect.signature(fn, follow_wrapped=False).parameters.values())


def swap_reason(fn, hook: types.FunctionType) -> Optional[str]:
    """Why ``fn``'s code cannot be replaced by the code of ``hook`` (None: it can)."""
    if type(fn) is not types.FunctionType:
        return f"{ATTRIBUTE} is {fn!r}, not torch's function (replaced by another library?)"
    if fn.__code__ is hook.__code__:
        return f"{ATTRIBUTE} already runs this hook's code (another copy of gproj_patch?)"
    if fn.__code__.co_freevars:
        return f"{ATTRIBUTE} is a closure (free variables {fn.__code__.co_freevars})"
    if _parameters(fn) != _parameters(hook):
        return f"{ATTRIBUTE}'s parameters differ from the ones this hook was written for: {inspect.signature(fn)}"
    return None


def copy_function(fn: types.FunctionType) -> types.FunctionType:
    """A new function object with ``fn``'s code, globals, defaults, closure and attributes (``original``)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__module__, copy.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__dict__.update(fn.__dict__)
    return copy


@dataclass
class Reach:
    """What ``install()`` did. ``function``: torch's function (its code swapped when ``swapped``);
    ``original``: what the hook calls as the unpatched flex_attention; ``hook``: the hook's function (its code is
    the swapped-in code; the module attribute in the fallback); ``not_reached``: the bindings that keep the
    original (fallback only); ``reason``: why the swap was refused (None when it was made)."""
    function: Callable
    original: Callable
    original_code: Optional[types.CodeType]
    swapped: bool
    hook: types.FunctionType
    reason: Optional[str] = None
    not_reached: Tuple[str, ...] = ()

    def status(self) -> str:
        """``Handle.installed["flex"]``: "installed", or what was not reached and why."""
        if self.swapped:
            return "installed"
        names = ", ".join(self.not_reached) or "none found in module globals"
        return (f"installed for call-time lookups only ({self.reason}); names bound before enable() and "
                f"torch.compile(flex_attention) objects made before it keep the uncorrected backward: {names}")


def install(fa_module: types.ModuleType, hook: types.FunctionType,
            bound_names: Callable[[Callable], List[str]]) -> Reach:
    """Swap the code of ``fa_module.flex_attention`` for ``hook``'s (module docstring), or, when ``swap_reason``
    refuses, replace the module attribute by ``hook`` and name the module globals (``bound_names(function)``)
    that keep the original."""
    fn = fa_module.flex_attention
    reason = swap_reason(fn, hook)
    if reason is None:
        reach = Reach(function=fn, original=copy_function(fn), original_code=fn.__code__, swapped=True, hook=hook)
        fn.__code__ = hook.__code__
        return reach
    not_reached = tuple(bound_names(fn))
    fa_module.flex_attention = hook
    return Reach(function=fn, original=fn, original_code=None, swapped=False, hook=hook, reason=reason,
                 not_reached=not_reached)


def uninstall(fa_module: types.ModuleType, reach: Reach) -> bool:
    """Undo ``install()`` by identity: the original code goes back only where the swapped code still sits, the
    module attribute only where this hook's function still sits. True when restored."""
    if not reach.swapped:
        from .restore import restore_by_identity
        return restore_by_identity(vars(fa_module), "flex_attention", reach.hook, reach.function, ATTRIBUTE)
    if reach.function.__code__ is reach.hook.__code__:
        reach.function.__code__ = reach.original_code
        return True
    logger.warning("%s.__code__ was replaced after enable() (now %r); left as it is", ATTRIBUTE,
                   reach.function.__code__)
    return False


# ---- module globals that hold a function ---------------------------------------------------------------------

#: packages whose module globals are never reported: torch (defines the function; its internals hold it) and
#: this package
EXCLUDED_PACKAGES = frozenset(("torch", "gproj_patch"))


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


def find_bound_names(target) -> List[Tuple[types.ModuleType, str, str]]:
    """(module, module name, attribute) of every global, outside ``EXCLUDED_PACKAGES``, that *is* ``target``.
    One identity pass over each module's values (no equality, no import); modules without it are skipped."""
    is_target = functools.partial(operator.is_, target)
    hits = []
    for module_name, module in list(sys.modules.items()):
        if not isinstance(module_name, str) or module_name.partition(".")[0] in EXCLUDED_PACKAGES:
            continue
        namespace = _namespace(module)
        if namespace is None or not any(map(is_target, list(namespace.values()))):
            continue
        hits.extend((module, module_name, name) for name, value in list(namespace.items()) if value is target)
    return hits
