"""Name attention calls after the HF module that makes them: ``track_layers(model)``.

A forward pre-hook on every attention module enters ``layer_scope(<module name>)`` (e.g.
``"model.layers.3.self_attn"``) and a forward hook (``always_call=True``, so also when the forward raises)
leaves it; the autograd Function captures the name at forward time, so the policy's per-layer records and the
``gproj/<layer>/...`` log keys carry the module name — also under gradient checkpointing, whose recomputation
re-enters the same hooks. These names win over the ``"<AttentionClass>.<layer_idx>"`` every HF attention
implementation gives otherwise (``layer_context.module_layer``). Attention modules are, by default, the
outermost modules whose class name ends in ``"Attention"`` (``LlamaAttention``, ``Qwen2Attention``,
``MistralAttention``, ...); pass ``predicate`` for others.
"""
from __future__ import annotations

import threading
from typing import Callable, List, Optional, Tuple

import torch

from .scope import enter_traced_layer, exit_traced_layer, layer_scope

_ATTR = "_gproj_layer_tracking"


def is_attention_module(name: str, module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def attention_modules(model: torch.nn.Module, predicate: Optional[Callable[[str, torch.nn.Module], bool]] = None
                      ) -> List[Tuple[str, torch.nn.Module]]:
    """(name, module) of the outermost modules matching ``predicate`` (default: ``is_attention_module``)."""
    predicate = predicate or is_attention_module
    found: List[Tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if not name or not predicate(name, module):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        found.append((name, module))
    return found


class LayerTracking:
    """Handle of ``track_layers``: ``names`` lists the tracked modules; ``remove()`` takes the hooks off."""

    def __init__(self, model: torch.nn.Module, names: List[str], hooks: list):
        self.model = model
        self.names = names
        self._hooks = hooks

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def track_layers(model: torch.nn.Module, predicate=None, prefix: str = "") -> LayerTracking:
    """Install the hooks (idempotent: a model already tracked returns its existing handle)."""
    existing = getattr(model, _ATTR, None)
    if isinstance(existing, LayerTracking):
        return existing
    local = threading.local()  # one stack of open scopes per thread (nested or re-entrant calls)
    hooks, names = [], []
    for name, module in attention_modules(model, predicate):
        full = prefix + name

        def pre(mod, args, _full=full):
            if torch.compiler.is_compiling():  # traced by torch.compile: no ContextVar (a graph break)
                enter_traced_layer(_full)
                return
            scope = layer_scope(_full)
            scope.__enter__()
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = []
            stack.append(scope)

        def post(mod, args, output):
            if torch.compiler.is_compiling():
                exit_traced_layer()
                return
            stack = getattr(local, "stack", None)
            if stack:
                stack.pop().__exit__(None, None, None)

        hooks.append(module.register_forward_pre_hook(pre))
        hooks.append(module.register_forward_hook(post, always_call=True))
        names.append(full)
    handle = LayerTracking(model, names, hooks)
    try:
        setattr(model, _ATTR, handle)
    except Exception:  # e.g. a frozen wrapper; the hooks still work
        pass
    return handle
