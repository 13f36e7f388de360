"""Autograd and dispatch usages the shim must not change (patch off vs on, measured in the same test, CPU).

Each case here was a difference before its fix:

* a double backward (``create_graph=True``, then a backward through the gradient: a gradient penalty) silently
  dropped the second-order term (torch's ``once_differentiable`` marks the gradients only when dO requires
  grad): now either the unpatched result or a clear error — SDPA on its math backend (where the unpatched
  double backward works, checked against fp64) and on its default one, and HF's eager attention;
* ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, ``vmap`` of ``grad``) and forward-mode AD raised
  (the hooks' ``autograd.Function``s define neither ``setup_context`` nor ``jvp``): now the original's result;
* ``disable_saved_tensors_hooks`` made every corrected call raise; meta tensors raised in the backward (a mask on
  the meta device at the forward); under CPU autocast an FP64 or integer key was cast to BF16 (the unpatched call
  raises its dtype error); ``dropout_p=nan`` ran instead of raising the original's error;
* pickling the patched ``F.scaled_dot_product_attention`` (``torch.save`` of a module holding it) raised.
"""
from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gproj_patch
from gproj_patch.backends.reference import reference_backward
from gproj_patch.dispatch.autograd import SECOND_ORDER_ERROR
from tests.helpers.numerics import rel

pytestmark = pytest.mark.usefixtures("patch_off")

B, H, S, D = 1, 2, 8, 8
BOUND = 5e-3  # BF16 gradients vs fp64, relative (the corrected backward's usual accuracy at this size)


def _qkv(dtype=torch.bfloat16, requires_grad=True, shape=(B, H, S, D), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype).requires_grad_(requires_grad) for _ in range(3)]


def _outcome(fn):
    """("ok", value) or ("raised", type, first line of the message)."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the outcome under comparison
        return ("raised", type(exc), str(exc).split("\n")[0])


def _off_and_on(fn, **enable):
    """``fn``'s outcome unpatched, then under ``enable(**enable)``."""
    off = _outcome(fn)
    gproj_patch.enable(**enable)
    try:
        return off, _outcome(fn)
    finally:
        gproj_patch.disable()


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _assert_same(off, on):
    assert off[0] == on[0], (off, on)
    assert (off[1:] == on[1:]) if off[0] == "raised" else _equal(off[1], on[1]), (off, on)


# ---- create_graph / double backward -------------------------------------------------------------------------
def _penalised(attend, q, k, v):
    """A gradient penalty: loss = Σ out + Σ (∂Σout/∂q)², backward to q, k, v."""
    out = attend(q, k, v)
    gq, = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    (out.float().sum() + gq.float().pow(2).sum()).backward()
    return [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("backend", ["math", "default"])
def test_double_backward_is_the_unpatched_result_or_a_clear_error(backend):
    def attend(q, k, v):
        if backend == "math":
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    off, on = _off_and_on(lambda: _penalised(attend, *_qkv()), targets=("sdpa",))
    if on[0] == "raised":
        assert on[1] is RuntimeError and on[2] == SECOND_ORDER_ERROR, on
        return
    assert off[0] == "ok", (off, on)  # the patched call may not succeed where the unpatched one raises
    q, k, v = (t.detach().double().requires_grad_() for t in _qkv())
    with sdpa_kernel(SDPBackend.MATH):
        want = _penalised(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v)
    for got, ref in zip(on[1], want):
        assert rel(got.double(), ref) < BOUND


def test_create_graph_gradients_still_corrected_and_marked():
    """A create_graph backward that is not differentiated again: the corrected gradients, requiring grad as the
    unpatched ones do; differentiating them raises the clear error."""
    def requires_grad():
        q, k, v = _qkv()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return [g.requires_grad for g in torch.autograd.grad(out.float().sum(), (q, k, v), create_graph=True)]
    _assert_same(*_off_and_on(requires_grad, targets=("sdpa",)))
    gproj_patch.enable(targets=("sdpa",))
    q, k, v = _qkv()
    do = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(5)).bfloat16()
    grads = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do,
                                create_graph=True)
    assert all(g.requires_grad for g in grads)
    ref = reference_backward(*(t.detach() for t in (q, k, v)), do, causal=True)
    for got, want in zip(grads, ref):
        assert rel(got.detach().double(), want) < BOUND
    with pytest.raises(RuntimeError, match="not differentiable"):
        grads[0].float().sum().backward()


