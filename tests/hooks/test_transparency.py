"""The shim is invisible: tensor subclasses and __torch_function__ modes see SDPA exactly as without the patch,
the forward is bitwise unchanged, and what cannot be corrected is passed through with a reason."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left
from torch.overrides import TorchFunctionMode

import gproj_patch
from gproj_patch.backends.reference import reference_backward
from tests.helpers.memory import assert_tier_ran


pytestmark = pytest.mark.usefixtures("patch_off")


def _qkv(dtype, sq, sk, requires_grad, seed=0, B=2, H=3, D=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, sq, D, generator=g).to(dtype)
    k = torch.randn(B, H, sk, D, generator=g).to(dtype)
    v = torch.randn(B, H, sk, D, generator=g).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _run(bias_fn, dtype, sq, sk, requires_grad):
    q, k, v = _qkv(dtype, sq, sk, requires_grad)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias_fn(sq, sk))
    grads = None
    if requires_grad:
        out.backward(torch.ones_like(out))
        grads = [t.grad for t in (q, k, v)]
    return out.detach(), grads


@pytest.mark.parametrize("bias_fn", [causal_upper_left, causal_lower_right])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq,sk", [(8, 8), (8, 12)])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_causal_bias_forward_and_gradients_unchanged(bias_fn, dtype, sq, sk, requires_grad):
    want_out, want_grads = _run(bias_fn, dtype, sq, sk, requires_grad)
    gproj_patch.enable(targets=("sdpa",))
    got_out, got_grads = _run(bias_fn, dtype, sq, sk, requires_grad)
    assert torch.equal(got_out, want_out)
    if requires_grad:
        s = gproj_patch.stats()
        if dtype == torch.float32:  # nothing to repair: the original path, bit for bit, no hooked backward
            assert s["fp32"] == s["gproj"] == s["original"] == 0, s
            assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
        else:  # CausalBias calls SDPA back (causal flags): the corrected backward, the FP32 tier on a CPU
            assert_tier_ran("fp32", 1)
            q, k, v = (t.detach() for t in _qkv(dtype, sq, sk, False))
            align = "top_left" if bias_fn is causal_upper_left else "bottom_right"
            ref = reference_backward(q, k, v, torch.ones_like(q), causal=True, causal_align=align)
            for got, want_, ref_ in zip(got_grads, want_grads, ref):
                # the corrected gradient is at least as close to fp64 as the unpatched one (up to rounding)
                err = lambda g: ((g.double() - ref_).norm() / ref_.norm().clamp_min(1e-30)).item()  # noqa: E731
                assert err(got) <= err(want_) * 1.5 + 2e-3


class RecordingMode(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:  # resolved at call time, as user modes do
            self.calls.append((len(args), sorted(kwargs)))
        return func(*args, **kwargs)


def test_torch_function_mode_sees_one_sdpa_call_patch_on_and_off():
    seen = []
    for patched in (False, True):
        if patched:
            gproj_patch.enable(targets=("sdpa",))
        q, k, v = _qkv(torch.bfloat16, 16, 16, True)
        with RecordingMode() as mode:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
        seen.append((mode.calls, out.detach()))
    (calls_off, out_off), (calls_on, out_on) = seen
    assert len(calls_off) == len(calls_on) == 1 and calls_off == calls_on
    assert torch.equal(out_off, out_on)
    assert assert_tier_ran("fp32", 1)["fp32"] == 1  # the mode forwarded the call: it got the corrected backward


def test_mode_that_replaces_sdpa_is_respected():
    class Replace(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                return torch.zeros_like(args[0])
            return func(*args, **(kwargs or {}))

    gproj_patch.enable(targets=("sdpa",))
    q, k, v = _qkv(torch.bfloat16, 8, 8, True)
    with Replace():
        out = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, torch.zeros_like(q))


class PlainSubclass(torch.Tensor):
    """A subclass with the default __torch_function__ (results come back as the subclass)."""


def test_plain_subclass_is_corrected_like_a_tensor():
    """A subclass without its own ``__torch_dispatch__`` holds plain memory: the same forward (the subclass comes
    back), the corrected backward like any tensor's."""
    q, k, v = (t.detach().as_subclass(PlainSubclass).requires_grad_() for t in _qkv(torch.bfloat16, 8, 8, False))
    want = F.scaled_dot_product_attention(q, k, v)
    gproj_patch.enable(targets=("sdpa",))
    got = F.scaled_dot_product_attention(q, k, v)
    assert type(got) is type(want) is PlainSubclass and torch.equal(got, want)
    got.backward(torch.ones_like(got))
    assert gproj_patch.stats()["fp32"] == 1


