"""HF eager attention: ``hooks/hf_eager.py`` wraps every modeling module's
``eager_attention_forward``; its ``run_eager`` keeps the forward and routes the backward.

Checked: the forward and the returned attention weights bitwise equal to unpatched (a tiny Llama, a direct
call); dq/dk/dv against the fp64 oracle on keys with a 128σ common offset — the FP32 tier on BF16 and the
Triton kernel in the interpreter on FP16, with causal, left-padded and non-pattern masks — where the unpatched
eager gradient is far off; gpt-oss's sink column (dsink included); the four-key witness exactly 0; ``stats()``
counting; live tensor bytes flat; the pass-through reasons (dropout, unknown functions, position bias); a
gradient on the weights taking the original backward bit for bit; install by identity and at a later import.
GPU: ``PYTHONPATH=. python -m pytest -q -m gpu tests/integrations/test_hf_eager.py``.
"""
from __future__ import annotations

import importlib
import math
import subprocess
import sys

import pytest
import torch

import gproj_patch
from tests.helpers.switches import cpu_kernel_on
from gproj_patch.backends.reference import reference_backward
from gproj_patch.audit.cases import witness_parameters
from gproj_patch.hooks import hf_eager
from tests.helpers.memory import flat as _flat  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.t5 import modeling_t5  # noqa: E402
from tests.helpers.numerics import offset_along_direction, rel  # noqa: E402
from tests.helpers.paths import REPO  # noqa: E402

OFFSET = 128.0                                   # common key offset in σ
BOUND = {torch.bfloat16: 5e-3, torch.float16: 1.5e-3}   # 0.5% target; FP16 kernel as tests/kernels/test_triton_kernel.py
UNPATCHED_FAR = 0.05                             # the unpatched eager dq error on the offset case is above this
B, H, HKV, S, D = 2, 4, 2, 48, 32


@pytest.fixture(autouse=True)
def _patched():
    gproj_patch.disable()
    gproj_patch.reset_stats()
    gproj_patch.enable(targets=("sdpa",))
    hf_eager.install()
    yield
    hf_eager.uninstall()
    gproj_patch.disable()


class _Attention(torch.nn.Module):
    """What the eager functions read from their module."""

    def __init__(self, heads=H, kv_heads=HKV, sinks=None):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.head_dim = D
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)
        self.eval()


def make(dtype, *, seed=0, offset=OFFSET, orthogonal=False):
    """q, k, v (leaves) and dO in eager's output layout; keys offset by ``offset``σ along a unit direction u
    (``orthogonal``: u removed from the queries, so the scores — and a sink's weight — do not see it)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64)
    q, k = offset_along_direction(q, k, offset, g, orthogonal=orthogonal)
    v = torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)   # eager's output layout (B, S, H, D)
    q, k, v = (x.to(dtype).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (q, k, v))
    return q, k, v, do.to(dtype)


def eager_mask(pattern, dtype):
    """HF's eager mask: 0 where visible, the dtype's minimum elsewhere (masking_utils.eager_mask)."""
    return torch.where(pattern, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


def causal(pads=(0,) * B):
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    return torch.stack([(j <= i) & (j >= p) for p in pads])[:, None]


def grads_of(fn, module, q, k, v, do, mask, **kw):
    for t in (q, k, v):
        t.grad = None
    out, weights = fn(module, q, k, v, mask, scaling=D ** -0.5, dropout=0.0, **kw)
    out.backward(do)
    return out.detach(), weights, tuple(t.grad.clone() for t in (q, k, v))


def unpatched(fn):
    return hf_eager.original_of(fn)


def test_wrapped_at_install_and_restored_by_identity():
    original = unpatched(modeling_llama.eager_attention_forward)
    assert modeling_llama.eager_attention_forward is not original
    assert "transformers.models.llama.modeling_llama" in hf_eager.patched_modules()
    hf_eager.uninstall()
    assert modeling_llama.eager_attention_forward is original
    assert hf_eager.install() == "installed"
    assert hf_eager.original_of(modeling_llama.eager_attention_forward) is original


def test_rebound_after_install_is_left_with_a_warning(caplog):
    original = unpatched(modeling_llama.eager_attention_forward)

    def theirs(*args, **kwargs):
        return original(*args, **kwargs)
    modeling_llama.eager_attention_forward = theirs
    try:
        with caplog.at_level("WARNING", logger="gproj_patch"):
            hf_eager.uninstall()
        assert modeling_llama.eager_attention_forward is theirs
        assert any("modeling_llama.eager_attention_forward was rebound after enable()" in r.getMessage()
                   for r in caplog.records)
    finally:
        modeling_llama.eager_attention_forward = original


def test_module_imported_later_is_wrapped():
    candidates = ("olmo", "olmo2", "stablelm", "starcoder2", "persimmon", "cohere", "granite", "helium")
    name = next((f"transformers.models.{c}.modeling_{c}" for c in candidates
                 if f"transformers.models.{c}.modeling_{c}" not in sys.modules), None)
    if name is None:
        pytest.skip("every candidate modeling module is already imported")
    module = importlib.import_module(name)
    wrapped = module.eager_attention_forward
    assert hf_eager.original_of(wrapped) is not wrapped and name in hf_eager.patched_modules()
    hf_eager.uninstall()
    assert module.eager_attention_forward is hf_eager.original_of(wrapped)


def test_install_before_transformers_is_imported():
    """A fresh process: nothing of Transformers is imported by install(); the first model class imported
    afterwards (through HF's lazy top-level module) runs the wrapped function."""
    code = "\n".join([
        "import sys",
        "from gproj_patch.runtime import import_hooks",
        "from gproj_patch.hooks import hf_eager",
        "assert hf_eager.install() == 'installed'",
        "assert not any(n.startswith('transformers') for n in sys.modules), 'install imported transformers'",
        "assert 'transformers.modeling_utils' in import_hooks.pending()",
        "from transformers import LlamaForCausalLM",
        "m = sys.modules['transformers.models.llama.modeling_llama']",
        "assert hasattr(m.eager_attention_forward, '__gproj_original__')",
        "hf_eager.uninstall()",
        "assert not hasattr(m.eager_attention_forward, '__gproj_original__')",
        "assert not any(n.startswith('transformers') for n in import_hooks.pending())",
    ])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=str(REPO))
    assert done.returncode == 0, done.stderr[-3000:]


