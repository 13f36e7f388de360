"""Hook: swap the backward of flash-attn's custom ops by re-registering their CUDA kernels.

FA2 ≥ 2.7 defines its backward as ``torch.library.custom_op`` ops (``flash_attn::_flash_attn_backward`` and
``flash_attn::_flash_attn_varlen_backward``; newer releases name the namespace ``flashattn``), called from the
``backward`` of every ``FlashAttn*Func`` (func, varlen, qkvpacked, kvpacked). Re-registering the op's kernel for
the device (``CustomOpDef.register_kernel``, what ``torch.library.register_kernel`` calls) changes what the op
runs, so references bound at import time (``torch.ops.flash_attn._flash_attn_backward`` captured in a module
global, HF's preloaded ``flash_attn_func``) are covered. The forward (and its output) is untouched. The kernel
that was registered before is kept and restored by identity on ``uninstall()``; it also serves as the
"original" backward (dropout > 0 — its RNG cannot be replayed elsewhere —, ALiBi, seqused, or the policy).

FA3 (``flash_attn_3::_flash_attn_backward``, one op for dense and varlen) goes through the same mechanism.
FA4 (``flash_attn.cute.interface._flash_attn_bwd``, a plain Python function looked up as a module global by
its autograd Functions) is replaced as a module attribute.

Arguments are read by name (bound against the original function's signature), so the one replacement serves
every schema; an argument it does not know that is set to a non-default value sends the call to the original.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import config, layer_context, telemetry
from ..backends import dispatch

logger = logging.getLogger("gproj_patch")

FA2_OPS = ("flash_attn::_flash_attn_backward", "flash_attn::_flash_attn_varlen_backward",
           "flashattn::_flash_attn_backward", "flashattn::_flash_attn_varlen_backward")
FA3_OPS = ("flash_attn_3::_flash_attn_backward",)
FA_MODULES = ("flash_attn", "flash_attn_interface", "flash_attn_3", "flash_attn.cute")
FA4_MODULE, FA4_FN = "flash_attn.cute.interface", "_flash_attn_bwd"
DEVICE_TYPE = "cuda"  # the kernels install() replaces (flash-attn registers CUDA kernels only)

# names the replacement understands (and the values that mean "not used")
_KNOWN = {"dout", "do", "q", "k", "v", "out", "o", "softmax_lse", "lse", "dq", "dk", "dv", "cu_seqlens_q",
          "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "is_causal",
          "window_size_left", "window_size_right", "softcap", "deterministic", "sm_margin", "dropout_p",
          "rng_state", "zero_tensors", "m_block_size", "n_block_size", "num_threads", "pack_gqa",
          "num_stages_Q", "num_stages_dO", "SdP_swapAB", "dKV_swapAB", "dQ_swapAB", "AtomLayoutMSdP",
          "AtomLayoutNdKV", "AtomLayoutMdQ", "V_in_regs"}

_installed: List[Tuple[str, Callable[[], None]]] = []  # (what, restore)


def _arg(b: dict, *names, default=None):
    for n in names:
        if n in b and b[n] is not None:
            return b[n]
    return default


def _to_bhsd(x: torch.Tensor, varlen: bool) -> torch.Tensor:
    return x.unsqueeze(0).transpose(1, 2) if varlen else x.transpose(1, 2)


def _fallback_reason(b: dict) -> Optional[str]:
    if float(_arg(b, "dropout_p", default=0.0)) > 0.0:
        return "dropout > 0 (flash-attn's dropout RNG cannot be replayed): original backward"
    if _arg(b, "alibi_slopes") is not None:
        return "ALiBi slopes: original backward"
    if _arg(b, "sequed_q", "seqused_q", "sequed_k", "seqused_k") is not None:
        return "seqused_q/seqused_k: original backward"
    for name, value in b.items():
        if name not in _KNOWN and name != "alibi_slopes" and value is not None and value is not False \
                and not (isinstance(value, (int, float)) and value == 0):
            return f"unsupported flash-attn argument {name!r}: original backward"
    q = _arg(b, "q")
    if q is None or q.dtype not in (torch.bfloat16, torch.float16):
        return "flash-attn inputs not BF16/FP16: original backward"
    return None


def _softmax_d(b: dict, q4: torch.Tensor, o4: torch.Tensor, do4: torch.Tensor, varlen: bool, fake=None):
    """flash-attn's auxiliary return value (rowsum(dO∘O)); callers discard it. Shaped by the op's own fake
    kernel when it has one (FA3's shape depends on its tile sizes), else as FA2 shapes it."""
    if fake is not None:
        try:
            return fake().zero_()
        except Exception:  # a fake that cannot run eagerly: fall back to FA2's shape
            pass
    D = (do4.float() * o4.float()).sum(-1)  # (B, H, S)
    if varlen:
        nseq = _arg(b, "cu_seqlens_q").numel() - 1
        out = D.new_zeros((D.shape[1], D.shape[2] + 128 * nseq))
        out[:, :D.shape[2]] = D[0]
        return out
    sq = D.shape[2]
    out = D.new_zeros((D.shape[0], D.shape[1], -(-sq // 128) * 128))
    out[..., :sq] = D
    return out


def corrected_fa_backward(b: dict, original: Callable[[], object], source: str, returns: str = "softmax_d",
                          fake: Optional[Callable[[], torch.Tensor]] = None):
    """The replacement body: ``b`` holds the call's arguments by name; ``original()`` runs the saved kernel;
    ``fake()`` (optional) builds the op's auxiliary return value with the op's own shape."""
    cfg = config.active() or config.Config()
    reason = _fallback_reason(b)
    q = _arg(b, "q")
    k, v = _arg(b, "k"), _arg(b, "v")
    if reason is not None or cfg.mode == "off":
        telemetry.record_backward("original", reason, telemetry.shape_class(source, q, k))
        return original()
    varlen = _arg(b, "cu_seqlens_q") is not None
    do, o, lse = _arg(b, "dout", "do"), _arg(b, "out", "o"), _arg(b, "softmax_lse", "lse")
    if do.shape[-1] < v.shape[-1]:  # head dim padded to a multiple of 8 by the caller, dout not
        do = torch.nn.functional.pad(do, [0, v.shape[-1] - do.shape[-1]])
    q4, k4, v4, o4, do4 = (_to_bhsd(t, varlen) for t in (q, k, v, o, do))
    result = {}

    def run_original():
        result["ret"] = original()
        dq_b, dk_b, dv_b = (_arg(b, n) for n in ("dq", "dk", "dv"))
        if isinstance(result["ret"], tuple) and dq_b is None:  # FA4 returns (dq, dk, dv)
            dq_b, dk_b, dv_b = result["ret"][:3]
        return tuple(_to_bhsd(t, varlen) for t in (dq_b, dk_b, dv_b))

    causal = bool(_arg(b, "causal", "is_causal", default=False))
    wl, wr = int(_arg(b, "window_size_left", default=-1)), int(_arg(b, "window_size_right", default=-1))
    if causal and wr > 0:
        wr = -1
    grads = dispatch.corrected_backward(
        do4, q4, k4, v4, o4, lse, scale=_arg(b, "softmax_scale"), causal=causal, causal_align="bottom_right",
        window=(wl, wr), softcap=float(_arg(b, "softcap", default=0.0)), cu_seqlens_q=_arg(b, "cu_seqlens_q"),
        cu_seqlens_k=_arg(b, "cu_seqlens_k"), max_seqlen_q=_arg(b, "max_seqlen_q"),
        max_seqlen_k=_arg(b, "max_seqlen_k"), mode=cfg.mode, layer=layer_context.current_layer() or source,
        original=run_original, source=source, tier_option=cfg.tier,
        deterministic=bool(_arg(b, "deterministic", default=False)) or cfg.deterministic)
    if "ret" in result:  # the original kernel ran and filled the buffers itself
        return result["ret"]
    outs = []
    for name, g, ref in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        buf = _arg(b, name)
        g = g.transpose(1, 2).squeeze(0) if varlen else g.transpose(1, 2)
        if buf is None:
            outs.append(g.to(ref.dtype))
        else:
            buf.copy_(g[..., :buf.shape[-1]]) if g.shape[-1] >= buf.shape[-1] else buf.copy_(g)
            outs.append(buf)
    if returns == "grads":
        return tuple(outs)
    return _softmax_d(b, q4, o4, do4, varlen, fake)


# ------------------------------------------------------------------------------------------------------------
# custom-op kernels

def _opdef(qualname: str):
    from torch._library.custom_ops import OPDEFS
    return OPDEFS.get(qualname)


def patch_op(qualname: str, device_type: str = "cuda") -> Callable[[], None]:
    """Re-register ``qualname``'s kernel for ``device_type`` with the corrected backward; returns ``restore``.

    ``qualname`` must be a ``torch.library.custom_op`` with flash-attn's argument names (FA2 dense / varlen,
    FA3); the previous kernel stays reachable as the "original" backward and is put back by ``restore()``.
    """
    opdef = _opdef(qualname)
    if opdef is None:
        raise LookupError(f"{qualname} is not a torch.library.custom_op")
    previous = opdef._backend_fns.get(device_type)
    if previous is None:
        raise LookupError(f"{qualname} has no {device_type} kernel to replace")
    signature = inspect.signature(opdef._init_fn)
    source = qualname.split("::")[0].replace("flashattn", "flash_attn") + ":" + \
        ("varlen" if "varlen" in qualname else "dense")

    def kernel(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        fake = opdef._abstract_fn
        return corrected_fa_backward(dict(bound.arguments), lambda: previous(*args, **kwargs), source,
                                     fake=None if fake is None else (lambda: fake(*args, **kwargs)))

    kernel.__gproj_patched__ = True
    opdef.register_kernel(device_type)(kernel)

    def restore():
        if opdef._backend_fns.get(device_type) is not previous:
            opdef._backend_fns[device_type] = previous
    return restore


def _patch_attr(module, name: str, source: str) -> Callable[[], None]:
    previous = getattr(module, name)
    signature = inspect.signature(previous)

    def replacement(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return corrected_fa_backward(dict(bound.arguments), lambda: previous(*args, **kwargs), source,
                                     returns="grads")

    replacement.__gproj_patched__ = True
    setattr(module, name, replacement)

    def restore():
        if getattr(module, name) is replacement:
            setattr(module, name, previous)
    return restore


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install() -> str:
    if _installed:
        return "installed"
    for mod in FA_MODULES:
        if _importable(mod):
            try:
                importlib.import_module(mod)
            except Exception as exc:  # a broken build must not break enable()
                logger.warning("gproj_patch: importing %s failed (%s); not patched", mod, exc)
    done: Dict[str, Callable[[], None]] = {}
    for qualname in FA2_OPS + FA3_OPS:
        if _opdef(qualname) is not None and DEVICE_TYPE in _opdef(qualname)._backend_fns:
            done[qualname] = patch_op(qualname, DEVICE_TYPE)
    try:
        fa4 = importlib.import_module(FA4_MODULE) if _importable("flash_attn.cute") else None
    except Exception:
        fa4 = None
    if fa4 is not None and hasattr(fa4, FA4_FN):
        done[f"{FA4_MODULE}.{FA4_FN}"] = _patch_attr(fa4, FA4_FN, "flash_attn_4:dense")
    _installed.extend(done.items())
    if not done:
        return "skipped: flash-attn not installed"
    return "installed: " + ", ".join(done)


def uninstall() -> None:
    while _installed:
        _what, restore = _installed.pop()
        restore()