def test_hf_eager_double_backward_is_the_unpatched_result_or_a_clear_error():
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama
    from gproj_patch.hooks import hf_eager

    class Attention(torch.nn.Module):
        num_key_value_groups, head_dim = 1, D

    def attend(q, k, v):
        return modeling_llama.eager_attention_forward(Attention().eval(), q, k, v, None, scaling=D ** -0.5)[0]
    off = _outcome(lambda: _penalised(attend, *_qkv()))
    gproj_patch.enable(targets=("sdpa",))
    hf_eager.install()
    try:
        on = _outcome(lambda: _penalised(attend, *_qkv()))
        assert gproj_patch.stats()["fp32"] >= 1  # the corrected backward ran (the first-order part)
    finally:
        hf_eager.uninstall()
        gproj_patch.disable()
    if on[0] == "raised":
        assert on[1] is RuntimeError and on[2] == SECOND_ORDER_ERROR, on
        return
    assert off[0] == "ok"
    q, k, v = (t.detach().double().requires_grad_() for t in _qkv())
    for got, ref in zip(on[1], _penalised(attend, q, k, v)):
        assert rel(got.double(), ref) < BOUND


# ---- torch.func transforms and forward-mode AD ---------------------------------------------------------------
def _attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


TRANSFORMS = {
    "grad": lambda q, k, v: torch.func.grad(lambda a, b, c: _attend(a, b, c).float().sum(), argnums=(0, 1, 2))(q, k, v),
    "vjp": lambda q, k, v: torch.func.vjp(_attend, q, k, v)[1](torch.ones_like(q)),
    "jacrev": lambda q, k, v: torch.func.jacrev(lambda a: _attend(a, k[..., :2, :], v[..., :2, :]))(q[..., :2, :]),
    "vmap of grad": lambda q, k, v: torch.vmap(torch.func.grad(lambda a, b, c: _attend(a, b, c).float().sum()))(
        *(t.unsqueeze(0).expand(3, *t.shape) for t in (q, k, v))),
    "jvp": lambda q, k, v: torch.func.jvp(lambda a: _attend(a, k, v), (q,), (torch.ones_like(q),)),
}


#: transforms whose backward runs inside their interpreter (the seam passes it to PyTorch's kernel, bit for bit),
#: and those whose backward is an ordinary autograd call once the forward's transform has returned (``vjp``'s
#: function; ``jacrev`` maps it): the seam corrects those like any backward
INSIDE = ("grad", "vmap of grad", "jvp")


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_torch_func_transforms_see_the_original_or_a_corrected_backward(name):
    off, on = _off_and_on(lambda: TRANSFORMS[name](*_qkv(requires_grad=False)), targets=("sdpa",))
    if name in INSIDE:
        _assert_same(off, on)
        return
    assert off[0] == on[0] == "ok", (off, on)
    exact = TRANSFORMS[name](*(t.double() for t in _qkv(requires_grad=False)))
    flat = lambda x: torch.cat([t.double().flatten() for t in (x if isinstance(x, tuple) else (x,))])  # noqa: E731
    err = lambda x: ((flat(x) - flat(exact)).norm() / flat(exact).norm()).item()  # noqa: E731
    assert err(on[1]) <= err(off[1]) * 1.05 + 1e-4, (err(on[1]), err(off[1]))


@pytest.mark.parametrize("backend", [SDPBackend.MATH, None])
def test_forward_mode_ad_sees_the_original(backend):
    def tangent():
        q, k, v = _qkv()
        with sdpa_kernel(backend or [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]), fwAD.dual_level():
            out = _attend(fwAD.make_dual(q, torch.ones_like(q)), k, v)
            return fwAD.unpack_dual(out).tangent
    _assert_same(*_off_and_on(tangent, targets=("sdpa",)))


# ---- saved-tensor hooks, meta tensors, autocast, dropout -----------------------------------------------------
def test_disabled_saved_tensor_hooks_do_not_break_a_corrected_call():
    def call():
        q, k, v = _qkv()
        with torch.autograd.graph.disable_saved_tensors_hooks("no saved-tensor hooks here"):
            out = _attend(q, k, v)
        out.float().sum().backward()
        return out.detach(), [t.grad for t in (q, k, v)]
    off, on = _off_and_on(call, targets=("sdpa",))
    assert off[0] == on[0] == "ok", (off, on)
    assert torch.equal(off[1][0], on[1][0])
    ref = reference_backward(*(t.detach() for t in _qkv()), torch.ones(B, H, S, D, dtype=torch.bfloat16), causal=True)
    for got, want in zip(on[1][1], ref):
        assert rel(got.double(), want) < BOUND
    assert gproj_patch.stats()["fp32"] == 1  # corrected, not passed through


