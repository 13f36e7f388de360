"""HF attention registry: every implementation's calls named after their attention module.

A model's policy keys must not change with its ``attn_implementation``. HF's attention modules call
``ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)(self, query, key, value, ...)``: the
registry functions ("sdpa", "flash_attention_2/3/4", "flex_attention", "paged|eager", ... as the installed
Transformers has them) reach the SDPA / flash-attn / flex hooks, which know nothing of the module and would
number the calls ``call{n}``. ``wrap(mapping)`` replaces each entry of ``AttentionInterface._global_mapping`` by
a wrapper that runs the entry inside ``layer_context.call_in_module_layer(module, ...)``: the same name as HF
eager (``hooks/hf_eager.py``) and "gproj" (``hooks/transformers.py``) give — the module path of an
open ``track_layers`` scope, else ``"<AttentionClass>.<layer_idx>"``.

The wrapper is invisible: ``functools.wraps`` (name, docstring, ``__wrapped__`` so ``inspect.signature`` reads
the original's), the original called with the same arguments, its result and exceptions as they are; under
``torch.compile`` the name goes on the traced list (no graph break, a constant of the graph).
``unwrap(mapping)`` restores each entry by identity (``restore_by_identity``). Entries registered after
``wrap()`` (hub kernels, a model's own) are not wrapped: their calls keep ``call{n}``.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Tuple

from ..layers.scope import call_in_module_layer
from .restore import restore_by_identity

#: marks a naming wrapper (its value: the wrapped function)
ORIGINAL = "__gproj_named__"


def named(original: Callable) -> Callable:
    """``original`` (an HF attention function ``(module, query, key, value, attention_mask, ...)``) run inside
    its module's layer name."""
    @functools.wraps(original)
    def attention_function(*args, **kwargs):
        module = args[0] if args else kwargs.get("module")  # arguments passed on untouched, errors included
        return call_in_module_layer(module, original, *args, **kwargs)
    setattr(attention_function, ORIGINAL, original)
    return attention_function


def wrap(mapping: Dict[str, Callable], skip: Tuple[str, ...] = ()) -> List[Tuple[str, Callable, Callable]]:
    """Wrap every callable entry of ``mapping`` but those in ``skip`` (ours) and those already wrapped;
    returns ``(key, original, wrapper)`` for ``unwrap``."""
    done = []
    for key, fn in list(mapping.items()):
        if key in skip or not callable(fn) or hasattr(fn, ORIGINAL):
            continue
        wrapper = named(fn)
        mapping[key] = wrapper
        done.append((key, fn, wrapper))
    return done


def unwrap(mapping: Dict[str, Callable], wrapped: List[Tuple[str, Callable, Callable]]) -> None:
    """Put each original back where its wrapper still sits (else leave the entry, with a warning)."""
    for key, original, wrapper in reversed(wrapped):
        restore_by_identity(mapping, key, wrapper, original, where=f"transformers' AttentionInterface[{key!r}]",
                            change="registered again")
