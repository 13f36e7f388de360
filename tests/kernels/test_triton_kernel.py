"""The GProj Triton kernels on CPU, through Triton's interpreter (GPROJ_TIER=triton), in FP16.

Tight: against the FP16 emulation (rounding where the kernel rounds), after rounding the emulation's fp32
result to fp16 like the kernel's output. Loose: against the fp64 reference. BF16 runs on the GPU only
(tests/kernels/test_triton_gpu.py): the interpreter's BF16 is inexact.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from gproj_patch.backends import triton_bwd  # noqa: E402
from gproj_patch.backends.emulation import emulated_backward  # noqa: E402
from gproj_patch.backends.reference import reference_backward  # noqa: E402
from gproj_patch.backends.triton_bwd import gproj_backward, kernel_unsupported_reason  # noqa: E402
from tests.helpers.numerics import kernel_inputs as make, rel, saved_forward  # noqa: E402

TIGHT = 3e-4   # kernel vs FP16 emulation (both rounded to fp16 at the end)
LOOSE = 1.5e-3  # GProj kernel vs fp64


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("GPROJ_TIER", "triton")
    monkeypatch.setattr(triton_bwd, "_POISON_OUTPUTS", True)


def check(q, k, v, do, *, forms=("two_product",), uncorrected=False, lse_view=None, **mask):
    """Run the kernel; compare with the emulation (tight) and fp64 (loose). Returns the kernel grads."""
    o, lse = saved_forward(q, k, v, **mask)
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
    o, lse = saved_forward(q, k, v)
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
    o, lse = saved_forward(q, k, v, **mask)
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
    o, lse = saved_forward(q, k, v, window=(0, 0))
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
    o, lse = saved_forward(q, k, v)
    assert (o == 0).all()
    for form in ("two_product", "fused"):
        dq, dk, dv = gproj_backward(do, q, k, v, o, lse, dk_form=form)
        assert (dq == 0).all()
    dq0 = gproj_backward(do, q, k, v, o, lse, correct=False)[0]
    assert float(dq0[0, 0, 0, 0]) == -0.75


def test_deterministic_and_scale():
    q, k, v, do = make(1, 4, 2, 30, 30, 32, offset=8.0, seed=11)
    o, lse = saved_forward(q, k, v, scale=0.3)
    a = gproj_backward(do, q, k, v, o, lse, scale=0.3, deterministic=True)
    b = gproj_backward(do, q, k, v, o, lse, scale=0.3, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    ref = reference_backward(q, k, v, do, scale=0.3)
    assert all(rel(x, r) < LOOSE for x, r in zip(a, ref))


def test_unsupported_reasons(monkeypatch):
    q, k, v, _ = make(1, 1, 1, 8, 8, 32)
    cpu = dict(cpu_kernel=True)  # the caller lets CPU tensors run interpreted (the plan, from the options)
    assert kernel_unsupported_reason(q, k, v, **cpu) is None
    assert kernel_unsupported_reason(q, k, v, softcap=30.0, **cpu) is None
    assert kernel_unsupported_reason(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool), **cpu) == "attn_mask"
    assert kernel_unsupported_reason(q, k, v, dropout_p=0.1, **cpu) == "dropout"
    assert kernel_unsupported_reason(q.float(), k.float(), v.float(), **cpu) == "dtype=float32"
    assert "bfloat16" in kernel_unsupported_reason(q.bfloat16(), k.bfloat16(), v.bfloat16(), **cpu)
    big = torch.zeros(1, 1, 4, 320, dtype=torch.float16)
    assert kernel_unsupported_reason(big, big, big, **cpu) == "head_dim=320"
    # no environment is read here: without cpu_kernel a CPU tensor is refused, whatever the variables say
    assert kernel_unsupported_reason(q, k, v) == "cpu tensor without GPROJ_TIER=triton/TRITON_INTERPRET=1"
    monkeypatch.delenv("GPROJ_TIER")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # an explicit call of the kernel runs where the tensors are: interpreted on CPU (bf16 refused: inexact)
    with pytest.raises(ValueError, match="bfloat16 under the Triton interpreter"):
        gproj_backward(*(x.bfloat16() for x in (q, q, k, v, q)), torch.zeros(1, 1, 8))


def _launch_job(*, window=(-1, -1), sink=False, varlen=False, correct=True, sq=48, sk=80, d=40):
    """A ``triton_launch.Launch`` of CPU fp16 tensors (nothing runs: the argument builder's input)."""
    from gproj_patch.backends.triton_launch import Launch
    q = torch.empty(1, 4, sq, d, dtype=torch.float16)
    k = torch.empty(1, 2, sk, d, dtype=torch.float16)
    cu = torch.tensor([0, sq], dtype=torch.int32) if varlen else q
    return Launch(do=q, q=q, k=k, v=k, o=q, lse=torch.empty(1, 4, sq), dq=q, dk=k, dv=k,
                  sink=torch.zeros(4) if sink else None, cu_q=cu, cu_k=cu, varlen=varlen, n_problems=1, max_q=sq,
                  max_k=sk, window=window, bottom_right=False, alpha=0.125, softcap=0.0, correct=correct, fused=True,
                  cfg_dq=(16, 16, 4, 1), cfg_dkdv=(16, 32, 4, 1))


@pytest.mark.parametrize("sink, varlen, correct", [(False, False, True), (True, True, True), (False, False, False)])
def test_kernel_arguments_name_every_kernel_parameter(sink, varlen, correct):
    """Both launches pass every parameter of their kernel by keyword from one builder
    (``triton_launch.kernel_arguments``): exactly the kernel's parameters plus num_warps/num_stages, the
    constexpr flags follow the job, and the flags that are off get D's buffer as their placeholder pointer."""
    import inspect
    from gproj_patch.backends import triton_launch
    km = triton_bwd.kernel_module(True)
    job = _launch_job(window=(8, 0), sink=sink, varlen=varlen, correct=correct)
    scratch = triton_launch.allocate_scratch(job)
    for kind, name in triton_launch.KERNELS.items():
        args = triton_launch.kernel_arguments(kind, job, scratch, block_d=64)
        params = set(inspect.signature(getattr(km, name).fn).parameters)
        assert set(args) == params | {"num_warps", "num_stages"}, (kind, set(args) ^ params)
        assert args["HAS_L"] and args["HAS_R"] and args["VARLEN"] == varlen and args["CORRECT"] == correct
        assert not args["EVEN_D"] and args["BLOCK_D"] == 64 and args["GROUP"] == 2
        # 48 rows in tiles of 16: even unless varlen (sequences end anywhere); 80 keys: not a multiple of 32
        assert args["EVEN_M"] == (not varlen) and args["EVEN_N"] == (kind == "dq" and not varlen)
        assert (args["LAM"] is scratch.delta) == (not correct)
    dq = triton_launch.kernel_arguments("dq", job, scratch, block_d=64)
    assert dq["HAS_SINK"] == sink and (dq["SINK"] is scratch.delta) == (not sink)
    assert (dq["TGT"] is scratch.delta) == (not sink) and dq["ssink"] == (1 if sink else 0)
    assert triton_launch.grid("dq", job) == (3, 4, 1) and triton_launch.grid("dkdv", job) == (3, 2, 1)
    with pytest.raises(ValueError, match="kind"):
        triton_launch.kernel_arguments("dkdv_gluon", job, scratch, block_d=64)


def test_kernel_constants_are_their_formulas():
    """The named constants of the tl kernels equal the formulas their comments give (1/ln 2, −2/ln 2, the tanh
    series 1/3 and 2/15 below 1/16), and ROWSUM_WIDTH is tl.dot's smallest width with room for both
    row-sum columns."""
    import math
    km = triton_bwd.kernel_module(True)
    tiles = triton_bwd.kernel_module(True, "triton_tiles")
    value = lambda c: getattr(c, "value", c)  # noqa: E731 - tl.constexpr or a plain number
    assert value(km.RCP_LN2) == 1 / math.log(2) and value(tiles.NEG_2_RCP_LN2) == -2 / math.log(2)
    assert value(tiles.TANH_C3) == 1 / 3 and value(tiles.TANH_C5) == 2 / 15
    assert value(tiles.TANH_SERIES_BELOW) == 1 / 16
    assert value(km.ROWSUM_WIDTH) == 16 and {value(km.RHO_COL), value(km.MASS_COL)} == {0, 1}


def test_kernel_helpers_load_in_the_kernels_mode():
    """Each copy of the kernel file calls the tile helpers of its own mode: ``compat.load_interpreted_module``
    loads ``triton_tiles`` with it (interpreted helpers for the interpreted kernels, JIT-compiled ones for the
    compiled), and a mode's package refuses a file of the other mode."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    from gproj_patch.backends import compat
    for interpret, kind in ((True, InterpretedFunction), (False, JITFunction)):
        km = triton_bwd.kernel_module(interpret)
        tiles = triton_bwd.kernel_module(interpret, "triton_tiles")
        assert km.probs is tiles.probs and km.load_pair is tiles.load_pair and km.segment is tiles.segment
        assert isinstance(km._bwd_dq, kind) and isinstance(tiles.probs, kind) and isinstance(tiles.store_tile, kind)
    assert triton_bwd.kernel_module(True, "triton_tiles") is not triton_bwd.kernel_module(False, "triton_tiles")
    with pytest.raises(ValueError, match="interpret=False"):
        compat.load_interpreted_module("gproj_patch.backends._interp.triton_tiles", tiles.__file__, False)


def test_gluon_launch_shape_comes_from_the_kernel_constants():
    """The Gluon host launches the shape the kernel is written for, read from its constants, not restated:
    keys per CTA, the warps of the default partition, the descriptors' K/V box, and a maxnreg that fits the
    CTA's TOTAL_WARPS in one SM's register file."""
    from gproj_patch.backends import gluon_bwd
    if gluon_bwd.UNAVAILABLE_REASON is not None:
        pytest.skip(gluon_bwd.UNAVAILABLE_REASON)
    from gproj_patch.backends import gluon_kernels as gk
    assert gluon_bwd.BLOCK_N == gk.KEYS_PER_CTA.value == gk.CONSUMERS.value * gk.KEYS_PER_WG.value
    assert gluon_bwd.KEYS_PER_WG == gk.KEYS_PER_WG.value and gluon_bwd.NUM_WARPS == gk.CONSUMER_WARPS.value
    assert gluon_bwd.TOTAL_WARPS == gk.TOTAL_WARPS.value
    assert gk.TOTAL_WARPS.value % gk.CONSUMER_WARPS.value == 0
    assert gk.CONSUMERS.value * gk.CONSUMER_WARPS.value + gk.PRODUCER_WARPS.value <= gk.TOTAL_WARPS.value
    threads = gluon_bwd.TOTAL_WARPS * gluon_bwd.WARP_SIZE
    assert gluon_bwd.MAXNREG % 8 == 0 and threads * gluon_bwd.MAXNREG <= gluon_bwd.SM_REGISTERS
    assert threads * (gluon_bwd.MAXNREG + 8) > gluon_bwd.SM_REGISTERS
