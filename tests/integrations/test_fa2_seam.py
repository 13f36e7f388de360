"""FA2/FA3 at the backward op: no package code in the forward, one decision in the backward op's kernel.

Through FA2's autograd Functions as the release calls its ops (``tests/helpers/fa2_standin.py``: schemas of
flash-attention 2.7-2.8 and FA3, CPU kernels; the "original" backward is the uncorrected BF16 emulation of a
fused kernel, so it leaks under a common key offset). The backward op's kernel makes the call's record from its
own arguments and the options in force then, and names its layer from the autograd node being run (the scope its
forward was in), as the SDPA seam does.
"""
import pytest
import torch

import gproj_patch
from gproj_patch import policy
from gproj_patch.backends.reference import reference_backward
from gproj_patch.hooks import fa_records
from gproj_patch.hooks import flash_attn as fa_hook

from tests.helpers import fa2_standin
from tests.helpers.numerics import rel as _rel

pytestmark = pytest.mark.usefixtures("patch_off")

SICK_OFFSET = 300.0   # common key offset, in units of the keys' spread
BOUND = 1e-2          # corrected BF16 gradients against fp64
FAR = 10.0            # the uncorrected backward's dq error at SICK_OFFSET: at least this many times BOUND
CALLS = fa2_standin.CALLS


@pytest.fixture(autouse=True)
def _ops(monkeypatch):
    fa2_standin.point_hook_here(monkeypatch)
    fa2_standin.reset_calls()


def _inputs(seed=0, offset=0.0, B=1, S=48, H=4, Hkv=2, D=32, total=None):
    g = torch.Generator().manual_seed(seed)
    lead = (total,) if total is not None else (B, S)
    q, k, v, do = (torch.randn(*lead, h, D, generator=g) for h in (H, Hkv, Hkv, H))
    return q.bfloat16(), (k + offset).bfloat16(), v.bfloat16(), do.bfloat16()


def _leaves(q, k, v):
    return [t.clone().requires_grad_() for t in (q, k, v)]


def _oracle(q, k, v, do, causal=True, window=(-1, -1), softcap=0.0, cu=None):
    varlen = cu is not None
    return reference_backward(*(fa2_standin.bhsd(t, varlen) for t in (q, k, v, do)), causal=causal,
                              causal_align="bottom_right", window=window, softcap=softcap, cu_seqlens_q=cu,
                              cu_seqlens_k=cu)


def _seen_records(monkeypatch):
    seen = []
    real = fa_hook.run_backward
    monkeypatch.setattr(fa_hook, "run_backward", lambda record, *a, **kw: seen.append(record) or real(record, *a, **kw))
    return seen


def _grads(fn, q, k, v, do):
    leaves = _leaves(q, k, v)
    fn(*leaves).backward(do)
    return [t.grad for t in leaves]


def _scoped_forwards(layers):
    """Each named layer's forward inside its ``layer_scope``: the leaves by name, and Σ out·dO over the layers."""
    leaves, loss = {}, 0.0
    for name, (q, k, v, do) in layers.items():
        leaves[name] = _leaves(q, k, v)
        with gproj_patch.layer_scope(name):
            out = fa2_standin.flash_attn_func(*leaves[name], causal=True)
        loss = loss + (out.float() * do.float()).sum()
    return leaves, loss


def test_forward_runs_no_package_code():
    """With the patch on, the forward ops keep their registered kernels (the same objects), nothing is filed,
    and a forward's outputs are bitwise those of the unpatched forward."""
    from torch._library.custom_ops import OPDEFS
    kernels = {name: OPDEFS[name]._backend_fns["cpu"] for name in fa2_standin.FA2_FORWARD_OPS}
    backward_kernels = {name: OPDEFS[name]._backend_fns["cpu"] for name in fa2_standin.FA2_BACKWARD_OPS}
    q, k, v, _ = _inputs(1, 64.0, D=20)
    cu = torch.tensor([0, 20, 48], dtype=torch.int32)
    before = fa2_standin.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    before_varlen = fa2_standin.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 28, 28, causal=True)
    handle = gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    assert all(name in handle.installed["flash_attn"] for name in fa2_standin.FA2_BACKWARD_OPS)
    assert not any(name in handle.installed["flash_attn"] for name in fa2_standin.FA2_FORWARD_OPS)
    assert {name: OPDEFS[name]._backend_fns["cpu"] for name in kernels} == kernels
    assert all(OPDEFS[name]._backend_fns["cpu"] is not kernel for name, kernel in backward_kernels.items())
    leaves = _leaves(q, k, v)
    after = fa2_standin.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
    after_varlen = fa2_standin.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 28, 28, causal=True)
    for x, y in zip(before + (before_varlen,), after + (after_varlen,)):
        assert torch.equal(x, y) and x.dtype == y.dtype
    assert fa_records.live_records() == 0
    assert sum(gproj_patch.stats()[t] for t in ("original", "fp32", "gproj")) == 0


