"""Malformed SDPA calls behave exactly as without the patch: the same result, or the same
error raised at the same call (the forward, not the backward), with the same message.

Each case runs twice — unpatched, then under ``enable()`` — and the outcomes of the call and of its backward
are compared: exception type and message, or the output and every gradient bit for bit. The forward is PyTorch's
own (the seam is in the backward op); a malformed call that reaches a fused backward op is passed to PyTorch's
kernel untouched, so its backward is the original's too.
"""
import pytest
import torch
import torch.nn.functional as F

import gproj_patch


def _t(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_()


def _qkv(q=(1, 2, 16, 8), k=(1, 2, 16, 8), v=(1, 2, 16, 8), **kw):
    return (_t(*q, seed=1), _t(*k, seed=2), _t(*v, seed=3)), kw


CASES = {
    "2-D inputs": lambda: _qkv((16, 8), (16, 8), (16, 8)),
    "1-D inputs": lambda: _qkv((8,), (8,), (8,)),
    "3-D inputs": lambda: _qkv((2, 16, 8), (2, 16, 8), (2, 16, 8)),
    "5-D inputs": lambda: _qkv((1, 1, 2, 16, 8), (1, 1, 2, 16, 8), (1, 1, 2, 16, 8)),
    "negative dropout": lambda: _qkv(dropout_p=-0.5),
    "dropout above 1": lambda: _qkv(dropout_p=1.5),
    "k and v key counts differ": lambda: _qkv(v=(1, 2, 12, 8)),
    "k and v head counts differ": lambda: _qkv(v=(1, 1, 16, 8)),
    "q and k head dims differ": lambda: _qkv(k=(1, 2, 16, 4)),
    "GQA heads do not divide": lambda: _qkv(q=(1, 3, 16, 8), enable_gqa=True),
    "unknown keyword": lambda: _qkv(foo=1),
    "scale of a wrong type": lambda: _qkv(scale="x"),
    "is_causal not a bool": lambda: _qkv(is_causal=1),
    "mask of a wrong shape": lambda: _qkv(attn_mask=torch.ones(3, 5, dtype=torch.bool)),
    "mask of a wrong dtype": lambda: _qkv(attn_mask=torch.ones(16, 16, dtype=torch.int64)),
    "mixed dtypes": lambda: ((_t(1, 2, 16, 8), _t(1, 2, 16, 8, dtype=torch.float16), _t(1, 2, 16, 8)), {}),
}


def _outcome(make, positional=()):
    """("raised at call"/"raised in backward", type, message) or ("ok", output, grads)."""
    args, kwargs = make()
    try:
        out = F.scaled_dot_product_attention(*args, *positional, **kwargs)
    except Exception as e:  # noqa: BLE001 - the outcome under comparison
        return ("raised at call", type(e), str(e))
    try:
        out.float().sum().backward()
    except Exception as e:  # noqa: BLE001
        return ("raised in backward", type(e), str(e))
    return ("ok", out.detach(), [a.grad for a in args])


def _assert_same(plain, patched):
    assert plain[0] == patched[0], (plain, patched)
    if plain[0] != "ok":
        assert (plain[1], plain[2]) == (patched[1], patched[2])
        return
    torch.testing.assert_close(patched[1], plain[1], rtol=0, atol=0, equal_nan=True)
    for a, b in zip(patched[2], plain[2]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_call_behaves_as_unpatched(patch_off, case):
    plain = _outcome(CASES[case])
    gproj_patch.enable(targets=("sdpa",))
    patched = _outcome(CASES[case])
    _assert_same(plain, patched)


def test_too_many_positional_arguments(patch_off):
    """The builtin takes six positional arguments (scale and enable_gqa are keyword-only)."""
    extra = (None, 0.0, False, None)  # attn_mask, dropout_p, is_causal, then scale positionally: one too many
    plain = _outcome(_qkv, extra)
    gproj_patch.enable(targets=("sdpa",))
    patched = _outcome(_qkv, extra)
    assert plain[0] == "raised at call" and "positional" in plain[2]
    _assert_same(plain, patched)


def test_malformed_calls_are_reported_not_corrected(patch_off):
    """A call the fused op accepts although its shapes disagree (PyTorch's CPU flash op takes a value with fewer
    keys than the key) keeps PyTorch's backward, counted under its reason."""
    gproj_patch.enable(targets=("sdpa",))
    _outcome(CASES["k and v key counts differ"])
    s = gproj_patch.stats()
    assert s["gproj"] == s["fp32"] == 0 and s["original"] == 1, s
    assert any("disagree" in r for r in s["fallback_reasons"]), s


def test_a_tensor_scale_is_a_call_like_any_other(patch_off):
    """The builtin takes ``scale`` as a 0-d tensor; its fused op receives the number: the seam corrects that
    backward like any other (the forward is PyTorch's, bit for bit)."""
    from gproj_patch.backends.reference import reference_backward
    from tests.helpers.numerics import rel
    args, _ = _qkv()
    out = F.scaled_dot_product_attention(*args, scale=torch.tensor(0.25))
    gproj_patch.enable(targets=("sdpa",))
    patched = F.scaled_dot_product_attention(*args, scale=torch.tensor(0.25))
    assert torch.equal(out, patched)
    do = torch.ones_like(out)
    patched.backward(do)
    ref = reference_backward(*(a.detach() for a in args), do, scale=0.25)
    assert gproj_patch.stats()["fp32"] == 1 and rel(args[0].grad, ref[0]) < 4 * 2.0 ** -8


def test_empty_targets_variable_raises(patch_off, monkeypatch):
    monkeypatch.setenv("GPROJ_TARGETS", "")
    with pytest.raises(ValueError, match="GPROJ_TARGETS is empty"):
        gproj_patch.enable()
    assert not gproj_patch.is_enabled()
