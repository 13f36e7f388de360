"""CPU stand-ins for flash-attn 2 (2.7-2.8) and FA3's custom ops and the autograd Functions that call them.

The ops are ``torch.library.custom_op`` ops under this module's namespaces (``gproj_fa_test``: FA2's four,
``gproj_fa3_test``: FA3's backward), with the schemas of the releases' ops — argument names, order, types,
defaults, ``mutates_args`` and return values as in flash-attention's ``flash_attn/flash_attn_interface.py``
(identical in v2.7.0, v2.7.4 and v2.8.0; the varlen forward as in the newest source, with ``num_splits``) and
``hopper/flash_attn_interface.py`` — and CPU kernels in place of the CUDA ones. ``FlashAttnFunc`` and
``FlashAttnVarlenFunc`` call them as FA2's Functions do: the ops bound at import time
(``torch.ops.<ns>.<op>``), the forward op with q, k, v, dropout and scale positional and the rest by keyword, the
head dim padded to a multiple of 8, the scale defaulted before the forward op, ``(q, k, v, out_padded, lse,
rng_state)`` saved, and the backward op given every argument positionally but ``rng_state``, with dq, dk, dv
allocated by the Function and trimmed after.

What is modelled: the numerics. The forward is the fp64 oracle (bottom-right causal, window, softcap, varlen)
rounded to the input dtype, LSE fp32 ((B, H, Sq); varlen (H, total)). The backward ("the original") is the
uncorrected BF16 emulation of a fused backward (``emulated_backward(correct=False)``: it leaks under a common key
offset as the fused kernels do). Dropout and ALiBi are not modelled: the forward raises, the backward computes
without them (tests only check that such calls reach it). Each kernel call is counted in ``CALLS``.
"""
from typing import Optional, Tuple

import torch

from gproj_patch.backends.emulation import emulated_backward
from gproj_patch.backends.reference import reference_forward

NS, NS3 = "gproj_fa_test", "gproj_fa3_test"
FA2_BACKWARD_OPS = (f"{NS}::_flash_attn_backward", f"{NS}::_flash_attn_varlen_backward")
FA2_FORWARD_OPS = (f"{NS}::_flash_attn_forward", f"{NS}::_flash_attn_varlen_forward")
FA3_BACKWARD_OPS = (f"{NS3}::_flash_attn_backward",)
CALLS = {"forward": 0, "dense": 0, "varlen": 0, "fa3": 0}


