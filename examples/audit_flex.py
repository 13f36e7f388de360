"""Audit FlexAttention with ``gproj_patch.audit.check`` (CPU or GPU).

    python examples/audit_flex.py            # cuda if available, else cpu
    python -m gproj_patch audit --backend examples/audit_flex.py:flex --backend examples/audit_flex.py:flex_patched

``flex`` is torch's ``flex_attention`` (compiled on CUDA, as it is used in training): its fused BF16 backward
leaks on the adversarial cases. PyTorch has no flex backward on the CPU, so there every case is n/a and no
criterion can run — the audit says so instead of passing. ``flex_patched`` is the same call with
``gproj_patch.enable(targets=("flex",))``: the original forward, the GProj-corrected backward (the FP32 tier on
the CPU), which passes.
"""
from __future__ import annotations

import sys

import torch

import gproj_patch
from gproj_patch.audit import check


def _block_mask(q, k, attn_mask, is_causal):
    from torch.nn.attention.flex_attention import create_block_mask
    sq, sk = q.shape[-2], k.shape[-2]
    if is_causal:
        return create_block_mask(lambda b, h, i, j: j <= i, None, None, sq, sk, device=q.device)
    if attn_mask is not None:  # a boolean (Sq, Sk) mask, True = attend (SDPA's convention)
        return create_block_mask(lambda b, h, i, j: attn_mask[i, j], None, None, sq, sk, device=q.device)
    return None


_COMPILED = {}


def flex(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """SDPA's signature over torch's flex_attention (compiled on CUDA)."""
    from torch.nn.attention import flex_attention as fa
    fn = fa.flex_attention
    if q.is_cuda:
        fn = _COMPILED.setdefault(fn, torch.compile(fn, dynamic=False))
    return fn(q, k, v, block_mask=_block_mask(q, k, attn_mask, is_causal), scale=scale)


def flex_patched(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """The same call with the patch on (eager: the hook wraps flex_attention itself)."""
    from torch.nn.attention import flex_attention as fa
    with gproj_patch.enable(targets=("flex",)):
        return fa.flex_attention(q, k, v, block_mask=_block_mask(q, k, attn_mask, is_causal), scale=scale)


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = "witness,diffuse,key_offset_*,sink_offset_64,causal_top_left,window,gqa"
    status = 0
    for fn in (flex, flex_patched):
        report = check(fn, cases=cases, device=device)
        print(report.explain(), end="\n\n")
        status |= (fn is flex_patched) and not report.passed
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
