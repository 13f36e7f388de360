"""FA4's learnable sink through the flash-attn hook (issue 10 item 3, FA4 part).

FA4 (flash-attention's ``flash_attn/cute/interface.py``): ``_flash_attn_fwd(..., learnable_sink=(Hq,))`` puts
the sink logit in every row's softmax denominator and returns an LSE that includes it. Since flash-attention
#2706, ``_flash_attn_bwd(..., learnable_sink=...)`` computes dsink itself and returns ``(dq, dk, dv, dsink)``
(dsink like the sink); ``FlashAttnFunc.backward`` unpacks four values then. Before it, the backward was never
given the sink (``(dq, dk, dv)``, no sink gradient). Both are modelled here on the FA4 stand-in of
``tests/test_memory.py``, extended: the forward is the fp64 reference with the sink as an extra softmax column,
the "original" backward an uncorrected BF16 emulation (FA's roundings, so it leaks as FA4 does).

Checked against the fp64 oracle with the sink (``reference_backward(sink=...)``) on a 128σ common key offset:
dq, dk, dv and dsink within 0.5%; the original backward asserted far off on the same inputs, and a projection
that ignores the sink (a sink-including LSE with no sink: the forward's record missing) asserted far off too.
"""
import math

import pytest
import torch

import gproj_patch
from gproj_patch.backends.emulation import emulated_backward
from gproj_patch.backends.fp32_tier import fp32_backward
from gproj_patch.backends.reference import reference_backward, reference_forward
from gproj_patch.integrations import fa_records

from test_memory import _fake_fa4

BOUND = 5e-3          # corrected BF16 gradients (and dsink) against fp64: the 0.5%
FAR = 10.0            # the original (uncorrected) dq: at least this many times the corrected error
NAIVE_FAR = 0.5       # a projection towards the no-sink target: at least 50% dq error
KEY_OFFSET_SIGMA = 128.0
SINK_LEVELS = (-20.0, 0.0, 3.0, 8.0)  # sink logit − log(Sk) per head: P_sink ≈ 0, ~1/2, ~0.95, ~1
B, H, HKV, S, D = 1, 4, 2, 64, 32


pytestmark = pytest.mark.usefixtures("patch_off")


def _bhsd(t):
    return t.transpose(1, 2)


def _rel(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def _head_errors(got, want):
    """Relative error of each query head (B, H, S, D): the sink heads' large exact dq (it carries P_sink·D times
    the key offset) would hide the no-sink head's leak in one norm."""
    return [_rel(got[:, h], want[:, h]) for h in range(want.shape[1])]


def exact_attention(q, k, v, sink, *, softcap, causal, scale=None):
    """fp64 attention in FA4's layout, scores softcapped when ``softcap`` > 0, an uncapped sink column (what
    FA4 computes with both; the GProj tiers refuse the pair): (out, lse), differentiable. Sq = Sk here, so
    causal is the same in either alignment."""
    q, k, v = (_bhsd(t).double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    full = torch.cat([s, sink.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    return _bhsd(torch.softmax(full, dim=-1)[..., :-1] @ v), torch.logsumexp(full, dim=-1)


def fa4_with_sinks(monkeypatch, *, sink_backward=True):
    """The FA4 stand-in with a learnable sink. ``sink_backward``: FA4 ≥ #2706 (the backward takes
    ``learnable_sink`` and returns dsink); False: earlier FA4 (the sink reaches the forward only).
    Returns (interface module, FlashAttnFunc, calls of the original backward)."""
    iface, _ = _fake_fa4(monkeypatch)
    calls = {"original": 0}

    def _flash_attn_fwd(q, k, v, softmax_scale=None, causal=False, softcap=0.0, learnable_sink=None):
        if softcap and learnable_sink is not None:
            out, lse = exact_attention(q, k, v, learnable_sink.detach(), softcap=softcap, causal=causal,
                                            scale=softmax_scale)
            return out.to(q.dtype).contiguous(), lse.float()
        out, lse = reference_forward(*(_bhsd(t) for t in (q, k, v)), scale=softmax_scale, causal=causal,
                                     causal_align="bottom_right", softcap=softcap,
                                     sink=None if learnable_sink is None else learnable_sink.detach().float())
        return _bhsd(out.to(q.dtype)).contiguous(), lse.float()

    def original(q, k, v, out, dout, lse, softmax_scale, causal, softcap, sink, dlse=None):
        """FA4's fused BF16 backward, modelled: FA's roundings, no projection; dsink as FA4 computes it.
        Softcap with a sink, and a ``dlse``, the emulation does not take: computed exactly in fp64 there (only
        their routing is under test)."""
        calls["original"] += 1
        iface._flash_attn_bwd.compile_cache.setdefault("key", "compiled")  # FA4: state on the function object
        if (softcap or dlse is not None) and sink is not None:
            with torch.enable_grad():  # autograd's backward runs without grad mode
                leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
                o, l = exact_attention(*leaves, softcap=softcap, causal=causal, scale=softmax_scale)
                outputs, grad_outputs = (o,) + (() if dlse is None else (l,)), \
                    (dout.double(),) + (() if dlse is None else (dlse.double(),))
                grads = torch.autograd.grad(outputs, leaves, grad_outputs)
            return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v, sink)))
        grads = emulated_backward(*(_bhsd(t) for t in (q, k, v, out, dout)), lse, fmt="bf16", correct=False,
                                  scale=softmax_scale, causal=causal, causal_align="bottom_right", softcap=softcap,
                                  sink=None if sink is None else sink.float())
        outs = tuple(_bhsd(g).to(q.dtype) for g in grads[:3])
        return outs if sink is None else outs + (grads[3].to(sink.dtype),)

    if sink_backward:
        def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                            window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
                            max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
                            dlse=None, learnable_sink=None):
            if cu_seqlens_q is not None:
                raise NotImplementedError("the stand-in's original backward does not model varlen")
            return original(q, k, v, out, dout, lse, softmax_scale, causal, softcap, learnable_sink, dlse)
    else:
        def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                            window_size_left=None, window_size_right=None, deterministic=False):
            return original(q, k, v, out, dout, lse, softmax_scale, causal, softcap, None)

    _flash_attn_bwd.compile_cache = {}
    iface._flash_attn_fwd, iface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd

    class FlashAttnFunc(torch.autograd.Function):
        """FA4's FlashAttnFunc, reduced: the functions looked up as module globals at call time."""

        @staticmethod
        def forward(ctx, q, k, v, causal, learnable_sink, softcap):
            out, lse = iface._flash_attn_fwd(q, k, v, causal=causal, softcap=softcap, learnable_sink=learnable_sink)
            ctx.save_for_backward(q, k, v, out, lse, learnable_sink)
            ctx.causal, ctx.softcap = causal, softcap
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse, sink = ctx.saved_tensors
            if not sink_backward:
                dq, dk, dv = iface._flash_attn_bwd(q, k, v, out, dout, lse, None, ctx.causal, ctx.softcap)
                return dq, dk, dv, None, None, None
            result = iface._flash_attn_bwd(q, k, v, out, dout, lse, None, ctx.causal, ctx.softcap,
                                           learnable_sink=sink)
            dq, dk, dv, dsink = result if sink is not None else result + (None,)
            return dq, dk, dv, None, dsink, None

    return iface, FlashAttnFunc, calls


