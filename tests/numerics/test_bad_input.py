"""Bad input gives a clear ValueError (or the documented result) in the emulation and the FP32 tier."""
import pytest
import torch

from gproj_patch.backends.emulation import emulated_backward, emulated_forward
from gproj_patch.backends.fp32_tier import fp32_backward, fp32_forward


pytestmark = pytest.mark.usefixtures("one_thread")


def make(B=1, H=2, Hkv=2, Sq=16, Sk=24, D=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g).to(dtype)
    do = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    return q, k, v, do


def emu(q, k, v, do, **kw):
    o, lse = emulated_forward(q, k, v, **{n: x for n, x in kw.items() if n not in ("correct",)})
    return emulated_backward(q, k, v, o, do, lse, **kw)


BACKWARDS = {
    "emulated": emu,
    "fp32": lambda q, k, v, do, **kw: fp32_backward(q, k, v, do, **kw),
}


@pytest.fixture(params=sorted(BACKWARDS))
def backward(request):
    return BACKWARDS[request.param]


def test_mismatched_shapes(backward):
    q, k, v, do = make()
    with pytest.raises(ValueError, match="k and v"):
        backward(q, k, v[:, :, :-1], do)
    with pytest.raises(ValueError, match="multiple"):
        backward(q, make(Hkv=3, H=3)[1][:, :3], make(Hkv=3, H=3)[2][:, :3], do)
    with pytest.raises(ValueError, match="D="):
        backward(q, k[..., :8], v[..., :8], do)
    with pytest.raises(ValueError, match="shape"):
        backward(q[0], k, v, do)
    with pytest.raises(ValueError, match="do must have shape"):
        backward(q, k, v, do[:, :, :-1])


def test_mismatched_dtypes_and_devices(backward):
    q, k, v, do = make()
    with pytest.raises(ValueError, match="dtype"):
        backward(q, k.half(), v, do)
    with pytest.raises(ValueError, match="device"):
        backward(q, k.to("meta"), v, do)
    with pytest.raises(ValueError, match="floating"):
        backward(q.to(torch.int32), k, v, do)


def test_non_finite(backward):
    q, k, v, do = make()
    q2 = q.clone()
    q2[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        backward(q2, k, v, do)
    do2 = do.clone()
    do2[0, 0, 1, 1] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        backward(q, k, v, do2)


def test_empty_sequences(backward):
    q, k, v, do = make()
    with pytest.raises(ValueError, match="empty sequence"):
        backward(q[:, :, :0], k, v, do[:, :, :0])
    with pytest.raises(ValueError, match="empty sequence"):
        backward(q, k[:, :, :0], v[:, :, :0], do)


def test_bad_mask_arguments(backward):
    q, k, v, do = make()
    with pytest.raises(ValueError, match="causal_align"):
        backward(q, k, v, do, causal=True, causal_align="middle")
    with pytest.raises(ValueError, match="window"):
        backward(q, k, v, do, window=(1.5, 2))
    with pytest.raises(ValueError, match="softcap"):
        backward(q, k, v, do, softcap=-1.0)
    with pytest.raises(ValueError, match="together"):
        backward(q, k, v, do, cu_seqlens_q=torch.tensor([0, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        backward(q, k, v, do, cu_seqlens_q=torch.tensor([0, 20], dtype=torch.int32),
                 cu_seqlens_k=torch.tensor([0, 24], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fully_masked_rows_give_zero_gradients(backward, dtype):
    q, k, v, do = make(Sq=24, Sk=8, dtype=dtype)
    dq, dk, dv = backward(q, k, v, do, causal=True, causal_align="bottom_right")  # rows 0..15 see nothing
    assert all(torch.isfinite(x).all() for x in (dq, dk, dv))
    assert (dq[:, :, :16] == 0).all() and (dq[:, :, 16:] != 0).any()


def test_varlen_with_empty_and_keyless_sequences(backward):
    q, k, v, do = make(Sq=10, Sk=6)
    cq = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    ck = torch.tensor([0, 0, 0, 6], dtype=torch.int32)  # sequence 0: 4 queries, no key; sequence 1: empty
    dq, dk, dv = backward(q, k, v, do, cu_seqlens_q=cq, cu_seqlens_k=ck)
    assert (dq[:, :, :4] == 0).all() and torch.isfinite(dq).all() and (dq[:, :, 4:] != 0).any()


def test_emulation_specific():
    q, k, v, do = make()
    o, lse = emulated_forward(q, k, v)
    with pytest.raises(ValueError, match="fmt"):
        emulated_backward(q, k, v, o, do, lse, fmt="fp8")
    with pytest.raises(ValueError, match="dk_form"):
        emulated_backward(q, k, v, o, do, lse, dk_form="three_product")
    with pytest.raises(ValueError, match="block"):
        emulated_backward(q, k, v, o, do, lse, block_m=0)
    with pytest.raises(ValueError, match="unknown mask"):
        emulated_backward(q, k, v, o, do, lse, casual=True)
    with pytest.raises(ValueError, match="LSE"):
        emulated_backward(q, k, v, o, do, lse[:, :1])
    bad = lse.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="lse"):
        emulated_backward(q, k, v, o, do, bad)
    o2 = o.clone()
    o2[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        emulated_backward(q, k, v, o2, do, lse)
    # LSE layouts of the fused forwards are accepted: cuDNN's (B, H, S, 1)
    a = emulated_backward(q, k, v, o, do, lse)
    b = emulated_backward(q, k, v, o, do, lse[..., None])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_fp32_tier_specific():
    q, k, v, do = make()
    with pytest.raises(ValueError, match="dropout_p"):
        fp32_backward(q, k, v, do, dropout_p=1.0, dropout_seed=0)
    with pytest.raises(ValueError, match="dropout_seed"):
        fp32_forward(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="broadcast"):
        fp32_backward(q, k, v, do, attn_mask=torch.ones(3, 24, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool or floating"):
        fp32_backward(q, k, v, do, attn_mask=torch.ones(16, 24, dtype=torch.int64))
    with pytest.raises(ValueError, match="varlen"):
        fp32_backward(q, k, v, do, attn_mask=torch.ones(16, 24, dtype=torch.bool),
                      cu_seqlens_q=torch.tensor([0, 16], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, 24], dtype=torch.int32))
    with pytest.raises(ValueError, match="chunk_size"):
        fp32_backward(q, k, v, do, chunk_size=0)
    # an additive -inf mask on a whole row: output 0, LSE -inf, zero gradients (SDPA would give NaN)
    m = torch.zeros(16, 24)
    m[5] = float("-inf")
    out, lse = fp32_forward(q, k, v, attn_mask=m)
    dq, dk, dv = fp32_backward(q, k, v, do, attn_mask=m)
    assert (out[:, :, 5] == 0).all() and torch.isneginf(lse[:, :, 5]).all() and (dq[:, :, 5] == 0).all()
    assert all(torch.isfinite(x).all() for x in (out, dq, dk, dv))
