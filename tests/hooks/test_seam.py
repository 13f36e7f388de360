"""The SDPA seam (``hooks/sdpa.py``): the corrected backward is the autograd-level kernel of SDPA's fused
backward ops, so every caller is reached, the forward runs no package code, and ``disable()`` gives PyTorch's
kernels back. CPU: the seam sits on ``aten::_scaled_dot_product_flash_attention_for_cpu_backward``; the CUDA ops
are exercised in ``test_gpu_integration.py``.
"""
import sys

import pytest
import torch
import torch.nn.functional as F

import gproj_patch
from gproj_patch.backends.reference import reference_backward
from gproj_patch.hooks import sdpa as seam
from tests.helpers.numerics import rel

pytestmark = pytest.mark.usefixtures("patch_off")

BF16_TOL = 4 * 2.0 ** -8


def _inputs(offset=64.0, B=1, H=2, S=48, D=32, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g).to(dtype).requires_grad_()
    k = (torch.randn(B, H, S, D, generator=g) + offset).to(dtype).requires_grad_()
    v = torch.randn(B, H, S, D, generator=g).to(dtype).requires_grad_()
    do = torch.randn(B, H, S, D, generator=g).to(dtype)
    return q, k, v, do


def _dq(fn, q, k, v, do):
    q.grad = k.grad = v.grad = None
    fn(q, k, v).backward(do)
    return q.grad.clone()


def _ref(q, k, v, do, **mask):
    return reference_backward(q.detach(), k.detach(), v.detach(), do, **mask)


from torch.nn.functional import scaled_dot_product_attention as early_bound  # noqa: E402 - bound at import


def _default_argument(q, k, v, fn=F.scaled_dot_product_attention):
    return fn(q, k, v, is_causal=True)


CALLERS = {
    "F.scaled_dot_product_attention": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "bound at import": lambda q, k, v: early_bound(q, k, v, is_causal=True),
    "default argument": _default_argument,
    "torch._C._nn builtin": lambda q, k, v: torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=True),
}


@pytest.mark.parametrize("caller", list(CALLERS))
def test_every_binding_is_reached_and_corrected(caller):
    """A name bound before ``enable()`` and a default argument hold the same builtin: the seam is below them
    all. Unpatched the 64σ key offset leaks into dq; patched, dq is at BF16 accuracy."""
    fn = CALLERS[caller]
    q, k, v, do = _inputs()
    ref = _ref(q, k, v, do, causal=True)[0]
    unpatched = rel(_dq(fn, q, k, v, do), ref)
    gproj_patch.enable(targets=("sdpa",))
    patched = rel(_dq(fn, q, k, v, do), ref)
    assert unpatched > 0.05 and patched < BF16_TOL, (unpatched, patched)
    assert gproj_patch.stats()["fp32"] == 1


def test_disable_gives_pytorchs_kernel_back_bitwise():
    q, k, v, do = _inputs()
    fn = CALLERS["F.scaled_dot_product_attention"]
    before = _dq(fn, q, k, v, do)
    with gproj_patch.enable(targets=("sdpa",)):
        assert seam.is_installed() and seam.seam_ops()
        assert not torch.equal(_dq(fn, q, k, v, do), before)
    assert not seam.is_installed() and seam.seam_ops() == []
    assert torch.equal(_dq(fn, q, k, v, do), before)


def test_enable_twice_and_disable_twice():
    gproj_patch.enable(targets=("sdpa",))
    ops = seam.seam_ops()
    gproj_patch.enable(targets=("sdpa",))
    assert seam.seam_ops() == ops
    gproj_patch.disable()
    gproj_patch.disable()
    assert not seam.is_installed()


def test_the_forward_runs_no_package_code():
    """No Python of this package runs in an SDPA forward (profiled: no frame of ``gproj_patch`` is entered),
    and its output is the unpatched output bit for bit."""
    q, k, v, _ = _inputs()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gproj_patch.enable(targets=("sdpa",))
    entered = []

    def profile(frame, event, arg):
        if event == "call" and "gproj_patch" in frame.f_code.co_filename:
            entered.append(frame.f_code.co_name)
    sys.setprofile(profile)
    try:
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        sys.setprofile(None)
    assert entered == [] and torch.equal(got, want)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_graph_is_reached_compiles_once(backend):
    """The compiled backward calls the aten op at run time: corrected, one graph, no recompile over calls."""
    pytest.importorskip("triton") if backend == "inductor" else None
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    gproj_patch.enable(targets=("sdpa",))
    fn = torch.compile(CALLERS["F.scaled_dot_product_attention"], backend=backend, fullgraph=True)
    q, k, v, do = _inputs()
    ref = _ref(q, k, v, do, causal=True)[0]
    for _ in range(3):
        assert rel(_dq(fn, q, k, v, do), ref) < BF16_TOL
    assert gproj_patch.stats()["fp32"] == 3
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])
    torch._dynamo.reset()


