"""FA4's learnable sink through the flash-attn hook.

FA4 (flash-attention's ``flash_attn/cute/interface.py``): ``_flash_attn_fwd(..., learnable_sink=(Hq,))`` puts
the sink logit in every row's softmax denominator and returns an LSE that includes it. Since flash-attention
#2706, ``_flash_attn_bwd(..., learnable_sink=...)`` computes dsink itself and returns ``(dq, dk, dv, dsink)``
(dsink like the sink); ``FlashAttnFunc.backward`` unpacks four values then. Before it, the backward was never
given the sink (``(dq, dk, dv)``, no sink gradient). Both run on the CPU stand-in of 4.0.0b36
(``tests/helpers/fa4_standin.py``: the release's ``FlashAttnFunc`` verbatim — ``(out, lse)`` returned, ``lse`` saved —,
the forward the fp64 reference with the sink as an extra softmax column, the "original" backward an uncorrected
BF16 emulation, FA's roundings, so it leaks as FA4 does); the earlier release as the same Function whose
backward does not pass the sink.

Checked against the fp64 oracle with the sink (``reference_backward(sink=...)``) on a 128σ common key offset:
dq, dk, dv and dsink within 0.5%; the original backward asserted far off on the same inputs, and a projection
that ignores the sink (a sink-including LSE with no sink: the forward's record missing) asserted far off too.
"""
import math

import pytest
import torch

import gproj_patch
from gproj_patch.backends.fp32_tier import fp32_backward
from gproj_patch.backends.reference import reference_backward, reference_forward
from gproj_patch.hooks import fa_records

from tests.helpers import fa4_standin
from tests.helpers.numerics import offset_along_direction, rel as _rel

BOUND = 5e-3          # corrected BF16 gradients (and dsink) against fp64: the project's 0.5%
FAR = 10.0            # the original (uncorrected) dq: at least this many times the corrected error
NAIVE_FAR = 0.5       # a projection towards the no-sink target: at least 50% dq error
KEY_OFFSET_SIGMA = 128.0
SINK_LEVELS = (-20.0, 0.0, 3.0, 8.0)  # sink logit − log(Sk) per head: P_sink ≈ 0, ~1/2, ~0.95, ~1
B, H, HKV, S, D = 1, 4, 2, 64, 32


pytestmark = pytest.mark.usefixtures("patch_off")


def _bhsd(t):
    return t.transpose(1, 2)


def _head_errors(got, want):
    """Relative error of each query head (B, H, S, D): the sink heads' large exact dq (it carries P_sink·D times
    the key offset) would hide the no-sink head's leak in one norm."""
    return [_rel(got[:, h], want[:, h]) for h in range(want.shape[1])]


def fa4_with_sinks(monkeypatch, *, sink_backward=True):
    """The 4.0.0b36 stand-in as ``flash_attn.cute.interface``. ``sink_backward``: the release (the backward takes
    ``learnable_sink`` and returns dsink, flash-attention #2706); False: an earlier FA4, whose backward never
    sees the sink (its ``_flash_attn_bwd`` has no ``learnable_sink``). Returns (interface module, ``attend(q, k,
    v, causal, sink, softcap)`` -> out as a caller keeping only ``out`` gets it, the stand-in's call counters)."""
    iface = fa4_standin.install(monkeypatch)
    if sink_backward:
        def attend(q, k, v, causal, sink, softcap):
            return iface.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, softcap=softcap)[0]
        return iface, attend, iface.CALLS

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, deterministic=False):
        iface.CALLS["original"] += 1
        iface._flash_attn_bwd.compile_cache.setdefault("key", "compiled")
        return iface._original_backward(q, k, v, out, dout, lse, scale=softmax_scale, causal=causal,
                                        window=iface._window(window_size_left, window_size_right), softcap=softcap,
                                        cu_seqlens_q=None, cu_seqlens_k=None, sink=None, dlse=None)

    _flash_attn_bwd.compile_cache = {}
    iface._flash_attn_bwd = _flash_attn_bwd

    class FlashAttnFuncBeforeSinkBackward(iface.FlashAttnFunc):
        """The release's Function whose backward does not hand the sink to ``_flash_attn_bwd``."""

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, qv, out, lse, p, row_max, o_lo, gather_kv_indices, learnable_sink, *aux = ctx.saved_tensors
            dq, dk, dv = iface._flash_attn_bwd(q, k, v, out, dout, lse, ctx.softmax_scale, ctx.causal, ctx.softcap,
                                               window_size_left=ctx.window_size[0],
                                               window_size_right=ctx.window_size[1], deterministic=ctx.deterministic)
            return dq, dk, dv, *((None,) * 20)

    def attend(q, k, v, causal, sink, softcap):
        return FlashAttnFuncBeforeSinkBackward.apply(q, k, v, None, None, None, causal, (None, None), sink,
                                                     softcap)[0]
    return iface, attend, iface.CALLS