def test_errors_are_the_originals():
    q, k, v = _qkv(torch.bfloat16, 8, 8, True)
    errors = []
    for patched in (False, True):
        if patched:
            gproj_patch.enable(targets=("sdpa",))
        for call in (lambda: F.scaled_dot_product_attention(q, k[:, :2], v[:, :2]),  # heads differ, no gqa
                     lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool),
                                                            is_causal=True),
                     lambda: F.scaled_dot_product_attention(q, k[..., :8], v)):
            try:
                errors.append(("ok", call().detach()))
            except Exception as exc:  # noqa: BLE001 - the error itself is what is compared
                errors.append((type(exc), str(exc).split("\n")[0]))
    for (a0, a1), (b0, b1) in zip(errors[:3], errors[3:]):
        assert a0 == b0 and (torch.equal(a1, b1) if a0 == "ok" else a1 == b1)


def test_gproj_attention_respects_causal_bias():
    q, k, v = _qkv(torch.bfloat16, 8, 12, True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(8, 12))
    assert torch.equal(gproj_patch.attention(q, k, v, attn_mask=causal_lower_right(8, 12)), want)


def test_patched_gradients_still_match_fp64_under_a_mode():
    """The mode forwards the call; the corrected backward is right (against the fp64 oracle)."""
    gproj_patch.enable(targets=("sdpa",))
    q, k, v = _qkv(torch.bfloat16, 32, 32, True, seed=3)
    with torch.no_grad():
        k += 64.0  # a large common key offset: an uncorrected bf16 backward leaks here
    do = torch.randn_like(q)
    with RecordingMode():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(do)
    ref = reference_backward(q.detach(), k.detach(), v.detach(), do, causal=True)
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        assert ((got.double() - want).norm() / want.norm()).item() < 5e-3
    assert_tier_ran("fp32", 1)


def test_torchscript_of_multihead_attention_works_patch_on_and_after():
    """PyTorch's own TestTransformers scripts nn.MultiheadAttention: TorchScript compiles
    F.multi_head_attention_forward, which reads F.scaled_dot_product_attention — the wrapper while enabled. It
    must compile (as the aten op, the original forward) and keep working after disable()."""
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    want = mha(x, x, x)[0]
    gproj_patch.enable(targets=("sdpa",))
    scripted = torch.jit.script(mha)
    assert torch.allclose(scripted(x, x, x)[0], want, atol=1e-6)
    gproj_patch.disable()
    assert torch.allclose(scripted(x, x, x)[0], want, atol=1e-6)
    fresh = torch.jit.script(torch.nn.MultiheadAttention(8, 2, batch_first=True).eval())
    assert fresh(x, x, x)[0].shape == want.shape


def test_nested_tensors_pass_through_with_the_originals_behaviour():
    """Nested (jagged) inputs: whatever the original does (result or error), the patched call does the same;
    the reason is counted without asking the nested tensor for sizes it does not have."""
    def call():
        q = torch.nested.nested_tensor([torch.randn(3, 2, 8), torch.randn(5, 2, 8)], layout=torch.jagged,
                                       dtype=torch.float16, requires_grad=True).transpose(1, 2)
        try:
            return ("ok", F.scaled_dot_product_attention(q, q, q).values().detach())
        except Exception as exc:  # noqa: BLE001 - the original's error is the expected outcome
            return (type(exc).__name__, str(exc).split("\n")[0])
    torch.manual_seed(0)
    want = call()
    gproj_patch.enable(targets=("sdpa",))
    torch.manual_seed(0)
    got = call()
    assert got[0] == want[0] and (torch.equal(got[1], want[1]) if got[0] == "ok" else got[1] == want[1])
