"""flash-attn hook: the mechanism (re-registering a custom op's kernel) tested on CPU against ops with FA2's and
FA3's schemas (``tests/helpers/fa2_standin.py``), called directly as the releases' Functions call them; the real
module is tested only where flash-attn and a GPU exist. ``test_fa2_seam.py`` goes through the Functions."""

import pytest
import torch

import gproj_patch
from gproj_patch.backends.reference import reference_backward, reference_forward
from gproj_patch.hooks import flash_attn as fa_hook

from tests.helpers import fa2_standin, fa4_standin
from tests.helpers.numerics import bhsd as _bhsd, rel as _rel

NS = fa2_standin.NS
CALLS = fa2_standin.CALLS
_wrapped_bwd = fa2_standin.wrapped_bwd  # bound at import time, as flash_attn_interface binds its ops
_wrapped_varlen_bwd = fa2_standin.wrapped_varlen_bwd


def _fa_inputs(B=2, S=32, H=4, Hkv=2, D=16, offset=16.0, seed=0, varlen_lens=None):
    g = torch.Generator().manual_seed(seed)
    total = sum(varlen_lens) if varlen_lens else S
    shape = (total, H, D) if varlen_lens else (B, S, H, D)
    kshape = (total, Hkv, D) if varlen_lens else (B, S, Hkv, D)
    q = torch.randn(*shape, generator=g).bfloat16()
    k = (torch.randn(*kshape, generator=g) + offset).bfloat16()
    v = torch.randn(*kshape, generator=g).bfloat16()
    do = torch.randn(*shape, generator=g).bfloat16()
    return q, k, v, do


def _forward(q, k, v, causal, cu=None, window=(-1, -1)):
    varlen = cu is not None
    out, lse = reference_forward(*(_bhsd(t, varlen) for t in (q, k, v)), causal=causal,
                                 causal_align="bottom_right", window=window, cu_seqlens_q=cu, cu_seqlens_k=cu)
    out = out.to(q.dtype).transpose(1, 2)
    return (out[0] if varlen else out).contiguous(), (lse[0] if varlen else lse).float()


@pytest.fixture(autouse=True)
def _clean(patch_off):
    fa2_standin.reset_calls()


def _enable_with_test_ops(monkeypatch, mode="gproj"):
    """enable() patches the CUDA kernels of the ops in FA2_OPS / FA3_OPS; point it at the stand-ins' CPU kernels."""
    fa2_standin.point_hook_here(monkeypatch)
    return gproj_patch.enable(mode=mode, targets=("flash_attn",))


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (6, 0))])
def test_dense_op_kernel_replaced_and_restored(monkeypatch, causal, window):
    from torch._library.custom_ops import OPDEFS
    opdef = OPDEFS[f"{NS}::_flash_attn_backward"]
    original_kernel = opdef._backend_fns["cpu"]
    q, k, v, do = _fa_inputs()
    out, lse = _forward(q, k, v, causal, window=window)
    scale = q.shape[-1] ** -0.5
    handle = _enable_with_test_ops(monkeypatch)
    assert handle.installed["flash_attn"].startswith("installed")
    assert opdef._backend_fns["cpu"] is not original_kernel
    # a qkv-packed caller: dq, dk, dv are views into one buffer (FlashAttnQKVPackedFunc-style, MHA)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ret = _wrapped_bwd(do, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, window[0], window[1], 0.0, None,
                       False, torch.zeros(2, dtype=torch.int64))
    assert CALLS["dense"] == 0, "the original kernel must not run"
    assert ret.shape == (q.shape[0], q.shape[2], 7)  # the auxiliary return is shaped by the op's fake kernel
    ref = reference_backward(*(_bhsd(t, False) for t in (q, k, v, do)), causal=causal,
                             causal_align="bottom_right", window=window)
    for got, want in zip((dq, dk, dv), ref):
        assert _rel(_bhsd(got, False), want) < 1e-2
    assert gproj_patch.stats()["fp32"] + gproj_patch.stats()["gproj"] == 1
    gproj_patch.disable()
    assert opdef._backend_fns["cpu"] is original_kernel
    _wrapped_bwd(do, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, window[0], window[1], 0.0, None, False)
    assert CALLS["dense"] == 1


