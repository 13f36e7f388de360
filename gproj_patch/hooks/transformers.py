"""Hook: the HF Transformers attention implementation "gproj".

``install()`` registers ``"gproj"`` in ``AttentionInterface`` (the attention function below) and in
``AttentionMaskInterface`` (HF's own SDPA mask builder: a boolean mask, or None when ``is_causal`` can be used),
so ``AutoModelForCausalLM.from_config(cfg, attn_implementation="gproj")`` (or ``model.set_attn_implementation``)
works. Models on ``"sdpa"`` are covered by the SDPA hook instead (HF looks ``F.scaled_dot_product_attention`` up
at call time). The name has no "flash" in it on purpose (Transformers 5 treats such names as hub kernels).

Softcap (Gemma 2) and learnable sinks (``s_aux``, gpt-oss), which SDPA cannot run, take HF eager's own forward
(bit for bit: the model module's eager softcap function; gpt-oss's sink operations, below) with the corrected
backward (``hf_eager.run_eager``: the router with ``softcap`` / ``sink`` in the problem; the sink's gradient
reaches ``s_aux``). Otherwise the attention function runs SDPA's fused forward and the
corrected backward (``gproj_patch.attention``), with GQA natively (no ``repeat_kv`` copy), ``is_causal`` as HF's
SDPA path sets it, and the layer named ``"<AttentionClass>.<layer_idx>"`` for the policy (unless
``track_layers`` named it). ``install()`` also wraps every other entry of HF's attention registry so that their
calls get the same names (``hooks/hf_layer_names.py``): a model's policy keys do not depend on its
``attn_implementation``. Without a gradient it is exactly HF's "sdpa" function.
A boolean mask that is exactly causal or causal + sliding window (HF builds those for Mistral/Qwen2/Gemma
windows) is recognised in the backward and handed to the kernel as flags, not as a mask.

The name exists without ``enable()``. ``register_name()`` — run by ``import gproj_patch`` as soon as
``transformers.modeling_utils`` is imported, in either import order (``patch.py``) — puts ``"gproj"`` in both
registries where the name is free and changes nothing else: no other entry, no hook, nothing enabled. The name is
an explicit request for the corrected backward, so its calls are corrected whether the patch is on or off: with
the enabled options, else the environment's (``GPROJ_MODE=off`` turns them into HF's "sdpa" calls), as
``gproj_patch.attention`` does. So a model can be built with ``attn_implementation="gproj"`` before
``enable()`` (a Trainer callback then enables with its own options), and it keeps running after ``disable()``.

``install()`` (at ``enable()``) registers ``"gproj"`` over whatever holds the name then and wraps the other
entries for layer names. ``uninstall()`` puts both registries (and the wrapped entries) back as they were where
they still hold what ``install()`` put there (``restore_by_identity``: an entry registered again after
``enable()`` is left, with a warning), then registers the name again where it is free.

The sink path: attention with a learnable sink (a per-head logit in every row's softmax denominator with no value
row), for models that pass ``s_aux`` (gpt-oss). It is this hook's own forward (no other hook runs it), so it lives
here; its backward is HF eager's.

Forward: ``sink_attention_forward`` performs the operations of gpt-oss's eager attention in their order —
``QKᵀ·scaling`` in the input dtype (keys repeated per query-head group when heads differ), the mask added as
HF's eager mask (0 / the dtype's minimum), the sink logit concatenated as a last column, each row's maximum
subtracted, softmax in that dtype, the sink column dropped, the weights cast to V's dtype, ``P·V`` — so its
output is HF's own sink forward bit for bit (``tests/integrations/test_hf_sinks_softcap.py``). A row whose keys
are all masked puts all its weight on the sink (output 0), which is what the backends' sink convention says
(``backends/spec.py``), so the boolean mask (or the causal flag) is the problem's mask as given.

Backward: ``hf_eager.run_eager`` with the sink — the router with ``Problem.sink``, the sink's gradient
returned to ``s_aux`` (a Parameter). Dropout > 0 keeps this forward under plain autograd (uncorrected, reason
counted), as the other paths pass dropout through; so does a call traced by ``torch.compile`` (not counted: no
side effects inside a traced graph).
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..runtime import config, telemetry
from ..backends import compat
from ..backends.spec import SINK_SOFTCAP_REASON
from ..dispatch.autograd import has_backward
from ..layers.scope import module_layer_name
from . import hf_eager, hf_layer_names
from . import sdpa as sdpa_hook
from .restore import ABSENT, restore_by_identity

logger = logging.getLogger("gproj_patch")

NAME = "gproj"
#: the label of this path's calls in fallback reasons and shape classes (its softcap and sink forms:
#: "hf_gproj_softcap", "hf_gproj_sink")
SOURCE = "hf_gproj"


class _Installed:
    """What ``install()`` did, for ``uninstall()`` (hook bookkeeping): one instance, mutated, never re-bound."""
    saved: Optional[dict] = None  # {"attention": previous or ABSENT, "mask": previous or ABSENT, "named": wrapped}
    pending = None  # the import hook waiting for transformers.modeling_utils, when registration is deferred


INSTALLED = _Installed()


def _causal(module, query, attention_mask, is_causal) -> bool:
    """HF's SDPA rule: causal when no mask was materialised and the module (or the call) says so."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return bool(query.shape[2] > 1 and attention_mask is None and causal)


