"""The launches of one GProj backward (host side of ``triton_kernels.py``): the dQ-major kernel (which also writes
D, the base-2 LSE and the sink target for the next launch) and the KV-major kernel, and the learnable sink's
gradient. ``triton_bwd`` checks
the inputs, allocates the outputs, picks block configs and builds the ``Launch``."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton


@dataclass
class Launch:
    """One backward's launches: ``window`` is (left, right) around the diagonal (causal: right = 0),
    ``n_problems`` counts batch entries or varlen sequences, configs are (BLOCK_M, BLOCK_N, warps, stages)."""
    do: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    sink: Optional[torch.Tensor]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    varlen: bool
    n_problems: int
    max_q: int
    max_k: int
    window: Tuple[int, int]
    bottom_right: bool
    alpha: float
    softcap: float
    correct: bool
    fused: bool
    cfg_dq: Tuple[int, int, int, int]
    cfg_dkdv: Tuple[int, int, int, int]
    dot_precision: str = "tf32"  # tl.dot input precision: irrelevant for bf16/fp16, chosen for fp32 inputs
    kv_major: str = "tl"  # the KV-major launch's kernel: "tl" (below) or "gluon" (gluon_bwd.launch_dkdv)
    gluon_config: Optional[object] = None  # gluon_bwd.KernelConfig override (benchmarks)


def sink_gradient(target: torch.Tensor, job: Launch) -> torch.Tensor:
    """dsink_h = −Σ_{b,i} T_i over the rows of every problem (varlen: rows past the last sequence excluded),
    a fixed-shape PyTorch reduction (deterministic), in the sink's dtype."""
    if job.varlen:
        rows = torch.arange(target.shape[-1], device=target.device)
        inside = (rows < job.cu_q[-1]).view(1, 1, -1)  # no sync: cu_q stays on the device
        target = torch.where(inside, target, torch.zeros_like(target))
    return (-target.sum(dim=(0, 2))).to(job.sink.dtype)


def launch(km, interpret: bool, job: Launch, *, block_d: int, parts, last_kernels: dict) -> torch.Tensor:
    """Run the launches ``parts`` names ("dq", "dkdv"; benchmarks time them apart: the dK/dV launch alone then
    reads scratch the dQ launch did not write, a timing, not a result); returns the fp32 (B·H, SQ) buffer of
    T = P_sink·D (D itself without a sink).

    Scratch: fp32 (B·H, SQ) D, base-2 LSE (+inf on -inf rows), λ and T, written by the dQ-major launch; D's
    buffer stands in as a placeholder pointer for λ when uncorrected, and for T and the sink without a sink."""
    q, k, v, do, o, lse = job.q, job.k, job.v, job.do, job.o, job.lse
    B, H, SQ, _ = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    D = q.shape[-1]
    BD = block_d
    bm_q, bn_q, w_q, st_q = job.cfg_dq
    bm_k, bn_k, w_k, st_k = job.cfg_dkdv
    left, right = job.window
    delta = torch.empty((B * H, SQ), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    lam = torch.empty_like(delta) if job.correct else delta
    has_sink = job.sink is not None
    target = torch.empty_like(delta) if has_sink else delta
    sink = job.sink if has_sink else delta
    sink_stride = job.sink.stride(0) if has_sink else 0
    group = H // HKV
    alpha, softcap = job.alpha, job.softcap
    cap = (alpha / softcap, softcap * math.log2(math.e)) if softcap > 0 else (1.0, 1.0)
    common = dict(SOFTCAP=softcap > 0, BOTTOM_RIGHT=job.bottom_right, HAS_L=left >= 0, HAS_R=right >= 0,
                  VARLEN=job.varlen, CORRECT=job.correct, EVEN_D=BD == D,
                  DOT_PRECISION=job.dot_precision)
    kq = kk = None
    if job.max_q == 0:
        return target  # every sequence has no query: dk, dv are the zeros already there
    if "dq" in parts:  # also when every sequence has no key: it writes dq = 0 and the sink target
        kq = km._bwd_dq[(triton.cdiv(job.max_q, bm_q), H, job.n_problems)](
            q, k, v, do, o, lse, sink, job.dq, delta, lse2, lam, target, job.cu_q, job.cu_k,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *o.stride(), *lse.stride(), sink_stride,
            *job.dq.stride(),
            H, group, SQ, SK, D, left, right, alpha, alpha * math.log2(math.e), *cap, HAS_SINK=has_sink,
            EVEN_M=(not job.varlen) and SQ % bm_q == 0, EVEN_N=(not job.varlen) and SK % bn_q == 0,
            BLOCK_M=bm_q, BLOCK_N=bn_q, BLOCK_D=BD, num_warps=w_q, num_stages=st_q, **common)
    if "dkdv" in parts and job.max_k > 0 and job.kv_major == "gluon":
        from .gluon_bwd import launch_dkdv
        kk = launch_dkdv(job, delta, lse2, lam, job.gluon_config)
    elif "dkdv" in parts and job.max_k > 0:
        kk = km._bwd_dkdv[(triton.cdiv(job.max_k, bn_k), HKV, job.n_problems)](
            q, k, v, do, job.dk, job.dv, delta, lse2, lam, job.cu_q, job.cu_k,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *job.dk.stride(), *job.dv.stride(),
            H, group, SQ, SK, D, left, right, alpha, alpha * math.log2(math.e), *cap,
            FUSED=job.fused,
            EVEN_M=(not job.varlen) and SQ % bm_k == 0, EVEN_N=(not job.varlen) and SK % bn_k == 0,
            BLOCK_M=bm_k, BLOCK_N=bn_k, BLOCK_D=BD, num_warps=w_k, num_stages=st_k, **common)
    if not interpret:
        last_kernels.clear()
        for name, kern in (("dq", kq), ("dkdv", kk)):
            last_kernels[name] = dict(regs=getattr(kern, "n_regs", None), spills=getattr(kern, "n_spills", None))
        last_kernels["kv_major"] = job.kv_major
    return target
