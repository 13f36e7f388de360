"""The SDPA hook (the dispatcher seam): same forward bits, corrected backward, untouched original paths,
documented limitations."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import gproj_patch
from tests.helpers.switches import cpu_kernel_on
from gproj_patch.backends import compat
from gproj_patch.dispatch import masks as gp_masks
from gproj_patch.backends.reference import reference_backward
from gproj_patch.backends.spec import MaskSpec
from tests.helpers.numerics import rel as _rel



def unpatched_sdpa(*args, **kwargs):
    """SDPA's forward (the seam never changes it: the same call, patched or not)."""
    return torch._C._nn.scaled_dot_product_attention(*args, **kwargs)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in ("GPROJ_MODE", "GPROJ_TARGETS", "GPROJ_TIER", "GPROJ_LOG_LEVEL", "GPROJ_DETERMINISTIC"):
        monkeypatch.delenv(var, raising=False)
    gproj_patch.disable()
    gproj_patch.reset_stats()
    gproj_patch.enable(targets=("sdpa",))
    yield
    gproj_patch.disable()


def _inputs(dtype=torch.bfloat16, B=2, H=4, Hkv=None, Sq=24, Sk=None, D=16, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g).to(dtype).requires_grad_()
    k = (torch.randn(B, Hkv or H, Sk or Sq, D, generator=g) + offset).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv or H, Sk or Sq, D, generator=g).to(dtype).requires_grad_()
    do = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    return q, k, v, do


CASES = {
    "full": dict(),
    "causal": dict(is_causal=True),
    "causal_sq_lt_sk": dict(is_causal=True, Sk=40),
    "gqa": dict(is_causal=True, Hkv=2, enable_gqa=True),
    "bool_mask": dict(mask="bool"),
    "float_mask": dict(mask="float"),
    "sliding_bool_mask": dict(mask="window"),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_bitwise_and_backward_corrected(case, dtype):
    spec = dict(CASES[case])
    mask_kind = spec.pop("mask", None)
    is_causal, gqa = spec.pop("is_causal", False), spec.pop("enable_gqa", False)
    q, k, v, do = _inputs(dtype, offset=8.0, **spec)
    Sq, Sk = q.shape[2], k.shape[2]
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(q.shape[0], 1, Sq, Sk, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[..., 0] = True
    elif mask_kind == "float":
        mask = torch.randn(1, q.shape[1], Sq, Sk, generator=torch.Generator().manual_seed(2)).to(dtype)
    elif mask_kind == "window":
        i, j = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
        mask = MaskSpec(causal=True, window=(5, -1)).visible(i, j, Sq, Sk)
    kw = dict(attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    with torch.no_grad():
        plain = unpatched_sdpa(q, k, v, **kw)
    assert torch.equal(out, plain), "the forward must be the unpatched forward, bit for bit"
    out.backward(do)
    ref = reference_backward(q.detach(), k.detach(), v.detach(), do, attn_mask=mask, causal=is_causal)
    tol = 4 * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11)
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        assert _rel(got, want) < tol
    s = gproj_patch.stats()
    assert s["gproj"] + s["fp32"] == 1 and s["original"] == 0


def test_large_key_offset_stays_accurate():
    """The point of the patch: with a large common key offset the patched dq stays at BF16 accuracy."""
    q, k, v, do = _inputs(torch.bfloat16, B=1, H=2, Sq=64, D=32, offset=64.0)
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    dq_ref = reference_backward(q.detach(), k.detach(), v.detach(), do, causal=True)[0]
    assert _rel(q.grad, dq_ref) < 1e-2


def test_no_grad_and_no_requires_grad_take_original_path():
    q, k, v, _ = _inputs()
    with torch.no_grad():
        F.scaled_dot_product_attention(q, k, v)
    F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())
    s = gproj_patch.stats()
    assert s["forward"] == {} and s["fp32"] == s["gproj"] == 0


def test_fp32_inputs_take_original_path_exactly():
    q, k, v, do = _inputs(torch.float32)
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    unpatched_sdpa(q, k, v, is_causal=True).backward(do)
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))
    assert gproj_patch.stats()["forward"] == {}


