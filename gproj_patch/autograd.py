"""SDPA with its own fused forward and the corrected backward.

Eager path (``_SdpaFunction``): the forward calls the original ``scaled_dot_product_attention`` itself, on
detached aliases of q, k, v that require grad, so PyTorch picks and runs exactly the kernel it would have picked
(respecting ``torch.nn.attention.sdpa_kernel``, head-dim padding, mask preprocessing): the output is the
unpatched output, bit for bit. The LSE is read from the fused autograd node that call created
(``ScaledDotProduct{Cudnn,Flash,FlashForCpu}AttentionBackward0._saved_logsumexp``,
``ScaledDotProductEfficientAttentionBackward0._saved_log_sumexp``; computed because the
aliases require grad). That inner graph is dropped right away unless the mode may ask for the original backward
("auto", "audit"), in which case ``torch.autograd.grad`` on it is the original backward, exactly.

Dropout > 0: the forward and backward both run on the FP32 tier with one seed (a fused kernel's dropout RNG
cannot be replayed by another backward), so the forward is not the unpatched forward in that case.

Compiled path (``torch.compiler.is_compiling()``): the custom ops ``gproj::sdpa_fwd`` / ``gproj::sdpa_bwd`` are
opaque to Dynamo (no graph break); inside, the forward output is the original SDPA under ``no_grad`` (same
bits) and on CUDA the LSE is recomputed (no autograd node is reachable inside a custom op): by the Triton LSE
kernel (``triton_bwd.attention_lse``, a forward without V) without a mask, else by a chunked FP32 pass. In "auto"/"audit" a policy choice of "original" runs an uncorrected stand-in there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import config, layer_context, telemetry
from .backends import dispatch
from .backends.spec import LOW_PRECISION, MaskSpec, default_scale

_C_SDPA = torch._C._nn.scaled_dot_product_attention
# The forward SDPA to run; integrations.sdpa puts the function it replaced here while it is installed.
ORIGINAL: List = [_C_SDPA]
DEFAULT = config.Config()


def original_sdpa():
    return ORIGINAL[0]


@dataclass(frozen=True)
class _Params:
    dropout_p: float
    is_causal: bool
    scale: Optional[float]
    enable_gqa: bool
    mode: str
    tier: str
    deterministic: bool
    layer: Optional[str]


# saved LSE of the fused nodes: cuDNN, flash (CUDA), flash for CPU, overrideable: "logsumexp"; efficient: "log_sumexp"
_LSE_ATTRS = ("_saved_logsumexp", "_saved_log_sumexp")


def _find_lse(fn, depth: int = 4):
    """The LSE saved by the fused SDPA autograd node behind ``fn``, or None (math backend)."""
    frontier = [fn]
    for _ in range(depth):
        nxt = []
        for f in frontier:
            if f is None:
                continue
            if "ScaledDotProduct" in type(f).__name__:
                for attr in _LSE_ATTRS:
                    if hasattr(f, attr):
                        return getattr(f, attr)
            nxt.extend(g for g, _ in f.next_functions)
        frontier = nxt
    return None


def mask_as_flags(attn_mask: Optional[Tensor], sq: int, sk: int):
    """(attn_mask or None, causal, causal_align, window): a boolean mask that is exactly a causal / sliding
    window / full pattern, shared by every batch and head, is replaced by the flags the kernel takes."""
    if attn_mask is None or attn_mask.dtype != torch.bool or attn_mask.shape[-2:] != (sq, sk):
        return attn_mask, False, "top_left", (-1, -1)
    m = attn_mask.reshape(-1, sq, sk)
    m0 = m[0]
    if m.shape[0] > 1 and not torch.equal(m, m0.expand_as(m)):
        return attn_mask, False, "top_left", (-1, -1)
    if bool(m0.all()):
        return None, False, "top_left", (-1, -1)
    i = torch.arange(sq, device=m0.device)[:, None]
    j = torch.arange(sk, device=m0.device)[None, :]
    for align in ("top_left", "bottom_right") if sq != sk else ("top_left",):
        shift = sk - sq if align == "bottom_right" else 0
        last = sq - 1 + shift
        n_last = int(m0[-1].sum())
        left = n_last - 1 if 0 <= last < sk and n_last - 1 < last else -1
        spec = MaskSpec(causal=True, causal_align=align, window=(left, -1))
        if torch.equal(m0, spec.visible(i, j, sq, sk)):
            return None, True, align, (left, -1)
    return attn_mask, False, "top_left", (-1, -1)


def padding_as_flags(attn_mask: Optional[Tensor], do: Tensor, sq: int, sk: int):
    """Right padding: a boolean mask that is a causal (or causal + sliding window) pattern on every row whose
    output gradient is nonzero. Returns ``(window, dead_rows (B, Sq) bool)`` or None.

    Rows whose dO is exactly zero (padded positions whose labels are ignored, the usual right-padded batch)
    contribute nothing to any gradient, whatever their mask row; computing the others with the causal flags is
    exact, and the dead rows are zeroed by giving them LSE = +inf (P = 0). Only the first candidate pattern
    that fits is used: causal, else causal with the widest window the mask shows."""
    if attn_mask is None or attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[1] != 1 \
            or attn_mask.shape[-2:] != (sq, sk) or sq != sk:
        return None
    m = attn_mask[:, 0]
    i = torch.arange(sq, device=m.device)[:, None]
    j = torch.arange(sk, device=m.device)[None, :]
    live = do.abs().amax(dim=(1, 3)) != 0  # (B, Sq): rows whose output gradient is nonzero
    widest = int(m.sum(-1).max())
    for left in dict.fromkeys((-1, widest - 1 if widest < sk else -1)):
        pattern = MaskSpec(causal=True, window=(left, -1)).visible(i, j, sq, sk)
        dead = (m != pattern).any(-1).expand(live.shape[0], sq)  # (B, Sq): rows that differ from the pattern
        if not bool((dead & live).any()):
            return (left, -1), dead
    return None


def _new_seed() -> int:
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))


def _check_sdpa_args(q, k, attn_mask, is_causal, enable_gqa):
    if attn_mask is not None and is_causal:
        raise RuntimeError("scaled_dot_product_attention: explicit attn_mask should not be set when is_causal=True")
    if k.shape[1] != q.shape[1] and not enable_gqa:
        raise RuntimeError("scaled_dot_product_attention: query and key heads differ; pass enable_gqa=True")


def _backward_kwargs(p: _Params, q, k, attn_mask, do=None, lse=None):
    """Keyword arguments of ``dispatch.corrected_backward``; a mask the kernel can take as flags is replaced
    (exact patterns; right padding with zero dO on the padded rows, whose LSE is then set to +inf)."""
    mask, causal, align, window = mask_as_flags(attn_mask, q.shape[2], k.shape[2])
    if p.is_causal:
        causal, align = True, "top_left"
    dead = None
    if mask is not None and do is not None and p.dropout_p == 0.0:
        padded = padding_as_flags(mask, do, q.shape[2], k.shape[2])
        if padded is not None:
            (window, dead), mask, causal, align = padded, None, True, "top_left"
    return dict(scale=default_scale(q.shape[-1], p.scale), causal=causal, causal_align=align, window=window,
                attn_mask=mask, dead_rows=dead, dropout_p=p.dropout_p, mode=p.mode, layer=p.layer,
                source="sdpa", tier_option=p.tier, deterministic=p.deterministic)


def _keep(t):
    return t


class _SdpaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, p: _Params):
        ctx.p, ctx.inner, ctx.seed = p, None, None
        lse = None
        if p.dropout_p > 0.0:
            from .backends.fp32_tier import fp32_forward
            _check_sdpa_args(q, k, attn_mask, p.is_causal, p.enable_gqa)
            ctx.seed = _new_seed()
            out, _ = fp32_forward(q, k, v, attn_mask=attn_mask, dropout_p=p.dropout_p, dropout_seed=ctx.seed,
                                  check_finite=False,
                                  scale=default_scale(q.shape[-1], p.scale), causal=p.is_causal)
            out = out.to(q.dtype)
        else:
            # Identity saved-tensor hooks: under activation checkpointing the inner node's saved tensors would
            # otherwise be packed by the checkpoint, and reading its LSE would re-run the checkpointed block.
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                qi, ki, vi = (t.detach().requires_grad_() for t in (q, k, v))
                inner = ORIGINAL[0](qi, ki, vi, attn_mask=attn_mask, dropout_p=0.0, is_causal=p.is_causal,
                                    scale=p.scale, enable_gqa=p.enable_gqa)
            lse = _find_lse(inner.grad_fn)
            if p.mode in ("auto", "audit"):
                ctx.inner = (inner, qi, ki, vi)
            out = inner.detach()
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        original = None
        if ctx.inner is not None:
            inner, qi, ki, vi = ctx.inner

            def original():
                return torch.autograd.grad(inner, (qi, ki, vi), do)
        grads = dispatch.corrected_backward(do, q, k, v, out, lse, dropout_seed=ctx.seed, original=original,
                                            **_backward_kwargs(ctx.p, q, k, attn_mask, do))
        ctx.inner = None
        return grads[0], grads[1], grads[2], None, None


# ----------------------------------------------------------------------------------------------------------------
# torch.compile path: custom ops, opaque to Dynamo.

_LAYER_NAMES: List[str] = []
_LAYER_INDEX = {}


def _intern_layer(name: str) -> int:
    if name not in _LAYER_INDEX:
        _LAYER_INDEX[name] = len(_LAYER_NAMES)
        _LAYER_NAMES.append(name)
    return _LAYER_INDEX[name]


def lse_fp32(q, k, attn_mask, is_causal, scale, chunk: int = 256) -> Tensor:
    """Natural-log LSE (B, Hq, Sq) fp32 of SDPA's scores, one chunked FP32 pass (GQA by head grouping)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    kf = k.float()
    out = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    cols = torch.arange(Sk, device=q.device)
    for s0 in range(0, Sq, chunk):
        s1 = min(Sq, s0 + chunk)
        qc = q[:, :, s0:s1].float().reshape(B, Hkv, g * (s1 - s0), D)
        s = (scale * torch.matmul(qc, kf.transpose(-1, -2))).reshape(B, Hq, s1 - s0, Sk)
        if is_causal:
            rows = torch.arange(s0, s1, device=q.device)
            s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        if attn_mask is not None:
            mb = attn_mask[..., s0:s1, :] if attn_mask.dim() >= 2 and attn_mask.shape[-2] == Sq else attn_mask
            s = s.masked_fill(~mb, float("-inf")) if mb.dtype == torch.bool else s + mb.float()
        out[:, :, s0:s1] = torch.logsumexp(s, dim=-1)
    return out


