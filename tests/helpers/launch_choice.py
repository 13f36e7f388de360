"""Small inputs the tests of the per-call launch choice share (``tests/kernels/test_launch_choice.py``,
``test_kv_major.py``, ``test_dq_major.py``): CPU tensors for the predicates and the plan, and an fp16 causal SDPA
call that the kernel tier runs under Triton's interpreter."""
import torch


def qkv(sq=64, sk=64, d=128, dtype=torch.bfloat16, h=2, hkv=2):
    """(q, k, v, dO) on the CPU, seeded: v a copy of k, dO a copy of q (shapes are what the predicates read)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, sq, d, generator=g).to(dtype)
    k = torch.randn(1, hkv, sk, d, generator=g).to(dtype)
    return q, k, k.clone(), q.clone()


def sdpa_fp16_causal(seed=5):
    """(q, k, v, dO) fp16 1·2·24·16 with keys offset by 8: a causal call the interpreter runs quickly."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, 2, 24, 16, generator=g).to(torch.float16) for _ in range(4))
    return q, k + 8.0, v, do
