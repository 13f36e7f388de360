"""One process of the cuDNN dO-layout check (``test_gpu_integration.test_cudnn_do_layout_defect``): two cuDNN
SDPA backwards at one shape, dO laid out one way and then the other, each against fp64. PyTorch 2.11's cuDNN
backward caches its plan keyed on q/k/v only and built with the first call's dO strides, so unpatched the second
call reads dO wrongly. Prints one JSON line: the relative dq/dk/dv errors of both calls.

    python -m tests.hooks.cudnn_do_layout_probe {unpatched|patched|patched_late} {contiguous_first|view_first}

``patched``: ``enable(mode="auto")`` before any CUDA work (the seam builds every plan, dO in the output's
layout); ``patched_late``: the first backward runs unpatched, then ``enable(mode="auto")`` (the key's plan
predates the seam: its calls must take the corrected tier).
"""
import json
import sys

import torch
import torch.nn.functional as F

import gproj_patch
from gproj_patch.backends.reference import reference_backward
from gproj_patch.runtime.config import TIERS


def main(mode: str, order: str) -> None:
    if mode == "patched":
        gproj_patch.enable(mode="auto")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, S, D = 2, 8, 512, 64
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", generator=g, dtype=torch.float64) for _ in range(4))
    ref = reference_backward(q, k, v, do, causal=True)
    low = [t.to(torch.bfloat16) for t in (q, k, v, do)]
    layouts = ["contiguous", "view"] if order == "contiguous_first" else ["view", "contiguous"]
    errors = []
    for i, layout in enumerate(layouts):
        if mode == "patched_late" and i == 1:
            gproj_patch.enable(mode="auto")
        # q/k/v as an attention layer hands them over: (B, S, H, D) storage viewed as (B, H, S, D)
        leaves = [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in low[:3]]
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        grad = low[3].contiguous() if layout == "contiguous" else low[3].transpose(1, 2).contiguous().transpose(1, 2)
        out.backward(grad)
        errors.append({name: float((t.grad.double() - r).norm() / r.norm())
                       for name, t, r in zip(("dq", "dk", "dv"), leaves, ref)})
    print(json.dumps({"mode": mode, "order": order, "layouts": layouts, "errors": errors,
                      "stats": {t: gproj_patch.stats()[t] for t in TIERS}}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
