"""HF eager attention under the keyword conventions Transformers uses (the Trainer's ``num_items_in_batch``
above all): which calls ``hooks/hf_eager.py`` corrects and which it passes through.

The rule is read from each eager function's code (``hf_eager_forms.unread_parameters``): an argument bound to a
parameter the code never refers to — or landing in an unread ``**kwargs`` — cannot change the arithmetic, so the
call is corrected; an argument the function reads, beyond the probed ``scaling``/``dropout``/``softcap`` and
other than its parameter's default, passes the call through (reason counted).

Checked: the installed release's eager functions under every keyword set its models, the Trainer, ``generate``
and the padding-free collator pass (forward bit for bit, dq/dk/dv against the fp64 oracle, ``stats()``); the
pass-through of arguments a function reads (T5's ``position_bias``, a sink tensor given to a function that adds
it, a window read from ``**kwargs``: gradients bit for bit the unpatched ones, the reason naming the argument); a
tiny Llama called as the Trainer calls it (per call against the oracle, unpatched far off); a real
``transformers.Trainer`` run with ``GProjCallback`` on an eager model (per-layer logs, no pass-through).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math

import pytest
import torch

import gproj_patch
from gproj_patch import policy
from gproj_patch.backends.reference import reference_backward
from gproj_patch.hooks import hf_eager, hf_eager_forms
from tests.helpers import hf_models
from tests.helpers.numerics import offset_along_direction, rel

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

B, H, S, D = 2, 4, 32, 32
OFFSET = 128.0                 # common key offset in σ, along a direction the queries do not see
BOUND = 5e-3                   # BF16 through the FP32 tier on CPU, as tests/integrations/test_hf_eager.py
UNPATCHED_FAR = 0.05           # the unpatched eager dq error per call is above this here
SINKS = (-20.0, 0.0, 3.0, 8.0)  # sink logit − log(S) per head (gpt-oss)
SOFTCAP = 5.0


def _modeling(model: str):
    try:
        return importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no {model}")


class _Attention(torch.nn.Module):
    """What the eager functions read from their module."""

    def __init__(self, kv_heads: int, sinks=None, training=False):
        super().__init__()
        self.num_key_value_groups = H // kv_heads
        self.head_dim = D
        self.scaling = D ** -0.5
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)
        self.train(training)


def _inputs(kv_heads: int, seed: int = 0):
    """q, k, v leaves (BF16, keys offset by OFFSET σ along a direction removed from the queries), dO in eager's
    output layout (B, S, H, D), and HF's additive causal eager mask (0 / the dtype's minimum)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv_heads, S, D, generator=g, dtype=torch.float64)
    q, k = offset_along_direction(q, k, OFFSET, g, orthogonal=True)
    v = torch.randn(B, kv_heads, S, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, S, H, D, generator=g, dtype=torch.float64).to(torch.bfloat16)
    q, k, v = (x.to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    pattern = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S)
    mask = torch.zeros(B, 1, S, S, dtype=torch.bfloat16).masked_fill(~pattern, torch.finfo(torch.bfloat16).min)
    return q, k, v, do, pattern, mask


def _run(fn, module, q, k, v, do, mask, kwargs):
    """(output, grads of q, k, v[, sinks]) of one call of ``fn`` with ``kwargs`` and the loss ⟨do, output⟩."""
    leaves = [q, k, v] + ([module.sinks] if hasattr(module, "sinks") else [])
    for t in leaves:
        t.grad = None
    out, _ = fn(module, q, k, v, mask, **kwargs)
    out.backward(do)
    return out.detach(), [t.grad.clone() for t in leaves]


def _trainer_keywords():
    """What a Llama-style attention module hands its attention function under the Trainer."""
    return dict(dropout=0.0, scaling=D ** -0.5, position_ids=torch.arange(S)[None], use_cache=False,
                num_items_in_batch=torch.tensor(B * (S - 1)))


# (modeling module, its KV heads, extra keywords, the sink / softcap its math then has)
CORRECTED = {
    "llama: the Trainer": ("llama", 2, {}, None),
    "llama: padding-free collator": ("llama", 2, dict(cu_seq_lens_q=torch.tensor([0, S]), max_length_q=S,
                                                      cu_seq_lens_k=torch.tensor([0, S]), max_length_k=S,
                                                      seq_idx=torch.zeros(1, S, dtype=torch.int32)), None),
    "llama: generate / outputs": ("llama", 2, dict(use_cache=True, output_attentions=True, is_causal=True), None),
    # keywords other models pass, which Llama's function never reads (the mask carries windows)
    "llama: other models' keywords": ("llama", 2, dict(sliding_window=8, s_aux=torch.zeros(H), sinks=torch.zeros(H),
                                                       position_bias=torch.zeros(B, H, S, S), softcap=SOFTCAP), None),
    "eval-mode dropout": ("llama", 2, dict(dropout=0.1), None),
    "t5: position_bias at its default": ("t5", H, dict(position_bias=None), None),
    "modernbert_decoder: sliding_window (an unread parameter)": ("modernbert_decoder", H, dict(sliding_window=8), None),
    "inkling2: sinks and position_bias at their defaults": ("inkling2", 2, dict(sinks=None, position_bias=None,
                                                                                sliding_window=8), None),
    "gpt_oss: s_aux (module.sinks)": ("gpt_oss", 2, dict(s_aux="module.sinks"), "sink"),
    "gemma2: softcap": ("gemma2", 2, dict(softcap=SOFTCAP, sliding_window=None), "softcap"),
}


