"""HF Transformers: attn_implementation="gproj" (and "sdpa" through the SDPA hook) against an eager run."""
import copy

import pytest
import torch

import gproj_patch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig  # noqa: E402

SEQ, VOCAB = 24, 64


def _configs():
    small = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64)
    return {"llama": LlamaConfig(num_key_value_heads=4, **small),
            "mistral_gqa_window": MistralConfig(num_key_value_heads=2, sliding_window=8, **small)}


pytestmark = pytest.mark.usefixtures("sdpa_and_transformers_on")  # tests/conftest.py


def _models(cfg, dtype, impls):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=dtype)
    out = {"eager": base}
    for impl in impls:
        m = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl[0], dtype=impl[1])
        m.load_state_dict(base.state_dict())
        out[impl] = m
    return out


def _run(model, ids, mask, labels):
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach().double(), {n: p.grad.detach().double() for n, p in model.named_parameters()}


def _batch(padded):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    if padded:  # right padding: no query row is fully masked, so every backend defines every row
        mask[1, -5:] = 0
        labels[1, -5:] = -100
    return ids, mask, labels


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["llama", "mistral_gqa_window"])
def test_fp32_weights_match_eager_tightly(name, padded):
    cfg = _configs()[name]
    models = _models(cfg, torch.float32, [("gproj", torch.float32)])
    ids, mask, labels = _batch(padded)
    loss_e, grads_e = _run(models["eager"], ids, mask, labels)
    loss_g, grads_g = _run(models[("gproj", torch.float32)], ids, mask, labels)
    assert torch.allclose(loss_g, loss_e, rtol=1e-5, atol=1e-6)
    for n in grads_e:
        assert torch.allclose(grads_g[n], grads_e[n], rtol=1e-4, atol=1e-6), n


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["llama", "mistral_gqa_window"])
@pytest.mark.parametrize("impl", ["gproj", "sdpa"])
def test_bf16_gradients_within_flash_attention_style_tolerance(name, padded, impl):
    """As flash-attention's tests do: the BF16 error against a high-precision reference must be at most
    twice the error of the plain BF16 eager implementation (plus a small absolute floor)."""
    cfg = _configs()[name]
    models = _models(cfg, torch.bfloat16, [(impl, torch.bfloat16), ("eager", torch.float64)])
    ids, mask, labels = _batch(padded)
    loss_ref, grads_ref = _run(models[("eager", torch.float64)], ids, mask, labels)
    loss_e, grads_e = _run(models["eager"], ids, mask, labels)
    loss_g, grads_g = _run(models[(impl, torch.bfloat16)], ids, mask, labels)
    assert abs(loss_g - loss_ref) <= 2 * abs(loss_e - loss_ref) + 1e-2
    for n in grads_ref:
        scale = grads_ref[n].abs().max().item()
        err_g = (grads_g[n] - grads_ref[n]).abs().max().item()
        err_e = (grads_e[n] - grads_ref[n]).abs().max().item()
        assert err_g <= 2 * err_e + 1e-3 * scale, (n, err_g, err_e)
    s = gproj_patch.stats()
    assert s["gproj"] + s["fp32"] == cfg.num_hidden_layers, s  # every layer's backward was the corrected one
    # HF's causal / sliding-window boolean masks, right padding included (padded rows have zero dO), are
    # recognised as causal + window flags: no "attn_mask" fallback
    assert not any(r == "attn_mask" for r in s["fallback_reasons"]), s


def test_layer_names_and_inference_path(monkeypatch):
    seen = []
    from gproj_patch.hooks import sdpa as seam
    real = seam.run_backward
    monkeypatch.setattr(seam, "run_backward",
                        lambda record, *a, **kw: seen.append(record.context.layer) or real(record, *a, **kw))
    cfg = _configs()["mistral_gqa_window"]
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="gproj", dtype=torch.bfloat16)
    ids, mask, labels = _batch(False)
    with torch.no_grad():  # inference: exactly HF's sdpa path, nothing counted
        model(input_ids=ids)
    assert gproj_patch.stats()["forward"] == {}
    model(input_ids=ids, labels=labels).loss.backward()
    assert sorted(seen) == ["MistralAttention.0", "MistralAttention.1"]