def gproj_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """HF attention function: inputs (B, H, S, D) (k/v with KV heads), returns ((B, S, H, D), None).
    ``softcap=`` runs the model's own eager softcap forward, ``s_aux=`` (learnable sinks) HF's eager sink
    forward (``sink_attention`` below); both with the corrected backward."""
    sink = kwargs.pop("s_aux", None)
    if sink is None:
        sink = kwargs.pop("sinks", None)
    softcap = kwargs.pop("softcap", None)
    if sink is not None and softcap is not None:
        raise ValueError(f"attn_implementation='gproj': {SINK_SOFTCAP_REASON}")
    if sink is not None:
        return _sink_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, sink)
    if softcap is not None:
        return _softcap_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, softcap,
                                kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if not has_backward(query, key, value) or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = _causal(module, query, attention_mask, is_causal)
    if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.dtype != query.dtype:
        attention_mask = attention_mask.to(query.dtype)
    enable_gqa = key.shape[1] != query.shape[1]
    # the options: the enabled ones, else the environment's (the patch may be off: the name asked for GProj)
    out = sdpa_hook.sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal,
                         scale=scaling, enable_gqa=enable_gqa, cfg=config.active() or config.resolve(),
                         layer=module_layer_name(module), source=SOURCE)
    return out.transpose(1, 2).contiguous(), None


def _scaling(module, query, scaling) -> float:
    return float(scaling) if scaling is not None else float(getattr(module, "scaling", query.shape[-1] ** -0.5))


def _sink_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, sink):
    out, _ = sink_attention(query, key, value, attention_mask, scaling=_scaling(module, query, scaling), sink=sink,
                            causal=_causal(module, query, attention_mask, is_causal), dropout=float(dropout or 0.0),
                            layer=module_layer_name(module))
    return out, None


