"""HF ``"gproj"`` with learnable sinks (``s_aux``, gpt-oss) and softcap (Gemma 2).

The forward is HF eager's own (gpt-oss's sink operations in ``hooks/transformers.py``; Gemma 2's eager softcap
function itself), checked bit for bit on tiny models and on direct calls; the backward goes through the router
with ``Problem.sink`` / ``Problem.softcap`` and is checked against the fp64 oracle on keys with a 128σ offset
the queries cannot see (the scores, the sink weights and the softcap's tanh keep their level; only the
gradients carry the offset) — the FP32 tier on BF16 and the kernel in Triton's interpreter on FP16, causal and
left padded — where plain autograd of the same forward is far off. ``stats()`` counts the calls; live tensor
bytes stay flat. GPU: ``PYTHONPATH=. python -m pytest -q -m gpu tests/integrations/test_hf_sinks_softcap.py``.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import gproj_patch
from tests.helpers.switches import cpu_kernel_on
from gproj_patch.backends.reference import reference_backward
from gproj_patch.hooks import transformers as gproj_hf
from tests.helpers.memory import flat as _flat

transformers = pytest.importorskip("transformers")
from transformers.models.gemma2 import modeling_gemma2  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

from gproj_patch.hooks.transformers import gproj_attention_forward  # noqa: E402
from tests.helpers.numerics import offset_along_direction, rel  # noqa: E402

B, H, HKV, S, D = 2, 4, 2, 48, 32
OFFSET = 128.0
SOFTCAP = 5.0
SINK_LEVELS = (-20.0, 0.0, 3.0, 8.0)    # sink logit − log(S) per head: P_sink ≈ 0, ~1/2, ~0.95, ~1
BOUND = {torch.bfloat16: 5e-3, torch.float16: 1.5e-3}
UNCORRECTED_FAR = 0.05
NO_SINK_HEAD = 0                         # the exact dS row sum is ~0 there: the uncorrected leak shows


pytestmark = pytest.mark.usefixtures("sdpa_and_transformers_on")  # tests/conftest.py


def make(dtype, *, seed=0, device="cpu"):
    """q, k, v leaves (B, H, S, D) in HF's layout, dO (B, S, H, D), a graded sink (H,) in ``dtype``; keys offset
    by OFFSET σ along a direction removed from the queries."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64)
    q, k = offset_along_direction(q, k, OFFSET, g, orthogonal=True)
    v = torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    sink = torch.tensor([math.log(S) + lvl for lvl in SINK_LEVELS])
    q, k, v = (x.to(dtype).transpose(1, 2).contiguous().transpose(1, 2).to(device).requires_grad_()
               for x in (q, k, v))
    return q, k, v, do.to(dtype=dtype, device=device), torch.nn.Parameter(sink.to(dtype=dtype, device=device))


def causal(pads=(0,) * B, device="cpu"):
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    return torch.stack([(j <= i) & (j >= p) for p in pads])[:, None].to(device)


class _Attention(torch.nn.Module):
    def __init__(self, sinks=None):
        super().__init__()
        self.num_key_value_groups = H // HKV
        self.head_dim = D
        self.is_causal = True
        if sinks is not None:
            self.sinks = sinks
        self.eval()


def _grads(fn, q, k, v, do, *extra):
    leaves = (q, k, v) + extra
    for t in leaves:
        t.grad = None
    out = fn()
    out.backward(do)
    return out.detach(), tuple(t.grad.clone() for t in leaves)


def _pattern_args(pads, device="cpu"):
    """(mask given to "gproj", pattern for the oracle): None + is_causal without padding, as HF's sdpa_mask."""
    pattern = causal(pads, device)
    return (None if not any(pads) else pattern), pattern


