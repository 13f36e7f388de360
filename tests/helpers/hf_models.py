"""A tiny HF Llama in the large-key regime, and each of its attention calls' gradients against the fp64 oracle.

``llama(impl)``: 2 layers, random init from a config, BF16, every layer's keys carrying a common offset far beyond
their spread (a ``k_proj`` bias on the lowest RoPE frequency, which RoPE barely rotates): there the unpatched BF16
attention gradient is off by several percent per call and the corrected one by a fraction of a percent.

``TokenDataset`` and ``trainer(...)``: a few CPU steps of a real ``transformers.Trainer`` on random tokens.

``spy_calls(mapping, key)``: replaces ``mapping[key]`` (a module's ``vars()`` holding ``eager_attention_forward``,
or HF's ``AttentionInterface._global_mapping``) by a spy that calls what was there and records each call's
inputs, keyword names and gradients (dq, dk through tensor hooks, dO through the output's); ``Call.errors()``
measures dq and dk against ``backends.reference.reference_backward`` on the same inputs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from gproj_patch.backends.reference import reference_backward
from tests.helpers.numerics import rel

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS = 128, 64, 4, 2, 2
KEY_OFFSET = 40.0   # the k_proj bias on the lowest RoPE frequency: about 100x the key spread of the random init


def llama(impl: str, *, dtype=torch.bfloat16, offset: float = KEY_OFFSET):
    """The tiny Llama (random init, seed 0) on ``attn_implementation=impl``, keys offset in every layer."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   num_key_value_heads=KV_HEADS, max_position_embeddings=64, attention_bias=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    hd = HIDDEN // HEADS
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.zero_()
            layer.self_attn.k_proj.bias[hd // 2 - 1::hd] = offset  # dim hd/2 - 1 of each KV head
    return model.to(dtype)


def token_batch(batch: int = 2, seq: int = 32, seed: int = 0) -> Dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


class TokenDataset(torch.utils.data.Dataset):
    """Random token rows (seed 0), each its own labels."""

    def __init__(self, n: int = 16, seq: int = 32):
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer(output_dir, model, callback, steps: int = 4):
    """A CPU Trainer over ``TokenDataset`` (batch 4, a log every 2 steps, no reporters, no checkpoints)."""
    import transformers
    args = transformers.TrainingArguments(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=4,
                                          logging_steps=2, report_to=[], save_strategy="no", use_cpu=True,
                                          disable_tqdm=True, learning_rate=1e-4, dataloader_num_workers=0)
    return transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[callback])


@dataclass(eq=False)
class Call:
    """One attention call: its inputs (detached), mask, scale, keyword names and the gradients it received."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    scale: float
    keywords: tuple
    none_means_causal: bool
    grads: Dict[str, torch.Tensor] = field(default_factory=dict)

    def oracle(self):
        """(dq, dk, dv) in fp64 for the math of this call: the mask's visible keys (HF's additive eager mask:
        0 where visible; a boolean SDPA mask as it is), or causal where no mask was built and the function then
        is causal (HF's SDPA convention)."""
        kw = {}
        if self.mask is None:
            kw["causal"] = self.none_means_causal
        else:
            kw["attn_mask"] = self.mask if self.mask.dtype == torch.bool else self.mask == 0
        return reference_backward(self.q, self.k, self.v, self.grads["do"].transpose(1, 2), scale=self.scale, **kw)

    def errors(self) -> Dict[str, float]:
        want = self.oracle()
        return {"dq": rel(self.grads["dq"], want[0]), "dk": rel(self.grads["dk"], want[1])}


@contextlib.contextmanager
def spy_calls(mapping: dict, key: str, *, none_means_causal: bool):
    """Record every call of ``mapping[key]`` while the block runs (the entry restored afterwards)."""
    inner = mapping[key]
    calls: List[Call] = []

    def spy(module, query, key_states, value, attention_mask, *args, **kwargs):
        call = Call(query.detach(), key_states.detach(), value.detach(), attention_mask,
                    float(kwargs.get("scaling") or module.scaling), tuple(kwargs), none_means_causal)
        for name, t in (("dq", query), ("dk", key_states)):
            if t.requires_grad:
                t.register_hook(lambda g, name=name: call.grads.__setitem__(name, g.detach()))
        out, weights = inner(module, query, key_states, value, attention_mask, *args, **kwargs)
        if out.requires_grad:
            out.register_hook(lambda g: call.grads.__setitem__("do", g.detach()))
        calls.append(call)
        return out, weights

    mapping[key] = spy
    try:
        yield calls
    finally:
        if mapping.get(key) is spy:
            mapping[key] = inner