def test_multihead_attention_and_transformer_encoder_layer():
    """Modules that call SDPA from inside torch: ``nn.MultiheadAttention`` (need_weights=False) and
    ``nn.TransformerEncoderLayer`` in training (dropout 0) reach the seam."""
    gproj_patch.enable(targets=("sdpa",))
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.bfloat16)
    x = torch.randn(2, 10, 32, dtype=torch.bfloat16, requires_grad=True)
    out, _ = mha(x, x, x, need_weights=False)
    out.float().sum().backward()
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, dtype=torch.bfloat16)
    layer(x).float().sum().backward()
    assert gproj_patch.stats()["fp32"] == 2


def test_dropout_passes_through_quietly_and_counted(caplog):
    """dropout > 0 cannot be corrected (the fused kernel's dropout mask cannot be replayed): PyTorch's backward
    as it is, the reason counted and logged at DEBUG only. (On CPU SDPA runs dropout on its math backend, which
    has no fused backward op: the decision is driven here with the CPU op's arguments; the GPU test runs the
    real fused dropout.)"""
    from gproj_patch.runtime import config
    q, k, v, do = _inputs()
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    b = seam.bind(op, (do, q.detach(), k.detach(), v.detach(), out, lse, 0.3, True), {})
    sentinel = tuple(torch.full_like(t, 7.0) for t in (q, k, v))
    got = seam.corrected(seam.spec_of(op), b, lambda: sentinel, config.resolve())
    assert got is sentinel
    s = gproj_patch.stats()
    assert s["original"] == 1 and any("dropout" in r for r in s["fallback_reasons"])
    assert not [r for r in caplog.records if r.name.startswith("gproj_patch") and r.levelname != "DEBUG"]


def test_layer_scope_names_the_backward(monkeypatch):
    """Without a forward record, a backward learns its layer from its autograd node: the named scope its
    forward ran in; unnamed calls are ``sdpa{n}`` in backward order."""
    gproj_patch.enable(mode="auto", targets=("sdpa",))
    q, k, v, do = _inputs(offset=0.0)
    with gproj_patch.layer_scope("blk0"):
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    b = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with gproj_patch.layer_scope("not me"):  # a scope open around the backward names nothing
        (a + b).backward(torch.cat([do, do], 0)[:1])
    assert set(gproj_patch.stats()["layers"]) == {"blk0", "sdpa0"}


def test_steps_advance_per_backward_pass():
    gproj_patch.enable(mode="auto", targets=("sdpa",))
    q, k, v, do = _inputs(offset=0.0)
    from gproj_patch import policy
    steps = []
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v).backward(do)
        steps.append(policy.current_step())
    assert steps == [0, 1, 2]


def test_create_graph_gradients_raise_only_when_differentiated():
    """create_graph=True: PyTorch's fused backward is not differentiable either; the corrected gradients are
    usable, and a second backward through them raises a clear error instead of dropping a term silently."""
    gproj_patch.enable(targets=("sdpa",))
    q, k, v, do = _inputs()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (gq,) = torch.autograd.grad(out, q, do, create_graph=True)
    assert rel(gq, _ref(q, k, v, do, causal=True)[0]) < BF16_TOL
    with pytest.raises(RuntimeError, match="not differentiable"):
        gq.float().sum().backward()


def test_varlen_reader_on_cpu_through_the_decision():
    """``torch_attn::_varlen_attn_backward``'s arguments ((total, H, D) tensors, the (H, total) LSE, cu_seq_*,
    causal bottom-right per sequence) read, decided and returned in its layout: the seam's own function on
    CPU tensors (the op itself runs on CUDA only; the GPU test calls ``varlen_attn``)."""
    pytest.importorskip("torch.nn.attention.varlen")
    from gproj_patch.backends.reference import reference_forward
    from gproj_patch.runtime import config
    g = torch.Generator().manual_seed(4)
    lens, H, D = (5, 11), 2, 16
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    T = sum(lens)
    q, k, v, do = (torch.randn(T, H, D, generator=g).to(torch.bfloat16) for _ in range(4))
    k = (k.float() + 32.0).to(torch.bfloat16)
    four = lambda t: t.unsqueeze(0).transpose(1, 2).double()  # noqa: E731
    out, lse = reference_forward(four(q), four(k), four(v), causal=True, causal_align="bottom_right",
                                 cu_seqlens_q=cu, cu_seqlens_k=cu)
    out = out[0].transpose(0, 1).to(torch.bfloat16)
    lse = lse[0].float()
    op = torch.ops.torch_attn._varlen_attn_backward.default
    spec = seam.spec_of(op)
    b = seam.bind(op, (do, q, k, v, out, lse, cu, cu, max(lens), max(lens), True,
                       torch.zeros(2, dtype=torch.uint64), None, None), {})
    dq, dk, dv = seam.corrected(spec, b, lambda: pytest.fail("no original here"), config.resolve())
    ref = reference_backward(four(q), four(k), four(v), four(do), causal=True, causal_align="bottom_right",
                             cu_seqlens_q=cu, cu_seqlens_k=cu)
    for got, want in zip((dq, dk, dv), ref):
        assert got.shape == (T, H, D) and got.dtype == torch.bfloat16
        assert rel(got.unsqueeze(0).transpose(1, 2), want) < BF16_TOL


