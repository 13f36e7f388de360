"""Is a whole-model ``torch.compile`` forward on HF's "flex_attention" bitwise unchanged by the patch? (H200)

A 2-layer Llama (hidden 256, 4 heads, 2 KV heads, BF16, seq 256, batch 2) compiled whole, one training step
(forward with labels, backward), logits compared patched vs unpatched, with Inductor's default numerics and with
``torch._inductor.config.emulate_precision_casts = True`` (every explicit cast rounds, whatever the fusion).
Run 17 (BENCHMARKS.md): default max |Δlogit| 0.0078, emulate_precision_casts bitwise equal; two unpatched
compiles, and with or without labels, are bitwise equal.

    PYTHONPATH=. python benchmarks/flex_compile_bits.py
"""
import torch
import torch._inductor.config as inductor_config
import transformers

import gproj_patch
from gproj_patch.integrations import flex as flex_hook


def build(layers=2, hidden=256, heads=4, kv_heads=2, seq=256, batch=2):
    """A Llama from a config on HF's "flex_attention", and token ids (seeded)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=seq)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="flex_attention",
                                                          dtype=torch.bfloat16).cuda()
    gen = torch.Generator("cuda").manual_seed(0)
    return model, torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=gen)


def compiled_step(model, ids):
    torch._dynamo.reset()
    out = torch.compile(model)(input_ids=ids, labels=ids)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return out.logits.detach().clone()


def main():
    model, ids = build()
    for emulate in (False, True):
        inductor_config.emulate_precision_casts = emulate
        gproj_patch.disable()
        flex_hook.uninstall()
        ref = compiled_step(model, ids)
        gproj_patch.enable()
        flex_hook.install()
        gproj_patch.reset_stats()
        got = compiled_step(model, ids)
        diff = (got.float() - ref.float()).abs().max().item()
        print(f"emulate_precision_casts={emulate}: bitwise equal {torch.equal(got, ref)}, max |dlogit| {diff:.3g}, "
              f"corrected backwards {gproj_patch.stats()['gproj']}", flush=True)
    gproj_patch.disable()


if __name__ == "__main__":
    main()
