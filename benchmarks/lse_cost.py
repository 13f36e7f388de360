"""Cost of the LSE the SDPA hook recomputes under torch.compile (one device call; prints a table).

Compares, at B=2, H=16, S=4096, D=128 causal BF16 (median ms, triton.testing.do_bench): the Triton LSE kernel
(`triton_bwd.attention_lse`), the chunked FP32 pass it replaces (`autograd.lse_fp32`), cuDNN SDPA's forward
and the GProj backward; and checks the kernel's LSE against the fused forward's.
"""
import os
import sys

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gproj_patch import autograd  # noqa: E402
from gproj_patch.backends.triton_bwd import attention_lse, gproj_backward  # noqa: E402


def main():
    B, H, S, D = 2, 16, 4096, 128
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = D ** -0.5
    qi = q.clone().requires_grad_()
    out = F.scaled_dot_product_attention(qi, k, v, is_causal=True)
    fused_lse = autograd._find_lse(out.grad_fn)
    lse = attention_lse(q, k, scale=scale, causal=True)
    from gproj_patch.backends.spec import normalize_lse
    diff = float((lse - normalize_lse(fused_lse, B, H, S)).abs().max())
    rows = {
        "Triton LSE kernel": lambda: attention_lse(q, k, scale=scale, causal=True),
        "chunked FP32 LSE (before)": lambda: autograd.lse_fp32(q, k, None, True, scale),
        "cuDNN SDPA forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "GProj backward": lambda: gproj_backward(do, q, k, v, out.detach(), lse, scale=scale, causal=True),
    }
    print(f"LSE cost, {torch.cuda.get_device_name()}, torch {torch.__version__}, B,H,S,D={B},{H},{S},{D} causal")
    print(f"  max |LSE_triton - LSE_fused| = {diff:.3g}")
    for name, fn in rows.items():
        print(f"  {triton.testing.do_bench(fn, return_mode='median'):8.3f} ms  {name}")


if __name__ == "__main__":
    main()