def _softcap_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, softcap, kwargs):
    """The model module's own eager function (Gemma 2: scores/softcap → tanh → ·softcap, + mask, fp32 softmax)
    with HF's eager mask made from the "gproj" boolean mask exactly as ``masking_utils.eager_mask`` makes it:
    the forward is HF eager's bit for bit; the backward is routed with ``softcap`` in the problem."""
    eager = getattr(sys.modules.get(type(module).__module__), hf_eager.ATTRIBUTE, None)
    if eager is None:
        raise ValueError(f"attn_implementation='gproj' with `softcap`: {type(module).__module__} has no "
                         f"{hf_eager.ATTRIBUTE} to take the softcap forward from")
    eager = hf_eager.original_of(eager)
    causal = _causal(module, query, attention_mask, is_causal)
    pattern = attention_mask
    if causal:
        pattern = causal_pattern(query.shape[2], key.shape[2], query.device)
    mask = additive_mask(pattern, query.dtype) if pattern is not None and pattern.dtype == torch.bool else pattern
    args = dict(dropout=dropout, scaling=_scaling(module, query, scaling), softcap=softcap, **kwargs)
    form = hf_eager.form_of(eager)
    reason = None
    if not (isinstance(form, hf_eager.EagerForm) and form.softcap == "applied" and not form.sink):
        reason = f"the eager function of {type(module).__module__} is not a probed softcap form ({form})"
    elif dropout and dropout > 0 and module.training:
        reason = "dropout > 0 (passed through)"
    if reason is not None or torch.compiler.is_compiling() or not hf_eager.needs_correction(query, key, value):
        if reason is not None:
            telemetry.record_forward("original", f"hf_gproj_softcap: {reason}",
                                     telemetry.shape_class("hf_gproj_softcap", query, key))
        return eager(module, query, key, value, mask, **args)[0], None

    def forward(q, k, v, _sink):
        return eager(module, q, k, v, mask, **args)
    call = hf_eager.EagerCall(fn=forward, scale=args["scaling"], mask=mask, softcap=float(softcap),
                              layer=module_layer_name(module), source="hf_gproj_softcap")
    out, _ = hf_eager.run_eager(call, query, key, value)
    return out, None


# ---- the sink path (module docstring) ---------------------------------------------------------------------
#: the label of the sink path's calls
SINK_SOURCE = "hf_gproj_sink"
SINK_DROPOUT_REASON = f"{SINK_SOURCE}: dropout > 0 (uncorrected autograd of the sink forward)"