@pytest.mark.parametrize("mask", [None, "bool", "causal"])
def test_meta_tensors_forward_and_backward_as_unpatched(mask):
    def call():
        q, k, v = (t.detach().to("meta").requires_grad_() for t in _qkv())
        m = torch.ones(S, S, dtype=torch.bool, device="meta") if mask == "bool" else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=mask == "causal")
        out.backward(torch.empty_like(out))
        return out.shape, out.stride(), out.dtype, [tuple(t.grad.shape) for t in (q, k, v)]
    _assert_same(*_off_and_on(call, targets=("sdpa",)))


@pytest.mark.parametrize("key_dtype", [torch.float64, torch.int64])
def test_autocast_leaves_ineligible_keys_alone(key_dtype):
    """CPU autocast casts FP32 arguments to BF16 but neither FP64 nor integer ones: the original raises."""
    def call():
        q, _, v = _qkv(torch.float32)
        k = torch.ones(B, H, S, D, dtype=key_dtype, requires_grad=key_dtype.is_floating_point)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _attend(q, k, v).detach()
    _assert_same(*_off_and_on(call, targets=("sdpa",)))


def test_nan_dropout_is_the_originals_error():
    _assert_same(*_off_and_on(lambda: F.scaled_dot_product_attention(*_qkv(), dropout_p=float("nan")).detach(),
                              targets=("sdpa",)))


@pytest.mark.parametrize("args", ["query int", "key list", "value tuple", "mask int"])
def test_non_tensor_arguments_raise_the_originals_type_error(args):
    def call():
        q, k, v = _qkv()
        given = {"query int": (3, k, v), "key list": (q, [1.0], v), "value tuple": (q, k, (1.0,)),
                 "mask int": (q, k, v, 1)}[args]
        return F.scaled_dot_product_attention(*given).detach()
    off, on = _off_and_on(call, targets=("sdpa",))
    assert off[:2] == ("raised", TypeError)
    _assert_same(off, on)


class _HoldsAttention(torch.nn.Module):
    """A module keeping the attention function as an attribute (``self.attend = F.scaled_dot_product_attention``)."""

    def __init__(self):
        super().__init__()
        self.attend = F.scaled_dot_product_attention

    def forward(self, q, k, v):
        return self.attend(q, k, v, is_causal=True)


def test_sdpa_pickles_as_the_builtin_under_the_patch(tmp_path):
    """``F.scaled_dot_product_attention`` is never replaced: it pickles as the builtin, patched or not, and a
    saved module holding it gives the same forward bits."""
    import pickle
    q, k, v = _qkv()
    plain = _HoldsAttention()(q, k, v)
    gproj_patch.enable(mode="gproj")
    try:
        assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
        assert pickle.loads(pickle.dumps(F.scaled_dot_product_attention)) is F.scaled_dot_product_attention
        torch.save(_HoldsAttention(), tmp_path / "m.pt")
        loaded = torch.load(tmp_path / "m.pt", weights_only=False)
        assert torch.equal(loaded(q, k, v), plain)
    finally:
        gproj_patch.disable()


def test_the_hooks_ask_one_backward_question_then_their_own_terms():
    """``has_backward``: grad mode on and an input (None skipped, a learnable sink counted) requires grad — what a
    call without a backward never gets past; flex adds the mode and the dtype, HF eager the dtype and its sink."""
    from gproj_patch.dispatch.autograd import has_backward
    from gproj_patch.hooks import flex, hf_eager
    x = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    g = x.clone().requires_grad_()
    sink = torch.zeros(1, requires_grad=True)
    assert not has_backward(x, x, x) and not has_backward(x, None, x)
    assert has_backward(x, g, x) and has_backward(x, x, x, sink)
    with torch.no_grad():
        assert not has_backward(g, g, g, sink)
        assert not flex.needs_correction(g, g, g, "gproj") and not hf_eager.needs_correction(g, g, g, sink)
    assert flex.needs_correction(x, x, g, "gproj") and not flex.needs_correction(x, x, g, "off")
    assert not flex.needs_correction(g.float(), x, x, "gproj") and not flex.needs_correction(x, x, x, "gproj")
    assert hf_eager.needs_correction(x, x, x, sink) and not hf_eager.needs_correction(x, x, x)
    assert not hf_eager.needs_correction(g.float(), g, g)
