"""Hooks into PyTorch SDPA, flash-attn, HF Transformers, the HF Trainer and interpreter start-up."""
