"""PyTorch's ring attention backward simulated in one process (no communication): every rank's steps run in turn,
the KV shard of rank r's step i being rank (r − i) mod W's, with PyTorch's own step logic (its
``_is_causal_behavior``, load-balancing halves and ``_partial_update``, through
``hooks.context_parallel.ring_step`` / ``step_operands``).

* ``shard(x, world, balanced)``: the sequence split as context parallelism splits it — head-tail load balancing
  (PyTorch's ``_HeadTailLoadBalancer`` indices, then ``world`` contiguous pieces) or plain contiguous pieces;
  ``unshard`` puts per-rank pieces back in sequence order.
* ``uncorrected(...)``: the ring as PyTorch runs it — a fused backward per step (``step_backward``) with the merged
  output and LSE, dq accumulated in FP32 per rank, dk/dv in FP32 per owner.
* ``corrected(...)``: the same steps through ``backends.ring.RingRows`` (row pass, λ, column pass).

Used by the GPU test (``test_context_parallel_gpu.py``), the timing script (``ring_timing.py``) and the CPU tests.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Sequence

import torch

from gproj_patch.backends import compat
from gproj_patch.backends.ring import RingRows
from gproj_patch.hooks.context_parallel import HALVES, ring_step, step_operands


def cp_module():
    """PyTorch's ring-attention module."""
    return compat.context_parallel_attention_module()


@contextlib.contextmanager
def load_balance(on: bool):
    """``_cp_options.enable_load_balance`` set to ``on`` inside (PyTorch's ring reads it at every step)."""
    opts = cp_module()._cp_options
    before = opts.enable_load_balance
    opts.enable_load_balance = on
    try:
        yield
    finally:
        opts.enable_load_balance = before


def order(seq: int, world: int, balanced: bool, device) -> torch.Tensor:
    """The sequence positions in rank order: PyTorch's head-tail load balancer's indices, or the identity."""
    if not balanced:
        return torch.arange(seq, device=device)
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    return _HeadTailLoadBalancer(seq, world, device)._generate_indices()[0].to(device=device, dtype=torch.long)


def shard(x: torch.Tensor, world: int, balanced: bool, dim: int = 2) -> List[torch.Tensor]:
    """``x`` split along ``dim`` into the ``world`` ranks' pieces (contiguous copies)."""
    idx = order(x.shape[dim], world, balanced, x.device)
    return [p.contiguous() for p in x.index_select(dim, idx).chunk(world, dim=dim)]


def unshard(pieces: Sequence[torch.Tensor], balanced: bool, dim: int = 2) -> torch.Tensor:
    """The ranks' pieces back in sequence order."""
    x = torch.cat(list(pieces), dim=dim)
    idx = order(x.shape[dim], len(pieces), balanced, x.device)
    out = torch.empty_like(x)
    out.index_copy_(dim, idx, x)
    return out


def _add_rows(acc: torch.Tensor, part: torch.Tensor, tail: bool) -> None:
    """PyTorch's accumulation of a step's dq (into the second half of the rows for a second-half step)."""
    if tail:
        acc.copy_(cp_module()._partial_update(acc, part, dim=2, n_chunks=HALVES, idx=1, add=True))
    else:
        acc += part


def _add_keys(acc: torch.Tensor, part: torch.Tensor, head: bool) -> None:
    """PyTorch's accumulation of a step's dk/dv (into the first half of the keys for a first-half step)."""
    if head:
        acc.copy_(cp_module()._partial_update(acc, part, dim=2, n_chunks=HALVES, idx=0, add=True))
    else:
        acc += part