@pytest.fixture(autouse=True)
def _patched():
    gproj_patch.disable()
    gproj_patch.reset_stats()
    policy.reset(keep_config=False)
    gproj_patch.enable(targets=("hf_eager",))
    yield
    gproj_patch.disable()
    policy.reset(keep_config=False)


@pytest.mark.parametrize("case", list(CORRECTED))
def test_keywords_the_function_does_not_read_are_corrected(case):
    """Every call carries the Trainer's keywords (``num_items_in_batch`` among them) besides the case's own."""
    model, kv_heads, extra, math_has = CORRECTED[case]
    mod = _modeling(model)
    q, k, v, do, pattern, mask = _inputs(kv_heads)
    sinks = torch.tensor([math.log(S) + s for s in SINKS]) if math_has == "sink" else None
    module = _Attention(kv_heads, sinks=None if sinks is None else sinks.to(torch.bfloat16))
    kwargs = {**_trainer_keywords(), **extra}
    if kwargs.get("s_aux") == "module.sinks":
        kwargs["s_aux"] = module.sinks   # gpt-oss passes its sinks both as module.sinks and as s_aux
    wrapped = mod.eager_attention_forward
    assert hf_eager.original_of(wrapped) is not wrapped, "the modeling module is not wrapped"
    out, got = _run(wrapped, module, q, k, v, do, mask, kwargs)
    out0, plain = _run(hf_eager.original_of(wrapped), module, q, k, v, do, mask, kwargs)
    assert torch.equal(out, out0)
    oracle = dict(attn_mask=pattern, scale=D ** -0.5)
    if math_has == "sink":
        oracle["sink"] = module.sinks.detach().float()
    if math_has == "softcap":
        oracle["softcap"] = SOFTCAP
    want = reference_backward(*(t.detach() for t in (q, k, v)), do.transpose(1, 2), **oracle)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert rel(a, b) < BOUND, (name, rel(a, b))
    s = gproj_patch.stats()
    assert s["fp32"] == 1 and s["forward"] == {"patched": 1}, s
    assert not any("argument" in r for r in s["fallback_reasons"]), s["fallback_reasons"]


