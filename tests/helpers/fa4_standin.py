"""A CPU stand-in for flash-attn-4 4.0.0b36's ``flash_attn/cute/interface.py`` (the newest release on PyPI when
written), loaded as ``flash_attn.cute.interface`` by ``load(monkeypatch)``.

What is the release's, verbatim (BSD-3-Clause, Tri Dao and the flash-attention authors): the signatures of
``_flash_attn_fwd`` and ``_flash_attn_bwd``, the autograd Functions ``FlashAttnFunc`` and
``FlashAttnVarlenFunc`` (``_flash_attn_fwd`` looked up as a module global and called with q, k, v positional and
everything else by keyword; five results ``out, lse, p, row_max, o_lo``; ``save_for_backward`` of the same
tensors, ``lse`` among them although it is one of the Function's own outputs; ``(out, lse)`` returned; the
backward calling ``_flash_attn_bwd`` with the same positional/keyword split), and the public
``flash_attn_func`` / ``flash_attn_varlen_func``, which return ``(out, lse)`` — callers usually keep ``out``.

What is modelled: the numerics. The forward is the fp64 oracle (bottom-right causal, window, softcap, varlen,
learnable sink) rounded to the input dtype, LSE fp32; ``p``, ``row_max``, ``o_lo`` are None as on the release's
dense paths. The backward ("the original") is the uncorrected BF16 emulation of a fused backward (FA's roundings,
so it leaks under a common key offset as FA4 does), with FA4's ``(dq, dk, dv[, dsink])`` return; where the
emulation has no model (a ``dlse``, softcap with a sink) it is exact fp64 autograd. Each call of the original is
counted in ``CALLS["original"]``; the sparse-MLA path (``qv``), the score/mask-mod arguments and a ``seqused``
shorter than the sequences raise.
"""
import importlib.machinery
import importlib.util
import pathlib
import sys
import types
import warnings
from typing import Callable, Optional, Tuple

import torch

from gproj_patch.backends.emulation import emulated_backward
from gproj_patch.backends.reference import reference_forward

RELEASE = "4.0.0b36"
CALLS = {"original": 0, "forward": 0}
BlockSparseTensorsTorch = SchedulerMetadataTensorsTorch = object  # annotations only


def load(monkeypatch):
    """A fresh copy of this module as ``flash_attn.cute.interface`` (with its parent packages) in ``sys.modules``
    for the test; returns it."""
    for name in ("flash_attn", "flash_attn.cute"):
        package = types.ModuleType(name)
        package.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        package.__path__ = []
        monkeypatch.setitem(sys.modules, name, package)
    spec = importlib.util.spec_from_file_location("flash_attn.cute.interface", pathlib.Path(__file__))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", module)
    spec.loader.exec_module(module)
    sys.modules["flash_attn.cute"].interface = module
    return module


def install(monkeypatch):
    """``load(monkeypatch)`` for the flash-attn hook's tests: the stand-in as ``flash_attn.cute.interface``, the
    hook's FA2/FA3 op lists emptied (no flash-attn ops exist on the CPU), its call counters at zero."""
    from gproj_patch.hooks import flash_attn as fa_hook
    for name in ("FA2_OPS", "FA3_OPS"):
        monkeypatch.setattr(fa_hook, name, ())
    module = load(monkeypatch)
    module.CALLS.update(original=0, forward=0)
    return module


class KeepOut:
    """``flash_attn_func`` as callers use it, keeping only ``out``: ``apply(q, k, v, causal, sink)``."""

    def __init__(self, module):
        self.module = module

    def apply(self, q, k, v, causal, sink):
        return self.module.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)[0]


