"""The record of one attention call, made once (at its forward, or by the SDPA seam in its backward op).

``CallRecord = (Problem, Context, BackwardPlan)``; the plan (``BackwardPlan``, defined here beside the record; made by ``plan.make_plan``) is made right after the record, still
at the forward. ``Problem`` is the math of the call (scale, causal and its alignment,
window, softcap, varlen offsets, the mask the kernel cannot take as flags, dropout, sink); ``Context`` is how
the patch was asked to run it (mode, tier option, layer name, source hook, policy options). Both are frozen and
built once, on the forward, from the arguments and the configuration active *then*: options changed and
``disable()`` called between a forward and its backward change nothing for that call, and the layer name is
the one whose scope was open at the forward.

Every hook makes one: at the forward, the flash-attn forward ops (FA2/FA3) and FA4's forward, HF eager and
flex; at the backward, the SDPA seam (``hooks/sdpa.py``), whose backward op has every argument a record
needs. ``Context`` holds no tensors (it is hashable).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from ..backends.compat import graph_task_id
from ..runtime import config as _config
from ..layers.scope import current_layer, layer_id
from ..policy import effective_config
from ..runtime.state import STATE

ALIGNMENTS = ("top_left", "bottom_right")


@dataclass(frozen=True)
class KernelPlan:
    """How the GProj kernel runs one backward."""
    kv_major: str                 # "gluon" | "tl": the kernel of the KV-major launch (dk, dv)
    kv_major_reason: Optional[str]  # why not the Gluon kernel (None when it runs); counted in stats()
    dq_major: str = "tl"          # "gluon" | "tl": the kernel of the dQ-major launch (dq, λ, the row scratch)
    dq_major_reason: Optional[str] = None  # why not the Gluon kernel there; counted in stats()


@dataclass(frozen=True)
class BackwardPlan:
    tier: str
    reason: Optional[str]
    kernel: Optional[KernelPlan]       # tier "gproj"
    fp32_kernel: Optional[KernelPlan]  # the FP32 tier's kernel form; None: the chunked recomputation
    layer: str
    step: int
    dense: Optional["BackwardPlan"] = None  # a padding mask that dO does not resolve: this plan instead
    error: Optional[str] = None  # the backward raises this (tier "triton" refused, known only at the backward)

    def __post_init__(self):
        if self.tier not in _config.TIERS:
            raise ValueError(f"plan tier must be one of {_config.TIERS}, got {self.tier!r}")


@dataclass(frozen=True, eq=False)
class Problem:
    scale: float
    causal: bool = False
    causal_align: str = "top_left"
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    attn_mask: Optional[torch.Tensor] = None     # a mask the kernel cannot take as flags (FP32 tier)
    padded: bool = False                         # attn_mask may be right/left padding around the flags
    dropout_p: float = 0.0
    dropout_mask: Optional[torch.Tensor] = None  # the fused forward's keep mask, recovered exactly
    sink: Optional[torch.Tensor] = None          # learnable per-head sink logits (H,)

    def __post_init__(self):
        if self.causal_align not in ALIGNMENTS:
            raise ValueError(f"causal_align must be one of {ALIGNMENTS}, got {self.causal_align!r}")

    @property
    def flags(self) -> dict:
        """The keyword arguments every backend takes for the mask pattern."""
        return dict(causal=self.causal, causal_align=self.causal_align, window=self.window, softcap=self.softcap,
                    cu_seqlens_q=self.cu_seqlens_q, cu_seqlens_k=self.cu_seqlens_k)


@dataclass(frozen=True)
class Context:
    mode: str
    tier_option: str
    layer: str
    source: str
    policy: _config.PolicyConfig = field(default_factory=_config.PolicyConfig)
    kv_major: str = "auto"  # the kernel tier's KV-major launch option (config.KV_MAJOR_OPTIONS)
    dq_major: str = "auto"  # the kernel tier's dQ-major launch option (config.DQ_MAJOR_OPTIONS)
    cpu_kernel: bool = False  # CPU tensors may run the kernel through Triton's interpreter (config.Config)
    # the backward runs inside a compiled graph, which CUDA-graph trees may warm up and capture: nothing the
    # backward allocates may outlive it (no launch that caches a tensor, no counter made there)
    in_graph: bool = False


@dataclass(frozen=True, eq=False)
class CallRecord:
    problem: Problem
    context: Context
    plan: Optional[BackwardPlan] = None  # made at the forward by plan.make_plan; the backward executes it


def forward_layer(layer: Optional[str] = None) -> str:
    """The layer of an attention forward running now: the open ``layer_scope``'s name, else ``layer``, else the
    step's next ``call{n}``; the forward is counted for the step (``state.forward_started``)."""
    STATE.forward_started(graph_task_id())  # a checkpoint's recomputation runs inside a backward
    return current_layer() or layer or layer_id()


def make_context(source: str, layer: Optional[str] = None, cfg: Optional[_config.Config] = None, *,
                 named: bool = False, in_graph: bool = False) -> Context:
    """The context of a call: the active configuration (else ``cfg``, else the environment's), and its layer.

    At a forward: ``forward_layer(layer)``. ``named``: ``layer`` is the call's name already — taken by the
    forward (``forward_layer``), or by a hook deciding in the backward op (the SDPA seam, FA2/FA3), where the
    scope a forward was in is not open any more and one open around ``loss.backward()`` names no call."""
    cfg = _config.active() or cfg or _config.resolve()
    name = layer if named else forward_layer(layer)
    return Context(mode=cfg.mode, tier_option=cfg.tier, layer=name, source=source,
                   policy=effective_config(cfg.policy), kv_major=cfg.kv_major, dq_major=cfg.dq_major,
                   cpu_kernel=cfg.cpu_kernel, in_graph=in_graph)
