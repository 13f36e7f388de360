"""The two passes of a corrected ring (context-parallel) attention backward, on one rank's query rows.

Ring attention splits each row's keys into shards s (one per rank) and runs the backward shard by shard with the
*merged* output O and LSE of the whole row. A fused BF16 backward rounds t = low(dS) on each shard, so the row's
mass ρ_i = Σ_s Σ_{j∈s} t_ij is not 0; the row's own λ_i = ρ_i / m_i (m_i = Σ_s Σ_{j∈s} r_ij, r = low(P)) removes it,
and it is known only once every shard has been seen (docs/math.md §8). So two passes over the shards:

* **row pass** (``RingRows.row_step`` per shard): A_i += α Σ_j t_ij k_j, B_i += α Σ_j r_ij k_j, ρ_i += Σ_j t_ij,
  m_i += Σ_j r_ij over the shard's keys, all fp32 (the dQ-major kernels' ``PARTIAL`` mode — tl, or Gluon where
  it takes the step — stores the shard's sums, added here). Then ``finish``: λ_i = ρ_i / m_i (0 where m_i = 0),
  and dq_i = A_i − λ_i B_i (``dq``): exact GProj of the whole row, the partial products kept in fp32 (they carry
  the common key offset, which cancels only across shards: rounded to BF16 they would leak again).
* **column pass** (``RingRows.column_step`` per shard): dk_j = α Σ_i low(P_ij (dP_ij − D_i − λ_i)) q_i and
  dv_j = Σ_i low(P_ij) dO_i over this rank's rows — the KV-major launch (Gluon or tl) reading λ, D and the base-2
  LSE from the row pass's per-row scratch, its outputs fp32 (the ring adds them over ranks).

P = exp(α q·k − LSE) with the merged LSE, D_i = dO_i·O_i from the merged output, in both passes (the dQ-major
kernel writes D and LSE2 to the scratch the KV-major one reads: the same D bit for bit). Masks: the ring's per-step
masks — top-left causal (SDPA's) or none; GQA. The ring may pass a subset of the rows (its load balancing gives
some steps only the second half of the queries): ``rows`` selects them, and each row range keeps its own scratch.

Memory (kernel form, beyond the ring's own fp32 dq): A and B, fp32 like 2 × q, and during the row pass a shard's
A and B per row range (2 × q again, freed at ``finish``); per row 6 fp32 numbers of scratch.

Two forms: the kernels (``kernel=True``: CUDA bf16/fp16, head dims 16..256; CPU fp16/fp32 through Triton's
interpreter), and an FP32 form in PyTorch (``kernel=False``: any dtype and head dim, t = dS and r = P unrounded,
chunked over queries like the FP32 tier). Pure numerics: the ring's communication is the caller's
(``hooks/context_parallel.py``), which decides the form.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional, Tuple

import torch

from . import configs, triton_bwd, triton_launch
from .compat import triton_interpreter_index_patch
from .emulation import full_fp32
from .fp32_tier import given_lse_chunks
from .spec import default_scale, normalize_lse

#: the launches a step can take ("gluon": where ``gluon_dq.dq_major_reason`` / ``gluon_bwd.kv_major_reason`` allows
#: the step, else tl)
LAUNCHES = ("tl", "gluon")


def kernel_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cpu_kernel: bool = False) -> Optional[str]:
    """None when ``RingRows(kernel=True)`` takes these inputs (``triton_bwd.kernel_unsupported_reason``'s kernel,
    head dim at least 16: the ring's launches take no padded copies); otherwise why not (the FP32 form then)."""
    reason = triton_bwd.kernel_unsupported_reason(q, k, v, cpu_kernel=cpu_kernel)
    if reason is None and q.shape[-1] < configs.MIN_BLOCK_D:
        reason = f"head_dim={q.shape[-1]} < {configs.MIN_BLOCK_D}"
    return reason


class RingRows:
    """One rank's query rows through the corrected ring backward: ``row_step`` for every key shard, ``finish``,
    ``column_step`` for every key shard, ``dq``. q, dO, O (B, Hq, Sq, D) any strides, ``lse`` the merged
    natural-log LSE in any layout ``spec.normalize_lse`` reads; ``kernel`` picks the form (module docstring),
    ``dq_major`` / ``kv_major`` the row / column pass's launches ("gluon": on every step the Gluon launch takes)."""

    def __init__(self, do: torch.Tensor, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, *,
                 scale: Optional[float] = None, kernel: bool = False, dq_major: str = "tl", kv_major: str = "tl"):
        for name, launch in (("dq_major", dq_major), ("kv_major", kv_major)):
            if launch not in LAUNCHES:
                raise ValueError(f"{name} must be one of {LAUNCHES}, got {launch!r}")
        B, H, Sq, D = q.shape
        self.q = q
        self.do = do if do.dtype == q.dtype or not kernel else do.to(q.dtype)
        self.o = o if o.dtype == q.dtype or not kernel else o.to(q.dtype)
        self.lse = normalize_lse(lse, B, H, Sq)
        self.alpha = default_scale(D, scale)
        self.kernel, self.dq_major, self.kv_major = kernel, dq_major, kv_major
        # A = α Σ t·K in [..., 0, :] and B = α Σ r·K in [..., 1, :] (the kernels' layout of a shard's sums); ρ, m
        self.sums = torch.zeros((B, H, Sq, 2, D), dtype=torch.float32, device=q.device)
        self.stats = torch.zeros((B, H, Sq, 2), dtype=torch.float32, device=q.device)
        self.lam: Optional[torch.Tensor] = None
        # the kernels' per-row scratch (D, LSE2, λ; a shard's ρ and m in λ's and T's rows) of each row range a
        # step used, and the buffer of a shard's A, B there (the row pass only): (start, stop) -> Scratch, buffer
        self._scratch: Dict[Tuple[int, int], triton_launch.Scratch] = {}
        self._shard_sums: Dict[Tuple[int, int], torch.Tensor] = {}

    # ---- row pass ----------------------------------------------------------------------------------------------
    def row_step(self, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, rows: slice = slice(None)):
        """Add key shard (k, v)'s A, B, ρ, m to the rows ``rows`` (``causal``: top-left, key j visible from row i
        of the selection iff j ≤ i)."""
        if self.lam is not None:
            raise RuntimeError("RingRows.row_step after finish()")
        r0, r1, _ = rows.indices(self.q.shape[2])
        if r1 <= r0 or k.shape[2] == 0:
            return
        sel = (slice(None), slice(None), slice(r0, r1))
        if self.kernel:
            self._kernel_rows(k, v, causal, (r0, r1), sel)
        else:
            self._fp32_rows(k, v, causal, sel)

    def finish(self) -> torch.Tensor:
        """λ = ρ / m (0 where m = 0) of every row, fp32 (B, Hq, Sq), once every shard's row step is in; the
        kernels' scratch of each row range gets its rows' λ."""
        rho, msum = self.stats.unbind(-1)
        self.lam = torch.where(msum > 0, rho / torch.where(msum > 0, msum, torch.ones_like(msum)),
                               torch.zeros_like(msum))
        for (r0, r1), scratch in self._scratch.items():
            scratch.lam.view(self.q.shape[0], self.q.shape[1], r1 - r0).copy_(self.lam[:, :, r0:r1])
        self._shard_sums.clear()
        return self.lam

    def dq(self) -> torch.Tensor:
        """dq = A − λ·B (fp32, (B, Hq, Sq, D)): GProj of the whole rows."""
        if self.lam is None:
            raise RuntimeError("RingRows.dq before finish()")
        return self.sums[..., 0, :] - self.lam[..., None] * self.sums[..., 1, :]

    # ---- column pass -------------------------------------------------------------------------------------------
    def column_step(self, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    rows: slice = slice(None)) -> Tuple[torch.Tensor, torch.Tensor]:
        """(dk, dv) fp32, shaped like k and v, of key shard (k, v) from the rows ``rows`` with the rows' λ."""
        if self.lam is None:
            raise RuntimeError("RingRows.column_step before finish()")
        r0, r1, _ = rows.indices(self.q.shape[2])
        if r1 <= r0 or k.shape[2] == 0:
            return (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                    torch.zeros(v.shape, dtype=torch.float32, device=v.device))
        sel = (slice(None), slice(None), slice(r0, r1))
        if self.kernel:  # the KV-major launches write every key's dk and dv
            scratch = self._scratch.get((r0, r1))
            if scratch is None:
                raise RuntimeError(f"RingRows.column_step: rows [{r0}, {r1}) had no row step")
            dk, dv = (torch.empty(x.shape, dtype=torch.float32, device=x.device) for x in (k, v))
            if triton_bwd._POISON_OUTPUTS:  # tests: an element the launch did not write stays NaN
                dk.fill_(float("nan"))
                dv.fill_(float("nan"))
            self._kernel_columns(k, v, causal, sel, scratch, dk, dv)
        else:
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            self._fp32_columns(k, v, causal, sel, dk, dv)
        return dk, dv

    # ---- the kernels -------------------------------------------------------------------------------------------
    def _job(self, k, v, causal: bool, sel, *, dq, dk, dv, partial: bool, launches: Tuple[str, str],
             do: Optional[torch.Tensor] = None) -> triton_launch.Launch:
        """The ``Launch`` of one step on the rows ``sel`` (dO: the rows' own, or ``do``): no varlen, top-left
        causal or dense, fused dk."""
        q, o, lse = self.q[sel], self.o[sel], self.lse[sel]
        do = self.do[sel] if do is None else do
        interpret = q.device.type != "cuda"
        cfg_dq, cfg_dkdv = configs.launch_configs(q.shape[-1], q.dtype, interpret)
        return triton_launch.Launch(
            do=do, q=q, k=k, v=v, o=o, lse=lse, dq=dq, dk=dk, dv=dv, sink=None, cu_q=q, cu_k=q, varlen=False,
            n_problems=q.shape[0], max_q=q.shape[2], max_k=k.shape[2], window=(-1, 0 if causal else -1),
            bottom_right=False, alpha=self.alpha, softcap=0.0, correct=True, fused=True, cfg_dq=cfg_dq,
            cfg_dkdv=cfg_dkdv, dot_precision=configs.dot_precision(q.dtype),
            dq_major=launches[0], kv_major=launches[1], partial=partial, own_outputs=True)

    def _launch(self, job: triton_launch.Launch, part: str, scratch: triton_launch.Scratch) -> None:
        interpret = job.q.device.type != "cuda"
        with (triton_interpreter_index_patch() if interpret else contextlib.nullcontext()):
            triton_launch.launch(triton_bwd.kernel_module(interpret), interpret, job,
                                 block_d=configs.block_d(job.q.shape[-1]), parts=(part,),
                                 last_kernels=triton_bwd.LAST_KERNELS, scratch=scratch)

    def _kernel_rows(self, k, v, causal: bool, span: Tuple[int, int], sel) -> None:
        B, H, _, D = self.q.shape
        n = span[1] - span[0]
        if span not in self._scratch:  # contiguous (B·H, rows) buffers, as the KV-major launches read them
            d, l2, lam, t = torch.empty((4, B * H, n), dtype=torch.float32, device=self.q.device).unbind(0)
            self._scratch[span] = triton_launch.Scratch(delta=d, lse2=l2, lam=lam, target=t)
            self._shard_sums[span] = torch.empty((B, H, n, 2, D), dtype=torch.float32, device=self.q.device)
        scratch, sums = self._scratch[span], self._shard_sums[span]
        dq_major = "tl"
        if self.dq_major == "gluon":
            from .gluon_dq import dq_major_reason
            do = self.do[sel]
            if dq_major_reason(self.q[sel], k, v, do=do) is None:
                dq_major = "gluon"
        job = self._job(k, v, causal, sel, dq=sums[..., 0, :], dk=k, dv=v, partial=True, launches=(dq_major, "tl"))
        self._launch(job, "dq", scratch)
        # the shard's sums into the rows' accumulators (fp32, in step order: deterministic)
        self.sums[sel] += sums
        self.stats[sel] += torch.stack((scratch.lam, scratch.target), dim=-1).view(B, H, n, 2)

    def _kernel_columns(self, k, v, causal: bool, sel, scratch, dk, dv) -> None:
        kv_major, do = "tl", self.do[sel]
        if self.kv_major == "gluon":  # where the Gluon launch takes this step (dO read through TMA: its layout)
            from .gluon_bwd import kv_major_reason, tma_strides_reason
            if tma_strides_reason("do", do) is not None:
                do = do.contiguous()
            if kv_major_reason(self.q[sel], k, v, do=do) is None:
                kv_major = "gluon"
        job = self._job(k, v, causal, sel, dq=dk, dk=dk, dv=dv, partial=False, launches=("tl", kv_major), do=do)
        self._launch(job, "dkdv", scratch)

    # ---- the FP32 form -----------------------------------------------------------------------------------------
    def _fp32_chunks(self, k, v, causal: bool, sel):
        """(chunk, dO, D, fp32 P) of the rows ``sel`` over shard (k, v): P from the merged LSE, D from O."""
        q, do, o = self.q[sel], self.do[sel], self.o[sel]
        for ch in given_lse_chunks(q, k, v, self.lse[sel], scale=self.alpha, causal=causal):
            dO = do[ch.bs, :, ch.rows].to(torch.float32)
            delta = (dO * o[ch.bs, :, ch.rows].to(torch.float32)).sum(-1, keepdim=True)
            yield ch, dO, delta

    def _fp32_rows(self, k, v, causal: bool, sel) -> None:
        a, b, stats = self.sums[sel][..., 0, :], self.sums[sel][..., 1, :], self.stats[sel]
        with full_fp32():
            for ch, dO, delta in self._fp32_chunks(k, v, causal, sel):
                g = ch.p * (torch.matmul(dO, ch.v.transpose(-1, -2)) - delta)  # dS = P∘(dP − D), shard's part
                a[ch.bs, :, ch.rows] += self.alpha * torch.matmul(g, ch.k)  # α Σ_j t_ij k_j (t = dS)
                b[ch.bs, :, ch.rows] += self.alpha * torch.matmul(ch.p, ch.k)  # α Σ_j r_ij k_j (r = P)
                stats[ch.bs, :, ch.rows] += torch.stack((g.sum(-1), ch.p.sum(-1)), dim=-1)  # ρ, m

    def _fp32_columns(self, k, v, causal: bool, sel, dk, dv) -> None:
        B, H = self.q.shape[:2]
        Hkv, Sk = k.shape[1], k.shape[2]
        dk_h = torch.zeros((B, H, Sk, k.shape[-1]), dtype=torch.float32, device=k.device)
        dv_h = torch.zeros((B, H, Sk, v.shape[-1]), dtype=torch.float32, device=v.device)
        lam = self.lam[sel]
        with full_fp32():
            for ch, dO, delta in self._fp32_chunks(k, v, causal, sel):
                lam_c = lam[ch.bs, :, ch.rows][..., None]
                # the projected score gradient P∘(dP − D − λ) = dS − λP, never rounded
                g = ch.p * (torch.matmul(dO, ch.v.transpose(-1, -2)) - delta - lam_c)
                dk_h[ch.bs, :, ch.keys] += self.alpha * torch.matmul(g.transpose(-1, -2), ch.q)
                dv_h[ch.bs, :, ch.keys] += torch.matmul(ch.p.transpose(-1, -2), dO)
        dk += dk_h.view(B, Hkv, H // Hkv, Sk, -1).sum(2)
        dv += dv_h.view(B, Hkv, H // Hkv, Sk, -1).sum(2)
