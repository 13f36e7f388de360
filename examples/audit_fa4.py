"""Audit FlashAttention-4 (``flash_attn.cute``) with the audit's pytest fixture or ``check`` — GPU only
(FA4 runs on Hopper/Blackwell); elsewhere the script says what is missing and exits with status 1, the pytest
test is skipped with that reason.

    python examples/audit_fa4.py
    python -m gproj_patch audit --layout bshd --backend examples/audit_fa4.py:fa4 --backend examples/audit_fa4.py:fa4_patched
    pytest examples/audit_fa4.py        # the gproj_audit fixture (installed with gproj_patch)

``fa4`` adapts ``flash_attn.cute.flash_attn_func`` (flash-attn's (B, S, H, D) layout: ``layout="bshd"``) to the
audit's SDPA signature. FA4's causal mask is bottom-right aligned and it takes no dense mask, so those cases are
n/a (it raises, the audit reports the reason). Its fused BF16 backward rounds dS before the products: the
witness and the large-key-offset cases fail. ``fa4_patched`` is the same call under ``gproj_patch.enable()``
(FA4's forward, the GProj backward), which passes.
"""
from __future__ import annotations

import sys

import gproj_patch
from gproj_patch.audit import check

CASES = "witness,diffuse,key_offset_*,sink_offset_64,repeated_max,odd_lengths,long,gqa"


def fa4(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """(B, S, H, D) tensors, SDPA's keywords."""
    from flash_attn.cute import flash_attn_func
    if attn_mask is not None:
        raise NotImplementedError("FA4 takes no dense mask")
    if is_causal and q.shape[1] != k.shape[1]:
        raise NotImplementedError("FA4's causal mask is bottom-right aligned, the case's top-left")
    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=is_causal)
    return out[0] if isinstance(out, tuple) else out


def fa4_patched(q, k, v, attn_mask=None, is_causal=False, scale=None):
    with gproj_patch.enable(targets=("flash_attn",)):
        return fa4(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def test_fa4_patched_keeps_the_conservation_law(gproj_audit):
    import pytest
    why = unavailable_reason()
    if why is not None:
        pytest.skip(why)
    gproj_audit(fa4_patched, cases=CASES, layout="bshd", device="cuda")


def unavailable_reason():
    """Why FA4 cannot run here (None when it can): it needs a CUDA GPU and ``flash_attn.cute``."""
    import torch
    if not torch.cuda.is_available():
        return f"needs CUDA: FA4 runs on Hopper/Blackwell GPUs, and torch {torch.__version__} sees no CUDA GPU here"
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or a broken CUDA extension: say which
        return f"needs flash_attn.cute (pip install flash-attn-4): {type(e).__name__}: {e}"
    return None


def main() -> int:
    why = unavailable_reason()
    if why is not None:  # a clean line and status 1, not a traceback from inside the audit
        print(f"audit_fa4.py: {why}", file=sys.stderr)
        return 1
    reports = [check(fn, cases=CASES, layout="bshd", device="cuda") for fn in (fa4, fa4_patched)]
    for report in reports:
        print(report.explain(), end="\n\n")
    return 0 if reports[1].passed else 1


if __name__ == "__main__":
    sys.exit(main())