def test_math_backend_is_not_reached():
    """``sdpa_kernel(MATH)`` is respected, and the math backend has no fused backward op: its backward is
    PyTorch's composite (in FP32 inside for BF16 inputs), bit for bit the unpatched one, not counted. (A known
    limit of the seam: the README says so.)"""
    q, k, v, do = _inputs()
    grads = []
    for patched in (True, False):
        if not patched:
            gproj_patch.disable()
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(do)
        grads.append([t.grad.clone() for t in (q, k, v)])
        q.grad = k.grad = v.grad = None
    assert all(torch.equal(a_, b_) for a_, b_ in zip(*grads))
    s = gproj_patch.stats()
    assert s["fp32"] == s["gproj"] == s["original"] == 0


def test_dropout_keeps_the_forward_and_its_backward():
    """dropout > 0 on CPU runs on the math backend (PyTorch's CPU flash op takes no dropout): the same forward
    bits and gradients as without the patch. (On CUDA its fused op reaches the seam and is passed through,
    counted: tests/hooks/test_gpu_integration.py.)"""
    q, k, v, do = _inputs()
    results = []
    for patched in (True, False):
        if not patched:
            gproj_patch.disable()
        torch.manual_seed(5)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
        out.backward(do)
        results.append((out.detach(), q.grad.clone(), k.grad.clone()))
        q.grad = k.grad = v.grad = None
    for a_, b_ in zip(*results):
        assert torch.equal(a_, b_)


def test_three_d_inputs_take_the_math_backend_untouched():
    """3-D inputs: SDPA takes its math backend on CPU (no fused op): PyTorch's own backward, not counted."""
    q, k, v, do = _inputs()
    out = F.scaled_dot_product_attention(q[0], k[0], v[0])
    out.backward(do[0])
    s = gproj_patch.stats()
    assert s["fp32"] == s["gproj"] == s["original"] == 0 and torch.isfinite(q.grad).all()


def test_mask_as_flags():
    S = 12
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    causal = (j <= i).expand(2, 1, S, S)
    assert gp_masks.mask_as_flags(causal, S, S)[1:] == (True, "top_left", (-1, -1))
    win = MaskSpec(causal=True, window=(3, -1)).visible(i, j, S, S)
    assert gp_masks.mask_as_flags(win, S, S)[1:] == (True, "top_left", (3, -1))
    assert gp_masks.mask_as_flags(torch.ones(S, S, dtype=torch.bool), S, S)[:2] == (None, False)
    pad = causal.clone()
    pad[1, ..., :2] = False
    m, c, _, _ = gp_masks.mask_as_flags(pad, S, S)
    assert m is pad and not c
    br = MaskSpec(causal=True, causal_align="bottom_right").visible(i[:5], j, 5, S)
    assert gp_masks.mask_as_flags(br, 5, S)[1:3] == (True, "bottom_right")


def test_triton_kernel_path_under_interpreter(monkeypatch):
    """fp16 on CPU runs the GProj Triton kernel through Triton's interpreter (the CUDA path's plumbing)."""
    pytest.importorskip("triton")
    cpu_kernel_on(monkeypatch)
    q, k, v, do = _inputs(torch.float16, B=1, H=2, Hkv=1, Sq=16, D=16, offset=4.0)
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)
    s = gproj_patch.stats()
    assert s["gproj"] == 1, s
    ref = reference_backward(q.detach(), k.detach(), v.detach(), do, causal=True)
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        assert _rel(got, want) < 4 * 2.0 ** -11


def test_lse_read_from_the_fused_node():
    """The LSE handed to the kernel is the one the fused forward saved (CPU flash here; cuDNN/flash/efficient
    on CUDA), and it is the natural-log LSE of the scaled scores."""
    from gproj_patch.backends.reference import reference_forward
    from gproj_patch.backends.spec import normalize_lse
    q, k, v, _ = _inputs(Hkv=2)
    out = unpatched_sdpa(q, k, v, is_causal=True, enable_gqa=True)
    lse = compat.fused_sdpa_lse(out.grad_fn)
    assert lse is not None
    _, ref = reference_forward(q.detach(), k.detach(), v.detach(), causal=True)
    assert torch.allclose(normalize_lse(lse, *q.shape[:3]).double(), ref, atol=1e-4)