def _compiled_path_lse(q, k, attn_mask, is_causal, scale) -> Tensor:
    """The LSE the backward needs when no fused autograd node is reachable (inside a custom op): one Triton
    launch (a forward without V) where the kernel applies, else a chunked FP32 pass."""
    if attn_mask is None:
        try:
            from .backends.triton_bwd import attention_lse, kernel_unsupported_reason
        except ImportError:
            attention_lse = None
        if attention_lse is not None and kernel_unsupported_reason(q, k, k) is None:
            return attention_lse(q, k, scale=scale, causal=is_causal)
    return lse_fp32(q, k, attn_mask, is_causal, scale)


def _active_params(layer: Optional[str], dropout_p, is_causal, scale, enable_gqa) -> _Params:
    cfg = config.active() or DEFAULT
    return _Params(float(dropout_p), bool(is_causal), scale, bool(enable_gqa), cfg.mode, cfg.tier,
                   cfg.deterministic, layer)


@torch.library.custom_op("gproj::sdpa_fwd", mutates_args=())
def _sdpa_fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float, is_causal: bool,
              scale: Optional[float], enable_gqa: bool, layer: str) -> Tuple[Tensor, Tensor, Tensor]:
    seed = 0
    if dropout_p > 0.0:
        from .backends.fp32_tier import fp32_forward
        _check_sdpa_args(q, k, attn_mask, is_causal, enable_gqa)
        seed = _new_seed()
        out, _ = fp32_forward(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, dropout_seed=seed,
                              check_finite=False,
                              scale=default_scale(q.shape[-1], scale), causal=is_causal)
        out = out.to(q.dtype)
    else:
        with torch.no_grad():
            out = ORIGINAL[0](q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                              enable_gqa=enable_gqa)
    if q.device.type == "cuda" and dropout_p == 0.0:
        lse = _compiled_path_lse(q, k, attn_mask, is_causal, default_scale(q.shape[-1], scale))
    else:
        lse = q.new_empty((0,), dtype=torch.float32)
    aux = torch.tensor([_intern_layer(layer or layer_context.layer_id()), seed], dtype=torch.int64)
    return out.contiguous(), lse, aux