def test_packed_buffer_views_are_written_in_place(monkeypatch):
    q, k, v, do = _fa_inputs(Hkv=4)
    out, lse = _forward(q, k, v, True)
    _enable_with_test_ops(monkeypatch)
    dqkv = torch.zeros(q.shape[:2] + (3,) + q.shape[2:], dtype=q.dtype)
    _wrapped_bwd(do, q, k, v, out, lse, dqkv[:, :, 0], dqkv[:, :, 1], dqkv[:, :, 2], 0.0, q.shape[-1] ** -0.5,
                 True, -1, -1, 0.0, None, False)
    ref = reference_backward(*(_bhsd(t, False) for t in (q, k, v, do)), causal=True, causal_align="bottom_right")
    for idx, want in enumerate(ref):
        assert _rel(_bhsd(dqkv[:, :, idx], False), want) < 1e-2


def test_varlen_op(monkeypatch):
    lens = [5, 19, 8]
    cu = torch.tensor([0, 5, 24, 32], dtype=torch.int32)
    q, k, v, do = _fa_inputs(varlen_lens=lens)
    out, lse = _forward(q, k, v, True, cu=cu)
    _enable_with_test_ops(monkeypatch)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _wrapped_varlen_bwd(do, q, k, v, out, lse, dq, dk, dv, cu, cu, max(lens), max(lens), 0.0, q.shape[-1] ** -0.5,
                        True, -1, -1, 0.0, None, False, None)
    assert CALLS["varlen"] == 0
    ref = reference_backward(*(_bhsd(t, True) for t in (q, k, v, do)), causal=True, causal_align="bottom_right",
                             cu_seqlens_q=cu, cu_seqlens_k=cu)
    for got, want in zip((dq, dk, dv), ref):
        assert _rel(_bhsd(got, True), want) < 1e-2


def test_dropout_and_alibi_go_to_the_original_kernel(monkeypatch):
    q, k, v, do = _fa_inputs()
    out, lse = _forward(q, k, v, True)
    _enable_with_test_ops(monkeypatch)
    bufs = [torch.empty_like(t) for t in (q, k, v)]
    _wrapped_bwd(do, q, k, v, out, lse, *bufs, 0.1, 0.25, True, -1, -1, 0.0, None, False)
    _wrapped_bwd(do, q, k, v, out, lse, *bufs, 0.0, 0.25, True, -1, -1, 0.0, torch.ones(4), False)
    assert CALLS["dense"] == 2
    s = gproj_patch.stats()
    assert s["original"] == 2 and any("dropout" in r for r in s["fallback_reasons"])
    assert any("ALiBi" in r for r in s["fallback_reasons"])