# ------------------------------------------------------------------------------------------------ sinks
def test_sink_forward_is_gpt_oss_eager_bit_for_bit():
    q, k, v, _, sink = make(torch.bfloat16)
    mask = gproj_hf.additive_mask(causal((0, 9)), torch.bfloat16)
    ours = gproj_hf.sink_attention_forward(q, k, v, mask, scaling=D ** -0.5, sink=sink)
    module = _Attention(sinks=sink)
    eager = getattr(modeling_gpt_oss.eager_attention_forward, "__gproj_original__",
                    modeling_gpt_oss.eager_attention_forward)
    theirs = eager(module, q, k, v, mask, scaling=D ** -0.5, dropout=0.0)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("pads", [(0, 0), (0, 11)])
def test_sink_fp32_tier_bf16_matches_fp64(pads):
    q, k, v, do, sink = make(torch.bfloat16, seed=1)
    do[1, : pads[1]] = 0
    mask, pattern = _pattern_args(pads)
    module = _Attention()

    def call():
        return gproj_attention_forward(module, q, k, v, mask, scaling=D ** -0.5, s_aux=sink)[0]
    out, got = _grads(call, q, k, v, do, sink)
    plain_out, plain = _grads(lambda: gproj_hf.sink_attention_forward(
        q, k, v, gproj_hf.additive_mask(pattern, q.dtype), scaling=D ** -0.5, sink=sink)[0], q, k, v, do, sink)
    assert torch.equal(out, plain_out)
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), attn_mask=pattern,
                              scale=D ** -0.5, sink=sink.detach().float())
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert rel(a, b) < BOUND[torch.bfloat16], name
    assert rel(plain[0][:, NO_SINK_HEAD], want[0][:, NO_SINK_HEAD]) > UNCORRECTED_FAR
    s = gproj_patch.stats()
    assert s["fp32"] == 1 and s["forward"]["patched"] == 1


@pytest.mark.parametrize("pads", [(0, 0), (0, 11)])
def test_sink_kernel_fp16_in_the_interpreter(monkeypatch, pads):
    pytest.importorskip("triton")
    cpu_kernel_on(monkeypatch, "GPROJ_TIER", "triton")
    q, k, v, do, sink = make(torch.float16, seed=2)
    do[1, : pads[1]] = 0
    mask, pattern = _pattern_args(pads)
    _, got = _grads(lambda: gproj_attention_forward(_Attention(), q, k, v, mask, scaling=D ** -0.5, s_aux=sink)[0],
                    q, k, v, do, sink)
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), attn_mask=pattern,
                              scale=D ** -0.5, sink=sink.detach().float())
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert rel(a, b) < BOUND[torch.float16], name
    assert gproj_patch.stats()["gproj"] == 1


def test_sink_memory_flat():
    q, k, v, do, sink = make(torch.bfloat16, seed=3)

    def step():
        gproj_attention_forward(_Attention(), q, k, v, None, scaling=D ** -0.5, s_aux=sink)[0].backward(do)
        for t in (q, k, v, sink):
            t.grad = None
    _flat(step)


def test_sink_dropout_passes_through_with_a_reason():
    q, k, v, do, sink = make(torch.bfloat16, seed=4)
    out = gproj_attention_forward(_Attention(), q, k, v, None, dropout=0.1, scaling=D ** -0.5, s_aux=sink)[0]
    out.backward(do)
    assert sink.grad is not None
    assert gproj_patch.stats()["forward"] == {"original": 1}
    assert gproj_hf.SINK_DROPOUT_REASON in gproj_patch.stats()["fallback_reasons"]


# ---------------------------------------------------------------------------------------------- softcap
def _gemma2_attention():
    cfg = transformers.Gemma2Config(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=HKV, head_dim=D,
                                    query_pre_attn_scalar=D, attn_logit_softcapping=SOFTCAP)
    return modeling_gemma2.Gemma2Attention(cfg, layer_idx=0).to(torch.bfloat16).eval()