@_sdpa_fwd.register_fake
def _(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, layer):
    out = q.new_empty(q.shape[:3] + (v.shape[3],))
    lse = q.new_empty(q.shape[:3] if (q.device.type == "cuda" and dropout_p == 0.0) else (0,), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64, device="cpu")


@torch.library.custom_op("gproj::sdpa_bwd", mutates_args=())
def _sdpa_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, attn_mask: Optional[Tensor],
              aux: Tensor, dropout_p: float, is_causal: bool, scale: Optional[float],
              enable_gqa: bool) -> Tuple[Tensor, Tensor, Tensor]:
    layer_idx, seed = (int(x) for x in aux.tolist())
    p = _active_params(_LAYER_NAMES[layer_idx], dropout_p, is_causal, scale, enable_gqa)
    kw = _backward_kwargs(p, q, k, attn_mask, do)
    lse_t = lse if lse.numel() else None

    def stand_in():
        mask = {n: kw[n] for n in ("causal", "causal_align", "window")}
        if dispatch.kernel_reason(q, k, v, out, lse_t, attn_mask=kw["attn_mask"], **mask) is None:
            from .backends.triton_bwd import gproj_backward
            return gproj_backward(do, q, k, v, out, dispatch.kernel_lse(lse_t, kw["dead_rows"], q),
                                  scale=kw["scale"], correct=False, **mask)
        from .backends.fp32_tier import fp32_backward
        return fp32_backward(q, k, v, do, attn_mask=kw["attn_mask"], project=False, scale=kw["scale"],
                             check_finite=False, **mask)
    dq, dk, dv = dispatch.corrected_backward(
        do, q, k, v, out, lse_t, dropout_seed=seed if dropout_p > 0 else None, original=stand_in,
        stand_in_reason="torch.compile: original fused backward unreachable in a custom op; uncorrected stand-in",
        **kw)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_sdpa_bwd.register_fake