def test_disable_keeps_gproj_and_unwraps_every_other_entry():
    """The registry after disable() is the registry before enable(): the layer-name wrappers gone (each original
    back by identity), "gproj" still registered (the name exists without the patch), so a model built with it
    keeps running."""
    from transformers.modeling_utils import AttentionInterface
    from gproj_patch.hooks.transformers import gproj_attention_forward
    mapping = AttentionInterface._global_mapping
    gproj_patch.disable()
    before = dict(mapping)
    gproj_patch.enable(targets=("sdpa", "transformers"))
    assert all(hasattr(mapping[k], "__gproj_named__") for k in before if k != "gproj")  # wrapped while enabled
    model = AutoModelForCausalLM.from_config(copy.deepcopy(_configs()["llama"]), attn_implementation="gproj")
    gproj_patch.disable()
    assert mapping.keys() == before.keys() and all(mapping[k] is v for k, v in before.items())
    assert mapping["gproj"] is gproj_attention_forward
    ids, _, labels = _batch(False)
    model(input_ids=ids, labels=labels).loss.backward()  # no KeyError


def test_disable_leaves_a_gproj_entry_registered_again_after_enable(caplog):
    """Someone else's "gproj" registered after enable() stays after disable(), with a warning (as every other
    hook restores: by identity)."""
    from transformers.modeling_utils import AttentionInterface

    def theirs(*args, **kwargs):
        raise AssertionError("not called")
    AttentionInterface.register("gproj", theirs)
    try:
        with caplog.at_level("WARNING", logger="gproj_patch"):
            gproj_patch.disable()
        assert AttentionInterface._global_mapping["gproj"] is theirs
        assert any("AttentionInterface['gproj'] was registered again after enable()" in r.getMessage()
                   for r in caplog.records)
    finally:
        AttentionInterface._global_mapping.pop("gproj", None)
        from gproj_patch.hooks.transformers import register_name
        register_name()  # the name as `import gproj_patch` left it, for the tests after this one


def test_attention_dropout_in_training_keeps_the_fused_path():
    """HF attention dropout: the fused forward (and its own dropout mask) stays and its backward is PyTorch's —
    the same loss and gradients as without the patch. (On CPU SDPA runs dropout on its math backend, which the
    seam does not reach; on CUDA the fused op's backward is passed through with the reason counted.)"""
    cfg = copy.deepcopy(_configs()["llama"])
    cfg.attention_dropout = 0.1
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="gproj", dtype=torch.bfloat16).train()
    ids, mask, labels = _batch(False)
    torch.manual_seed(0)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    s = gproj_patch.stats()
    assert s["fp32"] == s["gproj"] == 0, s
    model.zero_grad()
    model.set_attn_implementation("sdpa")
    gproj_patch.disable()
    torch.manual_seed(0)
    ref = model(input_ids=ids, labels=labels).loss
    ref.backward()
    assert torch.equal(loss, ref)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


def test_enable_defers_transformers_until_its_modeling_code_is_imported():
    """enable() must not import Transformers (seconds, in every process that imports torch under GPROJ_PATCH=1);
    the "gproj" attention is registered the moment transformers.modeling_utils is imported."""
    import subprocess
    import sys
    code = (
        "import sys, torch, gproj_patch\n"
        "h = gproj_patch.enable()\n"
        "assert 'transformers' not in sys.modules, 'enable() imported transformers'\n"
        "print(h.installed['transformers'])\n"
        "from transformers import LlamaConfig, AutoModelForCausalLM\n"
        "cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
        "                  num_attention_heads=2, num_key_value_heads=1)\n"
        "m = AutoModelForCausalLM.from_config(cfg, attn_implementation='gproj')\n"
        "ids = torch.randint(0, 32, (1, 8))\n"
        "m(ids, labels=ids).loss.backward()\n"
        "print('registered', m.config._attn_implementation)\n"
        "gproj_patch.disable()\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "registers when transformers.modeling_utils is imported" in res.stdout
    assert "registered gproj" in res.stdout
