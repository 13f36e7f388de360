"""Model side of ``python -m benchmarks.training``: the run's configuration, the Llama built from a config, the
induced key offset, the loss under BF16 autocast.

The key offset (why: see ``benchmarks/training/__main__.py``'s docstring): a frozen ``k_proj`` bias on the
lowest-frequency RoPE pair of every KV head (coordinates D/2−1 and D−1 in HF's rotate-half layout),
‖b‖ = ``offset_rk`` times the layer's key spread RMS_j ‖k_j − mean key‖ measured at init on the first batch
(pre-RoPE, averaged over sequences and KV heads), so R_k ≈ ``offset_rk`` at step 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from benchmarks.training import data

ARM_MODES = {"unpatched": None, "gproj": "gproj", "auto": "auto", "fp32": "fp32"}
HEAD_DIM = 64


@dataclass
class RunConfig:
    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 2048
    seq: int = 512
    batch: int = 32
    max_steps: int = 3000
    time_budget: float = 300.0       # seconds of the lockstep training loop (checked between blocks)
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    beta2: float = 0.95
    clip: float = 1.0
    rope_theta: float = 5e5
    offset_layers: Tuple[int, ...] = (2, 5)
    offset_rk: float = 4096.0
    eval_every: int = 50
    eval_batches: int = 8
    checkpoint_every: int = 250
    sample_every: int = 10
    oracle_seqs: int = 4
    max_bytes: Optional[int] = None
    seed: int = 0
    arms: Tuple[str, ...] = tuple(ARM_MODES)
    device: str = "cuda"


SMALL = dict(layers=3, hidden=128, heads=2, kv_heads=1, intermediate=256, seq=128, batch=4, max_steps=12,
             time_budget=30.0, warmup=4, eval_every=4, eval_batches=2, checkpoint_every=8, sample_every=4,
             offset_layers=(1,), oracle_seqs=2, max_bytes=1 << 20)


def build_model(cfg: RunConfig, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    hf = LlamaConfig(vocab_size=data.VOCAB, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                     num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                     head_dim=HEAD_DIM, max_position_embeddings=cfg.seq, attention_bias=False,
                     rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                     tie_word_embeddings=False)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(hf)
    model.config._attn_implementation = "sdpa"
    return model.to(device)


def key_spread(model: torch.nn.Module, layer: int, ids: torch.Tensor) -> float:
    """RMS_j ‖k_j − mean key‖ of ``layer``'s k_proj output (pre-RoPE), averaged over sequences and KV heads."""
    seen = {}
    proj = model.model.layers[layer].self_attn.k_proj
    hook = proj.register_forward_hook(lambda m, i, o: seen.__setitem__("k", o.detach().float()))
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    k = seen["k"]
    k = k.view(k.shape[0], k.shape[1], -1, HEAD_DIM).transpose(1, 2)  # (B, Hkv, S, D)
    return (k - k.mean(2, keepdim=True)).pow(2).sum(-1).mean().sqrt().item()


def induce_key_offset(model: torch.nn.Module, cfg: RunConfig, ids: torch.Tensor) -> Dict[str, object]:
    """Frozen k_proj bias on the lowest-frequency RoPE pair of every KV head of ``cfg.offset_layers``."""
    info = {"layers": list(cfg.offset_layers), "target_r_k": cfg.offset_rk, "spread": {}, "bias_norm": {}}
    pair = (HEAD_DIM // 2 - 1, HEAD_DIM - 1)
    for layer in cfg.offset_layers:
        spread = key_spread(model, layer, ids)
        proj = model.model.layers[layer].self_attn.k_proj
        bias = torch.zeros(proj.out_features, device=proj.weight.device)
        per_coord = cfg.offset_rk * spread / 2 ** 0.5  # two coordinates: ‖b‖ = offset_rk · spread per KV head
        for c in pair:
            bias[c::HEAD_DIM] = per_coord
        proj.bias = torch.nn.Parameter(bias, requires_grad=False)
        info["spread"][layer] = spread
        info["bias_norm"][layer] = per_coord * 2 ** 0.5
    return info


def lm_loss(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return loss, logits
