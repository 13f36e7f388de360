"""What the FlexAttention hook tests share (tests/integrations/test_flex.py, test_flex_reach.py): the accuracy
target, torch's ``flex_attention`` as bound before any hook is installed, a causal mask_mod, block masks, the
audit's cases as inputs and the check of gradients against the fp64 oracle.

Import after ``pytest.importorskip("torch.nn.attention.flex_attention")``."""
import torch
from torch.nn.attention import flex_attention as fam

from gproj_patch.audit.cases import get_case

from .numerics import rel

TARGET = 5e-3  # the project's accuracy bar: dq, dk, dv within 0.5% of fp64
UNPATCHED = fam.flex_attention  # bound at import, before any install(): the hook swaps this function's code
ORIGINAL_CODE = UNPATCHED.__code__


def causal(b, h, q_idx, kv_idx):
    """The causal mask_mod (top-left aligned), module-level so the hook can recognise it."""
    return q_idx >= kv_idx


def block_mask(mask_mod, sq, sk, B=None, H=None, device="cpu"):
    """``create_block_mask`` of ``mask_mod`` for an sq × sk problem."""
    return fam.create_block_mask(mask_mod, B, H, sq, sk, device=device)


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A fresh leaf with the values of ``t`` that requires grad."""
    return t.detach().clone().requires_grad_()


def case_inputs(name, dtype=torch.bfloat16, device="cpu"):
    """The audit case ``name``'s quick inputs (seed 0)."""
    return get_case(name).build(seed=0, dtype=dtype, device=device, quick=True)


def check(grads, ref):
    """dq, dk, dv each within TARGET of the oracle's; returns the three errors."""
    errs = [rel(g, r) for g, r in zip(grads, ref[:3])]
    assert max(errs) < TARGET, errs
    return errs
