"""The Gluon KV-major launch asked for explicitly (tests and benchmarks): its full predicate and the backward
that requires it. The patch's own calls get it through their plan (``dispatch/plan.kv_major_choice``)."""
from __future__ import annotations

from typing import Optional

import torch

from .gluon_bwd import kv_major_reason
from .triton_bwd import gproj_backward, kernel_unsupported_reason


def gluon_supported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, do: Optional[torch.Tensor] = None,
                           **mask_and_options) -> Optional[str]:
    """None when ``gluon_backward`` runs these inputs: this kernel's predicate (CPU allowed, as an explicit call),
    then ``gluon_bwd.kv_major_reason``. ``mask_and_options``: the mask kwargs plus ``attn_mask``, ``dropout_p``,
    ``sink``, ``correct``, ``dk_form``."""
    o = mask_and_options
    reason = kernel_unsupported_reason(q, k, v, dropout_p=o.get("dropout_p", 0.0), attn_mask=o.get("attn_mask"),
                                       softcap=o.get("softcap", 0.0), sink=o.get("sink"), cpu_kernel=True)
    if reason is not None:
        return reason
    if o.get("causal") and o.get("causal_align", "top_left") not in ("top_left", "bottom_right"):
        return f"causal_align={o['causal_align']}"
    return kv_major_reason(q, k, v, do=do, window=o.get("window", (-1, -1)), softcap=o.get("softcap", 0.0),
                           varlen=o.get("cu_seqlens_q") is not None or o.get("cu_seqlens_k") is not None,
                           correct=o.get("correct", True), dk_form=o.get("dk_form"))


def gluon_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, **kwargs):
    """``gproj_backward`` with the Gluon KV-major launch required (ValueError where ``gluon_supported_reason`` is
    not None; tests and benchmarks). ``_gluon_config`` (a ``configs.KernelConfig``) overrides its tiles, its
    ring and its slot release."""
    reason = gluon_supported_reason(q, k, v, do=do, **{n: x for n, x in kwargs.items() if not n.startswith("_")})
    if reason is not None:
        raise ValueError(f"gluon_backward cannot run these inputs: {reason}")
    return gproj_backward(do, q, k, v, o, lse, kv_major="gluon", **kwargs)
