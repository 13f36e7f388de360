"""The fp64 oracle against independent fp64 autograd computations (SDPA math backend or explicit masks)."""
import math

import pytest
import torch
import torch.nn.functional as F

from gproj_patch.backends.reference import reference_backward, reference_forward


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _autograd(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _explicit_mask(sq, sk, causal=False, bottom_right=False, left=-1, right=-1):
    """Loop-built visibility, written independently of MaskSpec."""
    m = torch.zeros(sq, sk, dtype=torch.bool)
    shift = sk - sq if bottom_right else 0
    for i in range(sq):
        for j in range(sk):
            ok = True
            if causal and j > i + shift:
                ok = False
            if left >= 0 and j < i + shift - left:
                ok = False
            if right >= 0 and j > i + shift + right:
                ok = False
            m[i, j] = ok
    return m


def _naive(q, k, v, scale, mask=None, softcap=0.0):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    s = scale * q @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1)
    p = torch.nan_to_num(p, nan=0.0)  # fully masked rows: exact output and gradient are 0
    return p @ v


def _assert_close(ours, ref, tol=1e-12):
    for a, b in zip(ours, ref):
        assert a.dtype == torch.float64
        err = (a - b).norm() / b.norm().clamp_min(1e-300)
        assert err < tol, float(err)


@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 11), (13, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_math_top_left(sq, sk, causal):
    q, k, v, do = _rand(2, 3, sq, 8, seed=1), _rand(2, 3, sk, 8, seed=2), _rand(2, 3, sk, 8, seed=3), _rand(2, 3, sq, 8, seed=4)
    ref = _autograd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), q, k, v, do)
    out, lse = reference_forward(q, k, v, causal=causal)
    _assert_close([out], [ref[0]])
    _assert_close(reference_backward(q, k, v, do, causal=causal), ref[1:])
    s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    if causal:
        s = s.masked_fill(~_explicit_mask(sq, sk, causal=True), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("sq,sk", [(5, 11), (6, 6), (13, 4)])
def test_bottom_right_causal_and_empty_rows(sq, sk):
    q, k, v, do = _rand(1, 2, sq, 4, seed=5), _rand(1, 2, sk, 4, seed=6), _rand(1, 2, sk, 4, seed=7), _rand(1, 2, sq, 4, seed=8)
    m = _explicit_mask(sq, sk, causal=True, bottom_right=True)
    ref = _autograd(lambda a, b, c: _naive(a, b, c, 0.5, m), q, k, v, do)
    out, lse = reference_forward(q, k, v, scale=0.5, causal=True, causal_align="bottom_right")
    _assert_close([out], [ref[0]])
    grads = reference_backward(q, k, v, do, scale=0.5, causal=True, causal_align="bottom_right")
    _assert_close(grads, ref[1:])
    empty = ~m.any(-1)
    assert bool(torch.isneginf(lse[..., empty]).all())
    assert bool((grads[0][..., empty, :] == 0).all()) and bool(torch.isfinite(grads[0]).all())


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window,causal", [((2, 0), False), ((3, 1), False), ((1, -1), True), ((-1, 2), False)])
def test_sliding_window(align, window, causal):
    sq, sk = 9, 12
    q, k, v, do = _rand(1, 2, sq, 4, seed=9), _rand(1, 2, sk, 4, seed=10), _rand(1, 2, sk, 4, seed=11), _rand(1, 2, sq, 4, seed=12)
    m = _explicit_mask(sq, sk, causal, align == "bottom_right", *window)
    ref = _autograd(lambda a, b, c: _naive(a, b, c, 0.3, m), q, k, v, do)
    kw = dict(scale=0.3, causal=causal, causal_align=align, window=window)
    _assert_close([reference_forward(q, k, v, **kw)[0]], [ref[0]])
    _assert_close(reference_backward(q, k, v, do, **kw), ref[1:])


@pytest.mark.parametrize("hkv", [1, 2])
def test_gqa_mqa_matches_sdpa(hkv):
    q, do = _rand(2, 4, 6, 8, seed=13), _rand(2, 4, 6, 8, seed=14)
    k, v = _rand(2, hkv, 9, 8, seed=15), _rand(2, hkv, 9, 8, seed=16)
    ref = _autograd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, enable_gqa=True), q, k, v, do)
    _assert_close(reference_backward(q, k, v, do), ref[1:])


