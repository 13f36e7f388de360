"""The GProj Triton backward as a PyTorch operator: ``torch.ops.gproj.attention_backward``.

``attention_backward(do, q, k, v, o, lse, *, scale=None, causal=False, causal_align="top_left",
window=(-1, -1), softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
correct=True, deterministic=False) -> (dq, dk, dv)`` is the documented public entry point; it calls the
custom op ``gproj::attention_backward`` (registered with ``torch.library.custom_op`` and a fake
implementation), so ``torch.compile(fullgraph=True)`` traces through it as one opaque node and
``torch.library.opcheck`` passes. Arguments and results are those of
``gproj_patch.backends.triton_bwd.gproj_backward`` (outputs in the input dtype, shaped and strided like
``torch.empty_like`` of q, k, v); the window is passed to the op as two ints.

**Learnable sinks.** ``attention_backward(..., sink=s)`` (s of shape (Hq,), fp32 or the input dtype) returns
(dq, dk, dv, dsink) through a second op, ``gproj::attention_backward_sink`` (the same arguments plus the sink;
four outputs, dsink like ``torch.empty_like(sink)``), so the three-output schema of the first op is unchanged.

The op runs the Triton kernel and nothing else: it raises ``ValueError`` with
``triton_bwd.kernel_unsupported_reason`` when the kernel cannot take the inputs (choosing a fallback tier is the
call's plan's job, ``plan.py``).

**CPU.** An explicit call of the kernel runs where its tensors are: on CPU through Triton's interpreter (FP16 and
FP32; the interpreter's BF16 is inexact and is refused). No environment variable is read; the interpreted copy of
the kernels is loaded separately from the compiled one.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import triton_bwd

__all__ = ["attention_backward"]


@torch.library.custom_op("gproj::attention_backward", mutates_args=())
def _attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           o: torch.Tensor, lse: torch.Tensor, scale: Optional[float] = None,
                           causal: bool = False, causal_align: str = "top_left", window_left: int = -1,
                           window_right: int = -1, softcap: float = 0.0,
                           cu_seqlens_q: Optional[torch.Tensor] = None,
                           cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                           max_seqlen_k: Optional[int] = None, correct: bool = True,
                           deterministic: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return triton_bwd.gproj_backward(
        do, q, k, v, o, lse, scale=scale, causal=causal, causal_align=causal_align,
        window=(window_left, window_right), softcap=softcap, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, correct=correct,
        deterministic=deterministic)


@_attention_backward_op.register_fake
def _attention_backward_fake(do, q, k, v, o, lse, scale=None, causal=False, causal_align="top_left",
                             window_left=-1, window_right=-1, softcap=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                             max_seqlen_q=None, max_seqlen_k=None, correct=True, deterministic=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("gproj::attention_backward_sink", mutates_args=())
def _attention_backward_sink_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                o: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, scale: Optional[float] = None,
                                causal: bool = False, causal_align: str = "top_left", window_left: int = -1,
                                window_right: int = -1, softcap: float = 0.0,
                                cu_seqlens_q: Optional[torch.Tensor] = None,
                                cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                                max_seqlen_k: Optional[int] = None, correct: bool = True,
                                deterministic: bool = False
                                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return triton_bwd.gproj_backward(
        do, q, k, v, o, lse, scale=scale, causal=causal, causal_align=causal_align,
        window=(window_left, window_right), softcap=softcap, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, correct=correct,
        deterministic=deterministic, sink=sink)


@_attention_backward_sink_op.register_fake
def _attention_backward_sink_fake(do, q, k, v, o, lse, sink, scale=None, causal=False, causal_align="top_left",
                                  window_left=-1, window_right=-1, softcap=0.0, cu_seqlens_q=None,
                                  cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, correct=True,
                                  deterministic=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(sink)


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, *, correct: bool = True, deterministic: bool = False,
                       sink: Optional[torch.Tensor] = None, **mask):
    """GProj attention backward (dq, dk, dv) through ``torch.ops.gproj.attention_backward``; with a ``sink``
    (Hq,), (dq, dk, dv, dsink) through ``torch.ops.gproj.attention_backward_sink``.

    ``mask``: the mask kwargs (``spec.MASK_KWARGS`` and ``spec.MAX_SEQLEN_KWARGS``). See the module docstring
    and ``triton_bwd.gproj_backward``. ``lse`` may be in any layout ``spec.normalize_lse`` reads; it is
    normalized to (B, H, Sq) fp32 here (a view where possible).
    """
    from .spec import MaskArgs, normalize_lse
    args = MaskArgs.from_kwargs("attention_backward", mask, max_seqlen=True)
    lse = normalize_lse(lse, q.shape[0], q.shape[1], q.shape[2])
    left, right = args.window
    varlen = args.varlen
    kwargs = dict(scale=None if args.scale is None else float(args.scale), causal=bool(args.causal),
                  causal_align=args.causal_align, window_left=int(left), window_right=int(right),
                  softcap=float(args.softcap), cu_seqlens_q=varlen.cu_seqlens_q, cu_seqlens_k=varlen.cu_seqlens_k,
                  max_seqlen_q=varlen.max_seqlen_q, max_seqlen_k=varlen.max_seqlen_k, correct=bool(correct),
                  deterministic=bool(deterministic))
    if sink is None:
        return torch.ops.gproj.attention_backward(do, q, k, v, o, lse, **kwargs)
    return torch.ops.gproj.attention_backward_sink(do, q, k, v, o, lse, sink, **kwargs)
