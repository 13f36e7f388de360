"""Hook: the HF Transformers attention implementation "gproj".

``install()`` registers ``"gproj"`` in ``AttentionInterface`` (the attention function below) and in
``AttentionMaskInterface`` (HF's own SDPA mask builder: a boolean mask, or None when ``is_causal`` can be used),
so ``AutoModelForCausalLM.from_config(cfg, attn_implementation="gproj")`` (or ``model.set_attn_implementation``)
works. Models on ``"sdpa"`` are covered by the SDPA hook instead (HF looks ``F.scaled_dot_product_attention`` up
at call time). The name has no "flash" in it on purpose (Transformers 5 treats such names as hub kernels).

The attention function runs SDPA's fused forward and the corrected backward (``gproj_patch.attention``), with
GQA natively (no ``repeat_kv`` copy), ``is_causal`` as HF's SDPA path sets it, and the layer named
``"<AttentionClass>.<layer_idx>"`` for the policy. Without a gradient it is exactly HF's "sdpa" function.
A boolean mask that is exactly causal or causal + sliding window (HF builds those for Mistral/Qwen2/Gemma
windows) is recognised in the backward and handed to the kernel as flags, not as a mask.

``uninstall()`` puts both registries back as they were (the key removed, or the previous value restored):
a model built with "gproj" needs the patch enabled to run.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from typing import Optional

import torch

from ..backends import compat
from ..ops import sdpa as sdpa_op

logger = logging.getLogger("gproj_patch")

NAME = "gproj"
_saved: Optional[dict] = None  # {"attention": previous or _MISSING, "mask": previous or _MISSING}
_MISSING = object()
_pending = None  # the import hook waiting for transformers.modeling_utils, when registration is deferred


def gproj_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """HF attention function: inputs (B, H, S, D) (k/v with KV heads), returns ((B, S, H, D), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if not needs_grad or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_implementation='gproj' follows SDPA and does not support `softcap`")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError("attn_implementation='gproj' follows SDPA and does not support attention sinks (s_aux)")
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
        attention_mask = attention_mask.to(query.dtype)
    enable_gqa = key.shape[1] != query.shape[1]

    layer = None
    if getattr(module, "layer_idx", None) is not None:
        layer = f"{type(module).__name__}.{module.layer_idx}"
    out = sdpa_op.sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal,
                        scale=scaling, enable_gqa=enable_gqa, layer=layer)
    return out.transpose(1, 2).contiguous(), None


def install() -> str:
    """Register "gproj" now if Transformers' modeling code is loaded, else right after it is imported (so a
    process that never builds an HF model — a data worker, a compile worker — never imports Transformers)."""
    global _pending
    if _saved is not None or _pending is not None:
        return "installed"
    if "transformers.modeling_utils" in sys.modules:
        return _register()
    try:
        if importlib.util.find_spec("transformers") is None:
            return "skipped: transformers not installed"
    except (ImportError, ValueError) as exc:
        return f"skipped: transformers not importable ({exc})"
    from ..import_hooks import call_after_import
    _pending = call_after_import("transformers.modeling_utils", _register_on_import)
    return "installed (registers when transformers.modeling_utils is imported)"


def _register_on_import() -> None:
    global _pending
    _pending = None
    status = _register()
    if not status.startswith("installed"):
        logger.warning("could not register the 'gproj' attention: %s", status)


def _register() -> str:
    global _saved
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        from transformers.modeling_utils import AttentionInterface
    except ImportError as exc:
        return f"skipped: transformers not importable ({exc})"
    _saved = {"attention": compat.hf_registry_mapping(AttentionInterface).get(NAME, _MISSING),
              "mask": compat.hf_registry_mapping(AttentionMaskInterface).get(NAME, _MISSING)}
    AttentionInterface.register(NAME, gproj_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return "installed"


def uninstall() -> None:
    global _saved, _pending
    if _pending is not None:
        _pending.cancel()
        _pending = None
    if _saved is None:
        return
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
    for registry, key in ((AttentionInterface, "attention"), (AttentionMaskInterface, "mask")):
        previous = _saved[key]
        mapping = compat.hf_registry_mapping(registry)
        if previous is _MISSING:
            mapping.pop(NAME, None)
        else:
            mapping[NAME] = previous
    _saved = None
