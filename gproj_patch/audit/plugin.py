"""Plugin backends: any attention function audited like a built-in backend (``--backend MODULE:FUNCTION``).

The function takes ``(q, k, v, attn_mask=None, is_causal=False, scale=None)`` like
``torch.nn.functional.scaled_dot_product_attention`` and returns the output; autograd gives its backward. The
tensors are (B, H, S, D) (``layout="bhsd"``) or (B, S, H, D) (``layout="bshd"``, flash-attn's). Each case's
mask is passed the way SDPA takes it: ``is_causal=True`` for causal with equal lengths or top-left alignment, a
boolean ``attn_mask`` (True = attend, (Sq, Sk)) for a sliding window or bottom-right causal with Sq != Sk.
Grouped-query cases repeat k and v to the query heads before the call (autograd sums the group's gradients), so
the function always sees equal head counts. Cases the signature cannot express (varlen packs, softcap, a row
that sees no key) are n/a with the reason; so is a case on which the function raises — a plugin that rejects a
case is a limitation to report, not a crash of the audit.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .backends import Backend, Grads, NotApplicable
from .cases import CaseInputs
from .eager import case_visibility

LAYOUTS = ("bhsd", "bshd")


class PluginError(ValueError):
    """A ``--backend`` spec that cannot be loaded (bad form, module not importable, no such callable)."""


def load_function(spec: str) -> Callable:
    """The callable named by ``MODULE:FUNCTION`` (a dotted module on sys.path) or ``PATH.py:FUNCTION``."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"--backend {spec!r}: expected MODULE:FUNCTION or PATH.py:FUNCTION")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise PluginError(f"--backend {spec!r}: no file {module_name}")
            mod_spec = importlib.util.spec_from_file_location(
                "gproj_audit_plugin_" + os.path.basename(module_name)[:-3], module_name)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to import is the user's spec to fix: one line
        raise PluginError(f"--backend {spec!r}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise PluginError(f"--backend {spec!r}: {module_name} has no attribute {attr!r}")
    if not callable(fn):
        raise PluginError(f"--backend {spec!r}: {attr} is not callable")
    return fn


@dataclass
class SdpaCall:
    """How one case reaches an SDPA-signature function: the mask arguments and the GQA repeat."""
    attn_mask: Optional[torch.Tensor]
    is_causal: bool
    scale: Optional[float]
    group: int


def sdpa_call(inp: CaseInputs) -> SdpaCall:
    """The case's mask as SDPA arguments, or NotApplicable with what the signature cannot express."""
    m = inp.mask
    if m.get("cu_seqlens_q") is not None:
        raise NotApplicable("varlen packs need cu_seqlens, which the SDPA signature does not take")
    if m.get("softcap"):
        raise NotApplicable("the SDPA signature has no softcap")
    visible = case_visibility(inp)
    if visible is not None and not bool(visible.any(-1).all()):
        raise NotApplicable("a row sees no key (SDPA-style kernels return NaN or 0 there, the oracle 0)")
    sq, sk = inp.q.shape[2], inp.k.shape[2]
    window = tuple(m.get("window", (-1, -1)))
    causal = bool(m.get("causal", False))
    top_left = m.get("causal_align", "top_left") == "top_left" or sq == sk
    if causal and top_left and window == (-1, -1):
        mask, is_causal = None, True
    else:
        mask, is_causal = visible, False
    return SdpaCall(mask, is_causal, m.get("scale"), inp.q.shape[1] // inp.k.shape[1])


def plugin_backend(name: str, fn: Callable, layout: str = "bhsd") -> Backend:
    """A ``Backend`` running ``fn`` forward and backward on each case (module docstring)."""
    if layout not in LAYOUTS:
        raise PluginError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")

    def run(inp: CaseInputs, k: torch.Tensor, saved) -> Grads:
        call = sdpa_call(inp)
        q, kk, v = (x.detach().clone().requires_grad_(True) for x in (inp.q, k, inp.v))
        k_in, v_in = ((x.repeat_interleave(call.group, dim=1) if call.group > 1 else x) for x in (kk, v))
        args = (q, k_in, v_in) if layout == "bhsd" else tuple(x.transpose(1, 2) for x in (q, k_in, v_in))
        try:
            out = fn(*args, attn_mask=call.attn_mask, is_causal=call.is_causal, scale=call.scale)
            out = out[0] if isinstance(out, (tuple, list)) else out
            if layout == "bshd":
                out = out.transpose(1, 2)
            if not isinstance(out, torch.Tensor) or out.shape != inp.do.shape:
                raise TypeError(f"returned {type(out).__name__} {tuple(getattr(out, 'shape', ()))}, "
                                f"expected an output of shape {tuple(inp.do.shape)} ({layout})")
            out.backward(inp.do)
        except Exception as e:  # noqa: BLE001 - the plugin cannot run this case: n/a with its reason
            text = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            raise NotApplicable(f"raised {type(e).__name__}" + (f": {text}" if text else "")) from None
        if q.grad is None or kk.grad is None or v.grad is None:
            raise NotApplicable("no gradient reached q, k or v (is the output detached from them?)")
        return q.grad, kk.grad, v.grad

    return Backend(name, run)


def load_backend(spec: str, layout: str = "bhsd") -> Backend:
    """``--backend SPEC``: the loaded function as a backend named by its spec."""
    return plugin_backend(spec, load_function(spec), layout)