def test_output_strides_are_the_meta_kernels():
    """A compiled graph reads the op's outputs with the strides of its meta kernel (CPU flash: (B, S, H, D)
    order); the seam's gradients have exactly those, whatever layout the inputs had."""
    gproj_patch.enable(targets=("sdpa",))
    q, k, v, do = _inputs()
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    got = op(do, q.detach(), k.detach(), v.detach(), out, lse, 0.0, True)
    with torch._subclasses.FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (do, q, k, v, out, lse)]
        want = op(fakes[0], fakes[1], fakes[2], fakes[3], fakes[4], fakes[5], 0.0, True)
    assert [g.stride() for g in got] == [w.stride() for w in want]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_one_step_per_training_step(reentrant):
    """Activation checkpointing: a reentrant checkpoint runs one nested backward per block inside the step's
    backward; the seam counts them as one pass (one step per training step) and numbers the unnamed calls of
    the step in backward order, the same every step."""
    from torch.utils.checkpoint import checkpoint
    from gproj_patch import policy
    gproj_patch.enable(mode="auto", targets=("sdpa",), sample_every=1)
    q, k, v, do = _inputs(offset=0.0)
    lins = [torch.nn.Linear(32, 32).bfloat16() for _ in range(2)]

    def block(x, lin):
        return F.scaled_dot_product_attention(lin(x), k, v, is_causal=True)
    steps = []
    for _ in range(3):
        x = q
        for lin in lins:
            x = checkpoint(block, x, lin, use_reentrant=reentrant)
        x.backward(do)
        steps.append(policy.current_step())
    assert steps == [0, 1, 2]
    layers = policy.stats()
    assert sorted(layers) == ["sdpa0", "sdpa1"] and all(r["samples"] == 3 for r in layers.values()), layers


def test_efficient_op_asked_for_a_missing_bias_gradient_goes_to_pytorchs_kernel():
    """``grad_input_mask[3]`` with no bias: PyTorch's efficient kernel raises ("bias_requires_grad is true but no
    bias was provided"); the seam hands the call to that kernel (here a stand-in that says it ran) and counts it.
    The real kernel's error, unpatched and patched, is checked on CUDA (``test_gpu_integration.py``)."""
    from gproj_patch.runtime import config
    q, k, v, do = (t.detach() for t in _inputs(offset=0.0))
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:3])
    op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    spec = seam.spec_of(op)
    ran = []
    for gim in ((True, True, True, False), (True, True, True, True)):
        b = seam.bind(op, (do, q, k, v, None, out, lse, torch.zeros(()), torch.zeros(()), 0.0, gim, False), {})
        assert seam.spec_of(op).read(b).bias_grad == gim[3]
    gproj_patch.reset_stats()
    assert seam.corrected(spec, b, lambda: ran.append(1) or "pytorch's", config.resolve()) == "pytorch's"
    assert ran == [1] and gproj_patch.stats()["fallback_reasons"], gproj_patch.stats()


def _auto_steps(monkeypatch, settled: bool, steps: int = 7):
    """Two named layers, one with a large common key offset, over ``steps`` training steps in ``auto`` (sampled
    every 3 steps); the plans made per layer, the gradients of every step, the counters and the policy's layers.
    ``settled=False``: every call takes the full plan (the settled-layer shortcut switched off)."""
    from gproj_patch import policy
    from gproj_patch.dispatch import plan
    if not settled:
        monkeypatch.setattr(seam, "settled_original", lambda cfg, layer, has_original: False)
    planned = []
    real = plan.make_plan
    monkeypatch.setattr(seam, "make_plan", lambda record, *a, **kw: planned.append(
        (policy.current_step(), record.context.layer)) or real(record, *a, **kw))
    gproj_patch.disable()
    gproj_patch.reset_stats()
    gproj_patch.enable(mode="auto", targets=("sdpa",), sample_every=3)
    healthy, sick = _inputs(offset=0.0, seed=1), _inputs(offset=64.0, seed=2)
    grads = []
    for _ in range(steps):
        for name, (q, k, v, _) in (("healthy", healthy), ("sick", sick)):
            q.grad = k.grad = v.grad = None
        with gproj_patch.layer_scope("healthy"):
            a = F.scaled_dot_product_attention(*healthy[:3], is_causal=True)
        with gproj_patch.layer_scope("sick"):
            b = F.scaled_dot_product_attention(*sick[:3], is_causal=True)
        torch.autograd.backward([a, b], [healthy[3], sick[3]])
        grads.append([t.grad.clone() for t in healthy[:3] + sick[:3]])
    s = gproj_patch.stats()
    counts = {t: s[t] for t in ("original", "gproj", "fp32")}
    layers = {n: {key: r[key] for key in ("tier", "calls", "samples", "last_sampled_step")}
              for n, r in policy.stats().items()}
    gproj_patch.disable()
    return planned, grads, counts, layers, (healthy, sick)


