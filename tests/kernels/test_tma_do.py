"""dO as the Gluon launches take it (``router._tma_do``): the transposed view an attention layer hands back
(``out.transpose(1, 2)`` before its output projection) goes to the TMA descriptors as it is — no copy — and every
layout a descriptor cannot address is copied contiguous. On an sm_90 GPU: the patched SDPA's gradients with that
view are bitwise those with a contiguous dO and within the suite's distance of the fp64 oracle at a 128σ key
offset."""
from __future__ import annotations

import pytest
import torch

from gproj_patch.backends import gluon_bwd
from gproj_patch.dispatch.router import _tma_do
from tests.helpers.hopper import gluon_gpu_reason
from tests.helpers.numerics import rel

B, H, S, D = 2, 4, 96, 128


def _model_do(dtype=torch.bfloat16, device="cpu"):
    """The gradient of SDPA's output in a layer that does ``out.transpose(1, 2).reshape(B, S, H·D)``: a
    (B, H, S, D) view of (B, S, H, D) memory."""
    return torch.randn(B, S, H, D, dtype=dtype, device=device).transpose(1, 2)


def test_the_layers_transposed_view_is_passed_as_it_is():
    do = _model_do()
    assert not do.is_contiguous()
    assert _tma_do(do) is do


@pytest.mark.parametrize("layout", ["last_dim_strided", "expanded", "row_stride_not_16_bytes"])
def test_what_a_descriptor_cannot_address_is_copied_contiguous(layout):
    if layout == "last_dim_strided":
        do = torch.randn(B, H, S, 2 * D, dtype=torch.bfloat16)[..., ::2]
    elif layout == "expanded":  # the dO of out.sum(): one value, every stride 0
        do = torch.ones((), dtype=torch.bfloat16).expand(B, H, S, D)
    else:  # rows 2·(D + 4) bytes apart: not a multiple of 16 bytes
        do = torch.randn(B, H, S, D + 4, dtype=torch.bfloat16)[..., :D]
    assert gluon_bwd.tma_strides_reason("do", do) is not None
    got = _tma_do(do)
    assert got.is_contiguous() and torch.equal(got, do)


def test_the_base_address_is_left_to_the_descriptor_binding():
    """A view at an odd offset with good strides is passed as it is: ``bound_descriptor`` reads an unaligned base
    from an aligned copy (``test_kv_major``'s unaligned-base test), so the router copies nothing for it."""
    flat = torch.randn(B * H * S * D + 1, dtype=torch.bfloat16)
    do = flat[1:].view(B, H, S, D)
    assert do.data_ptr() % gluon_bwd.TMA_ALIGN_BYTES != 0
    assert gluon_bwd.tma_strides_reason("do", do) is None and _tma_do(do) is do


@pytest.mark.gpu
@pytest.mark.skipif(gluon_gpu_reason() is not None, reason="needs an sm_90 GPU and Gluon")
def test_patched_sdpa_with_the_layers_do_view_is_exact_and_bitwise_the_contiguous_one():
    import torch.nn.functional as F
    import gproj_patch
    from gproj_patch.backends.reference import reference_backward
    g = torch.Generator(device="cuda").manual_seed(7)
    mk = lambda: torch.randn(B, S, H, D, generator=g, device="cuda").transpose(1, 2)  # noqa: E731
    q, k, v = mk(), mk(), mk()
    k = k + 128.0 * torch.randn(D, generator=g, device="cuda")  # a large common key offset: the leak's regime
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    do_view = torch.randn(B, S, H, D, generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    ref = reference_backward(q, k, v, do_view, causal=True)
    grads = {}
    gproj_patch.enable(mode="gproj")
    try:
        for name, do in (("view", do_view), ("contiguous", do_view.contiguous())):
            qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).backward(do)
            grads[name] = (qq.grad, kk.grad, vv.grad)
        stats = gproj_patch.stats()
    finally:
        gproj_patch.disable()
    assert stats["gproj"] == 2 and stats["kv_major"] == {"gluon": 2} and stats["dq_major"] == {"gluon": 2}, stats
    assert all(torch.equal(a, b) for a, b in zip(grads["view"], grads["contiguous"]))
    for got, want in zip(grads["view"], ref):
        assert rel(got, want) < 5e-3
