"""The backends the audit runs (``python -m gproj_patch audit``): each computes (dq, dk, dv) for one suite case.

On any device: the rounding-exact emulation of a fused low-precision backward (uncorrected, GProj), the FP32 tier
(with and without the projection), PyTorch's SDPA backends; on CUDA also flash-attn when importable and the
GProj Triton kernel, which also runs on a CPU in fp16 through Triton's interpreter where the environment lets the
patch run it there (``triton_cpu_kernel``). ``available_backends`` lists those that can run here and why the others
cannot.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

from ..backends.emulation import emulated_backward, emulated_forward
from ..backends.fp32_tier import fp32_backward
from .cases import CaseInputs

Grads = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class NotApplicable(Exception):
    """A backend cannot express this case (reported as n/a, not as an error)."""


@dataclass
class Backend:
    name: str
    run: Callable[[CaseInputs, torch.Tensor, "SavedForwards"], Grads]
    reason: Callable[[CaseInputs], Optional[str]] = lambda inp: None


class SavedForwards:
    """Per (case, key variant) lazily computed emulated forward (saved O and LSE)."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.cache: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, inp: CaseInputs, k: torch.Tensor):
        key = id(k)
        if key not in self.cache:
            self.cache[key] = emulated_forward(inp.q, k, inp.v, fmt=self.fmt, **inp.mask)
        return self.cache[key]


def case_format(inp: CaseInputs) -> str:
    """The emulation format of a case's inputs: "fp16" for FP16, else "bf16"."""
    return "fp16" if inp.q.dtype == torch.float16 else "bf16"


def _emulated(correct: bool, dk_form: str = "two_product"):
    def run(inp: CaseInputs, k, saved: SavedForwards) -> Grads:
        o, lse = saved.get(inp, k)
        return emulated_backward(inp.q, k, inp.v, o, inp.do, lse, fmt=case_format(inp), correct=correct,
                                 dk_form=dk_form, **inp.mask)
    return run


def _fp32(project: bool):
    def run(inp: CaseInputs, k, saved) -> Grads:
        return fp32_backward(inp.q, k, inp.v, inp.do, project=project, **inp.mask)
    return run


# ---------------------------------------------------------------------------------------------- CUDA backends
def _sdpa_reason(inp: CaseInputs) -> Optional[str]:
    m = inp.mask
    if "cu_seqlens_q" in m:
        return "SDPA has no varlen (cu_seqlens) interface"
    if tuple(m.get("window", (-1, -1))) != (-1, -1):
        return "SDPA has no sliding window"
    if m.get("softcap", 0.0):
        return "SDPA has no softcap"
    if m.get("causal") and m.get("causal_align") == "bottom_right" and inp.q.shape[2] != inp.k.shape[2]:
        return "SDPA's is_causal is top-left aligned only"
    return None


def _sdpa(backend_name: str):
    def run(inp: CaseInputs, k, saved) -> Grads:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
        which = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
        q, kk, v = (x.detach().clone().requires_grad_(True) for x in (inp.q, k, inp.v))
        kw = {"is_causal": bool(inp.mask.get("causal", False)), "scale": inp.mask.get("scale")}
        if q.shape[1] != kk.shape[1]:
            kw["enable_gqa"] = True
        try:
            with sdpa_kernel([which]):
                out = F.scaled_dot_product_attention(q, kk, v, **kw)
        except RuntimeError as e:
            raise NotApplicable(str(e).splitlines()[0][:160]) from None
        out.backward(inp.do)
        return q.grad, kk.grad, v.grad
    return run


def _flash_reason(inp: CaseInputs) -> Optional[str]:
    m = inp.mask
    if m.get("causal") and m.get("causal_align", "top_left") == "top_left" and inp.q.shape[2] != inp.k.shape[2]:
        return "flash-attn's causal is bottom-right aligned only"
    return None


def _flash(variant: str):
    def run(inp: CaseInputs, k, saved) -> Grads:
        if variant == "fa2":
            import flash_attn as mod
        elif variant == "fa3":
            import flash_attn_interface as mod
        else:
            import flash_attn.cute as mod
        m = inp.mask
        q, kk, v = (x.detach().clone().requires_grad_(True) for x in (inp.q, k, inp.v))
        kw = {"causal": bool(m.get("causal", False)), "softmax_scale": m.get("scale")}
        if tuple(m.get("window", (-1, -1))) != (-1, -1):
            kw["window_size"] = tuple(m["window"])
        if m.get("softcap"):
            kw["softcap"] = float(m["softcap"])
        bshd = lambda x: x.transpose(1, 2)
        if "cu_seqlens_q" in m:
            cq, ck = m["cu_seqlens_q"].to(torch.int32), m["cu_seqlens_k"].to(torch.int32)
            kw.update(max_seqlen_q=int((cq[1:] - cq[:-1]).max()), max_seqlen_k=int((ck[1:] - ck[:-1]).max()))
            res = mod.flash_attn_varlen_func(bshd(q)[0], bshd(kk)[0], bshd(v)[0], cq, ck, **kw)
            out = (res[0] if isinstance(res, tuple) else res).unsqueeze(0)
        else:
            res = mod.flash_attn_func(bshd(q), bshd(kk), bshd(v), **kw)
            out = res[0] if isinstance(res, tuple) else res
        out.backward(bshd(inp.do))
        return q.grad, kk.grad, v.grad
    return run