def inputs(*, orthogonal, seed=0, sink_dtype=torch.float32, device="cpu"):
    """FA4 layout (B, S, H, D) BF16 q, k, v, do and a graded sink (H,). The keys share a 128σ offset along a
    random direction u; ``orthogonal`` removes u from the queries (the offset leaves the scores, and so the sink
    weights, alone and only the gradients carry it), else the offset also moves rows towards/away from the sink."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (H, HKV, HKV, H))
    q, k = offset_along_direction(q, k, KEY_OFFSET_SIGMA, g, orthogonal=orthogonal)
    sink = torch.tensor([math.log(S) + SINK_LEVELS[h % len(SINK_LEVELS)] for h in range(H)], dtype=sink_dtype)
    return tuple(_bhsd(t.bfloat16()).contiguous().to(device) for t in (q, k, v, do)) + (sink.to(device),)


def oracle(q, k, v, do, sink, causal):
    return reference_backward(*(_bhsd(t) for t in (q, k, v, do)), causal=causal, causal_align="bottom_right",
                              sink=sink.float())  # exact for the 16-bit sinks too


def run(attend, q, k, v, do, sink, causal, softcap=0.0):
    """Gradients (dq, dk, dv in FA4's layout, dsink) of one call of the stand-in's FlashAttnFunc."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.clone().requires_grad_()
    attend(*leaves, causal, sink_leaf, softcap).backward(do)
    return [t.grad for t in leaves] + [sink_leaf.grad]


def check_corrected(monkeypatch, *, orthogonal, causal, device="cpu", tier="fp32"):
    """One FA4 call with a sink, unpatched then patched: the patched gradients within 0.5% of fp64 (dq per
    head), the unpatched dq far off, the call counted under ``tier``."""
    _iface, attend, calls = fa4_with_sinks(monkeypatch)
    q, k, v, do, sink = inputs(orthogonal=orthogonal, device=device)
    ref = oracle(q, k, v, do, sink, causal)
    unpatched = run(attend, q, k, v, do, sink, causal)
    assert calls["original"] == 1

    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    got = run(attend, q, k, v, do, sink, causal)
    assert calls["original"] == 1, "the corrected call must not run the original backward"
    s = gproj_patch.stats()
    assert s[tier] == 1 and s["original"] == 0
    for name, g, want in zip(("dq", "dk", "dv", "dsink"), got, ref):
        assert g.dtype == (sink.dtype if name == "dsink" else torch.bfloat16)
        err = _rel(_bhsd(g) if g.dim() == 4 else g, want)
        assert err < BOUND, (name, err)
    corrected = _head_errors(_bhsd(got[0]), ref[0])
    assert max(corrected) < BOUND, corrected
    assert max(_head_errors(_bhsd(unpatched[0]), ref[0])) > FAR * max(corrected)


@pytest.mark.parametrize("orthogonal,causal", [(True, True), (False, False)])
def test_sink_backward_corrected_against_fp64(monkeypatch, orthogonal, causal):
    check_corrected(monkeypatch, orthogonal=orthogonal, causal=causal)  # CPU BF16: the FP32 tier


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("orthogonal,causal", [(True, True), (False, False)])
def test_gpu_sink_backward_kernel_bf16(monkeypatch, orthogonal, causal):
    """The same through the GProj Triton kernel in BF16 (the FA4 stand-in on the GPU)."""
    monkeypatch.setenv("GPROJ_TIER", "triton")
    check_corrected(monkeypatch, orthogonal=orthogonal, causal=causal, device="cuda", tier="gproj")


@pytest.mark.parametrize("sink_dtype", [torch.bfloat16, torch.float16])
def test_dsink_in_fa4s_format(monkeypatch, sink_dtype):
    """dsink comes back shaped and typed like the sink FA4 was given (FA4: ``torch.empty_like(learnable_sink)``)."""
    _iface, attend, _calls = fa4_with_sinks(monkeypatch)
    q, k, v, do, sink = inputs(orthogonal=True, seed=1, sink_dtype=sink_dtype)
    ref = oracle(q, k, v, do, sink, True)
    gproj_patch.enable(mode="fp32", targets=("flash_attn",))
    got = run(attend, q, k, v, do, sink, True)
    assert got[3].dtype == sink_dtype and got[3].shape == sink.shape
    assert _rel(got[3], ref[3]) < 2 * 2.0 ** -8  # the fp32 dsink, rounded once to the sink's 16-bit dtype
    assert _rel(_bhsd(got[0]), ref[0]) < BOUND


def test_fa4_before_sink_backward_takes_the_sink_from_the_forward(monkeypatch):
    """Earlier FA4: the backward never sees the sink, but its LSE includes it. The corrected dq/dk/dv must use
    the sink the forward was given (its record)."""
    _iface, attend, calls = fa4_with_sinks(monkeypatch, sink_backward=False)
    q, k, v, do, sink = inputs(orthogonal=True, seed=2)
    ref = oracle(q, k, v, do, sink, True)
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    got = run(attend, q, k, v, do, sink, True)
    assert got[3] is None and calls["original"] == 0  # FA4's format then: no sink gradient
    corrected = [_rel(_bhsd(g), want) for g, want in zip(got[:3], ref)]
    assert max(corrected) < BOUND, corrected
    assert gproj_patch.stats()["fp32"] + gproj_patch.stats()["gproj"] == 1


def test_fa4_before_sink_backward_without_forward_record_takes_the_original(monkeypatch):
    """Earlier FA4, forward run before enable(): nothing says whether its LSE includes a sink, and correcting
    without the sink would be far off (shown with the FP32 tier given no sink), so FA4's own backward runs."""
    iface, _attend, calls = fa4_with_sinks(monkeypatch, sink_backward=False)
    q, k, v, do, sink = inputs(orthogonal=True, seed=2)
    ref = oracle(q, k, v, do, sink, True)
    out, lse = iface._flash_attn_fwd(q, k, v, causal=True, learnable_sink=sink, return_lse=True)[:2]  # unrecorded
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    got = iface._flash_attn_bwd(q, k, v, out, do, lse, None, True)
    assert calls["original"] == 1 and len(got) == 3
    s = gproj_patch.stats()
    assert s["original"] == 1 and any("learnable_sink and no forward record" in r for r in s["fallback_reasons"])
    naive = fp32_backward(*(_bhsd(t) for t in (q, k, v, do)), causal=True, causal_align="bottom_right",
                          project=True)
    assert _rel(naive[0], ref[0]) > NAIVE_FAR  # why the sink must be known before correcting


def test_sink_kernel_tier_in_the_interpreter(monkeypatch):
    """FP16 through the GProj Triton kernel (Triton's interpreter): the sink reaches the kernel."""
    pytest.importorskip("triton")
    monkeypatch.setenv("GPROJ_TIER", "triton")
    _iface, attend, _calls = fa4_with_sinks(monkeypatch)
    q, k, v, do, sink = (t.half() if t.dim() == 4 else t for t in inputs(orthogonal=True, seed=3))
    q, k, v, do = (t[:, :32, :, :16].contiguous() for t in (q, k, v, do))
    ref = oracle(q, k, v, do, sink, True)
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    got = run(attend, q, k, v, do, sink, True)
    assert gproj_patch.stats()["gproj"] == 1
    for name, g, want in zip(("dq", "dk", "dv", "dsink"), got, ref):
        err = _rel(_bhsd(g) if g.dim() == 4 else g, want)
        assert err < BOUND, (name, err)


def test_sink_with_softcap_takes_the_original_and_keeps_function_attributes(monkeypatch):
    """Softcap with a sink (no convention for capping the sink logit) goes to FA4's own backward, in FA4's own
    format; that path reads ``_flash_attn_bwd.compile_cache`` through the module global, which the proxy
    forwards to the original function, and writes reach the original too."""
    iface, attend, calls = fa4_with_sinks(monkeypatch)
    original = iface._flash_attn_bwd
    q, k, v, do, sink = inputs(orthogonal=True, seed=4)
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    assert iface._flash_attn_bwd is not original and iface._flash_attn_bwd.compile_cache is original.compile_cache
    got = run(attend, q, k, v, do, sink, True, softcap=30.0)
    assert calls["original"] == 1 and original.compile_cache == {"key": "compiled"}
    assert got[3] is not None and got[3].shape == sink.shape
    s = gproj_patch.stats()
    assert s["original"] == 1 and any("learnable_sink" in r and "softcap" in r for r in s["fallback_reasons"])
    iface._flash_attn_bwd.extra = 1
    assert original.extra == 1
    gproj_patch.disable()
    assert iface._flash_attn_bwd is original


def test_sink_records_do_not_outlive_their_backward(monkeypatch):
    _iface, attend, _calls = fa4_with_sinks(monkeypatch)
    q, k, v, do, sink = inputs(orthogonal=True, seed=5)
    gproj_patch.enable(mode="auto", targets=("flash_attn",))
    for _ in range(3):
        run(attend, q, k, v, do, sink, True)
    import gc
    gc.collect()
    assert fa_records.live_records() == 0
    s = gproj_patch.stats()
    assert s["fp32"] + s["gproj"] + s["original"] == 3


def test_varlen_sink_direct_call(monkeypatch):
    """FA4's varlen layout (total, H, D), LSE (H, total): dsink sums the rows of every sequence of a head."""
    iface, _attend, calls = fa4_with_sinks(monkeypatch)
    lens = (20, 37, 7)
    cu = torch.tensor((0,) + tuple(sum(lens[:i + 1]) for i in range(len(lens))), dtype=torch.int32)
    q, k, v, do, sink = (t.reshape(-1, *t.shape[2:])[:sum(lens)] if t.dim() == 4 else t
                         for t in inputs(orthogonal=False, seed=6))
    packed = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, do)]  # (1, H, total, D)
    out, lse = reference_forward(*packed[:3], causal=True, causal_align="bottom_right", cu_seqlens_q=cu,
                                 cu_seqlens_k=cu, sink=sink)
    ref = reference_backward(*packed, causal=True, causal_align="bottom_right", cu_seqlens_q=cu, cu_seqlens_k=cu,
                             sink=sink)
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    out = out[0].transpose(0, 1).to(q.dtype).contiguous()
    got = iface._flash_attn_bwd(q, k, v, out, do, lse[0].float(), None, True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                max_seqlen_q=max(lens), max_seqlen_k=max(lens), learnable_sink=sink)
    assert calls["original"] == 0 and len(got) == 4
    for name, g, want in zip(("dq", "dk", "dv", "dsink"), got, ref):
        err = _rel(g.unsqueeze(0).transpose(1, 2) if g.dim() == 3 else g, want)
        assert err < BOUND, (name, err)


def test_dlse_goes_to_the_original(monkeypatch):
    """FA4 with ``return_lse=True`` hands the backward the LSE's gradient (``dlse``), which changes D; the
    corrected path does not take it: FA4's own backward runs, reason counted."""
    iface, _attend, calls = fa4_with_sinks(monkeypatch)
    q, k, v, do, sink = inputs(orthogonal=True, seed=7)
    out, lse = iface._flash_attn_fwd(q, k, v, causal=True, learnable_sink=sink, return_lse=True)[:2]
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(8))
    got = iface._flash_attn_bwd(q, k, v, out, do, lse, None, True, dlse=dlse, learnable_sink=sink)
    assert calls["original"] == 1 and len(got) == 4
    without = reference_backward(*(_bhsd(t) for t in (q, k, v, do)), causal=True, sink=sink)
    assert _rel(got[3], without[3]) > 0.1, "dlse changes dsink: FA4's own answer, not the one without dlse"
    s = gproj_patch.stats()
    assert s["original"] == 1 and any("'dlse'" in r for r in s["fallback_reasons"])