def bhsd(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    return t.unsqueeze(0).transpose(1, 2) if varlen else t.transpose(1, 2)


def _fa_layout(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    return t.transpose(1, 2).squeeze(0) if varlen else t.transpose(1, 2)


def _forward(q, k, v, scale, causal, window, softcap, cu_q=None, cu_k=None):
    varlen = cu_q is not None
    out, lse = reference_forward(*(bhsd(t, varlen) for t in (q, k, v)), scale=scale, causal=causal,
                                 causal_align="bottom_right", window=window, softcap=softcap,
                                 cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return _fa_layout(out.to(q.dtype), varlen).contiguous(), (lse[0] if varlen else lse).float().contiguous()


def _backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, window, softcap, cu_q=None, cu_k=None):
    """The uncorrected fused backward, modelled; writes dq, dk, dv (allocated when None, as the releases do)."""
    varlen = cu_q is not None
    lse4 = lse.unsqueeze(0) if varlen else lse
    grads = emulated_backward(*(bhsd(t, varlen) for t in (q, k, v, out, dout)), lse4, fmt="bf16", correct=False,
                              scale=scale, causal=causal, causal_align="bottom_right", window=window,
                              softcap=softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for buf, g in zip((dq, dk, dv), grads[:3]):
        if buf is not None:
            buf.copy_(_fa_layout(g, varlen))


def _no_dropout_or_alibi(dropout_p, alibi_slopes):
    if dropout_p > 0 or alibi_slopes is not None:
        raise NotImplementedError("the FA2 stand-in's forward does not model dropout or ALiBi")


# ---- FA2's ops (schemas: flash_attn/flash_attn_interface.py) ----------------------------------------------

@torch.library.custom_op(f"{NS}::_flash_attn_forward", mutates_args=(), device_types="cpu")
def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: Optional[torch.Tensor], return_softmax: bool
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _no_dropout_or_alibi(dropout_p, alibi_slopes)
    CALLS["forward"] += 1
    out, lse = _forward(q, k, v, softmax_scale, causal, (window_size_left, window_size_right), softcap)
    return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)


@_flash_attn_forward.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
      return_softmax):
    B, S, H, _ = q.shape
    return (torch.empty_like(q), q.new_empty((B, H, S), dtype=torch.float32), q.new_empty(0),
            q.new_empty((2,), dtype=torch.int64))


@torch.library.custom_op(f"{NS}::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                               softmax_scale: float, causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
                               block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
                               seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False,
                               num_splits: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _no_dropout_or_alibi(dropout_p, alibi_slopes)
    CALLS["forward"] += 1
    out, lse = _forward(q, k, v, softmax_scale, causal, (window_size_left, window_size_right), softcap,
                        cu_seqlens_q, cu_seqlens_k)
    return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op(f"{NS}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu")
def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                         dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                         window_size_left: int, window_size_right: int, softcap: float,
                         alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                         rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    CALLS["dense"] += 1
    _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal,
              (window_size_left, window_size_right), softcap)
    return softmax_lse.new_zeros(q.shape[0], q.shape[2], 128)


@_flash_attn_backward.register_fake
def _(dout, q, k, v, out, softmax_lse, dq, dk, dv, *args, **kwargs):
    return softmax_lse.new_empty(q.shape[0], q.shape[2], 7)  # a distinctive shape: the patched kernel must copy it


@torch.library.custom_op(f"{NS}::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, softmax_lse: torch.Tensor, dq: Optional[torch.Tensor],
                                dk: Optional[torch.Tensor], dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                                softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                                softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                                rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False
                                ) -> torch.Tensor:
    CALLS["varlen"] += 1
    _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal,
              (window_size_left, window_size_right), softcap, cu_seqlens_q, cu_seqlens_k)
    return softmax_lse.new_zeros(q.shape[1], q.shape[0] + 128)


# bound at import time, as flash_attn_interface binds them (``torch.ops.flash_attn._flash_attn_*``)
wrapped_fwd = torch.ops.gproj_fa_test._flash_attn_forward
wrapped_varlen_fwd = torch.ops.gproj_fa_test._flash_attn_varlen_forward
wrapped_bwd = torch.ops.gproj_fa_test._flash_attn_backward
wrapped_varlen_bwd = torch.ops.gproj_fa_test._flash_attn_varlen_backward


def _pad8(t: torch.Tensor) -> torch.Tensor:
    d = t.shape[-1]
    return t if d % 8 == 0 else torch.nn.functional.pad(t, [0, 8 - d % 8])