def triton_cpu_kernel(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the environment lets CPU tensors run the GProj kernel through Triton's interpreter, by the rule
    ``enable()`` applies (``config.Config.cpu_kernel``: GPROJ_TIER=triton, or TRITON_INTERPRET set), so that
    the audit's Triton rows run wherever the patch itself would run the kernel. Only these two variables are
    read: an unrelated bad GPROJ_* value is not the audit's concern. ValueError on a bad GPROJ_TIER."""
    environ = os.environ if environ is None else environ
    from ..runtime import config
    return config.resolve(environ={n: environ[n] for n in (config.ENV["tier"], "TRITON_INTERPRET")
                                   if n in environ}).cpu_kernel


def _triton_reason(cpu_kernel: bool):
    def reason(inp: CaseInputs) -> Optional[str]:
        from ..backends import triton_bwd
        return triton_bwd.kernel_unsupported_reason(inp.q, inp.k, inp.v, cpu_kernel=cpu_kernel, **inp.mask)
    return reason


def _triton(correct: bool):
    def run(inp: CaseInputs, k, saved: SavedForwards) -> Grads:
        from ..backends import triton_bwd
        o, lse = saved.get(inp, k)
        return triton_bwd.gproj_backward(inp.do, inp.q, k, inp.v, o.to(inp.q.dtype), lse, correct=correct,
                                         **inp.mask)
    return run


def available_backends(device: torch.device, dtype: torch.dtype, environ: Optional[Mapping[str, str]] = None
                       ) -> Tuple[List[Backend], Dict[str, str]]:
    """The backends that run on ``device`` and, for the rest, why not. ``environ`` (default ``os.environ``):
    where GPROJ_TIER and TRITON_INTERPRET are read (``triton_cpu_kernel``); ValueError on a bad GPROJ_TIER."""
    backends = [Backend("emulated-uncorrected", _emulated(False)), Backend("emulated-gproj", _emulated(True)),
                Backend("emulated-gproj-fused", _emulated(True, "fused")), Backend("fp32-tier", _fp32(True)),
                Backend("fp32-plain", _fp32(False))]
    skipped: Dict[str, str] = {}
    cuda = device.type == "cuda"
    for name in ("flash", "efficient", "cudnn"):
        if cuda or name == "flash":  # PyTorch also has a fused flash backward on the CPU
            backends.append(Backend(f"sdpa-{name}", _sdpa(name), _sdpa_reason))
        else:
            skipped[f"sdpa-{name}"] = "needs CUDA"
    for variant, module in (("fa2", "flash_attn"), ("fa3", "flash_attn_interface"), ("fa4", "flash_attn.cute")):
        if not cuda:
            skipped[variant] = "needs CUDA"
            continue
        try:
            __import__(module)
        except Exception as e:  # ImportError, or a broken CUDA extension
            skipped[variant] = f"{module} not importable ({type(e).__name__})"
            continue
        backends.append(Backend(variant, _flash(variant), _flash_reason))
    from .eager import eager_reason, eager_run  # HF's eager arithmetic, unpatched and through the hook
    backends += [Backend("hf-eager-uncorrected", eager_run(False), eager_reason),
                 Backend("hf-eager-gproj", eager_run(True), eager_reason)]
    try:  # FlexAttention: compiled flex's own backward (CUDA) and flex through the hook
        from ..hooks import flex as flex_hook
        for name, run, reason in flex_hook.audit_backends(device):
            backends.append(Backend(name, run, reason))
    except Exception as e:  # noqa: BLE001 - a torch without flex_attention: say why
        skipped["flex"] = f"flex_attention not available ({type(e).__name__}: {e})"
    interp = not cuda and triton_cpu_kernel(environ)
    if not cuda and not interp:
        skipped["triton"] = "needs CUDA (or GPROJ_TIER=triton TRITON_INTERPRET=1 with --dtype fp16)"
    elif not cuda and dtype != torch.float16:
        # its bf16 casts truncate and its bf16 tl.dot computes on raw bits: rows would be garbage, not findings
        skipped["triton"] = ("Triton's CPU interpreter computes bf16 wrongly (its fp16 is exact): audit the kernel "
                             "on a CPU with --dtype fp16, in bf16 on CUDA")
    else:
        try:
            from ..backends import triton_bwd  # noqa: F401
        except Exception as e:
            skipped["triton"] = f"gproj_patch.backends.triton_bwd not importable ({type(e).__name__}: {e})"
        else:
            backends.append(Backend("triton-uncorrected", _triton(False), _triton_reason(interp)))
            backends.append(Backend("triton-gproj", _triton(True), _triton_reason(interp)))
    return backends, skipped