@pytest.mark.parametrize("causal,window,softcap,D", [(True, (-1, -1), 0.0, 32), (True, (9, 0), 0.0, 20),
                                                     (False, (-1, -1), 30.0, 32)])
def test_corrected_at_a_large_key_offset(causal, window, softcap, D):
    """FlashAttnFunc at a 300σ common key offset: the unpatched backward's dq is far off the fp64 oracle, the
    patched one within BF16 accuracy (window, softcap and a head dim the Function pads to 24 included)."""
    q, k, v, do = _inputs(2, SICK_OFFSET, D=D)
    fn = lambda q, k, v: fa2_standin.flash_attn_func(q, k, v, causal=causal, window_size=window,  # noqa: E731
                                                     softcap=softcap)
    ref = _oracle(q, k, v, do, causal, window, softcap)
    unpatched = _grads(fn, q, k, v, do)
    far = FAR if not softcap else FAR / 2  # capped scores leak less of the offset
    assert _rel(fa2_standin.bhsd(unpatched[0], False), ref[0]) > far * BOUND
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    CALLS.update(dense=0)
    got = _grads(fn, q, k, v, do)
    assert CALLS["dense"] == 0 and gproj_patch.stats()["fp32"] + gproj_patch.stats()["gproj"] == 1
    for g, want in zip(got, ref):
        assert g.shape == want.transpose(1, 2).shape and g.dtype == torch.bfloat16
        assert _rel(fa2_standin.bhsd(g, False), want) < BOUND


def test_varlen_corrected_from_the_backwards_offsets(monkeypatch):
    """FlashAttnVarlenFunc: the problem's cu_seqlens / max_seqlen are the backward op's own arguments."""
    seen = _seen_records(monkeypatch)
    lens = (20, 37, 7)
    cu = torch.tensor((0, 20, 57, 64), dtype=torch.int32)
    q, k, v, do = _inputs(3, SICK_OFFSET, total=sum(lens))
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    got = _grads(lambda q, k, v: fa2_standin.flash_attn_varlen_func(q, k, v, cu, cu, 37, 37, causal=True),
                 q, k, v, do)
    (record,) = seen
    assert torch.equal(record.problem.cu_seqlens_q, cu) and record.problem.max_seqlen_q == 37
    assert record.context.source == f"{fa2_standin.NS}:varlen" and CALLS["varlen"] == 0
    for g, want in zip(got, _oracle(q, k, v, do, cu=cu)):
        assert _rel(fa2_standin.bhsd(g, True), want) < BOUND


def test_layers_are_the_forwards_scopes_and_auto_samples_at_the_backward(monkeypatch):
    """Two named layers, one sick, backwards after every scope has closed: each backward takes its forward's
    scope from its autograd node, ``auto`` samples each at the backward, only the sick one is corrected; an
    unnamed call is the pass's ``flash_attn{n}``."""
    seen = _seen_records(monkeypatch)
    gproj_patch.enable(mode="auto", targets=("flash_attn",), sample_every=1)
    layers = {"layers.0": _inputs(4, 0.0), "layers.1": _inputs(5, SICK_OFFSET)}
    leaves, loss = _scoped_forwards(layers)
    q, k, v, do = _inputs(6, 0.0)
    loss = loss + (fa2_standin.flash_attn_func(*_leaves(q, k, v), causal=True).float() * do.float()).sum()
    loss.backward()
    assert sorted(r.context.layer for r in seen) == ["flash_attn0", "layers.0", "layers.1"]
    assert all(r.context.source == f"{fa2_standin.NS}:dense" for r in seen)  # the library, by namespace
    assert sorted(policy.stats()) == ["flash_attn0", "layers.0", "layers.1"]
    tiers = {name: rec["tier"] for name, rec in gproj_patch.stats()["layers"].items()}
    assert tiers == {"layers.0": "original", "layers.1": "fp32", "flash_attn0": "original"}  # CPU: gproj -> FP32 tier
    assert CALLS["dense"] == 2
    q, k, v, do = layers["layers.1"]
    for g, want in zip((t.grad for t in leaves["layers.1"]), _oracle(q, k, v, do)):
        assert _rel(fa2_standin.bhsd(g, False), want) < BOUND