class FlashAttnFunc(torch.autograd.Function):
    """FA2's dense Function, calling the ops as the release's does (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5
        head_dim = q.shape[-1]
        q, k, v = _pad8(q), _pad8(k), _pad8(v)
        out_padded, lse, s_dmask, rng_state = wrapped_fwd(
            q, k, v, dropout_p, softmax_scale, causal=causal, window_size_left=window_size[0],
            window_size_right=window_size[1], softcap=softcap, alibi_slopes=alibi_slopes,
            return_softmax=return_softmax and dropout_p > 0)
        ctx.save_for_backward(q, k, v, out_padded, lse, rng_state)
        ctx.args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic)
        out = out_padded[..., :head_dim]
        return out if not return_softmax else (out, lse, s_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, lse, rng_state = ctx.saved_tensors
        dropout_p, scale, causal, window, softcap, alibi_slopes, deterministic = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        head_dim = dout.shape[-1]
        wrapped_bwd(_pad8(dout), q, k, v, out, lse, dq, dk, dv, dropout_p, scale, causal, window[0], window[1],
                    softcap, alibi_slopes, deterministic, rng_state=rng_state)
        return (dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]) + (None,) * 9


class FlashAttnVarlenFunc(torch.autograd.Function):
    """FA2's varlen Function, calling the ops as the release's does (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, block_table,
                is_grad_enabled):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5
        head_dim = q.shape[-1]
        q, k, v = _pad8(q), _pad8(k), _pad8(v)
        out_padded, lse, s_dmask, rng_state = wrapped_varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            causal=causal, window_size_left=window_size[0], window_size_right=window_size[1], softcap=softcap,
            alibi_slopes=alibi_slopes, return_softmax=return_softmax and dropout_p > 0, block_table=block_table)
        ctx.save_for_backward(q, k, v, out_padded, lse, cu_seqlens_q, cu_seqlens_k, rng_state)
        ctx.args = (max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, deterministic)
        out = out_padded[..., :head_dim]
        return out if not return_softmax else (out, lse, s_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, lse, cu_q, cu_k, rng_state = ctx.saved_tensors
        max_q, max_k, dropout_p, scale, causal, window, softcap, alibi_slopes, deterministic = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        head_dim = dout.shape[-1]
        wrapped_varlen_bwd(_pad8(dout), q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, scale,
                           causal, window[0], window[1], softcap, alibi_slopes, deterministic, rng_state=rng_state)
        return (dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]) + (None,) * 14


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs, torch.is_grad_enabled())


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                     softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                     return_attn_probs, block_table, torch.is_grad_enabled())


# ---- FA3's backward op (schema: hopper/flash_attn_interface.py) -------------------------------------------

@torch.library.custom_op(f"{NS3}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu")
def _fa3_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  softmax_lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None,
                  cu_seqlens_k: Optional[torch.Tensor] = None, sequed_q: Optional[torch.Tensor] = None,
                  sequed_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                  max_seqlen_k: Optional[int] = None, dq: Optional[torch.Tensor] = None,
                  dk: Optional[torch.Tensor] = None, dv: Optional[torch.Tensor] = None,
                  softmax_scale: Optional[float] = None, is_causal: bool = False, window_size_left: int = -1,
                  window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False,
                  sm_margin: int = 0) -> torch.Tensor:
    CALLS["fa3"] += 1
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, scale, is_causal, (window_size_left, window_size_right),
              softcap, cu_seqlens_q, cu_seqlens_k)
    varlen = cu_seqlens_q is not None
    return softmax_lse.new_zeros((q.shape[1], q.shape[0] + 128) if varlen else (q.shape[0], q.shape[2], 128))


fa3_wrapped_bwd = torch.ops.gproj_fa3_test._flash_attn_backward


def fa3_backward(dout, q, k, v, out, lse, scale, causal, window=(-1, -1), softcap=0.0, cu_q=None, cu_k=None,
                 max_q=None, max_k=None):
    """FA3's ``FlashAttnFunc`` / ``FlashAttnVarlenFunc.backward``: the op given every argument positionally,
    seqused None, dq/dk/dv allocated here; returns them."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa3_wrapped_bwd(dout, q, k, v, out, lse, cu_q, cu_k, None, None, max_q, max_k, dq, dk, dv, scale, causal,
                    window[0], window[1], softcap, False, 0)
    return dq, dk, dv


def reset_calls() -> None:
    CALLS.update(forward=0, dense=0, varlen=0, fa3=0)


def point_hook_here(monkeypatch) -> None:
    """The flash-attn hook's op lists and device pointed at these ops' CPU kernels (FA4 left alone)."""
    from gproj_patch.hooks import flash_attn as fa_hook
    monkeypatch.setattr(fa_hook, "FA2_OPS", FA2_BACKWARD_OPS)
    monkeypatch.setattr(fa_hook, "FA3_OPS", FA3_BACKWARD_OPS)
    monkeypatch.setattr(fa_hook, "DEVICE_TYPE", "cpu")