def test_probed_forms():
    assert hf_eager.form_of(unpatched(modeling_llama.eager_attention_forward)) == \
        hf_eager.EagerForm(gqa=True, sink=False, softcap="ignored")
    assert hf_eager.form_of(unpatched(modeling_gpt_oss.eager_attention_forward)).sink

    def not_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        return torch.matmul(query, value.transpose(2, 3)).transpose(1, 2), None
    assert isinstance(hf_eager.form_of(not_attention), str)


@pytest.mark.parametrize("padded", [False, True])
def test_fp32_tier_bf16_matches_fp64_and_forward_is_unchanged(padded):
    fn = modeling_llama.eager_attention_forward
    q, k, v, do = make(torch.bfloat16)
    pads = (0, 11) if padded else (0, 0)
    pattern = causal(pads)
    if padded:
        do[1, : pads[1]] = 0                      # labels -100 on the pad rows and the row before the first token
    mask = eager_mask(pattern, torch.bfloat16)
    module = _Attention()
    out, weights, got = grads_of(fn, module, q, k, v, do, mask)
    out0, weights0, plain = grads_of(unpatched(fn), module, q, k, v, do, mask)
    assert torch.equal(out, out0) and torch.equal(weights, weights0)
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), attn_mask=pattern,
                              scale=D ** -0.5)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < BOUND[torch.bfloat16], name
    assert rel(plain[0], want[0]) > UNPATCHED_FAR
    s = gproj_patch.stats()
    assert s["fp32"] == 1 and s["forward"]["patched"] == 1


@pytest.mark.parametrize("pads", [(0, 0), (0, 13)])
def test_kernel_fp16_in_the_interpreter(monkeypatch, pads):
    pytest.importorskip("triton")
    cpu_kernel_on(monkeypatch, "GPROJ_TIER", "triton")
    q, k, v, do = make(torch.float16, seed=1)
    do[1, : pads[1]] = 0
    pattern = causal(pads)
    _, _, got = grads_of(modeling_llama.eager_attention_forward, _Attention(), q, k, v, do,
                         eager_mask(pattern, torch.float16))
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), attn_mask=pattern,
                              scale=D ** -0.5)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < BOUND[torch.float16], name
    assert gproj_patch.stats()["gproj"] == 1