def _(do, q, k, v, out, lse, attn_mask, aux, dropout_p, is_causal, scale, enable_gqa):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the real op


def _fwd_setup(ctx, inputs, output):
    q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, _layer = inputs
    out, lse, aux = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, aux)
    ctx.args = (dropout_p, is_causal, scale, enable_gqa)


def _fwd_backward(ctx, dout, _dlse, _daux):
    q, k, v, out, lse, attn_mask, aux = ctx.saved_tensors
    dq, dk, dv = _sdpa_bwd(dout, q, k, v, out, lse, attn_mask, aux, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_sdpa_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# ----------------------------------------------------------------------------------------------------------------

def _unsupported_reason(q, k, v, attn_mask, dropout_p=0.0, is_causal=False) -> Optional[str]:
    if any(getattr(t, "is_nested", False) for t in (q, k, v)):
        return "nested tensors"
    if any(t.numel() == 0 for t in (q, k, v)):
        return "empty input"
    if dropout_p >= 1.0:
        return "dropout_p >= 1"
    if attn_mask is not None and is_causal:
        return "attn_mask together with is_causal (the original decides what that means)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "inputs are not 4-D (B, H, S, D)"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return "broadcast batch dimensions"
    if attn_mask is not None and attn_mask.requires_grad:
        return "attn_mask requires grad"
    return None


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The low-precision dtype autocast would run SDPA in on this device, or None."""
    try:
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            return dtype if dtype in LOW_PRECISION else None
    except (AttributeError, RuntimeError, TypeError):  # torch without per-device autocast queries
        pass
    return None


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
         *, cfg: Optional[config.Config] = None, layer: Optional[str] = None):
    """SDPA's semantics; the corrected backward when a gradient is needed and the inputs are BF16/FP16.

    ``layer`` names the call for the policy when no ``layer_scope`` is active (else ``call{n}``)."""
    cfg = cfg or config.active() or DEFAULT
    orig = ORIGINAL[0]
    if query.dtype == torch.float32 and cfg.mode != "off" and torch.is_grad_enabled():
        low = _autocast_dtype(query.device.type)
        if low is not None:  # autocast would run SDPA in low precision (and leak): cast as autocast does
            query, key, value = (t.to(low) for t in (query, key, value))
    if (cfg.mode == "off" or not torch.is_grad_enabled()
            or not (query.requires_grad or key.requires_grad or value.requires_grad)
            or query.dtype not in LOW_PRECISION):
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    compiling = torch.compiler.is_compiling()
    reason = _unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal)
    if reason is None and compiling:
        return _sdpa_fwd(query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale,
                         bool(enable_gqa), layer or "")[0]
    if reason is not None:
        if not compiling:
            telemetry.record_forward("original", f"sdpa: {reason}", telemetry.shape_class("sdpa", query, key))
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    telemetry.record_forward("patched")
    name = layer_context.current_layer() or layer or layer_context.layer_id()
    p = _Params(float(dropout_p), bool(is_causal), scale, bool(enable_gqa), cfg.mode, cfg.tier, cfg.deterministic,
                name)
    return _SdpaFunction.apply(query, key, value, attn_mask, p)