def _bhsd(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    """FA4's (B, S, H, D) or varlen (total, H, D) as the backends' (B, H, S, D)."""
    return t.unsqueeze(0).transpose(1, 2) if varlen else t.transpose(1, 2)


def _fa_layout(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    return t.transpose(1, 2).squeeze(0) if varlen else t.transpose(1, 2)


def _window(left, right) -> Tuple[int, int]:
    return (-1 if left is None else int(left), -1 if right is None else int(right))


def exact_attention(q, k, v, sink, *, softcap, causal, scale=None):
    """fp64 attention in FA4's dense layout with scores softcapped when ``softcap`` > 0 and an uncapped sink
    column (what FA4 computes with both; the oracle and the GProj tiers refuse the pair): (out, lse),
    differentiable. Sq = Sk where it is used, so causal is the same in either alignment."""
    q, k, v = (t.transpose(1, 2).double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    full = torch.cat([s, sink.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    return (torch.softmax(full, dim=-1)[..., :-1] @ v).transpose(1, 2), torch.logsumexp(full, dim=-1)


def _forward_numerics(q, k, v, *, scale, causal, window, softcap, cu_seqlens_q, cu_seqlens_k, sink):
    """(out in q's dtype and FA4's layout, LSE fp32: (B, H, Sq), varlen (H, total))."""
    varlen = cu_seqlens_q is not None
    if softcap and sink is not None:
        out, lse = exact_attention(q, k, v, sink.detach(), softcap=softcap, causal=causal, scale=scale)
        return out.to(q.dtype).contiguous(), lse.float()
    out, lse = reference_forward(*(_bhsd(t, varlen) for t in (q, k, v)), scale=scale, causal=causal,
                                 causal_align="bottom_right", window=window, softcap=softcap,
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 sink=None if sink is None else sink.detach().float())
    return _fa_layout(out.to(q.dtype), varlen).contiguous(), (lse[0] if varlen else lse).float().contiguous()


def _original_backward(q, k, v, out, dout, lse, *, scale, causal, window, softcap, cu_seqlens_q, cu_seqlens_k,
                       sink, dlse):
    """FA4's fused backward, modelled (see the module docstring): (dq, dk, dv[, dsink])."""
    varlen = cu_seqlens_q is not None
    if dlse is not None or (softcap and sink is not None):
        if varlen or sink is None:
            raise NotImplementedError("the stand-in models dlse / softcap only with a sink, dense")
        with torch.enable_grad():  # autograd runs a backward without grad mode
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
            o, l = exact_attention(*leaves, softcap=softcap, causal=causal, scale=scale)
            outputs, grad_outputs = (o,), (dout.double(),)
            if dlse is not None:
                outputs, grad_outputs = outputs + (l,), grad_outputs + (dlse.double(),)
            grads = torch.autograd.grad(outputs, leaves, grad_outputs)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v, sink)))
    lse4 = lse.unsqueeze(0) if varlen else lse
    grads = emulated_backward(*(_bhsd(t, varlen) for t in (q, k, v, out, dout)), lse4, fmt="bf16", correct=False,
                              scale=scale, causal=causal, causal_align="bottom_right", window=window,
                              softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              sink=None if sink is None else sink.float())
    outs = tuple(_fa_layout(g, varlen).to(t.dtype) for g, t in zip(grads[:3], (q, k, v)))
    return outs if sink is None else outs + (grads[3].to(sink.dtype),)


def _full_lengths_only(seqused: Optional[torch.Tensor], x: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> None:
    """``seqused_q``/``seqused_k`` are modelled only where every sequence is used in full (then they change
    nothing); shorter used lengths raise."""
    if seqused is None:
        return
    full = cu_seqlens.diff() if cu_seqlens is not None else torch.full_like(seqused, x.shape[1])
    if not torch.equal(seqused.to(full.dtype), full):
        raise NotImplementedError("the FA4 stand-in models seqused only at the full sequence lengths")


def _unmodelled(**arguments) -> None:
    for name, value in arguments.items():
        if value is not None and value is not False:
            raise NotImplementedError(f"the FA4 stand-in does not model {name}")


# signature: flash-attn-4 4.0.0b36, flash_attn/cute/interface.py
def _flash_attn_fwd(
    q: Optional[torch.Tensor],
    k: Optional[torch.Tensor],
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    min_seqlen_k: Optional[int] = None,
    page_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    softcap: Optional[float] = None,
    window_size_left: Optional[int] = None,
    window_size_right: Optional[int] = None,
    learnable_sink: Optional[torch.Tensor] = None,
    tile_mn: Optional[Tuple[int, int]] = None,
    mma_pv_is_rs: Optional[bool] = None,
    intra_wg_overlap: Optional[bool] = None,
    num_threads: int = 384,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    _arch: Optional[int] = None,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None,
    return_lse: bool = False,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    aux_tensors: Optional[list] = None,
    aux_scalars: Optional[tuple] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    scheduler_metadata: Optional[SchedulerMetadataTensorsTorch] = None,
    seqlen_k_per_split: Optional[int] = None,
    disable_scheduler_metadata: bool = False,
    gather_bwd_recompute_p: bool = False,
):
    """The release's forward, modelled: ``(out, lse, p, row_max, o_lo)``, lse allocated when some input requires
    grad or ``return_lse`` (as the release does), None otherwise."""
    _unmodelled(qv=qv, seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table, score_mod=score_mod,
                mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors, aux_tensors=aux_tensors,
                gather_kv_indices=gather_kv_indices, out=out, lse=lse)
    CALLS["forward"] += 1
    _flash_attn_fwd.compile_cache.setdefault("fwd", "compiled")  # the release keeps its JIT cache here
    requires_grad = any(t is not None and t.requires_grad for t in (q, k, v, qv, learnable_sink))
    o, l = _forward_numerics(q, k, v, scale=softmax_scale, causal=causal,
                             window=_window(window_size_left, window_size_right), softcap=softcap or 0.0,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sink=learnable_sink)
    return o, (l if requires_grad or return_lse else None), None, None, None


_flash_attn_fwd.compile_cache = {}


# signature: flash-attn-4 4.0.0b36, flash_attn/cute/interface.py
def _flash_attn_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    softcap: float = 0.0,
    window_size_left: Optional[int] = None,
    window_size_right: Optional[int] = None,
    m_block_size: int = 64,
    n_block_size: int = 128,
    num_threads: int = 256,
    pack_gqa: bool = False,
    num_stages_Q: int = 2,
    num_stages_dO: int = 2,
    SdP_swapAB: bool = False,
    dKV_swapAB: bool = False,
    dQ_swapAB: bool = False,
    AtomLayoutMSdP: int = 2,
    AtomLayoutNdKV: int = 2,
    AtomLayoutMdQ: int = 2,
    V_in_regs: bool = False,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    deterministic: bool = False,
    dq: Optional[torch.Tensor] = None,
    dk: Optional[torch.Tensor] = None,
    dv: Optional[torch.Tensor] = None,
    score_mod: Optional[Callable] = None,
    score_mod_bwd: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    aux_tensors: Optional[list] = None,
    aux_scalars: Optional[tuple] = None,
    block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None,
    dlse: Optional[torch.Tensor] = None,
    learnable_sink: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, ...]:
    """The release's backward, modelled: ``(dq, dk, dv)``, ``(dq, dk, dv, dsink)`` when given a sink."""
    _full_lengths_only(seqused_q, q, cu_seqlens_q)
    _full_lengths_only(seqused_k, k, cu_seqlens_k)
    _unmodelled(dq=dq, dk=dk, dv=dv, score_mod=score_mod,
                score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                block_sparse_tensors=block_sparse_tensors)
    CALLS["original"] += 1
    _flash_attn_bwd.compile_cache.setdefault("key", "compiled")  # state on the function object, read as a global
    return _original_backward(q, k, v, out, dout, lse, scale=softmax_scale, causal=causal,
                              window=_window(window_size_left, window_size_right), softcap=softcap or 0.0,
                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sink=learnable_sink, dlse=dlse)


_flash_attn_bwd.compile_cache = {}


def _flash_attn_bwd_sparse_mla(*args, **kwargs):
    raise NotImplementedError("the FA4 stand-in does not model the sparse-MLA (qv) path")


def _validate_gather_bwd_kwargs(gather_kv_indices, gather_bwd_recompute_p, gather_bwd_token_chunk):
    """The release's check, reduced: the sparse-MLA options need ``gather_kv_indices``."""
    if gather_kv_indices is None and (gather_bwd_recompute_p or gather_bwd_token_chunk is not None):
        raise ValueError("gather_bwd_recompute_p / gather_bwd_token_chunk only apply to sparse top-k MLA attention")
    return gather_bwd_token_chunk


# ------------------------------------------------------------------------------------------------------------
# verbatim from flash-attn-4 4.0.0b36, flash_attn/cute/interface.py (FlashAttnFunc, FlashAttnVarlenFunc,
# flash_attn_func, flash_attn_varlen_func; the long docstring of flash_attn_varlen_func left out)

class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qv: Optional[torch.Tensor] = None,
        gather_kv_indices: Optional[torch.Tensor] = None,
        softmax_scale: Optional[float] = None,
        causal: bool = False,
        window_size: Tuple[Optional[int], Optional[int]] = (None, None),
        learnable_sink: Optional[torch.Tensor] = None,
        softcap: float = 0.0,
        num_splits: int = 1,
        pack_gqa: Optional[bool] = None,
        deterministic: bool = False,
        score_mod: Optional[Callable] = None,
        score_mod_bwd: Optional[Callable] = None,
        mask_mod: Optional[Callable] = None,
        aux_tensors: Optional[list] = None,
        aux_scalars: Optional[tuple] = None,
        block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None,
        block_sparse_tensors_bwd: Optional[BlockSparseTensorsTorch] = None,
        return_lse: bool = False,
        gather_bwd_recompute_p: bool = False,
        gather_bwd_token_chunk: Optional[int] = None,
    ):
        aux_scalars = tuple(aux_scalars) if aux_scalars else None
        shared_kv = k is v
        if shared_kv and v.shape[-1] == 512:
            # specialize MLA attention formula
            # O = softmax(Q @ K.T + Qv @ V.T) @ V
            # by setting q, k to None
            qv = q if qv is None else qv
            q = k = None
        out, lse, p, row_max, o_lo = _flash_attn_fwd(
            q,
            k,
            v,
            qv=qv,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            learnable_sink=learnable_sink,
            softcap=softcap,
            num_splits=num_splits,
            pack_gqa=pack_gqa,
            score_mod=score_mod,
            mask_mod=mask_mod,
            aux_tensors=aux_tensors,
            aux_scalars=aux_scalars,
            block_sparse_tensors=block_sparse_tensors,
            return_lse=return_lse,
            gather_kv_indices=gather_kv_indices,
            gather_bwd_recompute_p=gather_bwd_recompute_p,
        )
        ctx.save_for_backward(q, k, v, qv, out, lse, p, row_max, o_lo, gather_kv_indices, learnable_sink, *(aux_tensors or ()))
        ctx.gather_bwd_recompute_p = gather_bwd_recompute_p
        ctx.shared_kv = shared_kv
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.window_size = window_size
        ctx.softcap = softcap
        ctx.deterministic = deterministic
        ctx.return_lse = return_lse
        ctx.score_mod = score_mod 
        ctx.score_mod_bwd = score_mod_bwd 
        ctx.mask_mod = mask_mod
        ctx.aux_scalars = aux_scalars
        ctx.block_sparse_tensors_bwd = block_sparse_tensors_bwd
        ctx.gather_bwd_token_chunk = gather_bwd_token_chunk
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, qv, out, lse, p, row_max, o_lo, gather_kv_indices, learnable_sink, *aux = ctx.saved_tensors
        aux_tensors = aux if aux else None
        if not ctx.return_lse:
            dlse = None
        if dout is None:
            dout = torch.zeros_like(out)
        if qv is not None:
            dq, dk, dv, dqv, dsink = _flash_attn_bwd_sparse_mla(
                q,
                k,
                v,
                qv,
                out,
                dout,
                lse,
                p,
                row_max,
                gather_kv_indices,
                learnable_sink=learnable_sink,
                softmax_scale=ctx.softmax_scale,
                causal=ctx.causal,
                recompute_p=ctx.gather_bwd_recompute_p,
                token_chunk=ctx.gather_bwd_token_chunk,
                o_lo=o_lo,
            )
            if ctx.shared_kv:
                return dqv, dv, None, None, None, None, None, None, dsink, *((None,) * 14)
            else:
                return dq, dk, dv, dqv, None, None, None, None, dsink, *((None,) * 14)
        else:
            bwd_result = _flash_attn_bwd(
                q,
                k,
                v,
                out,
                dout,
                lse,
                ctx.softmax_scale,
                ctx.causal,
                ctx.softcap,
                window_size_left=ctx.window_size[0],
                window_size_right=ctx.window_size[1],
                deterministic=ctx.deterministic,
                score_mod=ctx.score_mod,
                score_mod_bwd=ctx.score_mod_bwd,
                mask_mod=ctx.mask_mod,
                aux_tensors=aux_tensors,
                aux_scalars=ctx.aux_scalars,
                block_sparse_tensors=ctx.block_sparse_tensors_bwd,
                dlse=dlse,
                learnable_sink=learnable_sink,
            )
            if learnable_sink is None:
                dq, dk, dv = bwd_result
                dsink = None
            else:
                dq, dk, dv, dsink = bwd_result
            return dq, dk, dv, None, None, None, None, None, dsink, *((None,) * 14)


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: Optional[torch.Tensor],
        k: Optional[torch.Tensor],
        v: torch.Tensor,
        qv: Optional[torch.Tensor] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_k: Optional[torch.Tensor] = None,
        seqused_q: Optional[torch.Tensor] = None,
        seqused_k: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_k: Optional[int] = None,
        min_seqlen_k: Optional[int] = None,
        gather_kv_indices: Optional[torch.Tensor] = None,
        page_table: Optional[torch.Tensor] = None,
        softmax_scale: Optional[float] = None,
        causal: bool = False,
        window_size: Tuple[Optional[int], Optional[int]] = (None, None),
        learnable_sink: Optional[torch.Tensor] = None,
        softcap: float = 0.0,
        num_splits: int = 1,
        pack_gqa: Optional[bool] = None,
        deterministic: bool = False,
        score_mod: Optional[Callable] = None,
        score_mod_bwd: Optional[Callable] = None,
        mask_mod: Optional[Callable] = None,
        block_sparse_tensors: Optional[list] = None,
        aux_tensors: Optional[list] = None,
        aux_scalars: Optional[tuple] = None,
        return_lse: bool = False,
        scheduler_metadata: Optional["SchedulerMetadataTensorsTorch"] = None,
        seqlen_k_per_split: Optional[int] = None,
        disable_scheduler_metadata: bool = False,
        gather_bwd_recompute_p: bool = False,
        gather_bwd_token_chunk: Optional[int] = None,
    ):
        aux_scalars = tuple(aux_scalars) if aux_scalars else None
        shared_kv = k is v
        if shared_kv and v.shape[-1] == 512:
            # specialize MLA attention formula
            # O = softmax(Q @ K.T + Qv @ V.T) @ V
            # by setting q, k to None
            qv = q if qv is None else qv
            q = k = None
        out, lse, p, row_max, o_lo = _flash_attn_fwd(
            q,
            k,
            v,
            qv=qv,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            seqused_q=seqused_q,
            seqused_k=seqused_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            min_seqlen_k=min_seqlen_k,
            page_table=page_table,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            learnable_sink=learnable_sink,
            softcap=softcap,
            num_splits=num_splits,
            pack_gqa=pack_gqa,
            score_mod=score_mod,
            mask_mod=mask_mod,
            block_sparse_tensors=block_sparse_tensors,
            aux_tensors=aux_tensors,
            aux_scalars=aux_scalars,
            return_lse=return_lse,
            gather_kv_indices=gather_kv_indices,
            scheduler_metadata=scheduler_metadata,
            seqlen_k_per_split=seqlen_k_per_split,
            disable_scheduler_metadata=disable_scheduler_metadata,
            gather_bwd_recompute_p=gather_bwd_recompute_p,
        )
        ctx.save_for_backward(
            q,
            k,
            v,
            qv,
            out,
            lse,
            p,
            row_max,
            o_lo,
            gather_kv_indices,
            learnable_sink,
            cu_seqlens_q,
            cu_seqlens_k,
            seqused_q,
            seqused_k,
            *(aux_tensors or ()),
        )
        ctx.gather_bwd_recompute_p = gather_bwd_recompute_p
        ctx.shared_kv = shared_kv
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.window_size = window_size
        ctx.softcap = softcap
        ctx.deterministic = deterministic
        ctx.max_seqlen_q = max_seqlen_q
        ctx.max_seqlen_k = max_seqlen_k
        ctx.min_seqlen_k = min_seqlen_k
        ctx.return_lse = return_lse
        ctx.score_mod = score_mod
        ctx.score_mod_bwd = score_mod_bwd
        ctx.mask_mod = mask_mod
        ctx.aux_scalars = aux_scalars
        ctx.gather_bwd_token_chunk = gather_bwd_token_chunk
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, qv, out, lse, p, row_max, o_lo, gather_kv_indices, learnable_sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, *aux = ctx.saved_tensors
        aux_tensors = aux if aux else None
        if not ctx.return_lse:
            dlse = None
        if dout is None:
            dout = torch.zeros_like(out)
        if qv is not None:
            dq, dk, dv, dqv, dsink = _flash_attn_bwd_sparse_mla(
                q,
                k,
                v,
                qv,
                out,
                dout,
                lse,
                p,
                row_max,
                gather_kv_indices,
                learnable_sink=learnable_sink,
                softmax_scale=ctx.softmax_scale,
                causal=ctx.causal,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                seqused_q=seqused_q,
                seqused_k=seqused_k,
                max_seqlen_q=ctx.max_seqlen_q,
                max_seqlen_k=ctx.max_seqlen_k,
                min_seqlen_k=ctx.min_seqlen_k,
                recompute_p=ctx.gather_bwd_recompute_p,
                token_chunk=ctx.gather_bwd_token_chunk,
                o_lo=o_lo,
            )
            if ctx.shared_kv:
                return dqv, dv, None, None, *((None,) * 12), dsink, *((None,) * 16)
            else:
                return dq, dk, dv, dqv, *((None,) * 12), dsink, *((None,) * 16)
        else:
            bwd_result = _flash_attn_bwd(
                q,
                k,
                v,
                out,
                dout,
                lse,
                ctx.softmax_scale,
                ctx.causal,
                ctx.softcap,
                window_size_left=ctx.window_size[0],
                window_size_right=ctx.window_size[1],
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                seqused_q=seqused_q,
                seqused_k=seqused_k,
                max_seqlen_q=ctx.max_seqlen_q,
                max_seqlen_k=ctx.max_seqlen_k,
                deterministic=ctx.deterministic,
                score_mod=ctx.score_mod,
                score_mod_bwd=ctx.score_mod_bwd,
                aux_tensors=aux_tensors,
                aux_scalars=ctx.aux_scalars,
                mask_mod=ctx.mask_mod,
                dlse=dlse,
                learnable_sink=learnable_sink,
            )
            if learnable_sink is None:
                dq, dk, dv = bwd_result
                dsink = None
            else:
                dq, dk, dv, dsink = bwd_result
            return dq, dk, dv, None, *((None,) * 12), dsink, *((None,) * 16)