def test_auto_settled_layer_runs_pytorchs_backward_without_a_plan(monkeypatch):
    """``auto``: a layer settled on "original" runs PyTorch's backward between its samples without a record or a
    plan (host time); the outcome — gradients, counters, the policy's layers — is the full decision's, and a
    layer on the corrected tier is planned at every call."""
    planned, grads, counts, layers, (healthy, sick) = _auto_steps(monkeypatch, settled=True)
    full_planned, full_grads, full_counts, full_layers, _ = _auto_steps(monkeypatch, settled=False)
    # planned: the healthy layer at its samples only (steps 0, 3, 6), the sick one every step
    assert [s for s, n in planned if n == "healthy"] == [0, 3, 6]
    assert [s for s, n in planned if n == "sick"] == list(range(7))
    assert len(full_planned) == 14
    assert counts == full_counts and counts["original"] == 7 and counts["gproj"] + counts["fp32"] == 7
    assert layers == full_layers
    assert layers["healthy"]["tier"] == "original" and layers["healthy"]["calls"]["original"] == 7
    assert layers["sick"]["tier"] != "original" and layers["healthy"]["samples"] == 3  # on CPU "gproj" runs fp32
    for got, want in zip(grads, full_grads):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    # the healthy layer's gradients are PyTorch's own, bit for bit; the sick one's corrected against fp64
    gproj_patch.disable()
    q, k, v, do = healthy
    q.grad = k.grad = v.grad = None
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    assert all(torch.equal(g, t.grad) for g, t in zip(grads[-1][:3], (q, k, v)))
    q, k, v, do = sick
    dq_ref = _ref(q, k, v, do, causal=True)[0]
    assert rel(grads[-1][3], dq_ref) < BF16_TOL


@pytest.mark.parametrize("unknown_before", [False, True])
def test_cudnn_original_hands_do_in_the_outputs_layout_and_keys_its_plans(monkeypatch, unknown_before):
    """The cuDNN original (module docstring of the seam): dO already in the output's layout passes on as the call
    came; another layout reaches PyTorch's kernel in the output's strides, same values. The plan keys are kept,
    and asked for, only where a cuDNN backward may predate the seam. (PyTorch's kernel is CUDA-only: here the
    redispatch is recorded instead; the defect itself is checked on CUDA, ``test_gpu_integration.py``.)"""
    op = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    q, k, v, do = (t.detach() for t in _inputs(offset=0.0))
    out = torch.randn(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).to(q.dtype).transpose(1, 2)  # (B, S, H, D)
    seen = []
    monkeypatch.setattr(seam.compat, "redispatch_native", lambda op_, keyset, args, kwargs: seen.append(
        (args, kwargs)) or "pytorch's")
    monkeypatch.setattr(seam.CUDNN_KEYS, "unknown_before", unknown_before)
    monkeypatch.setattr(seam.CUDNN_KEYS, "ours", set())
    for i, grad in enumerate((do.transpose(1, 2).contiguous().transpose(1, 2), do.contiguous())):  # out's, not
        args = (grad, q, k, v, out, torch.zeros(q.shape[:3]), torch.zeros(()), torch.zeros(()), None, None, None,
                q.shape[2], k.shape[2], 0.0, True)
        b = seam.bind(op, args, {"scale": None})
        key = seam._cudnn_key(b) if unknown_before else None
        assert seam._cudnn_plan_known(key) == (not unknown_before or i > 0)  # the key holds no dO strides
        assert seam._cudnn_original(op, None, args, {"scale": None}, b, key) == "pytorch's"
        assert seam._cudnn_plan_known(key)  # the seam built this key's plan
        passed, kwargs = seen[-1]
        assert passed[0].stride() == out.stride() and torch.equal(passed[0], grad) and kwargs == {"scale": None}
        assert (passed is args) == (grad.stride() == out.stride())
        assert all(x is y for x, y in zip(passed[1:], args[1:]))
    assert len(seam.CUDNN_KEYS.ours) == (1 if unknown_before else 0)
