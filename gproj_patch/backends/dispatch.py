"""Pick the tier of one attention backward, run it, count it, log why it fell back (once per shape class).

Tiers: "gproj" (the Triton GProj kernel, `triton_bwd.gproj_backward`), "fp32" (attention recomputed in FP32 with
the projection, `fp32_tier.fp32_backward`), "original" (the caller's own uncorrected backward, given as a
callable). Modes: "gproj" → kernel where supported, else FP32 tier; "fp32" → FP32 tier; "off" → original;
"auto"/"audit" → `gproj_patch.policy.decide(...)` chooses, and "audit" reports to `policy.after_backward`.
The ``tier`` option ("auto" | "triton" | "fp32", env GPROJ_TIER) can force the FP32 tier or make a missing
kernel an error instead of a fallback.

Every tensor is in the shared layout (spec.py): q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), any strides.
Gradients come back in the dtypes of q, k, v.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .. import layer_context, telemetry
from .spec import default_scale, normalize_lse

Grads = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _mask_kwargs(causal, causal_align, window, softcap, cu_seqlens_q, cu_seqlens_k):
    return dict(causal=bool(causal), causal_align=causal_align, window=tuple(int(w) for w in window),
                softcap=float(softcap), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


def kernel_reason(q, k, v, o, lse, *, attn_mask=None, dropout_p=0.0, **mask) -> Optional[str]:
    """Why the GProj Triton kernel cannot take this backward (None when it can)."""
    if dropout_p > 0.0:
        return "dropout > 0 (a fused kernel's dropout RNG cannot be replayed)"
    try:
        from .triton_bwd import kernel_unsupported_reason
    except ImportError as exc:  # triton missing, or the kernel module not there yet
        return f"no triton kernel ({exc})"
    reason = kernel_unsupported_reason(q, k, v, dropout_p=dropout_p, attn_mask=attn_mask, **mask)
    if reason is None and (o is None or lse is None):
        return "the forward returned no LSE (non-fused forward)"
    return reason


def kernel_lse(lse, dead_rows, q):
    """The LSE handed to the kernel: (B, H, Sq) fp32, +inf on ``dead_rows`` (B, Sq) so their P is 0."""
    if lse is None:
        return None
    lse = normalize_lse(lse, q.shape[0], q.shape[1], q.shape[2])
    return lse if dead_rows is None else lse.masked_fill(dead_rows[:, None, :], float("inf"))


def _fp32(q, k, v, do, *, attn_mask, dropout_p, dropout_seed, scale, mask) -> Grads:
    from .fp32_tier import fp32_backward
    return fp32_backward(q, k, v, do, attn_mask=attn_mask, dropout_p=dropout_p, dropout_seed=dropout_seed,
                         project=True, scale=scale, check_finite=False, **mask)


def _cast(grads, q, k, v) -> Grads:
    return tuple(g if g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def _policy_tier(q, k, lse, scale, layer, mode) -> str:
    try:
        from .. import policy
    except ImportError as exc:
        raise RuntimeError(f"mode {mode!r} needs gproj_patch.policy, which is not available ({exc}); "
                           "use mode='gproj' or 'fp32'") from exc
    tier = policy.decide(q=q, k=k, lse=lse, scale=scale, layer=layer, mode=mode, dtype=q.dtype)
    if tier not in telemetry.TIERS:
        raise RuntimeError(f"policy.decide returned {tier!r}; expected one of {telemetry.TIERS}")
    return tier


def corrected_backward(do, q, k, v, o=None, lse=None, *, scale=None, causal=False, causal_align="top_left",
                       window=(-1, -1), softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, attn_mask=None, dropout_p=0.0, dropout_seed=None, mode="gproj",
                       layer=None, original: Optional[Callable[[], Grads]] = None, source="sdpa",
                       tier_option="auto", deterministic=False, stand_in_reason=None, dead_rows=None) -> Grads:
    """Gradients (dq, dk, dv) of one attention call through the tier that ``mode`` selects.

    ``original`` computes the caller's own backward (needed for mode "off" and for the policy's "original").
    ``dead_rows`` (B, Sq) bool: query rows whose dO is exactly zero and whose mask row differs from the flags;
    the kernel gets LSE = +inf there (P = 0: zero contributions, as the exact gradient has).
    ``stand_in_reason``: when set, "original" has no real original backward behind it; the string is logged.
    """
    scale = default_scale(q.shape[-1], scale)
    mask = _mask_kwargs(causal, causal_align, window, softcap, cu_seqlens_q, cu_seqlens_k)
    cls = telemetry.shape_class(source, q, k)
    lse_n = None
    if lse is not None:
        lse_n = normalize_lse(lse, q.shape[0], q.shape[1], q.shape[2])
    layer_context.backward_ran()

    reason = None
    if mode == "off":
        tier = "original"
    elif mode == "fp32" or tier_option == "fp32" or dropout_p > 0.0:
        tier = "fp32"
        if dropout_p > 0.0 and mode != "fp32" and tier_option != "fp32":
            reason = "dropout > 0 (a fused kernel's dropout RNG cannot be replayed)"
    elif mode in ("gproj", "auto", "audit"):
        tier = "gproj" if mode == "gproj" else _policy_tier(q, k, lse_n, scale, layer, mode)
        if tier == "gproj":
            reason = kernel_reason(q, k, v, o, lse_n, attn_mask=attn_mask, dropout_p=dropout_p, **mask)
            if reason is not None:
                if tier_option == "triton":
                    raise RuntimeError(f"GPROJ_TIER=triton but the GProj kernel cannot run: {reason}")
                tier = "fp32"
    else:
        raise ValueError(f"unknown mode {mode!r}")

    if tier == "original" and original is None:
        reason, tier = f"{source}: no original backward available", "fp32"

    if tier == "original":
        if stand_in_reason:
            reason = stand_in_reason
        grads = original()
    elif tier == "gproj":
        from .triton_bwd import gproj_backward
        grads = gproj_backward(do, q, k, v, o, kernel_lse(lse_n, dead_rows, q), scale=scale, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, correct=True, deterministic=deterministic, **mask)
    else:
        grads = _fp32(q, k, v, do, attn_mask=attn_mask, dropout_p=dropout_p, dropout_seed=dropout_seed,
                      scale=scale, mask=mask)
    grads = _cast(grads, q, k, v)
    telemetry.record_backward(tier, reason, cls)

    if mode == "audit":
        from .. import policy

        def fp32_grads():
            return _fp32(q, k, v, do, attn_mask=attn_mask, dropout_p=dropout_p, dropout_seed=dropout_seed,
                         scale=scale, mask=mask)
        policy.after_backward(layer=layer, tier=tier, grads=grads, fp32_grads=fp32_grads)
    return grads
