"""The GProj Triton kernels on CPU, through Triton's interpreter (GPROJ_TIER=triton), in FP16.

Tight: against the FP16 emulation (rounding where the kernel rounds), after rounding the emulation's fp32
result to fp16 like the kernel's output. Loose: against the fp64 reference. BF16 runs on the GPU only
(tests/test_triton_gpu.py): the interpreter's BF16 is inexact.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from gproj_patch.backends import triton_bwd  # noqa: E402
from gproj_patch.backends.emulation import emulated_backward  # noqa: E402
from gproj_patch.backends.reference import reference_backward, reference_forward  # noqa: E402
from gproj_patch.backends.triton_bwd import gproj_backward, kernel_unsupported_reason  # noqa: E402

TIGHT = 3e-4   # kernel vs FP16 emulation (both rounded to fp16 at the end)
LOOSE = 1.5e-3  # GProj kernel vs fp64


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("GPROJ_TIER", "triton")
    monkeypatch.setattr(triton_bwd, "_POISON_OUTPUTS", True)


def rel(a, b):
    a, b = a.double(), b.double()
    n = b.norm()
    return float((a - b).norm() / n) if n > 0 else float((a - b).abs().max())


def make(B, H, HKV, SQ, SK, D, *, offset=0.0, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, SQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, SK, D, generator=g, dtype=torch.float64)
    k = k + offset * torch.randn(D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, SK, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, SQ, D, generator=g, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, do))


def forward(q, k, v, **mask):
    o, lse = reference_forward(q, k, v, **mask)
    return o.to(q.dtype), lse.float()


def check(q, k, v, do, *, forms=("two_product",), uncorrected=False, lse_view=None, **mask):
    """Run the kernel; compare with the emulation (tight) and fp64 (loose). Returns the kernel grads."""
    o, lse = forward(q, k, v, **mask)
    ref = reference_backward(q, k, v, do, **mask)
    out = None
    for form in forms:
        grads = gproj_backward(do, q, k, v, o, lse if lse_view is None else lse_view(lse), dk_form=form, **mask)
        emu = emulated_backward(q, k, v, o, do, lse, fmt="fp16", correct=True, dk_form=form, **mask)
        for name, a, e, r in zip(("dq", "dk", "dv"), grads, emu, ref):
            assert a.dtype == q.dtype and a.shape == e.shape
            assert torch.isfinite(a).all(), f"{name}: unwritten or non-finite elements"
            assert rel(a, e.to(a.dtype)) < TIGHT, (form, name, rel(a, e.to(a.dtype)))
            assert rel(a, r) < LOOSE, (form, name, rel(a, r))
        out = grads
    if uncorrected:
        grads = gproj_backward(do, q, k, v, o, lse, correct=False, **mask)
        emu = emulated_backward(q, k, v, o, do, lse, fmt="fp16", correct=False, **mask)
        for name, a, e in zip(("dq", "dk", "dv"), grads, emu):
            # the uncorrected dq carries the large cancelling ρμ term: accumulation order shows more
            assert rel(a, e.to(a.dtype)) < 2 * TIGHT, ("uncorrected", name, rel(a, e.to(a.dtype)))
    return out


def test_dense_both_dk_forms_and_uncorrected():
    q, k, v, do = make(2, 2, 2, 37, 50, 32, offset=8.0)
    check(q, k, v, do, forms=("two_product", "fused"), uncorrected=True)


def test_offset_projection_beats_uncorrected():
    q, k, v, do = make(1, 2, 2, 48, 48, 64, offset=32.0, seed=1)
    o, lse = forward(q, k, v)
    ref = reference_backward(q, k, v, do)
    dq = gproj_backward(do, q, k, v, o, lse)[0]
    dq0 = gproj_backward(do, q, k, v, o, lse, correct=False)[0]
    assert rel(dq, ref[0]) < LOOSE
    assert rel(dq0, ref[0]) > 5 * rel(dq, ref[0])


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(40, 23), (23, 40)])
def test_causal_alignments(align, sq, sk):
    q, k, v, do = make(1, 2, 1, sq, sk, 32, offset=4.0, seed=2)
    dq, dk, dv = check(q, k, v, do, causal=True, causal_align=align)
    if align == "bottom_right" and sq > sk:  # the first sq - sk rows see no key: zero gradients
        assert (dq[:, :, : sq - sk] == 0).all()


@pytest.mark.parametrize("window,causal", [((5, -1), True), ((4, 3), False), ((-1, 2), False), ((0, 0), False)])
def test_window(window, causal):
    q, k, v, do = make(1, 2, 2, 33, 41, 32, offset=4.0, seed=3)
    check(q, k, v, do, window=window, causal=causal, causal_align="bottom_right")


def test_gqa_and_mqa_with_uncorrected():
    q, k, v, do = make(1, 4, 2, 20, 36, 32, offset=16.0, seed=4)
    check(q, k, v, do, forms=("two_product", "fused"), uncorrected=True, causal=True)
    q, k, v, do = make(1, 3, 1, 17, 17, 32, seed=5)
    check(q, k, v, do)


def test_varlen_with_empty_sequences():
    lq, lk = [5, 0, 19, 1, 0, 7], [9, 4, 21, 0, 0, 7]
    cq = torch.tensor([0, 5, 5, 24, 25, 25, 32], dtype=torch.int32)
    ck = torch.tensor([0, 9, 13, 34, 34, 34, 41], dtype=torch.int32)
    assert cq.diff().tolist() == lq and ck.diff().tolist() == lk
    q, k, v, do = make(1, 2, 1, 32, 41, 32, offset=8.0, seed=6)
    mask = dict(causal=True, causal_align="bottom_right", cu_seqlens_q=cq, cu_seqlens_k=ck)
    dq, dk, dv = check(q, k, v, do, **mask)
    assert (dk[:, :, 9:13] == 0).all() and (dv[:, :, 9:13] == 0).all()  # keys of a sequence with no query
    # the same through max_seqlen (no sync) and with a packed tail past the last sequence
    o, lse = forward(q, k, v, **mask)
    # FA2/FA3 varlen LSE layout (H, total)
    g2 = gproj_backward(do, q, k, v, o, lse[0], max_seqlen_q=19, max_seqlen_k=21, dk_form="two_product", **mask)
    assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), g2))


@pytest.mark.parametrize("D", [64, 96, 128])
def test_head_dims(D):
    q, k, v, do = make(1, 1, 1, 24, 20, D, offset=4.0, seed=7)
    check(q, k, v, do, causal=True)


def test_head_dim_256_small():
    q, k, v, do = make(1, 1, 1, 16, 16, 256, seed=8)
    check(q, k, v, do)


def test_strided_inputs_and_lse_layouts():
    B, H, S, D = 1, 2, 21, 32
    q, k, v, do = make(B, H, H, S, S, D, offset=8.0, seed=9)
    # (B, S, H, D) memory (SDPA / flash-attn layout), and a head-dim slice with a row stride of 2D
    q2, k2 = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k))
    v2 = torch.cat([v, torch.randn_like(v)], dim=-1)[..., :D]
    assert not q2.is_contiguous() and not v2.is_contiguous()
    # cuDNN-style LSE (B, H, S, 1) with a non-contiguous stride, and efficient-style padded (B, H, 32)
    check(q2, k2, v2, do, lse_view=lambda l: torch.stack([l, l], -1)[..., :1])
    check(q2, k2, v2, do, lse_view=lambda l: torch.cat([l, torch.zeros(B, H, 32 - S)], -1))


@pytest.mark.parametrize("cap", [1.0, 2.0, 5.0])
def test_softcap(cap):
    # cap 1 saturates part of the scores, cap 5 is the mild regime. (Where tanh saturates so far that
    # τ' is 0 in torch's fp32 tanh but ~1e-7 in the kernel's exp2 form, ρ's t/τ' term differs: not tested.)
    q, k, v, do = make(1, 2, 1, 29, 35, 32, offset=2.0, seed=12)
    check(q, k, v, do, forms=("two_product", "fused"), uncorrected=True, softcap=cap, causal=True)


def test_fully_masked_rows_get_zero_gradients():
    q, k, v, do = make(1, 1, 1, 8, 8, 32, seed=10)
    o, lse = forward(q, k, v, window=(0, 0))
    lse[..., 3] = float("-inf")
    o[..., 3, :] = 0
    dq, dk, dv = gproj_backward(do, q, k, v, o, lse, window=(0, 0))
    assert (dq[..., 3, :] == 0).all() and (dk[..., 3, :] == 0).all() and (dv[..., 3, :] == 0).all()
    assert torch.isfinite(dq).all()


def test_four_key_witness_fp16():
    # FP16 version of the four-key witness (docs/math.md §4): eps = 3/8192 (fp16(1 + eps) = 1), keys at 16384; exact dq = 0,
    # an uncorrected kernel returns -α·16384·eps = -0.75 in dq[..., 0].
    D, eps = 64, 3.0 / 8192
    q = torch.zeros(1, 1, 1, D, dtype=torch.float16)
    k = torch.zeros(1, 1, 4, D, dtype=torch.float16)
    k[..., 0] = 16384.0
    v = torch.zeros(1, 1, 4, D, dtype=torch.float16)
    v[0, 0, 0, 0], v[0, 0, 0, 1], v[0, 0, 1, 0], v[0, 0, 2, 1] = 4.0, 4 * eps, -4.0, -4 * eps
    do = torch.zeros(1, 1, 1, D, dtype=torch.float16)
    do[..., :2] = 1.0
    o, lse = forward(q, k, v)
    assert (o == 0).all()
    for form in ("two_product", "fused"):
        dq, dk, dv = gproj_backward(do, q, k, v, o, lse, dk_form=form)
        assert (dq == 0).all()
    dq0 = gproj_backward(do, q, k, v, o, lse, correct=False)[0]
    assert float(dq0[0, 0, 0, 0]) == -0.75


def test_deterministic_and_scale():
    q, k, v, do = make(1, 4, 2, 30, 30, 32, offset=8.0, seed=11)
    o, lse = forward(q, k, v, scale=0.3)
    a = gproj_backward(do, q, k, v, o, lse, scale=0.3, deterministic=True)
    b = gproj_backward(do, q, k, v, o, lse, scale=0.3, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    ref = reference_backward(q, k, v, do, scale=0.3)
    assert all(rel(x, r) < LOOSE for x, r in zip(a, ref))


def test_unsupported_reasons(monkeypatch):
    q, k, v, _ = make(1, 1, 1, 8, 8, 32)
    assert kernel_unsupported_reason(q, k, v) is None
    assert kernel_unsupported_reason(q, k, v, softcap=30.0) is None
    assert kernel_unsupported_reason(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool)) == "attn_mask"
    assert kernel_unsupported_reason(q, k, v, dropout_p=0.1) == "dropout"
    assert kernel_unsupported_reason(q.float(), k.float(), v.float()) == "dtype=float32"
    assert "bfloat16" in kernel_unsupported_reason(q.bfloat16(), k.bfloat16(), v.bfloat16())
    big = torch.zeros(1, 1, 4, 320, dtype=torch.float16)
    assert kernel_unsupported_reason(big, big, big) == "head_dim=320"
    monkeypatch.delenv("GPROJ_TIER")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernel_unsupported_reason(q, k, v) == "cpu tensor without GPROJ_TIER=triton/TRITON_INTERPRET=1"
    with pytest.raises(ValueError, match="cpu tensor"):
        gproj_backward(q, q, k, v, q, torch.zeros(1, 1, 8))


@pytest.mark.parametrize("sq,sk,causal,hkv", [(37, 37, True, 2), (20, 45, True, 1), (45, 20, True, 4),
                                               (33, 50, False, 4), (1, 17, True, 2)])
def test_attention_lse_matches_fp64(sq, sk, causal, hkv):
    """The LSE kernel (SDPA semantics: top-left causal) against the fp64 oracle, with GQA and odd lengths."""
    q, k, _, _ = make(2, 4, hkv, sq, sk, 24, offset=8.0, seed=11)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # strided, as HF hands them over
    got = triton_bwd.attention_lse(q, k, scale=0.3, causal=causal)
    _, want = reference_forward(q, k, k, scale=0.3, causal=causal)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
