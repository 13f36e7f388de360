"""Audit a hand-written Triton attention (FlashAttention-2 style, forward and backward in Triton) — GPU; on a CPU
only in fp16 through Triton's interpreter (``TRITON_INTERPRET=1``; its bf16 is not exact).

    python examples/audit_triton.py                               # CUDA: bf16
    TRITON_INTERPRET=1 python examples/audit_triton.py --fp16      # CPU, interpreted (two cases, ~20 s)
    python -m gproj_patch audit --backend examples/audit_triton.py:triton_attention

On a CPU without ``TRITON_INTERPRET=1`` (Triton then has no driver to launch on) the script says so and exits
with status 1; under the interpreter in bf16 it does the same (the interpreter's bf16 is wrong, its fp16 exact:
the audit would measure the interpreter, not the kernel).

Like every FA-style backward, ``_bwd_kernel`` rounds dS = P ∘ (dP − D) to the input format before its two
products (``ds.to(q.dtype)``): dS's rows no longer sum to zero, and dq picks up α·ρ_i·(mean key). The audit
shows it on the witness (exact 0) and on keys offset far beyond their spread; the reference-vs-random tests a
kernel usually ships with do not. Dense and causal (Sq == Sk) attention, any lengths, head dim 16..128 (a power
of two); other cases raise and are reported n/a.
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

from gproj_patch.audit import check
from gproj_patch.backends.compat import triton_interpreter_index_patch  # Triton 3.6's interpreter + numpy 2.4

BLOCK = 16


@triton.jit
def _fwd_kernel(Q, K, V, O, L, scale, SQ, SK, D: tl.constexpr, CAUSAL: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr):
    bh, mb = tl.program_id(1), tl.program_id(0)
    rm = mb * BM + tl.arange(0, BM)
    rd = tl.arange(0, D)
    q = tl.load(Q + bh * SQ * D + rm[:, None] * D + rd[None, :], mask=rm[:, None] < SQ, other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for n0 in range(0, SK, BN):
        rn = n0 + tl.arange(0, BN)
        k = tl.load(K + bh * SK * D + rn[:, None] * D + rd[None, :], mask=rn[:, None] < SK, other=0.0)
        v = tl.load(V + bh * SK * D + rn[:, None] * D + rd[None, :], mask=rn[:, None] < SK, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        ok = rn[None, :] < SK
        if CAUSAL:
            ok = ok & (rn[None, :] <= rm[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    tl.store(O + bh * SQ * D + rm[:, None] * D + rd[None, :], (acc / l[:, None]).to(O.dtype.element_ty),
             mask=rm[:, None] < SQ)
    tl.store(L + bh * SQ + rm, m + tl.log(l), mask=rm < SQ)


@triton.jit
def _bwd_kernel(Q, K, V, DO, L, DELTA, DQ, DK, DV, scale, SQ, SK, D: tl.constexpr, CAUSAL: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, KV_MAJOR: tl.constexpr):
    """KV_MAJOR: one key block, all query blocks -> dk, dv. Else: one query block, all key blocks -> dq."""
    bh, blk = tl.program_id(1), tl.program_id(0)
    rd = tl.arange(0, D)
    if KV_MAJOR:
        rn = blk * BN + tl.arange(0, BN)
        k = tl.load(K + bh * SK * D + rn[:, None] * D + rd[None, :], mask=rn[:, None] < SK, other=0.0)
        v = tl.load(V + bh * SK * D + rn[:, None] * D + rd[None, :], mask=rn[:, None] < SK, other=0.0)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        for m0 in range(0, SQ, BM):
            rm = m0 + tl.arange(0, BM)
            q = tl.load(Q + bh * SQ * D + rm[:, None] * D + rd[None, :], mask=rm[:, None] < SQ, other=0.0)
            do = tl.load(DO + bh * SQ * D + rm[:, None] * D + rd[None, :], mask=rm[:, None] < SQ, other=0.0)
            lse = tl.load(L + bh * SQ + rm, mask=rm < SQ, other=0.0)
            delta = tl.load(DELTA + bh * SQ + rm, mask=rm < SQ, other=0.0)
            ok = (rn[None, :] < SK) & (rm[:, None] < SQ)
            if CAUSAL:
                ok = ok & (rn[None, :] <= rm[:, None])
            p = tl.where(ok, tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)  # dS rounded to the input format: the leak
        tl.store(DK + bh * SK * D + rn[:, None] * D + rd[None, :], (dk * scale).to(DK.dtype.element_ty),
                 mask=rn[:, None] < SK)
        tl.store(DV + bh * SK * D + rn[:, None] * D + rd[None, :], dv.to(DV.dtype.element_ty), mask=rn[:, None] < SK)
    else:
        rm = blk * BM + tl.arange(0, BM)
        q = tl.load(Q + bh * SQ * D + rm[:, None] * D + rd[None, :], mask=rm[:, None] < SQ, other=0.0)
        do = tl.load(DO + bh * SQ * D + rm[:, None] * D + rd[None, :], mask=rm[:, None] < SQ, other=0.0)
        lse = tl.load(L + bh * SQ + rm, mask=rm < SQ, other=0.0)
        delta = tl.load(DELTA + bh * SQ + rm, mask=rm < SQ, other=0.0)
        dq = tl.zeros([BM, D], tl.float32)
        for n0 in range(0, SK, BN):
            rn = n0 + tl.arange(0, BN)
            k = tl.load(K + bh * SK * D + rn[:, None] * D + rd[None, :], mask=rn[:, None] < SK, other=0.0)
            v = tl.load(V + bh * SK * D + rn[:, None] * D + rd[None, :], mask=rn[:, None] < SK, other=0.0)
            ok = (rn[None, :] < SK) & (rm[:, None] < SQ)
            if CAUSAL:
                ok = ok & (rn[None, :] <= rm[:, None])
            p = tl.where(ok, tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None]), 0.0)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)  # dS rounded to the input format: the leak
        tl.store(DQ + bh * SQ * D + rm[:, None] * D + rd[None, :], (dq * scale).to(DQ.dtype.element_ty),
                 mask=rm[:, None] < SQ)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        B, H, SQ, D = q.shape
        SK = k.shape[2]
        q, k, v = (x.contiguous() for x in (q, k, v))
        o = torch.empty_like(q)
        lse = torch.empty(B * H, SQ, device=q.device, dtype=torch.float32)
        with triton_interpreter_index_patch():
            _fwd_kernel[(triton.cdiv(SQ, BLOCK), B * H)](q, k, v, o, lse, scale, SQ, SK, D=D, CAUSAL=causal,
                                                         BM=BLOCK, BN=BLOCK)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        B, H, SQ, D = q.shape
        SK = k.shape[2]
        do = do.contiguous()
        delta = (do.float() * o.float()).sum(-1).reshape(B * H, SQ)  # FA's preprocess, from the saved output
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        args = (q, k, v, do, lse, delta, dq, dk, dv, ctx.scale, SQ, SK)
        meta = dict(D=D, CAUSAL=ctx.causal, BM=BLOCK, BN=BLOCK)
        with triton_interpreter_index_patch():
            _bwd_kernel[(triton.cdiv(SK, BLOCK), B * H)](*args, KV_MAJOR=True, **meta)
            _bwd_kernel[(triton.cdiv(SQ, BLOCK), B * H)](*args, KV_MAJOR=False, **meta)
        return dq, dk, dv, None, None


def triton_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """SDPA's signature: (B, H, S, D) bf16/fp16 tensors, dense or causal with Sq == Sk."""
    D = q.shape[-1]
    if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise NotImplementedError("CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter) set before start")
    if attn_mask is not None:
        raise NotImplementedError("this kernel takes no dense mask")
    if is_causal and q.shape[2] != k.shape[2]:
        raise NotImplementedError("causal needs Sq == Sk here")
    if D < 16 or D > 128 or D & (D - 1):
        raise NotImplementedError(f"head dim {D}: 16..128, a power of two")
    return _TritonAttention.apply(q, k, v, bool(is_causal), float(D ** -0.5 if scale is None else scale))


def cpu_reason(fp16: bool):
    """Why this example cannot run on the CPU as asked (None when it can)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return ("needs CUDA, or Triton's interpreter on the CPU in fp16: "
                "TRITON_INTERPRET=1 python examples/audit_triton.py --fp16")
    if not fp16:
        return "add --fp16: Triton's interpreter computes bf16 wrongly (its fp16 is exact)"
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fp16 = "--fp16" in argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    why = cpu_reason(fp16) if device == "cpu" else None
    if why is not None:  # one clean line, not every case reported n/a with Triton's driver error
        print(f"audit_triton.py: {why}", file=sys.stderr)
        return 1
    cases = "witness,key_offset_128" if device == "cpu" else "witness,diffuse,key_offset_*,sink_offset_64,gqa"
    report = check(triton_attention, cases=cases, dtype="fp16" if fp16 else "bf16", device=device)
    print(report.explain())
    return 0


if __name__ == "__main__":
    sys.exit(main())
