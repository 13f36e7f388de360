"""Host side of the Triton LSE kernel (``triton_lse_kernels.py``): ``attention_lse``, the natural-log LSE of a
forward whose LSE the caller cannot reach (the compiled SDPA path). Same device rules as ``triton_bwd``."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton

from .compat import triton_interpreter_index_patch
from .spec import default_scale
from .triton_bwd import MIN_BLOCK_D, block_d, kernel_module, kernel_unsupported_reason, pad_head_dim

RCP_LN2 = 1.4426950408889634  # 1/ln 2: the kernel works in base 2 (exp2/log2)


def attention_lse(q: torch.Tensor, k: torch.Tensor, *, scale: Optional[float] = None,
                  causal: bool = False) -> torch.Tensor:
    """Natural-log LSE (B, Hq, Sq) fp32 of α·q·kᵀ — SDPA's semantics (dense, or top-left causal), GQA by head
    group — in one Triton launch (bf16/fp16 operands, fp32 accumulation: the scores the backward recomputes).

    For callers that hold a fused forward's output but not its LSE (inside a ``torch.compile``d graph the SDPA
    hook cannot reach the fused node's saved LSE). Same device rules as ``gproj_backward``.
    """
    reason = kernel_unsupported_reason(q, k, k, cpu_kernel=True)  # an explicit call: CPU interpreted
    if reason is not None:
        raise ValueError(f"attention_lse cannot run here: {reason}")
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or Hq % Hkv != 0:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not form an attention problem")
    if D < MIN_BLOCK_D:  # as in gproj_backward: zero columns change no score
        return attention_lse(pad_head_dim(q), pad_head_dim(k), scale=default_scale(D, scale), causal=causal)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    interpret = q.device.type != "cuda"
    km = kernel_module(interpret, "triton_lse_kernels")
    block_m, block_n = (16, 16) if interpret else (64, 64)
    grid = (triton.cdiv(Sq, block_m), Hq, B)
    with (triton_interpreter_index_patch() if interpret else contextlib.nullcontext()):
        km._lse_fwd[grid](q, k, lse, *q.stride(), *k.stride(), *lse.stride(), Hq // Hkv, Sq, Sk, D,
                          default_scale(D, scale) * RCP_LN2, CAUSAL=bool(causal), BLOCK_M=block_m,
                          BLOCK_N=block_n, BLOCK_D=block_d(D), num_warps=4)
    return lse