def inputs(*, orthogonal, seed=0, sink_dtype=torch.float32, device="cpu"):
    """FA4 layout (B, S, H, D) BF16 q, k, v, do and a graded sink (H,). The keys share a 128σ offset along a
    random direction u; ``orthogonal`` removes u from the queries (the offset leaves the scores, and so the sink
    weights, alone and only the gradients carry it), else the offset also moves rows towards/away from the sink."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (H, HKV, HKV, H))
    u = torch.randn(D, generator=g, dtype=torch.float64)
    u = u / u.norm()
    if orthogonal:
        q = q - (q @ u)[..., None] * u
    k = k + KEY_OFFSET_SIGMA * math.sqrt(D) * u
    sink = torch.tensor([math.log(S) + SINK_LEVELS[h % len(SINK_LEVELS)] for h in range(H)], dtype=sink_dtype)
    return tuple(_bhsd(t.bfloat16()).contiguous().to(device) for t in (q, k, v, do)) + (sink.to(device),)


def oracle(q, k, v, do, sink, causal):
    return reference_backward(*(_bhsd(t) for t in (q, k, v, do)), causal=causal, causal_align="bottom_right",
                              sink=sink.float())  # exact for the 16-bit sinks too


def run(func, q, k, v, do, sink, causal, softcap=0.0):
    """Gradients (dq, dk, dv in FA4's layout, dsink) of one call of the stand-in FlashAttnFunc."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink.clone().requires_grad_()
    func.apply(*leaves, causal, sink_leaf, softcap).backward(do)
    return [t.grad for t in leaves] + [sink_leaf.grad]


def check_corrected(monkeypatch, *, orthogonal, causal, device="cpu", tier="fp32"):
    """One FA4 call with a sink, unpatched then patched: the patched gradients within 0.5% of fp64 (dq per
    head), the unpatched dq far off, the call counted under ``tier``."""
    _iface, func, calls = fa4_with_sinks(monkeypatch)
    q, k, v, do, sink = inputs(orthogonal=orthogonal, device=device)
    ref = oracle(q, k, v, do, sink, causal)
    unpatched = run(func, q, k, v, do, sink, causal)
    assert calls["original"] == 1

    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    got = run(func, q, k, v, do, sink, causal)
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
    _iface, func, _calls = fa4_with_sinks(monkeypatch)
    q, k, v, do, sink = inputs(orthogonal=True, seed=1, sink_dtype=sink_dtype)
    ref = oracle(q, k, v, do, sink, True)
    gproj_patch.enable(mode="fp32", targets=("flash_attn",))
    got = run(func, q, k, v, do, sink, True)
    assert got[3].dtype == sink_dtype and got[3].shape == sink.shape
    assert _rel(got[3], ref[3]) < 2 * 2.0 ** -8  # the fp32 dsink, rounded once to the sink's 16-bit dtype
    assert _rel(_bhsd(got[0]), ref[0]) < BOUND


def test_fa4_before_sink_backward_takes_the_sink_from_the_forward(monkeypatch):
    """Earlier FA4: the backward never sees the sink, but its LSE includes it. The corrected dq/dk/dv must use
    the sink the forward was given (its record)."""
    _iface, func, calls = fa4_with_sinks(monkeypatch, sink_backward=False)
    q, k, v, do, sink = inputs(orthogonal=True, seed=2)
    ref = oracle(q, k, v, do, sink, True)
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    got = run(func, q, k, v, do, sink, True)
    assert got[3] is None and calls["original"] == 0  # FA4's format then: no sink gradient
    corrected = [_rel(_bhsd(g), want) for g, want in zip(got[:3], ref)]
    assert max(corrected) < BOUND, corrected
    assert gproj_patch.stats()["fp32"] + gproj_patch.stats()["gproj"] == 1


def test_fa4_before_sink_backward_without_forward_record_takes_the_original(monkeypatch):
    """Earlier FA4, forward run before enable(): nothing says whether its LSE includes a sink, and correcting
    without the sink would be far off (shown with the FP32 tier given no sink), so FA4's own backward runs."""
    iface, _func, calls = fa4_with_sinks(monkeypatch, sink_backward=False)
    q, k, v, do, sink = inputs(orthogonal=True, seed=2)
    ref = oracle(q, k, v, do, sink, True)
    out, lse = iface._flash_attn_fwd(q, k, v, causal=True, learnable_sink=sink)  # forward not recorded
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
    _iface, func, _calls = fa4_with_sinks(monkeypatch)
    q, k, v, do, sink = (t.half() if t.dim() == 4 else t for t in inputs(orthogonal=True, seed=3))
    q, k, v, do = (t[:, :32, :, :16].contiguous() for t in (q, k, v, do))
    ref = oracle(q, k, v, do, sink, True)
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    got = run(func, q, k, v, do, sink, True)
    assert gproj_patch.stats()["gproj"] == 1
    for name, g, want in zip(("dq", "dk", "dv", "dsink"), got, ref):
        err = _rel(_bhsd(g) if g.dim() == 4 else g, want)
        assert err < BOUND, (name, err)


def test_sink_with_softcap_takes_the_original_and_keeps_function_attributes(monkeypatch):
    """Softcap with a sink (no convention for capping the sink logit) goes to FA4's own backward, in FA4's own
    format; that path reads ``_flash_attn_bwd.compile_cache`` through the module global, which the proxy
    forwards to the original function (issue 8.4), and writes reach the original too."""
    iface, func, calls = fa4_with_sinks(monkeypatch)
    original = iface._flash_attn_bwd
    q, k, v, do, sink = inputs(orthogonal=True, seed=4)
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    assert iface._flash_attn_bwd is not original and iface._flash_attn_bwd.compile_cache is original.compile_cache
    got = run(func, q, k, v, do, sink, True, softcap=30.0)
    assert calls["original"] == 1 and original.compile_cache == {"key": "compiled"}
    assert got[3] is not None and got[3].shape == sink.shape
    s = gproj_patch.stats()
    assert s["original"] == 1 and any("learnable_sink" in r and "softcap" in r for r in s["fallback_reasons"])
    iface._flash_attn_bwd.extra = 1
    assert original.extra == 1
    gproj_patch.disable()
    assert iface._flash_attn_bwd is original


def test_sink_records_do_not_outlive_their_backward(monkeypatch):
    _iface, func, _calls = fa4_with_sinks(monkeypatch)
    q, k, v, do, sink = inputs(orthogonal=True, seed=5)
    gproj_patch.enable(mode="auto", targets=("flash_attn",))
    for _ in range(3):
        run(func, q, k, v, do, sink, True)
    import gc
    gc.collect()
    assert fa_records.live_records() == 0
    s = gproj_patch.stats()
    assert s["fp32"] + s["gproj"] + s["original"] == 3


def test_varlen_sink_direct_call(monkeypatch):
    """FA4's varlen layout (total, H, D), LSE (H, total): dsink sums the rows of every sequence of a head."""
    iface, _func, calls = fa4_with_sinks(monkeypatch)
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
    iface, _func, calls = fa4_with_sinks(monkeypatch)
    q, k, v, do, sink = inputs(orthogonal=True, seed=7)
    out, lse = iface._flash_attn_fwd(q, k, v, causal=True, learnable_sink=sink)
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(8))
    got = iface._flash_attn_bwd(q, k, v, out, do, lse, None, True, dlse=dlse, learnable_sink=sink)
    assert calls["original"] == 1 and len(got) == 4
    without = reference_backward(*(_bhsd(t) for t in (q, k, v, do)), causal=True, sink=sink)
    assert _rel(got[3], without[3]) > 0.1, "dlse changes dsink: FA4's own answer, not the one without dlse"
    s = gproj_patch.stats()
    assert s["original"] == 1 and any("'dlse'" in r for r in s["fallback_reasons"])