def test_softcap_matches_autograd():
    q, k, v, do = _rand(1, 2, 7, 8, seed=17) * 4, _rand(1, 2, 7, 8, seed=18) * 4, _rand(1, 2, 7, 8, seed=19), _rand(1, 2, 7, 8, seed=20)
    ref = _autograd(lambda a, b, c: _naive(a, b, c, 0.35, softcap=5.0), q, k, v, do)
    _assert_close([reference_forward(q, k, v, scale=0.35, softcap=5.0)[0]], [ref[0]])
    _assert_close(reference_backward(q, k, v, do, scale=0.35, softcap=5.0), ref[1:])


@pytest.mark.parametrize("causal,align", [(False, "top_left"), (True, "bottom_right")])
def test_varlen_equals_per_sequence(causal, align):
    lens_q, lens_k = [3, 1, 0, 5], [4, 1, 2, 5]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q, do = _rand(1, 2, sum(lens_q), 4, seed=21), _rand(1, 2, sum(lens_q), 4, seed=22)
    k, v = _rand(1, 1, sum(lens_k), 4, seed=23), _rand(1, 1, sum(lens_k), 4, seed=24)
    kw = dict(causal=causal, causal_align=align)
    out, _ = reference_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    dq, dk, dv = reference_backward(q, k, v, do, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    for s in range(len(lens_q)):
        qs, qe, ks, ke = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if qe == qs:
            assert bool((dk[:, :, ks:ke] == 0).all()) and bool((dv[:, :, ks:ke] == 0).all())
            continue
        m = _explicit_mask(qe - qs, ke - ks, causal=causal, bottom_right=align == "bottom_right")
        ref = _autograd(lambda a, b, c: _naive(a, b, c, 0.5, m), q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke],
                        do[:, :, qs:qe])
        torch.testing.assert_close(out[:, :, qs:qe], ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dq[:, :, qs:qe], ref[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dk[:, :, ks:ke], ref[2], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dv[:, :, ks:ke], ref[3], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_attn_mask_matches_sdpa(kind):
    q, k, v, do = _rand(2, 2, 5, 4, seed=25), _rand(2, 2, 7, 4, seed=26), _rand(2, 2, 7, 4, seed=27), _rand(2, 2, 5, 4, seed=28)
    keep = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[..., 0] = True
    mask = keep if kind == "bool" else torch.where(keep, _rand(2, 1, 5, 7, seed=29), torch.tensor(float("-inf"), dtype=torch.float64))
    ref = _autograd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask), q, k, v, do)
    _assert_close([reference_forward(q, k, v, attn_mask=mask)[0]], [ref[0]])
    _assert_close(reference_backward(q, k, v, do, attn_mask=mask), ref[1:])


def test_low_precision_inputs_taken_exactly():
    q, k, v, do = (_rand(1, 2, 6, 8, seed=s).to(torch.bfloat16) for s in range(30, 34))
    ref = _autograd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), *(t.double() for t in (q, k, v, do)))
    _assert_close(reference_backward(q, k, v, do), ref[1:])


def test_chunking_does_not_change_result(monkeypatch):
    import gproj_patch.backends.reference as reference
    q, k, v, do = _rand(1, 2, 37, 4, seed=40), _rand(1, 2, 29, 4, seed=41), _rand(1, 2, 29, 4, seed=42), _rand(1, 2, 37, 4, seed=43)
    whole = reference_backward(q, k, v, do, causal=True)
    monkeypatch.setattr(reference, "_BLOCK_ELEMENTS", 2 * 29 * 5)
    _assert_close(reference_backward(q, k, v, do, causal=True), whole, tol=1e-14)


@pytest.mark.parametrize("bad", ["shape", "dtype", "heads", "empty", "nonfinite", "cu", "mask"])
def test_bad_input_raises_value_error(bad):
    q, k, v = _rand(1, 4, 5, 8), _rand(1, 2, 6, 8), _rand(1, 2, 6, 8)
    kw = {}
    if bad == "shape":
        v = _rand(1, 2, 7, 8)
    elif bad == "dtype":
        k = k.float()
    elif bad == "heads":
        k, v = _rand(1, 3, 6, 8), _rand(1, 3, 6, 8)
    elif bad == "empty":
        q = _rand(1, 4, 0, 8)
    elif bad == "nonfinite":
        q[0, 0, 0, 0] = float("nan")
    elif bad == "cu":
        kw = dict(cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 6], dtype=torch.int32))
    elif bad == "mask":
        kw = dict(attn_mask=torch.ones(3, 5, 6, dtype=torch.bool))
    with pytest.raises(ValueError):
        reference_backward(q, k, v, _rand(1, 4, q.shape[2], 8), **kw)
