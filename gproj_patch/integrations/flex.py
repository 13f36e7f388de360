"""Hook: FlexAttention — torch's ``flex_attention`` (every binding of it) and HF's ``"flex_attention"``.

``install()``:

* swaps the code of ``torch.nn.attention.flex_attention.flex_attention`` for the hook's (``flex_reach.py``):
  the function keeps its identity, and every caller reaches the hook — call-time lookups, names bound before
  ``enable()`` (``from torch.nn.attention.flex_attention import flex_attention``), ``torch.compile(flex_attention)``
  objects made before it, class attributes, partials. The hook's forward and pass-throughs run
  ``flex_reach``'s copy of the original (``ops/flex.original_flex``). Where the swap is refused, only the module
  attribute is replaced, and the bindings that keep the original are named once (WARNING) and in
  ``Handle.installed["flex"]``;
* replaces HF's ``AttentionInterface`` entry ``"flex_attention"`` (looked up at every layer call) by
  ``hf_flex_attention_forward`` — now if ``transformers.modeling_utils`` is loaded, else right after it is
  imported. HF's own function asks flex for its LSE as an output and builds its ``score_mod`` as a closure that
  a compiled region cannot read; this hook knows the softcap from its arguments, builds the same ``score_mod``
  and runs HF's own (compiled) flex call as the forward, asking it for the LSE where HF itself would (not on
  CPU, where Inductor's flex returns none). Calls it does not take (an additive score mask, a position bias,
  attention sinks ``s_aux``, dropout, no gradient) go to HF's function unchanged.

``uninstall()`` restores both by identity (a later replacement by someone else is left in place, with a
warning). ``flex_is_supported()`` says whether this torch has FlexAttention at all.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..runtime import config as _config
from ..runtime import telemetry
from ..backends import compat
from ..layers.scope import module_layer
from . import flex_reach
from .restore import restore_by_identity
from ..ops import flex as flex_op
from .flex_reach import flex_attention  # noqa: F401 - the hook's flex_attention (public)

logger = logging.getLogger("gproj_patch")

HF_NAME = "flex_attention"
_MISSING = object()


@dataclass
class InstalledFlex:
    """What ``install()`` did, to be undone by ``uninstall()`` (hook bookkeeping, not runtime state: ``reset()``
    leaves it alone). One instance, ``INSTALLED``, mutated in place and never re-bound."""
    reach: Optional[flex_reach.Reach] = None  # what install() did to torch's flex_attention
    last_report: Optional[str] = None  # the fallback's status last logged (logged again only when it changes)
    hf_saved: Any = _MISSING  # HF's registry entry before install() (restored by identity)
    pending: Any = None  # the import hook waiting for transformers.modeling_utils (import_hooks.AfterImport)


INSTALLED = InstalledFlex()


def flex_is_supported() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def _hf_unsupported_reason(query, attention_mask, s_aux, position_bias, kwargs) -> Optional[str]:
    from torch.nn.attention.flex_attention import BlockMask
    if attention_mask is not None and not isinstance(attention_mask, BlockMask):
        return "hf flex: additive score mask (not a BlockMask)"
    if position_bias is not None:
        return "hf flex: position bias"
    if s_aux is not None:
        return "hf flex: attention sinks (s_aux) are applied outside flex through its LSE"
    if kwargs.get("dropout", 0.0) > 0:
        return "hf flex: dropout"
    return None


def hf_flex_attention_forward(module, query, key, value, attention_mask, scaling=None, softcap=None, s_aux=None,
                              position_bias=None, **kwargs):
    """HF's ``flex_attention_forward`` contract: (B, H, S, D) inputs, returns ((B, S, H, D), None)."""
    import transformers.integrations.flex_attention as hf_flex
    saved = INSTALLED.hf_saved
    original = saved if saved is not _MISSING else hf_flex.flex_attention_forward
    cfg_mode = (_config.active() or flex_op.DEFAULT_CONFIG).mode

    def passthrough():
        return original(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, s_aux=s_aux,
                        position_bias=position_bias, **kwargs)
    if not flex_op.needs_correction(query, key, value, cfg_mode):
        return passthrough()
    reason = _hf_unsupported_reason(query, attention_mask, s_aux, position_bias, kwargs)
    if reason is not None:
        if not torch.compiler.is_compiling():
            telemetry.record_forward("original", reason, telemetry.shape_class(flex_op.SOURCE, query, key))
        return passthrough()
    enable_gqa = True
    heads = query.shape[1]
    if heads & (heads - 1):  # as HF: repeat the KV heads when the head count is not a power of two
        key = hf_flex.repeat_kv(key, heads // key.shape[1])
        value = hf_flex.repeat_kv(value, heads // value.shape[1])
        enable_gqa = False
    layer = module_layer(module)  # track_layers' scope (also the traced one under torch.compile), else Class.idx
    score_mod = None if softcap is None else flex_op.softcap_score_mod(softcap)
    forward_fn = functools.partial(hf_flex.compile_friendly_flex_attention, training=module.training)
    caller = flex_op.Caller(declared_softcap=None if softcap is None else float(softcap), forward_fn=forward_fn,
                            forward_lse=query.device.type != "cpu", layer=layer)  # HF's own rule for the LSE
    out = flex_op.flex(query, key, value, score_mod=score_mod, block_mask=attention_mask, scale=scaling,
                       enable_gqa=enable_gqa, kernel_options=kwargs.get("kernel_options"), caller=caller)
    return out.transpose(1, 2).contiguous(), None


def _load_compiled_path() -> None:
    from ..ops import flex_compiled  # noqa: F401


def is_installed() -> bool:
    return INSTALLED.reach is not None


def _module_globals_holding(fn) -> List[str]:
    """"module.name" of every module global (torch's and this package's excepted) that holds ``fn``, HF's flex
    module excepted (its calls go through the registry entry hooked below)."""
    return [f"{module_name}.{name}" for _, module_name, name in flex_reach.find_bound_names(fn)
            if module_name != "transformers.integrations.flex_attention"]


def _report(reach: flex_reach.Reach) -> None:
    """Log once (again only when it changes) what the fallback did not reach; nothing when the swap was made."""
    status = reach.status()
    if reach.swapped or status == INSTALLED.last_report:
        return
    logger.warning("flex: %s", status)
    INSTALLED.last_report = status


def install() -> str:
    if INSTALLED.reach is not None:
        return "installed"
    if not flex_is_supported():
        return "skipped: this torch has no torch.nn.attention.flex_attention"
    import torch.nn.attention.flex_attention as fa_module

    # the compiled path must be loaded before any compiled region traces the hook, but it imports Dynamo (about
    # 1.3 s): load it when Dynamo is imported (torch.compile does that first), not at every enable()
    from ..runtime.import_hooks import call_after_import
    call_after_import(compat.dynamo_module_name(), _load_compiled_path)
    reach = INSTALLED.reach = flex_reach.install(fa_module, _module_globals_holding)
    flex_op.set_original(reach.original)
    _report(reach)
    status = reach.status()
    if "transformers.modeling_utils" in sys.modules:
        _register_hf()
    elif importlib.util.find_spec("transformers") is not None:
        INSTALLED.pending = call_after_import("transformers.modeling_utils", _register_on_import)
        if reach.swapped:
            return "installed (HF's 'flex_attention' hooked when transformers.modeling_utils is imported)"
    return status


def _register_on_import() -> None:
    INSTALLED.pending = None
    _register_hf()


def _register_hf() -> None:
    try:
        from transformers.modeling_utils import AttentionInterface
        mapping = compat.hf_registry_mapping(AttentionInterface)
    except (ImportError, compat.CompatError) as exc:
        logger.warning("could not hook HF's 'flex_attention': %s", exc)
        return
    INSTALLED.hf_saved = mapping.get(HF_NAME, _MISSING)
    if INSTALLED.hf_saved is _MISSING:
        return  # this Transformers has no flex implementation
    mapping[HF_NAME] = hf_flex_attention_forward
    hf_flex = sys.modules.get("transformers.integrations.flex_attention")
    if getattr(hf_flex, "flex_attention", None) is flex_attention:
        # Transformers imported after install() bound this wrapper; HF's own function (the pass-through of the
        # hook above, and the forward it runs) must see the original, as it would have without the patch
        hf_flex.flex_attention = flex_op.original_flex()


def uninstall() -> None:
    if INSTALLED.pending is not None:
        INSTALLED.pending.cancel()
        INSTALLED.pending = None
    if INSTALLED.hf_saved is not _MISSING:
        from transformers.modeling_utils import AttentionInterface
        mapping = compat.hf_registry_mapping(AttentionInterface)
        restore_by_identity(mapping, HF_NAME, hf_flex_attention_forward, INSTALLED.hf_saved,
                            "HF's 'flex_attention' entry")
        INSTALLED.hf_saved = _MISSING
    if INSTALLED.reach is None:
        return
    import torch.nn.attention.flex_attention as fa_module
    flex_reach.uninstall(fa_module, INSTALLED.reach)
    flex_op.set_original(None)
    INSTALLED.reach = None


# ---- the audit's flex backends (``audit.backends.available_backends`` adds what ``audit_backends`` returns) --
def _case_mask_mod(mask: dict, sq: int, sk: int):
    """The audit case's flags as a mask_mod (None: no mask)."""
    causal, left, right = bool(mask.get("causal")), *tuple(mask.get("window", (-1, -1)))
    if not causal and left < 0 and right < 0:
        return None
    shift = sk - sq if mask.get("causal_align", "top_left") == "bottom_right" else 0

    def case_mask(b, h, q_idx, kv_idx):
        diag = q_idx + shift
        ok = kv_idx <= diag if causal else kv_idx >= 0
        if left >= 0:
            ok = ok & (kv_idx >= diag - left)
        if right >= 0:
            ok = ok & (kv_idx <= diag + right)
        return ok
    return case_mask


#: bounded cache: one entry, (original flex, its torch.compile wrapper) for the audit's uncorrected backend;
#: replaced when the original changes (each install() may hand out a new copy of it), never grows
_COMPILED_ORIGINAL: List[Tuple[Callable, Callable]] = []


def _compiled_original():
    """The compiled original flex (the audit's uncorrected backend), compiled once per original function."""
    fn = flex_op.original_flex()
    if not _COMPILED_ORIGINAL or _COMPILED_ORIGINAL[0][0] is not fn:
        _COMPILED_ORIGINAL[:] = [(fn, torch.compile(fn, dynamic=False))]
    return _COMPILED_ORIGINAL[0][1]


def _audit_reason(corrected: bool):
    def reason(inp) -> Optional[str]:
        if not flex_is_supported():
            return "this torch has no FlexAttention"
        if "cu_seqlens_q" in inp.mask:
            return "the varlen case packs unequal query/key lengths (flex documents need Sq == Sk per segment)"
        if not corrected and inp.q.device.type != "cuda":
            return "PyTorch's flex_attention has no CPU backward"
        return None
    return reason


def _audit_run(corrected: bool):
    def run(inp, k, saved):
        from torch.nn.attention.flex_attention import create_block_mask
        q, kk, v = (x.detach().clone().requires_grad_(True) for x in (inp.q, k, inp.v))
        sq, sk = q.shape[2], kk.shape[2]
        mask_mod = _case_mask_mod(inp.mask, sq, sk)
        bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, sq, sk, device=q.device)
        cap = float(inp.mask.get("softcap", 0.0))
        args = dict(score_mod=flex_op.softcap_score_mod(cap) if cap else None, block_mask=bm,
                    scale=inp.mask.get("scale"), enable_gqa=q.shape[1] != kk.shape[1])
        if corrected:  # the hook's eager path: the GProj kernel or the FP32 tier
            out = flex_op.flex(q, kk, v, cfg=_config.Config(mode="gproj"), **args)
            if type(out.grad_fn).__name__ != "_FlexFunctionBackward":
                raise RuntimeError(f"the flex hook passed this case through: {telemetry.stats()['fallback_reasons']}")
        else:  # what an unpatched user gets: compiled flex and its fused backward
            out = _compiled_original()(q, kk, v, **args)
        out.backward(inp.do)
        return q.grad, kk.grad, v.grad
    return run


def audit_backends(device) -> list:
    """[(name, run(inp, k, saved) -> (dq, dk, dv), reason(inp) -> str or None)] for ``audit.Backend``:
    ``flex-uncorrected`` (compiled flex, CUDA only) and ``flex-gproj`` (flex through this hook)."""
    del device  # the reasons decide per case input
    return [("flex-uncorrected", _audit_run(False), _audit_reason(False)),
            ("flex-gproj", _audit_run(True), _audit_reason(True))]