def test_softcap_fp32_tier_bf16_matches_fp64_and_eager_forward():
    q, k, v, do, _ = make(torch.bfloat16, seed=5)
    module = _gemma2_attention()
    pads = (0, 7)
    do[1, : pads[1]] = 0
    pattern = causal(pads)
    out, got = _grads(lambda: gproj_attention_forward(module, q, k, v, pattern, scaling=D ** -0.5,
                                                      softcap=SOFTCAP)[0], q, k, v, do)
    eager = getattr(modeling_gemma2.eager_attention_forward, "__gproj_original__",
                    modeling_gemma2.eager_attention_forward)
    mask = gproj_hf.additive_mask(pattern, torch.bfloat16)
    plain_out, plain = _grads(lambda: eager(module, q, k, v, mask, scaling=D ** -0.5, softcap=SOFTCAP)[0],
                              q, k, v, do)
    assert torch.equal(out, plain_out)
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), attn_mask=pattern,
                              scale=D ** -0.5, softcap=SOFTCAP)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < BOUND[torch.bfloat16], name
    assert rel(plain[0], want[0]) > UNCORRECTED_FAR
    assert gproj_patch.stats()["fp32"] == 1


def test_softcap_kernel_fp16_in_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    cpu_kernel_on(monkeypatch, "GPROJ_TIER", "triton")
    q, k, v, do, _ = make(torch.float16, seed=6)
    module = _gemma2_attention().to(torch.float16)
    _, got = _grads(lambda: gproj_attention_forward(module, q, k, v, None, scaling=D ** -0.5,
                                                    softcap=SOFTCAP)[0], q, k, v, do)
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), causal=True,
                              scale=D ** -0.5, softcap=SOFTCAP)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert rel(a, b) < BOUND[torch.float16], name
    assert gproj_patch.stats()["gproj"] == 1


# ------------------------------------------------------------------------------------------ tiny models
def _tiny(name):
    small = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, head_dim=16)
    if name == "gemma2":
        return transformers.Gemma2Config(attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                         sliding_window=8, query_pre_attn_scalar=16, **small)
    return transformers.GptOssConfig(num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **small)


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_tiny_model_gproj_forward_equals_eager_and_counts(name):
    cfg = _tiny(name)
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager",
                                                          dtype=torch.bfloat16)
    gproj = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="gproj",
                                                          dtype=torch.bfloat16)
    gproj.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    labels = ids.masked_fill(mask == 0, -100)  # HF: the last pad row predicts the first token (nonzero dO)
    logits = {}
    for key, model in (("eager", eager), ("gproj", gproj)):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        logits[key] = out.logits.detach()
    assert torch.equal(logits["eager"], logits["gproj"])
    s = gproj_patch.stats()
    assert s["fp32"] + s["gproj"] == cfg.num_hidden_layers and s["forward"]["patched"] == cfg.num_hidden_layers
    if name == "gpt_oss":  # boolean semantics: the fully masked pad rows are inert, left padding is varlen
        assert not any("attn_mask" in r for r in s["fallback_reasons"]), s["fallback_reasons"]
        sinks = [m.sinks.grad for m in gproj.modules() if hasattr(m, "sinks")]
        assert sinks and all(g is not None and bool(g.abs().sum() > 0) for g in sinks)


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["sink", "softcap"])
def test_kernel_bf16_on_gpu(kind):
    q, k, v, do, sink = make(torch.bfloat16, seed=7, device="cuda")
    pads = (0, 11)
    do[1, : pads[1]] = 0
    pattern = causal(pads, "cuda")
    if kind == "sink":
        extra, leaves, ref = dict(s_aux=sink), (sink,), dict(sink=sink.detach().float())
        module = _Attention()
    else:
        extra, leaves, ref = dict(softcap=SOFTCAP), (), dict(softcap=SOFTCAP)
        module = _gemma2_attention().cuda()
    _, got = _grads(lambda: gproj_attention_forward(module, q, k, v, pattern, scaling=D ** -0.5, **extra)[0],
                    q, k, v, do, *leaves)
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), attn_mask=pattern,
                              scale=D ** -0.5, **ref)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert rel(a, b) < BOUND[torch.bfloat16], name
    assert gproj_patch.stats()["gproj"] == 1