def _windowed(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """An eager function that reads its ``**kwargs``: a sliding window taken from them (keys at distance ≥
    window hidden). Without the keyword it is plain eager attention (so the probe accepts it)."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    window = kwargs.get("sliding_window")
    if window is not None:
        i = torch.arange(query.shape[2])[:, None]
        j = torch.arange(key.shape[2])[None, :]
        scores = scores.masked_fill(i - j >= window, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


# (modeling module, its KV heads, keywords beyond the Trainer's, the argument the reason names, training)
PASSED = {
    "t5: position_bias": ("t5", H, dict(position_bias=torch.randn(B, H, S, S).to(torch.bfloat16)), "position_bias",
                          False),
    "inkling2: a sink column": ("inkling2", 2, dict(sinks=torch.zeros(B, H, S, 1, dtype=torch.bfloat16)), "sinks",
                                False),
    "training dropout": ("llama", 2, dict(dropout=0.1), "dropout", True),
}


def _passes_through(fn, module, kwargs, reason, seed):
    """``fn`` wrapped by the hook gives the unpatched output and gradients bit for bit, and the one reason
    counted names ``reason``."""
    q, k, v, do, _, mask = _inputs(H // module.num_key_value_groups, seed=seed)
    torch.manual_seed(0)
    out, got = _run(hf_eager._wrap(fn), module, q, k, v, do, mask, kwargs)
    torch.manual_seed(0)
    out0, plain = _run(fn, module, q, k, v, do, mask, kwargs)
    assert torch.equal(out, out0) and all(torch.equal(a, b) for a, b in zip(got, plain))
    s = gproj_patch.stats()
    assert s["forward"] == {"original": 1}, s
    assert len(s["fallback_reasons"]) == 1 and reason in next(iter(s["fallback_reasons"])), s


@pytest.mark.parametrize("case", list(PASSED))
def test_arguments_the_function_reads_pass_through(case):
    """The function computes something the probe did not see: the call keeps its own backward, and the reason
    names that argument, not the Trainer's ``num_items_in_batch`` (given after it, as HF's modules do)."""
    model, kv_heads, extra, reason, training = PASSED[case]
    kwargs = dict(extra, **{n: x for n, x in _trainer_keywords().items() if n not in extra})
    _passes_through(hf_eager.original_of(_modeling(model).eager_attention_forward),
                    _Attention(kv_heads, training=training), kwargs, reason, seed=1)


def test_a_window_read_from_kwargs_passes_through():
    """A non-tensor keyword can change the arithmetic as well as a tensor one: this function applies the window
    it reads from ``**kwargs``, so the call keeps its own backward (the routed math would have no window)."""
    _passes_through(_windowed, _Attention(H), dict(scaling=D ** -0.5, sliding_window=4), "sliding_window", seed=2)


def test_a_function_that_reads_its_kwargs_counts_every_keyword_as_read():
    """Where the code reads ``**kwargs``, any keyword landing there may change the arithmetic: passed through."""
    _passes_through(_windowed, _Attention(H), dict(scaling=D ** -0.5, num_items_in_batch=torch.tensor(3)),
                    "argument 'num_items_in_batch' that the function reads", seed=3)


def test_unread_parameters_from_the_code():
    def captured(module, query, key, value, attention_mask, scaling, window=None, **kwargs):
        return (lambda: window)()

    def frame_reader(module, query, key, value, attention_mask, scaling, window=None, **kwargs):
        return locals()

    @functools.wraps(hf_eager.original_of(modeling_llama.eager_attention_forward))
    def wrapper(*args, **kwargs):
        return hf_eager.original_of(modeling_llama.eager_attention_forward)(*args, **kwargs)

    def unread(fn):
        return hf_eager_forms.unread_parameters(fn, inspect.signature(fn))
    assert unread(hf_eager.original_of(modeling_llama.eager_attention_forward)) == {"kwargs"}
    modernbert = _modeling("modernbert_decoder")
    assert unread(hf_eager.original_of(modernbert.eager_attention_forward)) == {"kwargs", "sliding_window"}
    assert unread(_windowed) == {"module", "dropout"}   # its **kwargs is read
    assert "window" not in unread(captured) and "kwargs" in unread(captured)  # captured by a nested function
    assert unread(frame_reader) == set()           # locals(): every parameter may be read
    assert unread(wrapper) == set()                # its code's parameters are not its signature's
    assert unread(functools.partial(_windowed)) == set()  # no code object


def test_tiny_llama_called_as_the_trainer_calls_it_is_corrected_per_call():
    """``model(**batch, num_items_in_batch=n)`` (``Trainer.compute_loss``): each eager call's dq and dk against
    the fp64 oracle on that call's own inputs, patched and unpatched; ``stats()`` counts both layers."""
    model = hf_models.llama("eager")
    batch = dict(hf_models.token_batch(), num_items_in_batch=torch.tensor(2 * 31))
    errors = {}
    for arm in ("patched", "unpatched"):
        if arm == "unpatched":
            gproj_patch.disable()
        with hf_models.spy_calls(vars(modeling_llama), "eager_attention_forward", none_means_causal=False) as calls:
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
        assert len(calls) == hf_models.LAYERS and all("num_items_in_batch" in c.keywords for c in calls)
        errors[arm] = [c.errors() for c in calls]
        if arm == "patched":
            s = gproj_patch.stats()
            assert s["fp32"] == hf_models.LAYERS and s["forward"] == {"patched": hf_models.LAYERS}, s
    for patched, unpatched in zip(errors["patched"], errors["unpatched"]):
        assert patched["dq"] < BOUND and patched["dk"] < BOUND, errors
        assert unpatched["dq"] > UNPATCHED_FAR, errors


def test_trainer_run_with_the_callback_corrects_eager_attention(tmp_path, caplog):
    """A real Trainer (CPU, 4 steps) on an eager model in the large-key regime with ``GProjCallback(mode="auto")``:
    the Trainer hands ``num_items_in_batch`` to every eager call, the calls are corrected (FP32 tier on CPU),
    every layer gets its per-layer statistics in the logs, and no call passes through."""
    from gproj_patch.integrations.trainer import GProjCallback
    gproj_patch.disable()
    model = hf_models.llama("eager")
    trainer = hf_models.trainer(tmp_path, model, GProjCallback(mode="auto", sample_every=1))
    with caplog.at_level(logging.WARNING, logger="gproj_patch"), \
            hf_models.spy_calls(vars(modeling_llama), "eager_attention_forward", none_means_causal=False) as calls:
        trainer.train()
    assert calls and all("num_items_in_batch" in c.keywords for c in calls)  # the convention under test
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for entry in logged:
        assert entry["gproj/calls/gproj"] + entry["gproj/calls/fp32"] == 2 * hf_models.LAYERS, entry
        assert entry["gproj/calls/original"] == 0.0
        assert not any("num_items_in_batch" in key for key in entry), entry
        for layer in range(hf_models.LAYERS):
            assert entry[f"gproj/model.layers.{layer}.self_attn/tier"] >= 1.0, entry
    s = gproj_patch.stats()
    assert "original" not in s["forward"] and not any("argument" in r for r in s["fallback_reasons"]), s
    assert not any("num_items_in_batch" in r.getMessage() for r in caplog.records)