def test_options_in_force_at_the_backward_decide(monkeypatch):
    """No record: a forward made with the patch off and a backward made with it on is corrected (and the other
    way round the original runs)."""
    q, k, v, do = _inputs(7, SICK_OFFSET)
    leaves = _leaves(q, k, v)
    out = fa2_standin.flash_attn_func(*leaves, causal=True)  # before enable()
    gproj_patch.enable(mode="fp32", targets=("flash_attn",))
    out.backward(do)
    assert CALLS["dense"] == 0 and gproj_patch.stats()["fp32"] == 1
    for g, want in zip((t.grad for t in leaves), _oracle(q, k, v, do)):
        assert _rel(fa2_standin.bhsd(g, False), want) < BOUND


def test_disable_between_forward_and_backward_runs_the_original(monkeypatch):
    """disable() restores the backward kernels at once: a forward made under the patch gets the original
    backward, uncounted, and nothing waits for it."""
    from torch._library.custom_ops import OPDEFS
    opdef = OPDEFS[fa2_standin.FA2_BACKWARD_OPS[0]]
    original = opdef._backend_fns["cpu"]
    q, k, v, do = _inputs(8, SICK_OFFSET)
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    leaves = _leaves(q, k, v)
    with gproj_patch.layer_scope("blk.3"):
        out = fa2_standin.flash_attn_func(*leaves, causal=True)
    gproj_patch.disable()
    assert opdef._backend_fns["cpu"] is original and not fa_hook.INSTALLED.draining
    out.backward(do)
    assert CALLS["dense"] == 1
    assert sum(gproj_patch.stats()[t] for t in ("original", "fp32", "gproj")) == 0