def test_live_fully_masked_row_keeps_eager_uniform_semantics():
    """HF's loss on the last pad row: eager (additive mask, no sink) spreads that row's weight uniformly over
    every key, so it is not inert; the call takes the FP32 tier with the float mask itself. The oracle gets the
    same semantics through an fp64 additive mask that cancels that row's scores (uniform P, the gradient still
    reaching q and k through them); the eager mask's −3.4e38 itself would defeat the oracle's exp(s − LSE)."""
    q, k, v, do = make(torch.bfloat16, seed=8)
    pads = (0, 11)
    do[1, : pads[1] - 1] = 0                      # row 10 (the last pad) keeps its gradient
    pattern = causal(pads)
    mask = eager_mask(pattern, torch.bfloat16)
    _, _, got = grads_of(modeling_llama.eager_attention_forward, _Attention(), q, k, v, do, mask)
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    scores = q64 @ k64.repeat_interleave(H // HKV, 1).transpose(2, 3) * D ** -0.5
    empty = ~pattern.any(-1, keepdim=True)        # (B, 1, S, 1): the fully masked rows
    oracle_mask = torch.where(empty, -scores, torch.zeros_like(scores).masked_fill(~pattern, float("-inf")))
    want = reference_backward(q64, k64, v64, do.transpose(1, 2), attn_mask=oracle_mask, scale=D ** -0.5)
    assert float(want[0][1, :, pads[1] - 1].abs().max()) > 0  # the uniform row has a gradient
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < BOUND[torch.bfloat16], name
    assert gproj_patch.stats()["fp32"] == 1  # the FP32 tier with the mask (on CPU the planned tier: no reason)


def test_bias_mask_goes_to_the_fp32_tier_exactly():
    q, k, v, do = make(torch.bfloat16, seed=2)
    bias = torch.randn(B, 1, S, S, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    _, _, got = grads_of(modeling_llama.eager_attention_forward, _Attention(), q, k, v, do, bias)
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), attn_mask=bias,
                              scale=D ** -0.5)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < BOUND[torch.bfloat16], name
    assert gproj_patch.stats()["fp32"] == 1


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                     pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
@pytest.mark.parametrize("pads", [(0, 0), (0, 11)])
def test_gpt_oss_sink_column_with_dsink(pads, device):
    """With a sink a fully masked row puts its weight on the sink (output 0): inert even with a nonzero dO
    (HF's loss on the last pad row), so left padding still goes to the flags/varlen path, not the mask.
    On CUDA the backward is the Triton kernel with the sink (BF16); on CPU the FP32 tier."""
    q, k, v, do = (t.detach().to(device).requires_grad_() if i < 3 else t.to(device)
                   for i, t in enumerate(make(torch.bfloat16, seed=4, orthogonal=True)))
    do[1, : max(pads[1] - 1, 0)] = 0
    sinks = torch.tensor([math.log(S) + lvl for lvl in (-20.0, 0.0, 3.0, 8.0)]).to(torch.bfloat16)
    module = _Attention(sinks=sinks).to(device)
    pattern = causal(pads).to(device)
    fn = modeling_gpt_oss.eager_attention_forward
    out, _, got = grads_of(fn, module, q, k, v, do, eager_mask(pattern, torch.bfloat16))
    dsink = module.sinks.grad.clone()
    module.sinks.grad = None
    out0, _, plain = grads_of(unpatched(fn), module, q, k, v, do, eager_mask(pattern, torch.bfloat16))
    assert torch.equal(out, out0)
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), attn_mask=pattern,
                              scale=D ** -0.5, sink=module.sinks.detach().float())
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got + (dsink,), want):
        assert rel(a, b) < BOUND[torch.bfloat16], name
    no_sink = 0  # head 0's sink has weight e^-20: the exact dS row sum is ~0 there, so the leak shows
    assert rel(plain[0][:, no_sink], want[0][:, no_sink]) > UNPATCHED_FAR
    assert not any("attn_mask" in r for r in gproj_patch.stats()["fallback_reasons"])
    assert gproj_patch.stats()["gproj" if device == "cuda" else "fp32"] == 1


def test_four_key_witness_exactly_zero():
    p = witness_parameters(torch.bfloat16)
    eps, key0 = p["eps"], p["key0"]
    dim = 64
    q = torch.zeros(1, 1, 1, dim)
    k = torch.zeros(1, 1, 4, dim)
    k[..., 0] = key0
    k[0, 0, 1, 1] = 1.0
    v = torch.zeros(1, 1, 4, dim)
    v[0, 0, 0, :2] = torch.tensor([4.0, 4.0 * eps])
    v[0, 0, 1, 0] = -4.0
    v[0, 0, 2, 0] = -4.0 * eps
    do = torch.zeros(1, 1, 1, dim)
    do[..., :2] = 1.0
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    module = _Attention(heads=1, kv_heads=1)
    out, _ = modeling_llama.eager_attention_forward(module, q, k, v, None, scaling=dim ** -0.5)
    out.backward(do.to(torch.bfloat16))
    assert float(q.grad[0, 0, 0, 0]) == 0.0
    assert float(q.grad[0, 0, 0, 1]) == pytest.approx(-dim ** -0.5, rel=1e-2)