def fused_step_backward() -> Callable:
    """A step's backward as PyTorch's ring runs it on a GPU: the backward op of the fused kernel SDPA picks for the
    step's (q, k, v, causal) (``torch._fused_sdp_choice``: cuDNN by default on the H100/H200 image;
    ``sdpa_kernel`` decides), called with the merged output and LSE — the step's forward op is run once per step
    shape for the metadata its backward takes (RNG state, sequence offsets; the LSE's layout)."""
    from torch.nn.attention import SDPBackend
    aten = torch.ops.aten
    found = {}

    def forward(q, k, v, causal):
        choice = int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal, enable_gqa=q.shape[1] != k.shape[1]))
        if choice == int(SDPBackend.CUDNN_ATTENTION):
            res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)
            return "cudnn", res
        if choice == int(SDPBackend.FLASH_ATTENTION):
            return "flash", aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        if choice == int(SDPBackend.EFFICIENT_ATTENTION):
            return "efficient", aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
        raise RuntimeError(f"no fused SDPA op for this step (SDPA chose {choice})")

    def step(q, k, v, do, o, lse, causal):
        key = (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), causal)
        if key not in found:
            found[key] = forward(q, k, v, causal)
        kind, res = found[key]
        lse = lse.reshape(res[1].shape[:3])  # (B, H, Sq): the merged LSE, in the op's own layout below
        if kind == "cudnn":
            _, own_lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = res
            lse_op = torch.empty_like(own_lse).copy_(lse.reshape(own_lse.shape))
            return aten._scaled_dot_product_cudnn_attention_backward(
                do, q, k, v, o, lse_op, seed, offset, None,
                cum_q, cum_k, max_q, max_k, 0.0, causal)
        if kind == "flash":
            _, own_lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = res
            return aten._scaled_dot_product_flash_attention_backward(
                do, q, k, v, o, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
        _, own_lse, seed, offset = res
        lse_op = torch.full_like(own_lse, float("inf"))
        lse_op[..., :lse.shape[-1]] = lse
        return aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, None, o, lse_op, seed, offset, 0.0, [True, True, True, False], causal)[:3]
    return step


def uncorrected(step_backward: Callable, q, k, v, do, o, lse, is_causal: bool):
    """PyTorch's ring backward over per-rank pieces (lists indexed by rank): per-rank (dq, dk, dv), fp32.
    ``step_backward(q, k, v, do, o, lse, causal) -> (dq, dk, dv)`` is the fused backward of one step."""
    cp, world = cp_module(), len(q)
    dq = [torch.zeros_like(x, dtype=torch.float32) for x in q]
    dk = [torch.zeros_like(x, dtype=torch.float32) for x in k]
    dv = [torch.zeros_like(x, dtype=torch.float32) for x in v]
    for rank in range(world):
        for i in range(world):
            step = ring_step(cp, rank, world, i, is_causal)
            if step is None:
                continue
            src = (rank - i) % world
            tail, head, causal = step
            rows = slice(-(-q[rank].shape[2] // HALVES), None) if tail else slice(None)
            ks, vs = (k[src].chunk(HALVES, dim=2)[0], v[src].chunk(HALVES, dim=2)[0]) if head else (k[src], v[src])
            sel = (slice(None), slice(None), rows)
            gq, gk, gv = step_backward(q[rank][sel], ks, vs, do[rank][sel], o[rank][sel],
                                       lse[rank][sel].contiguous(), causal)
            _add_rows(dq[rank], gq.float(), tail)
            _add_keys(dk[src], gk.float(), head)
            _add_keys(dv[src], gv.float(), head)
    return dq, dk, dv


def corrected(q, k, v, do, o, lse, is_causal: bool, *, kernel: bool, launches=("tl", "tl")):
    """The corrected ring over per-rank pieces: per-rank (dq, dk, dv), fp32; ``launches`` the (row pass, column
    pass) launches of the kernel form."""
    cp, world = cp_module(), len(q)
    dk = [torch.zeros_like(x, dtype=torch.float32) for x in k]
    dv = [torch.zeros_like(x, dtype=torch.float32) for x in v]
    ranks = [RingRows(do[r], q[r], o[r], lse[r], kernel=kernel, dq_major=launches[0], kv_major=launches[1])
             for r in range(world)]
    for rank, rows in enumerate(ranks):
        for i in range(world):
            step = ring_step(cp, rank, world, i, is_causal)
            if step is not None:
                q_rows, ks, vs, causal = step_operands(rows, k[(rank - i) % world], v[(rank - i) % world], step)
                rows.row_step(ks, vs, causal=causal, rows=q_rows)
        rows.finish()
    for rank, rows in enumerate(ranks):
        for i in range(world):
            step = ring_step(cp, rank, world, i, is_causal)
            if step is not None:
                src = (rank - i) % world
                q_rows, ks, vs, causal = step_operands(rows, k[src], v[src], step)
                gk, gv = rows.column_step(ks, vs, causal=causal, rows=q_rows)
                _add_keys(dk[src], gk, step[1])
                _add_keys(dv[src], gv, step[1])
    return [rows.dq() for rows in ranks], dk, dv