def test_a_kernel_called_after_disable_runs_the_original(monkeypatch):
    """A backward already holding the corrected kernel when disable() ran (another thread's) runs the original."""
    from torch._library.custom_ops import OPDEFS
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    kernel = OPDEFS[fa2_standin.FA2_BACKWARD_OPS[0]]._backend_fns["cpu"]
    gproj_patch.disable()
    q, k, v, do = _inputs(9, 0.0)
    out, lse = (t.contiguous() for t in fa2_standin.wrapped_fwd(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None,
                                                               False)[:2])
    CALLS.update(dense=0)
    bufs = [torch.empty_like(t) for t in (q, k, v)]
    kernel(do, q, k, v, out, lse, *bufs, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    assert CALLS["dense"] == 1 and gproj_patch.stats()["original"] == 0


def test_install_is_idempotent_and_uninstall_restores_by_identity():
    from torch._library.custom_ops import OPDEFS
    names = fa2_standin.FA2_BACKWARD_OPS + fa2_standin.FA3_BACKWARD_OPS
    originals = {name: OPDEFS[name]._backend_fns["cpu"] for name in names}
    assert fa_hook.install().startswith("installed:")
    patched = {name: OPDEFS[name]._backend_fns["cpu"] for name in names}
    assert fa_hook.install() == "installed"
    assert {name: OPDEFS[name]._backend_fns["cpu"] for name in names} == patched
    fa_hook.uninstall()
    fa_hook.uninstall()
    assert all(OPDEFS[name]._backend_fns["cpu"] is fn for name, fn in originals.items())


@pytest.mark.parametrize("varlen", [False, True])
def test_fa3_op(monkeypatch, varlen):
    """FA3's one backward op (``is_causal``, ``sequed_*``, ``sm_margin``; dense and varlen) as its Functions call
    it: corrected from its own arguments, the original unpatched far off."""
    seen = _seen_records(monkeypatch)
    cu = torch.tensor((0, 30, 48), dtype=torch.int32) if varlen else None
    q, k, v, do = _inputs(10, SICK_OFFSET, total=48 if varlen else None)
    out, lse = fa2_standin._forward(q, k, v, 0.2, True, (-1, -1), 0.0, cu, cu)
    args = dict(cu_q=cu, cu_k=cu, max_q=30 if varlen else None, max_k=30 if varlen else None)
    ref = reference_backward(*(fa2_standin.bhsd(t, varlen) for t in (q, k, v, do)), scale=0.2, causal=True,
                             causal_align="bottom_right", cu_seqlens_q=cu, cu_seqlens_k=cu)
    unpatched = fa2_standin.fa3_backward(do, q, k, v, out, lse, 0.2, True, **args)
    assert _rel(fa2_standin.bhsd(unpatched[0], varlen), ref[0]) > FAR * BOUND
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    got = fa2_standin.fa3_backward(do, q, k, v, out, lse, 0.2, True, **args)
    assert CALLS["fa3"] == 1
    (record,) = seen
    assert record.context.source == f"{fa2_standin.NS3}:{'varlen' if varlen else 'dense'}"  # the library, by namespace
    assert (record.problem.scale, record.problem.causal) == (0.2, True)
    for g, want in zip(got, ref):
        assert _rel(fa2_standin.bhsd(g, varlen), want) < BOUND


def test_compiled_backward_graph_reaches_the_kernel(monkeypatch):
    """Under torch.compile (aot_eager) the compiled backward graph calls the backward op, whose kernel runs with
    real tensors and decides there (a record made in the compiled graph's backward node: ``in_graph``)."""
    seen = _seen_records(monkeypatch)
    q, k, v, do = _inputs(11, SICK_OFFSET)
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    fn = torch.compile(lambda q, k, v: fa2_standin.flash_attn_func(q, k, v, causal=True), backend="aot_eager",
                       fullgraph=True)
    got = _grads(fn, q, k, v, do)
    assert CALLS["dense"] == 0 and len(seen) == 1 and seen[0].context.in_graph
    for g, want in zip(got, _oracle(q, k, v, do)):
        assert _rel(fa2_standin.bhsd(g, False), want) < BOUND


def test_auto_settled_layer_runs_the_saved_kernel_without_a_plan(monkeypatch):
    """``auto``: between its samples a layer settled on the original backward runs the saved kernel at the
    backward op without a record or a plan; the gradients, counters and the policy's layers are those of the
    complete decision made every call."""
    from gproj_patch.dispatch import plan

    def run(settled: bool):
        monkeypatch.setattr(fa_hook, "settled_original", plan.settled_original if settled else
                            (lambda cfg, layer, has_original: False))
        seen = _seen_records(monkeypatch)
        gproj_patch.disable()
        gproj_patch.reset_stats()
        fa2_standin.reset_calls()
        gproj_patch.enable(mode="auto", targets=("flash_attn",), sample_every=3)
        layers = {"healthy": _inputs(7, 0.0), "sick": _inputs(8, SICK_OFFSET)}
        grads = []
        for _ in range(5):
            leaves, loss = _scoped_forwards(layers)
            loss.backward()
            grads.append([t.grad for name in layers for t in leaves[name]])
        s = gproj_patch.stats()
        out = ([(r.plan.step, r.context.layer) for r in seen], grads, {t: s[t] for t in ("original", "fp32")},
               {n: (r["tier"], r["calls"], r["samples"]) for n, r in policy.stats().items()}, CALLS["dense"])
        gproj_patch.disable()
        return out
    planned, grads, counts, layers, kernel_calls = run(settled=True)
    full_planned, full_grads, full_counts, full_layers, full_kernel_calls = run(settled=False)
    assert [s for s, n in planned if n == "healthy"] == [0, 3]
    assert [s for s, n in full_planned if n == "healthy"] == list(range(5))
    assert counts == full_counts == {"original": 5, "fp32": 5} and layers == full_layers
    assert kernel_calls == full_kernel_calls == 5  # the saved kernel ran for the healthy layer every step
    for got, want in zip(grads, full_grads):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
