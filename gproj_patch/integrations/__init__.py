"""Hooks into PyTorch SDPA, flash-attn, FlexAttention, HF Transformers, the HF Trainer and interpreter start-up
(one module per library; ``restore.py``: how every hook puts the original back at ``disable()``)."""
