"""gproj_patch: correct BF16/FP16 attention gradients (GProj) while keeping the fused forward.

    import gproj_patch
    gproj_patch.enable()                  # SDPA, flash-attn and HF "gproj" attention get the corrected backward
    with gproj_patch.enable(mode="fp32"):  # or as a context manager
        ...
    gproj_patch.stats()                   # {"gproj": n, "fp32": n, "original": n, "fallback_reasons": {...}, ...}
    gproj_patch.attention(q, k, v, is_causal=True)   # SDPA semantics, corrected backward, with or without enable()

The package's public names, re-exported from the modules that define them (``patch.py``: turning the patch on
and off; ``layers/``: layer names). ARCHITECTURE.md maps the folders.
"""
from __future__ import annotations

from .layers.scope import current_layer, layer_scope, new_step
from .patch import Handle, attention, disable, enable, is_enabled, reset_stats, stats
from .version import __version__

__all__ = ["enable", "disable", "is_enabled", "stats", "reset_stats", "attention", "Handle", "current_layer",
           "layer_scope", "new_step"]