def test_policy_original_is_the_unpatched_backward_bitwise(monkeypatch):
    from gproj_patch import policy
    monkeypatch.setattr(policy, "decide", lambda record, **kw: "original")
    seen = []
    monkeypatch.setattr(policy, "after_backward",
                        lambda record, **kw: seen.append((record.context.layer, kw["tier"])))
    gproj_patch.disable()
    q, k, v, do = _inputs(Hkv=2)
    unpatched_sdpa(q, k, v, is_causal=True, enable_gqa=True).backward(do)
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with gproj_patch.enable(mode="audit", targets=("sdpa",)), gproj_patch.layer_scope("blk0"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)
    assert all(torch.equal(a, t.grad) for a, t in zip(want, (q, k, v)))
    assert gproj_patch.stats()["original"] == 1 and seen == [("blk0", "original")]


def test_multihead_attention_module_goes_through_the_hook():
    """nn.MultiheadAttention (training path) looks SDPA up in torch.nn.functional at call time: covered."""
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.bfloat16)
    x = torch.randn(2, 10, 32, dtype=torch.bfloat16, requires_grad=True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(10, dtype=torch.bool)
    out, _ = mha(x, x, x, need_weights=False, is_causal=True, attn_mask=causal)
    out.float().sum().backward()
    s = gproj_patch.stats()
    assert s["gproj"] + s["fp32"] == 1 and torch.isfinite(x.grad).all()


def _right_padded(B=2, S=12, lens=(12, 7), window=-1):
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    pattern = MaskSpec(causal=True, window=(window, -1)).visible(i, j, S, S)
    mask = pattern.expand(B, 1, S, S).clone()
    for b, n in enumerate(lens):
        mask[b, :, :, n:] = False  # padded keys hidden; padded query rows then see the valid keys only
    return mask


def test_padding_as_flags():
    S = 12
    mask = _right_padded()
    do = torch.randn(2, 3, S, 8)
    assert gp_masks.padding_as_flags(mask, do, S, S) is None  # padded rows have a gradient: keep the mask
    do[1, :, 7:] = 0
    window, dead = gp_masks.padding_as_flags(mask, do, S, S)
    assert window == (-1, -1) and dead[1, 7:].all() and not dead[0].any() and not dead[1, :7].any()
    win = _right_padded(window=4)
    assert gp_masks.padding_as_flags(win, do, S, S)[0] == (4, -1)
    left = torch.flip(mask, dims=(-1,))  # not a right-padded causal pattern
    assert gp_masks.padding_as_flags(left, do, S, S) is None


@pytest.mark.parametrize("window", [-1, 4])
def test_right_padding_runs_the_kernel_exactly(monkeypatch, window):
    """Right-padded causal batch whose padded rows carry no gradient: the kernel runs with flags (under the
    Triton interpreter here) and the gradients are those of the masked attention."""
    pytest.importorskip("triton")
    cpu_kernel_on(monkeypatch)
    q, k, v, do = _inputs(torch.float16, B=2, H=2, Sq=12, D=16, offset=4.0)
    mask = _right_padded(window=window)
    do[1, :, 7:] = 0
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(do)
    s = gproj_patch.stats()
    assert s["gproj"] == 1, s
    ref = reference_backward(q.detach(), k.detach(), v.detach(), do, attn_mask=mask)
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        assert _rel(got, want) < 4 * 2.0 ** -11


def test_autocast_fp32_inputs_are_corrected_like_autocast_runs_them():
    """Under autocast SDPA runs in BF16 from FP32 inputs (and leaks): autocast's forward bits, the BF16 fused
    backward op corrected by the seam; the gradients reach the FP32 leaves."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, 64, 32, generator=g).requires_grad_()
    k = (torch.randn(1, 2, 64, 32, generator=g) + 64.0).requires_grad_()
    v = torch.randn(1, 2, 64, 32, generator=g).requires_grad_()
    do = torch.randn(1, 2, 64, 32, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with torch.no_grad():
            plain = unpatched_sdpa(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, plain)
    out.backward(do)
    low = [t.detach().bfloat16() for t in (q, k, v)]
    ref = reference_backward(*low, do, causal=True)
    assert q.grad.dtype == torch.float32
    assert _rel(q.grad, ref[0]) < 1e-2
    assert gproj_patch.stats()["fp32"] + gproj_patch.stats()["gproj"] == 1
    gproj_patch.disable()
    qu, ku, vu = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unpatched_sdpa(qu, ku, vu, is_causal=True).backward(do)
    assert _rel(qu.grad, ref[0]) > 5 * _rel(q.grad, ref[0]), "the unpatched autocast backward should leak here"


def test_backward_inside_autocast_still_runs_the_fp32_tier_in_fp32():
    """loss.backward() inside torch.autocast must not turn the FP32 tier's matmuls into BF16 ones."""
    q, k, v, do = _inputs(torch.bfloat16, B=1, H=2, Sq=64, D=32, offset=64.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    dq_ref = reference_backward(q.detach(), k.detach(), v.detach(), do, causal=True)[0]
    assert gproj_patch.stats()["fp32"] == 1
    assert _rel(q.grad, dq_ref) < 1e-2


def test_non_finite_output_gradient_propagates_instead_of_raising():
    """A GradScaler overflow puts inf into dO: the gradients must carry it (the scaler skips the step), not raise."""
    q, k, v, do = _inputs(torch.float16, B=1, H=2, Sq=16, D=16)
    do[0, 0, 3, 1] = float("inf")
    F.scaled_dot_product_attention(q, k, v).backward(do)
    assert not bool(torch.isfinite(q.grad).all())


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_does_not_rerun_the_block_in_the_forward(reentrant):
    from torch.utils.checkpoint import checkpoint
    runs = {"n": 0}
    lin = torch.nn.Linear(16, 16).bfloat16()

    def block(q, k, v):
        runs["n"] += 1
        return F.scaled_dot_product_attention(lin(q), k, v, is_causal=True)

    q, k, v, do = _inputs(torch.bfloat16, B=1, H=2, Sq=32, D=16, offset=32.0)
    out = checkpoint(block, q, k, v, use_reentrant=reentrant)
    assert runs["n"] == 1
    out.backward(do)
    assert runs["n"] == 2
    with torch.no_grad():
        qq = lin(q)
    ref = reference_backward(qq, k.detach(), v.detach(), do, causal=True)
    assert _rel(k.grad, ref[1]) < 1e-2 and _rel(v.grad, ref[2]) < 1e-2


@pytest.mark.parametrize("shape", [(0, 2, 8, 16), (1, 2, 0, 16)])
def test_empty_inputs_take_the_original_path(shape):
    q = torch.randn(*shape).bfloat16().requires_grad_()
    k = torch.randn(shape[0], 2, 8, 16).bfloat16().requires_grad_()
    v = torch.randn(shape[0], 2, 8, 16).bfloat16().requires_grad_()
    out = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, unpatched_sdpa(q, k, v))
    out.sum().backward()
    assert gproj_patch.stats()["fp32"] == gproj_patch.stats()["gproj"] == 0


def test_left_padded_causal_mask_reaches_the_kernel_as_varlen(monkeypatch):
    """HF-style left padding (padded query rows have zero dO, padded keys masked for every live row): the SDPA
    hook hands it to the kernel as varlen segments (exact) instead of the FP32 tier; gradients vs fp64."""
    cpu_kernel_on(monkeypatch, "GPROJ_TIER", "triton")  # the kernel on CPU fp16, through Triton's interpreter
    B, H, S, D = 2, 2, 24, 16
    pads = [0, 7]
    q, k, v, do = _inputs(torch.float16, B=B, H=H, Sq=S, D=D, offset=32.0)
    mask = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b, p in enumerate(pads):
        mask[b, 0, p:, p:] = torch.ones(S - p, S - p, dtype=torch.bool).tril()
        do[b, :, :p] = 0
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(do)
    s = gproj_patch.stats()
    assert s["gproj"] == 1 and not any("attn_mask" in r for r in s["fallback_reasons"]), s
    ref = reference_backward(q.detach(), k.detach(), v.detach(), do, attn_mask=mask)
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        assert _rel(got, want) < 4 * 2.0 ** -11
