"""The GProj attention backward as Triton kernels (bf16/fp16 inputs, fp32 accumulation; fp32 inputs for the FP32 tier).

``gproj_backward(do, q, k, v, o, lse, ...)`` returns (dq, dk, dv) in the input dtype. With r = low(P) (the
operand a fused backward already forms for dV), t = low(dS), ρ_i = Σ_j t_ij, m_i = Σ_j r_ij, λ_i = ρ_i / m_i:

    dq_i = α ( Σ_j t_ij k_j − λ_i Σ_j r_ij k_j )
    dk_j = α ( Σ_i t_ij q_i − Σ_i low(λ_i r_ij) q_i )       (dk_form "two_product", the paper's form)
        or α Σ_i low(P_ij (dP_ij − D_i − λ_i)) q_i          (dk_form "fused": one product, re-rounded)
    dv_j = Σ_i r_ij dO_i

The default is "fused" (``DEFAULT_DK_FORM``): on the H200 suite both forms are within 0.25% of fp64 on every
gauge case, the fused form is one product cheaper (×1.36–1.62 of cuDNN against ×1.51–1.77), and on rows with
P == 1 the two-product form loses the sink key's gradient (dk 47% vs 0.6%: low(t) and low(λr) round to the
same value there). See BENCHMARKS.md.

``t − λr`` is never rounded again: the dq correction is applied to the fp32 accumulators, the two-product dk
subtracts a second product, and the fused dk rounds the fp32 value P∘(dP − D − λ) once (it never rounds a
combination of already-rounded t and r). ``correct=False``
runs the same kernels without the r·K product, the row sums and λ: a standard fused backward, for
measurement.

**Where D comes from.** D_i = Σ_d dO_id O_id is computed (fp32) from the *saved low-precision output*, as
every fused backward does (FA's preprocess). Recomputing it as Σ_j P_ij dP_ij would need a whole extra pass
over the keys before the dq pass. The saved-output D carries a rounding error that is a multiple of p_i
per row (the "forward channel"); the projection removes exactly such multiples, so after GProj it costs
nothing — this is why the cheap form is safe here and is not safe in an uncorrected kernel. (With a sink the
target P_sink·D carries the same error: P_sink·(D_saved − D) stays in the row sum, one rounding of O relative
to the target itself.)

**Structure.** Two launches (``triton_kernels.py``): a dQ-major kernel (first D and a base-2 LSE of its rows,
-inf rows made +inf so that fully masked rows get exactly zero gradients; then dq, and λ written to an fp32
(B·H·S) scratch; the row sums ρ, m are dots with a one-hot matrix so they run on the tensor cores), and a
KV-major kernel (dk, dv, reading D, the LSE and λ). Extra memory: three fp32 (B·H·Sq) buffers (D, LSE, λ; a fourth, T, with a
sink) — never O(S²).

**Features.** bf16 and fp16; every head dim 1..256 (padded to a power of two inside the kernel; head dims
below 16 are zero-padded to 16 on the host first, ``pad_head_dim``; block configs are tuned per padded size
in ``configs.TL_CONFIGS`` and ``configs.block_config`` picks the nearest tuned one for a size without its own
entry); any lengths, Sq ≠ Sk; ``causal`` with
``causal_align`` "top_left" (SDPA) or "bottom_right" (flash-attn); sliding ``window=(left, right)``; GQA/MQA
(the KV-major program loops over the query heads of its group: dk/dv are reduced in registers, K/V are never
copied); varlen (B = 1 with ``cu_seqlens_q/k``; ``max_seqlen_*`` avoid a device sync); arbitrary strides on
every input, LSE (B, H, S) fp32 any strides (any layout ``spec.normalize_lse`` accepts is read through it).
The kernels use no atomics, so results are bitwise deterministic; ``deterministic=True`` is accepted and
changes nothing.

**Softcap** (c > 0, score = c·tanh(α q·k / c)). The conservation law Σ_j g_ij = 0 holds for the gradient
with respect to the *capped* score, g = P∘(dP − D), before the tanh derivative τ' = 1 − tanh² multiplies it;
the rounded operand is t = low(g∘τ'), whose row sum is not zero even exactly. So the row mass is measured
in capped-score units and the correction goes through the same τ' (the emulation's form, emulation.py):
ρ = Σ_j t_j/τ'_j (g_j where τ'_j = 0; an fp32 ALU row sum, the one reduction not on the tensor cores),
m = Σ r, w = low(r∘τ'), dq = α(tK − λ·wK), dk = α(tᵀQ − low(λw)ᵀQ) or α·low((g − λP)∘τ')ᵀQ. With a softcap
there is no exact gauge symmetry (tanh is not translation-equivariant): this reduces the rounding bias, it
does not restore an invariance. tanh is computed from exp2 (no libdevice, so the interpreter runs it too).

**Learnable sinks** (``sink``, shape (Hq,), fp32 or the input dtype; ``spec.py``). The LSE given must be the
forward's, which includes the sink, so P = exp(S − LSE) already sums to 1 − P_sink over the keys and the exact
row sum of dS is T_i = P_sink,i·D_i. The dQ-major kernel computes T (fp32, D from the saved output as above)
and uses λ = (ρ − T)/m; dk and dv need nothing else (they read λ). The sink's gradient
dsink_h = −Σ_{b,i} T_i is a reduction of T in PyTorch over a fixed shape (deterministic; varlen rows past the
last sequence excluded). The result is then (dq, dk, dv, dsink), dsink shaped and typed like ``sink``.
Softcap with a sink is refused (``spec.SINK_SOFTCAP_REASON``).

**FP32 inputs** (``fp32=True`` in ``kernel_unsupported_reason``; the FP32 tier's kernel form, ``router``): the
same kernels on fp32 tensors, every product at ``configs.FP32_DOT_PRECISION`` (3×TF32: fp32-level accuracy),
t = dS and r = P unrounded, block configs from ``configs.TL_CONFIGS_FP32``. The projection then removes what the
saved output's rounding puts into D (a multiple of P per row, see above), so low-precision saved O and LSE give
fp32-accurate gradients.

**Shards of a row** (``spec.shard_mass_tolerance``, math.md §8): a row whose keys' mass Σ low(P) misses its LSE's
1 − P_sink (a ring's per-shard call) is not projected (λ = 0); ``partial_rows`` counts such rows.

**Not supported** (``kernel_unsupported_reason`` says so; callers fall back to the FP32 tier): ``attn_mask``,
dropout, fp64 inputs (fp32 only with ``fp32=True``), head dim > 256, bf16 under the Triton interpreter (its bf16 is wrong, docs/design.md §4),
a sink of the wrong shape, dtype or device, softcap with a sink.

**CPU.** CPU fp16/fp32 tensors run the same kernels through Triton's interpreter (slow; meant for CI): always
for an explicit ``gproj_backward`` call; for the patch's backwards where the call's plan says so
(``cpu_kernel``: tier "triton" or TRITON_INTERPRET when ``enable()`` resolved the options). Nothing here reads
the environment. The interpreted copy of the kernels is loaded separately (``compat.load_interpreted_module``),
so this works whatever order triton was imported in.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Optional, Tuple

import torch

from . import triton_launch
from .compat import load_interpreted_module, triton_interpreter_index_patch
from .configs import MAX_HEAD_DIM, MIN_BLOCK_D, block_d, dot_precision, launch_configs
from .spec import (MASK_KWARGS, MAX_SEQLEN_KWARGS, VARLEN_KWARGS, MaskArgs, MaskSpec, Varlen, default_scale,
                   normalize_lse, sink_unsupported_reason, split_keywords, validate_cu_seqlens, validate_qkv)

try:  # pragma: no cover - import guard
    import triton  # noqa: F401
    _HAS_TRITON = True
except Exception:  # pragma: no cover
    _HAS_TRITON = False

DK_FORMS = ("two_product", "fused")
#: the kernels of each launch (dQ-major, KV-major): the portable tl kernel, the warp-specialized sm_90a Gluon one
LAUNCH_KERNELS = ("tl", "gluon")
#: dk form used when none is asked for (chosen on the H200 suite, see BENCHMARKS.md)
DEFAULT_DK_FORM = "fused"

#: CUDA's limit on a launch grid's y and z sizes (the kernels put heads, batch and batch·heads there)
GRID_YZ_MAX = 65535
#: tests and benchmarks set this to fill dense outputs with NaN before the launch (checks every element is written)
_POISON_OUTPUTS = False
#: launches to run (benchmarks time the kernels one at a time by removing the others; results then invalid)
_RUN = ("dq", "dkdv")
#: bounded cache: registers / spills of the last compiled launch, one entry per launch kind ("dq", "dkdv",
#: "kv_major"), overwritten by each backward (for the benchmarks' notes)
LAST_KERNELS: dict = {}

_lock = threading.Lock()
#: bounded cache: the kernel files, loaded once each as a compiled and an interpreted copy (at most 2 × 2)
_modules = {}


def kernel_module(interpret: bool, source: str = "triton_kernels"):
    """The kernel module ``source`` (a file of this folder), compiled (CUDA) or interpreted (CPU tensors), each
    loaded once with its helper files in the same mode, as ``gproj_patch.backends._cuda.<source>`` or
    ``._interp.<source>`` (``compat.load_interpreted_module``)."""
    key = ("interp" if interpret else "cuda", source)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            path = os.path.join(os.path.dirname(__file__), f"{source}.py")
            mod = _modules[key] = load_interpreted_module(f"gproj_patch.backends._{key[0]}.{source}", path, interpret)
        return mod


def pad_head_dim(x: torch.Tensor) -> torch.Tensor:
    """``x`` zero-padded to MIN_BLOCK_D along the head dim. Head dims below 16 run the kernels on such copies:
    ptxas of Triton 3.6 (sm_90a) segfaulted compiling the masked 16-wide tiles of D = 1 and D = 8 on the
    H200, while D = 16 compiled and passed. Zero columns change no score q·k, no dP = dO·v and no D = dO·O;
    their gradients are dropped. The copies are small: D < 16."""
    return torch.nn.functional.pad(x, (0, MIN_BLOCK_D - x.shape[-1]))


def kernel_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
                              attn_mask=None, softcap: float = 0.0, sink=None, fp32: bool = False,
                              cpu_kernel: bool = False, **_ignored) -> Optional[str]:
    """None when ``gproj_backward`` handles these inputs; otherwise a short reason for the fallback log.

    The single predicate of the kernel tier: every head dim 1..256, bf16/fp16, CUDA (or CPU fp16 under the
    interpreter), and a ``sink`` (if any) of shape (Hq,), fp32 or the input dtype, on q's device, without a
    softcap. ``fp32=True`` asks about the FP32 tier's form instead: the kernels run on fp32 copies of these
    inputs (bf16/fp16/fp32; any of them under the interpreter, whose fp32 is exact). ``cpu_kernel``: the caller
    lets CPU tensors run through Triton's interpreter (the plan's decision, from the options; never read from
    the environment here)."""
    if not _HAS_TRITON:
        return "no triton"
    if attn_mask is not None:
        return "attn_mask"
    if dropout_p and dropout_p > 0.0:
        return "dropout"
    if q.dtype not in ((torch.float16, torch.bfloat16, torch.float32) if fp32 else (torch.float16, torch.bfloat16)):
        return f"dtype={str(q.dtype).replace('torch.', '')}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "mixed dtypes"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "not 4-D"
    d = q.shape[-1]
    if d > MAX_HEAD_DIM or k.shape[-1] != d or v.shape[-1] != d:
        return f"head_dim={d}" if d > MAX_HEAD_DIM else "head dims differ"
    if d < 1:
        return f"head_dim={d}"
    if q.shape[0] * q.shape[1] > GRID_YZ_MAX:
        return f"batch·heads = {q.shape[0] * q.shape[1]} > {GRID_YZ_MAX} (CUDA grid limit)"
    sink_reason = sink_unsupported_reason(sink, q, softcap=float(softcap))
    if sink_reason is not None:
        return sink_reason
    if q.device.type == "cuda":
        return None
    if q.device.type == "cpu":
        if not cpu_kernel:
            return "cpu tensor without GPROJ_TIER=triton/TRITON_INTERPRET=1"
        if q.dtype == torch.bfloat16 and not fp32:
            return "bfloat16 under the Triton interpreter (inexact)"
        return None
    return f"device={q.device.type}"


@dataclass(frozen=True, eq=False)
class KernelOptions:
    """``gproj_backward``'s choices besides the mask kwargs, each accepted as a keyword of the same name:
    ``correct`` (False: the same kernels without the projection, for measurement), ``deterministic``
    (accepted, changes nothing: the kernels use no atomics), ``dk_form`` (None: ``DEFAULT_DK_FORM``),
    ``kv_major``, ``dq_major`` (the launches' kernels), and three overrides for tests and benchmarks: ``_config``
    ({"dq"|"dkdv": (BLOCK_M, BLOCK_N, warps, stages)}), ``_gluon_config`` (a ``configs.KernelConfig``) and
    ``_gluon_dq_config`` (a ``configs.DqConfig``)."""
    correct: bool = True
    deterministic: bool = False
    dk_form: Optional[str] = None
    kv_major: Optional[str] = None
    dq_major: Optional[str] = None
    _config: Optional[dict] = None
    _gluon_config: Optional[object] = None
    _gluon_dq_config: Optional[object] = None


#: the keywords ``KernelOptions`` is made of
KERNEL_OPTIONS = tuple(f.name for f in fields(KernelOptions))


def gproj_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, *, sink: Optional[torch.Tensor] = None,
                   partial_rows: Optional[torch.Tensor] = None, **mask_and_options):
    """GProj backward of attention: (dq, dk, dv) in the input dtype. See the module docstring.

    Shapes follow ``spec.py``: q, o, do (B, Hq, Sq, D); k, v (B, Hkv, Sk, D); any strides; lse the
    forward's natural-log LSE in any layout ``spec.normalize_lse`` reads (normally (B, Hq, Sq) fp32).
    ``mask_and_options``: the mask kwargs (``spec.MASK_KWARGS`` and ``spec.MAX_SEQLEN_KWARGS``) and the
    keywords of ``KernelOptions``. ``dk_form`` ("two_product" | "fused") picks the dk contraction (default
    ``DEFAULT_DK_FORM``). ``sink`` (Hq,): the learnable sink logits the forward's LSE includes; the result is then
    (dq, dk, dv, dsink), dsink shaped and typed like ``sink`` (module docstring).
    ``kv_major`` / ``dq_major`` pick the KV-major / dQ-major launch: "gluon" (the warp-specialized sm_90a kernels,
    ``gluon_bwd`` / ``gluon_dq``) or "tl" (also for None); choosing per call is the plan's
    (``plan.kv_major_choice``, ``plan.dq_major_choice``).
    ``partial_rows``: an int32 tensor of one element on q's device, to which the kernel adds the number of rows
    it found to be shards of a row (their keys' mass short of the LSE's, ``spec.shard_mass_tolerance``: not
    projected, see the module docstring); nothing is added for rows that saw no key.
    Raises ValueError when ``kernel_unsupported_reason`` is not None, or "gluon" is asked for and not possible.
    """
    mask_kw, option_kw = split_keywords("gproj_backward", mask_and_options, MASK_KWARGS + MAX_SEQLEN_KWARGS,
                                        KERNEL_OPTIONS)
    args = MaskArgs.from_kwargs("gproj_backward", mask_kw, max_seqlen=True)
    options = KernelOptions(**option_kw)
    mask = MaskSpec(causal=bool(args.causal), causal_align=args.causal_align,
                    window=tuple(int(w) for w in args.window), softcap=float(args.softcap))
    # an explicit call of the kernel: CPU tensors run through the interpreter (fp16/fp32; its bf16 is refused)
    reason = kernel_unsupported_reason(q, k, v, softcap=args.softcap, sink=sink, fp32=q.dtype == torch.float32,
                                       cpu_kernel=True)
    if reason is not None:
        raise ValueError(f"gproj_backward cannot run these inputs: {reason}")
    validate_qkv(q, k, v, ("o", o), ("do", do), check_finite=False)
    if partial_rows is not None and not (isinstance(partial_rows, torch.Tensor) and partial_rows.numel() == 1
                                         and partial_rows.dtype == torch.int32 and partial_rows.device == q.device):
        raise ValueError("partial_rows must be an int32 tensor of one element on q's device")
    # imported here, not at module level: gluon_bwd imports torch, whose import hook may load this module
    # (backends/ops.py) while gluon_bwd is still initializing
    from .gluon_dq import checked_kernels
    dq_major, kv_major = checked_kernels(q, k, v, do, mask, args.varlen, options)
    return _launch_backward(do, q, k, v, o, lse, scale=args.scale, mask=mask, varlen=args.varlen,
                            options=replace(options, dq_major=dq_major, kv_major=kv_major), sink=sink,
                            partial_rows=partial_rows)


def launch_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                    lse: torch.Tensor, *, scale: Optional[float], mask: MaskSpec, sink: Optional[torch.Tensor] = None,
                    partial_rows: Optional[torch.Tensor] = None, **varlen_and_options):
    """``gproj_backward`` for inputs its caller already checked, options by keyword (tests and benchmarks; the
    router runs a call's plan through ``launch_planned``). Decides nothing: the kernels run where the tensors are
    (compiled on CUDA, interpreted on CPU) with ``kv_major`` and ``dq_major`` as given ("tl" when not given).
    ``varlen_and_options``: the keywords of ``spec.Varlen`` and of ``KernelOptions``."""
    varlen_kw, option_kw = split_keywords("launch_backward", varlen_and_options, VARLEN_KWARGS, KERNEL_OPTIONS)
    options = KernelOptions(**{"kv_major": "tl", "dq_major": "tl", **option_kw})
    return _launch_backward(do, q, k, v, o, lse, scale=scale, mask=mask, varlen=Varlen(**varlen_kw),
                            options=options, sink=sink, partial_rows=partial_rows)


#: the options of a planned backward (``launch_planned``): the defaults with each (dQ-major, KV-major) pair of
#: kernels, built once
PLANNED_OPTIONS = MappingProxyType({(dq, kv): KernelOptions(dq_major=dq, kv_major=kv)
                                    for dq in LAUNCH_KERNELS for kv in LAUNCH_KERNELS})


def launch_planned(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, *, scale: Optional[float], mask: MaskSpec, varlen: Varlen,
                   kernels: Tuple[str, str], sink: Optional[torch.Tensor] = None,
                   partial_rows: Optional[torch.Tensor] = None):
    """``launch_backward`` as the router runs a call's plan: the mask and the varlen offsets already grouped, the
    options the defaults with the planned (dQ-major, KV-major) ``kernels`` (``PLANNED_OPTIONS``), so no keyword is
    split and no options object built per call. Checks nothing the plan checked; decides nothing."""
    return _launch_backward(do, q, k, v, o, lse, scale=scale, mask=mask, varlen=varlen,
                            options=PLANNED_OPTIONS[kernels], sink=sink, partial_rows=partial_rows)


def _launch_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                     lse: torch.Tensor, *, scale: Optional[float], mask: MaskSpec, varlen: Varlen,
                     options: KernelOptions, sink: Optional[torch.Tensor], partial_rows: Optional[torch.Tensor]):
    """``launch_backward`` with its keywords grouped (``gproj_backward`` calls it with the checked options)."""
    B, H, SQ, D = q.shape
    SK = k.shape[2]
    if D < MIN_BLOCK_D:  # zero-padded on the host (see pad_head_dim); outputs back at width D, like q, k, v
        padded_kv_major = "tl" if options.kv_major == "gluon" else options.kv_major
        grads = _launch_backward(
            *(pad_head_dim(x) for x in (do, q, k, v, o)), lse, scale=default_scale(D, scale), mask=mask,
            varlen=varlen, options=replace(options, kv_major=padded_kv_major, dq_major="tl"), sink=sink,
            partial_rows=partial_rows)
        narrow = tuple(torch.empty_like(x).copy_(g[..., :D]) for x, g in zip((q, k, v), grads))
        return narrow + tuple(grads[3:])
    cu_seqlens_q, cu_seqlens_k = varlen.cu_seqlens_q, varlen.cu_seqlens_k
    max_seqlen_q, max_seqlen_k = varlen.max_seqlen_q, varlen.max_seqlen_k
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    if cu_seqlens_q is not None and B != 1:
        raise ValueError(f"varlen inputs must have batch 1, got {B}")
    if cu_seqlens_q is not None and (max_seqlen_q is None or max_seqlen_k is None or q.device.type == "cpu"):
        validate_cu_seqlens(cu_seqlens_q, cu_seqlens_k, B, SQ, SK)  # syncs; skipped on GPU with max_seqlen
    dk_form = DEFAULT_DK_FORM if options.dk_form is None else options.dk_form
    if dk_form not in DK_FORMS:
        raise ValueError(f"dk_form must be one of {DK_FORMS}, got {dk_form!r}")
    if o.dtype != q.dtype or do.dtype != q.dtype:
        o = o.to(q.dtype)
        do = do.to(q.dtype)
    lse = normalize_lse(lse, B, H, SQ)

    interpret = q.device.type != "cuda"
    packed = cu_seqlens_q is not None
    if packed:
        cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
        cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
        nseq = cu_q.numel() - 1
        if max_seqlen_q is None:
            max_seqlen_q = int((cu_q[1:] - cu_q[:-1]).max().item()) if nseq > 0 else 0
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_k[1:] - cu_k[:-1]).max().item()) if nseq > 0 else 0
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        Z, MQ, MK = nseq, max_seqlen_q, max_seqlen_k
    else:
        cu_q = cu_k = q  # a placeholder pointer: without VARLEN the kernels never read it (no allocation per call)
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        if _POISON_OUTPUTS:
            for x in (dq, dk, dv):
                x.fill_(float("nan"))
        Z, MQ, MK = B, SQ, SK
    if Z == 0:
        return (dq, dk, dv) if sink is None else (dq, dk, dv, torch.zeros_like(sink))

    # window form of the mask: key j visible from query i iff diag-left <= j <= diag+right, diag = i + shift
    left, right = mask.window
    if mask.causal:
        right = 0
    cfg_dq, cfg_dkdv = launch_configs(D, q.dtype, interpret, options._config)
    job = triton_launch.Launch(
        do=do, q=q, k=k, v=v, o=o, lse=lse, dq=dq, dk=dk, dv=dv, sink=sink, cu_q=cu_q, cu_k=cu_k, varlen=packed,
        n_problems=Z, max_q=MQ, max_k=MK, window=(left, right), bottom_right=mask.causal_align == "bottom_right",
        alpha=default_scale(D, scale), softcap=float(mask.softcap), correct=bool(options.correct),
        fused=dk_form == "fused", cfg_dq=cfg_dq, cfg_dkdv=cfg_dkdv,
        dot_precision=dot_precision(q.dtype), kv_major=options.kv_major,
        gluon_config=options._gluon_config, dq_major=options.dq_major or "tl",
        gluon_dq_config=options._gluon_dq_config, partial_rows=partial_rows)
    with (triton_interpreter_index_patch() if interpret else contextlib.nullcontext()):
        target = _launch(kernel_module(interpret), interpret, job)
    if sink is None:
        return dq, dk, dv
    return dq, dk, dv, triton_launch.sink_gradient(target.view(B, H, SQ), job)


def _launch(km, interpret: bool, job) -> torch.Tensor:
    """The launches of one backward (``triton_launch.launch``), with the parts ``_RUN`` names."""
    return triton_launch.launch(km, interpret, job, block_d=block_d(job.q.shape[-1]), parts=_RUN,
                                last_kernels=LAST_KERNELS)
