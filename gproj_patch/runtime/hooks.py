"""The registry of hook targets: one row per target, the only place a target is named.

``enable()`` installs the rows the options select, in this order, by importing each row's module and calling its
``install() -> str`` ("installed" or "skipped: <why>"); ``disable()`` calls ``uninstall()`` in reverse order. A
new target is one row here and one module under ``hooks/`` with those two functions (its interception
and its corrected backward; see ARCHITECTURE.md). ``GPROJ_TARGETS`` / ``targets=`` accept exactly these names,
and the README's "What it reaches" table lists them (a contract test checks both).

The modules are named, not imported: this module imports nothing, so the options (``runtime/config.py``) can
validate target names without importing torch's or the libraries' hooks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class HookTarget:
    name: str      # the value of GPROJ_TARGETS / enable(targets=...)
    module: str    # the module that installs it: install() -> str, uninstall() -> None
    seam: str      # where the call is caught
    reaches: str   # which callers that reaches


HOOKS: Tuple[HookTarget, ...] = (
    HookTarget("sdpa", "gproj_patch.hooks.sdpa",
               "a Python kernel at the AutogradCUDA/AutogradCPU key of SDPA's fused backward ops",
               "every caller of SDPA's fused kernels, eager or compiled, varlen_attn, DTensor's local calls"),
    HookTarget("flash_attn", "gproj_patch.hooks.flash_attn",
               "FA2/FA3 backward ops' CUDA kernels re-registered (forward untouched); FA4's functions proxied",
               "every FlashAttn*Func, HF flash_attention_2/3, names bound at import"),
    HookTarget("transformers", "gproj_patch.hooks.transformers",
               'the "gproj" entry of HF\'s AttentionInterface; the other entries wrapped for layer names',
               'attn_implementation="gproj"; one layer name per module on every implementation'),
    HookTarget("hf_eager", "gproj_patch.hooks.hf_eager",
               "each modeling module's eager_attention_forward wrapped",
               'attn_implementation="eager", output_attentions=True'),
    HookTarget("flex", "gproj_patch.hooks.flex",
               "the code of torch's flex_attention swapped in place; HF's flex_attention entry",
               "every binding of flex_attention, compiled or not, and HF's flex"),
    HookTarget("context_parallel", "gproj_patch.hooks.context_parallel",
               "PyTorch's ring-attention backward replaced (installed when its module is imported)",
               "context_parallel and torchtitan's CP over flash / efficient / cuDNN and the CPU flash op"),
)

#: the target names, in install order
TARGETS: Tuple[str, ...] = tuple(h.name for h in HOOKS)