def test_mode_off_runs_original(monkeypatch):
    q, k, v, do = _fa_inputs()
    out, lse = _forward(q, k, v, True)
    _enable_with_test_ops(monkeypatch, mode="off")
    bufs = [torch.empty_like(t) for t in (q, k, v)]
    _wrapped_bwd(do, q, k, v, out, lse, *bufs, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    assert CALLS["dense"] == 1 and gproj_patch.stats()["original"] == 1


def test_enable_without_flash_attn_skips_cleanly():
    if fa_hook._importable("flash_attn"):
        pytest.skip("flash-attn is installed")
    h = gproj_patch.enable(targets=("flash_attn",))
    assert h.installed["flash_attn"].startswith("skipped")


@pytest.mark.gpu
def test_real_flash_attn_func():
    flash_attn = pytest.importorskip("flash_attn")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v, do = (t.cuda() for t in _fa_inputs(S=256, D=64))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    func = flash_attn.flash_attn_func  # bound before enable(), as HF does
    with gproj_patch.enable(targets=("flash_attn",)):
        out = func(q, k, v, causal=True)
        out.backward(do)
    s = gproj_patch.stats()
    assert s["gproj"] + s["fp32"] == 1
    ref = reference_backward(*(_bhsd(t.detach(), False) for t in (q, k, v, do)), causal=True,
                             causal_align="bottom_right")
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        assert _rel(_bhsd(got, False), want.to(got.device)) < 1e-2


def _fake_fa4(monkeypatch):
    """flash-attn-4 4.0.0b36's ``flash_attn.cute.interface`` as the CPU stand-in (``tests/helpers/fa4_standin.py``): its
    ``FlashAttnFunc`` looks ``_flash_attn_fwd`` / ``_flash_attn_bwd`` up as module globals, returns
    ``(out, lse)`` and saves ``lse``; ``CALLS["original"]`` counts its own backward."""
    return fa4_standin.install(monkeypatch)


@pytest.mark.parametrize("causal", [False, True])
def test_fa4_module_function_replaced_and_restored(monkeypatch, causal):
    iface = _fake_fa4(monkeypatch)
    calls = iface.CALLS
    original = iface._flash_attn_bwd
    q, k, v, do = _fa_inputs(S=24, offset=64.0)
    ref = reference_backward(*(_bhsd(t, False) for t in (q, k, v, do)), causal=causal, causal_align="bottom_right")

    handle = gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    assert "flash_attn.cute.interface._flash_attn_bwd" in handle.installed["flash_attn"]
    assert iface._flash_attn_bwd is not original
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    iface.flash_attn_func(*leaves, causal=causal)[0].backward(do)  # the caller keeps out only
    assert calls["original"] == 0 and gproj_patch.stats()["fp32"] + gproj_patch.stats()["gproj"] == 1
    for got, want in zip((t.grad for t in leaves), ref):
        assert got.shape == want.transpose(1, 2).shape and got.dtype == torch.bfloat16
        assert _rel(got.transpose(1, 2), want) < 1e-2

    gproj_patch.disable()
    assert iface._flash_attn_bwd is original
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    iface.flash_attn_func(*leaves, causal=causal)[0].backward(do)
    assert calls["original"] == 1


def test_fa4_seqused_goes_to_the_original(monkeypatch):
    iface = _fake_fa4(monkeypatch)
    calls = iface.CALLS
    q, k, v, do = _fa_inputs(S=16)
    out, lse = _forward(q, k, v, False)
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    iface._flash_attn_bwd(q, k, v, out, do, lse, seqused_q=torch.full((2,), 16, dtype=torch.int32))
    assert calls["original"] == 1
    assert gproj_patch.stats()["original"] == 1


@pytest.mark.parametrize("sq,window", [(1, (-1, -1)), (8, (-1, -1)), (8, (5, 0))])
def test_decode_shapes_use_flash_attn_bottom_right_alignment(monkeypatch, sq, window):
    """Sq < Sk tells the two causal alignments apart: flash-attn's is bottom-right (the last query sees every key)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, sq, 4, 16, generator=g).bfloat16()
    k = (torch.randn(2, 32, 2, 16, generator=g) + 16.0).bfloat16()
    v = torch.randn(2, 32, 2, 16, generator=g).bfloat16()
    do = torch.randn(2, sq, 4, 16, generator=g).bfloat16()
    out, lse = _forward(q, k, v, True, window=window)
    _enable_with_test_ops(monkeypatch)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _wrapped_bwd(do, q, k, v, out, lse, dq, dk, dv, 0.0, 0.25, True, window[0], window[1], 0.0, None, False)
    assert CALLS["dense"] == 0
    bottom = reference_backward(*(_bhsd(t, False) for t in (q, k, v, do)), scale=0.25, causal=True,
                                causal_align="bottom_right", window=window)
    top = reference_backward(*(_bhsd(t, False) for t in (q, k, v, do)), scale=0.25, causal=True,
                             causal_align="top_left", window=window)
    assert _rel(_bhsd(dk, False), bottom[1]) < 1e-2
    assert _rel(_bhsd(dk, False), top[1]) > 0.1, "the two alignments must differ on this shape"