def causal_pattern(sq: int, sk: int, device) -> Tensor:
    """(1, 1, Sq, Sk) bool, top-left causal (SDPA's ``is_causal``)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return (j <= i)[None, None]


def additive_mask(pattern: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """HF's eager mask of a boolean pattern: 0 where visible, the dtype's minimum elsewhere."""
    if pattern is None:
        return None
    return torch.where(pattern, torch.zeros((), dtype=dtype, device=pattern.device), torch.finfo(dtype).min)


def _repeat_heads(x: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def sink_attention_forward(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], *, scaling: float,
                           sink: Tensor, dropout: float = 0.0, training: bool = False) -> Tuple[Tensor, Tensor]:
    """(attn_output (B, Sq, Hq, D), weights (B, Hq, Sq, Sk)); ``mask`` additive (HF's eager mask) or None."""
    groups = query.shape[1] // key.shape[1]
    keys, values = _repeat_heads(key, groups), _repeat_heads(value, groups)
    logits = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if mask is not None:
        logits = logits + mask
    column = sink.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
    combined = torch.cat([logits, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    weights = torch.nn.functional.dropout(probs, p=dropout, training=training).to(values.dtype)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights


def sink_attention(query: Tensor, key: Tensor, value: Tensor, pattern: Optional[Tensor], *, scaling: float,
                   sink: Tensor, causal: bool = False, dropout: float = 0.0, layer: Optional[str] = None):
    """Sink attention with HF's eager sink forward and the corrected backward. ``pattern``: a boolean mask
    (True = attend), or None with ``causal`` for a top-left causal pattern. Returns (attn_output (B, Sq, Hq, D),
    weights)."""
    if causal and pattern is None:
        mask = additive_mask(causal_pattern(query.shape[2], key.shape[2], query.device), query.dtype)
    else:
        mask = pattern if pattern is None or pattern.dtype != torch.bool else additive_mask(pattern, query.dtype)
    if torch.compiler.is_compiling() or not hf_eager.needs_correction(query, key, value, sink):
        return sink_attention_forward(query, key, value, mask, scaling=scaling, sink=sink, dropout=dropout,
                                      training=dropout > 0)
    reason = hf_eager.mask_unsupported_reason(pattern, query.shape[2], key.shape[2])
    if dropout > 0:
        reason = SINK_DROPOUT_REASON
    if reason is not None:
        telemetry.record_forward("original", reason if reason == SINK_DROPOUT_REASON else f"{SINK_SOURCE}: {reason}",
                                 telemetry.shape_class(SINK_SOURCE, query, key))
        return sink_attention_forward(query, key, value, mask, scaling=scaling, sink=sink, dropout=dropout,
                                      training=dropout > 0)

    def forward(q, k, v, s):
        return sink_attention_forward(q, k, v, mask, scaling=scaling, sink=s)
    call = hf_eager.EagerCall(fn=forward, scale=float(scaling), mask=pattern, causal=causal and pattern is None,
                              sink=sink, sink_is_argument=True, layer=layer, source=SINK_SOURCE)
    return hf_eager.run_eager(call, query, key, value)


def install() -> str:
    """Register "gproj" now if Transformers' modeling code is loaded, else right after it is imported (so a
    process that never builds an HF model — a data worker, a compile worker — never imports Transformers)."""
    if INSTALLED.saved is not None or INSTALLED.pending is not None:
        return "installed"
    from ..runtime.import_hooks import call_after_import, imported
    if imported("transformers.modeling_utils"):  # in sys.modules but still executing does not count
        return _register()
    try:
        if importlib.util.find_spec("transformers") is None:
            return "skipped: transformers not installed"
    except (ImportError, ValueError) as exc:
        return f"skipped: transformers not importable ({exc})"
    INSTALLED.pending = call_after_import("transformers.modeling_utils", _register_on_import)
    return "installed (registers when transformers.modeling_utils is imported)"


def _register_on_import() -> None:
    INSTALLED.pending = None
    status = _register()
    if not status.startswith("installed"):
        logger.warning("could not register the 'gproj' attention: %s", status)


def register_name() -> None:
    """Register ``"gproj"`` (attention function and mask function) in each registry where the name is free;
    nothing else changes. Called once ``transformers.modeling_utils`` is imported, enabled or not."""
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        from transformers.modeling_utils import AttentionInterface
    except ImportError as exc:
        logger.warning("could not register the 'gproj' attention: transformers not importable (%s)", exc)
        return
    for registry, ours in ((AttentionInterface, gproj_attention_forward), (AttentionMaskInterface, sdpa_mask)):
        if NAME not in compat.hf_registry_mapping(registry):
            registry.register(NAME, ours)


def _register() -> str:
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        from transformers.modeling_utils import AttentionInterface
    except ImportError as exc:
        return f"skipped: transformers not importable ({exc})"
    saved = INSTALLED.saved = {"attention": compat.hf_registry_mapping(AttentionInterface).get(NAME, ABSENT),
                               "mask": compat.hf_registry_mapping(AttentionMaskInterface).get(NAME, ABSENT)}
    AttentionInterface.register(NAME, gproj_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    saved["named"] = hf_layer_names.wrap(compat.hf_registry_mapping(AttentionInterface), skip=(NAME,))
    return "installed"


def uninstall() -> None:
    if INSTALLED.pending is not None:
        INSTALLED.pending.cancel()
        INSTALLED.pending = None
    saved = INSTALLED.saved
    if saved is None:
        return
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
    hf_layer_names.unwrap(compat.hf_registry_mapping(AttentionInterface), saved["named"])
    for registry, key, ours in ((AttentionInterface, "attention", gproj_attention_forward),
                                (AttentionMaskInterface, "mask", sdpa_mask)):
        restore_by_identity(compat.hf_registry_mapping(registry), NAME, ours, saved[key],
                            where=f"transformers' {registry.__name__}[{NAME!r}]", change="registered again")
    INSTALLED.saved = None
    register_name()  # where the name is free again: a model built with "gproj" keeps running