def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod: Optional[Callable] = None,
    score_mod_bwd: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    aux_tensors: Optional[list] = None,
    aux_scalars: Optional[tuple] = None,
    block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None,
    block_sparse_tensors_bwd: Optional[BlockSparseTensorsTorch] = None,
    return_lse: bool = False,
    gather_bwd_recompute_p: bool = False,
    gather_bwd_token_chunk: Optional[int] = None,
):
    gather_bwd_token_chunk = _validate_gather_bwd_kwargs(
        gather_kv_indices, gather_bwd_recompute_p, gather_bwd_token_chunk
    )
    if (
        gather_bwd_token_chunk is not None
        and q.dim() == 4
        and q.shape[0] > 1
        and q.shape[1] > gather_bwd_token_chunk
        # inference-only forwards never allocate the dS transient
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (q, k, v, qv))
    ):
        warnings.warn(
            "gather_bwd_token_chunk requires varlen or batch_size == 1; "
            "the backward will run unchunked (full-size dS transient).",
            stacklevel=2,
        )
    return FlashAttnFunc.apply(
        q,
        k,
        v,
        qv,
        gather_kv_indices,
        softmax_scale,
        causal,
        window_size,
        learnable_sink,
        softcap,
        num_splits,
        pack_gqa,
        deterministic,
        score_mod,
        score_mod_bwd,
        mask_mod,
        aux_tensors,
        aux_scalars,
        block_sparse_tensors,
        block_sparse_tensors_bwd,
        return_lse,
        gather_bwd_recompute_p,
        gather_bwd_token_chunk,
    )


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    min_seqlen_k: Optional[int] = None,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    gather_kv_indices: Optional[torch.Tensor] = None,
    page_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[Optional[int], Optional[int]] = (None, None),
    learnable_sink: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    deterministic: bool = False,
    score_mod: Optional[Callable] = None,
    score_mod_bwd: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    block_sparse_tensors: Optional[BlockSparseTensorsTorch] = None,
    aux_tensors: Optional[list] = None,
    aux_scalars: Optional[tuple] = None,
    return_lse: bool = False,
    scheduler_metadata: Optional[SchedulerMetadataTensorsTorch] = None,
    seqlen_k_per_split: Optional[int] = None,
    disable_scheduler_metadata: bool = False,
    gather_bwd_recompute_p: bool = False,
    gather_bwd_token_chunk: Optional[int] = None,
):
    gather_bwd_token_chunk = _validate_gather_bwd_kwargs(
        gather_kv_indices, gather_bwd_recompute_p, gather_bwd_token_chunk
    )
    return FlashAttnVarlenFunc.apply(
        q,
        k,
        v,
        qv,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_q,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        min_seqlen_k,
        gather_kv_indices,
        page_table,
        softmax_scale,
        causal,
        window_size,
        learnable_sink,
        softcap,
        num_splits,
        pack_gqa,
        deterministic,
        score_mod,
        score_mod_bwd,
        mask_mod,
        block_sparse_tensors,
        aux_tensors,
        aux_scalars,
        return_lse,
        scheduler_metadata,
        seqlen_k_per_split,
        disable_scheduler_metadata,
        gather_bwd_recompute_p,
        gather_bwd_token_chunk,
    )

