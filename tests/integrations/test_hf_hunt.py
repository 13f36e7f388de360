"""HF end-to-end paths found wanting by a bug hunt (tiny models from configs, CPU, no downloads)."""
import copy

import pytest
import torch

import gproj_patch
from gproj_patch.runtime.state import STATE

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

VOCAB, SEQ, LAYERS = 128, 24, 3
pytestmark = pytest.mark.usefixtures("patch_off", "one_thread")  # tests/conftest.py


def _model(impl: str, layers: int = LAYERS):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=torch.bfloat16)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return dict(input_ids=ids, labels=ids.clone())


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("impl", ["sdpa", "gproj"])
def test_auto_mode_under_gradient_checkpointing_same_gradients_one_step_per_step(impl, reentrant):
    """mode="auto" with HF gradient checkpointing. Before: with use_reentrant=False the first step raised
    torch's CheckpointError (the forward sampled the layer through the patched Function, the recomputation then
    took the policy's original-SDPA shortcut and saved other tensors); and each recomputation after a layer's
    backward started a new implicit step (LAYERS steps per training step: the detector sampled LAYERS times
    as often as ``sample_every`` says)."""
    batch, steps = _batch(), 3
    gproj_patch.enable(mode="auto", targets=("sdpa", "transformers"), sample_every=2)
    plain = _model(impl).train()
    want = [_step(plain, batch) for _ in range(steps)]
    samples = {name: rec["samples"] for name, rec in gproj_patch.policy.stats().items()}
    gproj_patch.reset_stats()
    model = _model(impl).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    for i in range(steps):
        got = _step(model, batch)
        assert STATE.step() == i, "one implicit step per training step"
        assert got.keys() == want[i].keys()
        assert all(torch.equal(got[n], want[i][n]) for n in got), "checkpointing changed the gradients"
    assert {name: rec["samples"] for name, rec in gproj_patch.policy.stats().items()} == samples
    assert len(samples) == LAYERS and set(samples.values()) == {(steps + 1) // 2}