def test_pass_through_reasons():
    q, k, v, do = make(torch.bfloat16, seed=5)
    mask = eager_mask(causal(), torch.bfloat16)
    training = _Attention().train()
    modeling_llama.eager_attention_forward(training, q, k, v, mask, scaling=D ** -0.5, dropout=0.1)[0].sum()
    bias = torch.zeros(B, H, S, S, dtype=torch.bfloat16)
    t5 = _Attention(kv_heads=H)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    modeling_t5.eager_attention_forward(t5, q, kk, vv, mask, scaling=D ** -0.5, position_bias=bias)
    modeling_llama.eager_attention_forward(_Attention(), q, k, v, causal(), scaling=D ** -0.5)  # adds 0/1
    reasons = gproj_patch.stats()["fallback_reasons"]
    assert any("dropout" in r for r in reasons) and any("position_bias" in r for r in reasons)
    assert any("boolean attention_mask" in r for r in reasons)
    assert gproj_patch.stats()["forward"] == {"original": 3}


def test_weights_gradient_takes_the_original_backward_bit_for_bit():
    q, k, v, do = make(torch.bfloat16, seed=6)
    mask = eager_mask(causal(), torch.bfloat16)
    module = _Attention()
    grads = []
    for fn in (modeling_llama.eager_attention_forward, unpatched(modeling_llama.eager_attention_forward)):
        for t in (q, k, v):
            t.grad = None
        out, weights = fn(module, q, k, v, mask, scaling=D ** -0.5)
        (out.float().sum() + weights.float().pow(2).sum()).backward()
        grads.append(tuple(t.grad.clone() for t in (q, k, v)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert gproj_patch.stats()["original"] == 1


def test_tiny_llama_forward_and_weights_bitwise_and_memory_flat():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.bfloat16)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    patched = model(input_ids=ids, output_attentions=True)
    hf_eager.uninstall()
    plain = model(input_ids=ids, output_attentions=True)
    hf_eager.install()
    assert torch.equal(patched.logits, plain.logits)
    assert len(patched.attentions) == 2 and all(torch.equal(a, b) for a, b in
                                                zip(patched.attentions, plain.attentions))
    gproj_patch.reset_stats()

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    _flat(step)
    assert gproj_patch.stats()["fp32"] == 2 * 6

    def grads():
        model(input_ids=ids, labels=ids).loss.backward()
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out
    plain = grads()
    model.train()  # activation checkpointing recomputes the wrapped call during the backward: same gradients
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = grads()
    assert all(torch.equal(plain[n], checkpointed[n]) for n in plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pads", [(0, 0), (0, 13)])
def test_kernel_bf16_on_gpu(pads):
    q, k, v, do = (t.detach().cuda().requires_grad_() if i < 3 else t.cuda()
                   for i, t in enumerate(make(torch.bfloat16, seed=7)))
    do[1, : pads[1]] = 0
    pattern = causal(pads).cuda()
    fn = modeling_llama.eager_attention_forward
    out, _, got = grads_of(fn, _Attention(), q, k, v, do, eager_mask(pattern, torch.bfloat16))
    out0, _, plain = grads_of(unpatched(fn), _Attention(), q, k, v, do, eager_mask(pattern, torch.bfloat16))
    assert torch.equal(out, out0)
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), attn_mask=pattern,
                              scale=D ** -0.5)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < BOUND[torch.bfloat16], name
    assert rel(plain[0], want[0]) > UNPATCHED_FAR
    assert gproj_patch.stats()["gproj"] == 1


def test_auto_samples_with_the_lse_at_the_forward(monkeypatch):
    """``auto`` decides at the call's forward (its plan): on a path where the kernel can run, the HF eager hook
    computes the FP32 output and LSE at the forward, so the detector sees the LSE statistics (sink weight, LSE
    gap), and the backward reuses them; gradients still match the fp64 oracle."""
    pytest.importorskip("triton")
    from gproj_patch.policy import detector
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gproj_patch.disable()
    gproj_patch.enable(targets=("sdpa",), mode="auto", sample_every=1)
    hf_eager.install()
    seen = []
    real = detector.compute
    monkeypatch.setattr(detector, "compute", lambda q, k, lse, *a, **kw: seen.append(lse) or real(q, k, lse, *a, **kw))
    q, k, v, do = make(torch.float16, seed=3)
    with gproj_patch.layer_scope("eager0"):
        _, _, got = grads_of(modeling_llama.eager_attention_forward, _Attention(), q, k, v, do, None)
    assert len(seen) == 1 and seen[0] is not None, seen
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), scale=D ** -0.5)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < BOUND[torch.float16], name
    assert gproj_patch.stats()["layers"]["eager0"]["stats"]["p_sink"] is not None
