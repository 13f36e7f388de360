"""Which custom-op shape survives ``torch.compile(mode="reduce-overhead")`` (inductor's CUDA-graph trees with graph
partitions)? A probe for the compiled SDPA hook (``ops/sdpa_compiled.py``), whose forward op returns (out, lse, aux)
with ``aux`` a CPU int64 call number: under reduce-overhead that op crashed inductor (a cudagraph partition
returned the op's output tuple to the CPU partition reading ``aux``; benchmarks/cuda_graph_check.py, 2026-12-02).

Toy attention ops with the hook's structure (the forward files a Python record under a call number, the backward
reads it: both must run their Python on every call, or the backward must never need it), in variants:

    v0  as shipped: fwd -> (out, lse, aux CPU), bwd -> (dq, dk, dv)
    v1  v0 with both ops tagged ``torch.Tag.cudagraph_unsafe``
    v2  fwd -> out only, lse and aux preallocated by the caller and mutated; fwd tagged unsafe; bwd as v0
    v3  v2 with the bwd tagged unsafe too

Each: 4 steps on new values copied into the same leaves; reported: exception, gradients vs eager fp32 math, how
many times each op's Python ran.

    python benchmarks/cudagraph_ops_probe.py
"""
from __future__ import annotations

import json
import traceback
from typing import Tuple

import torch
from torch import Tensor

FILED = {}
COUNT = {"fwd": 0, "bwd": 0}


def _math(q, k, v):
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype), lse


def _math_bwd(do, q, k, v, lse):
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.exp(s - lse[..., None])
    dv = p.transpose(-1, -2) @ do.float()
    dp = do.float() @ v.float().transpose(-1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    a = q.shape[-1] ** -0.5
    return (a * ds @ k.float()).to(q.dtype), (a * ds.transpose(-1, -2) @ q.float()).to(k.dtype), dv.to(v.dtype)


def _file():
    COUNT["fwd"] += 1
    n = COUNT["fwd"]
    FILED[n] = "record"
    return n


def make_variant(name: str, tag_fwd: bool, tag_bwd: bool, mutated: bool):
    tags_f = (torch.Tag.cudagraph_unsafe,) if tag_fwd else ()
    tags_b = (torch.Tag.cudagraph_unsafe,) if tag_bwd else ()

    @torch.library.custom_op(f"probe::{name}_bwd", mutates_args=(), tags=tags_b)
    def bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, aux: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        COUNT["bwd"] += 1
        assert FILED[int(aux[0])] == "record"
        return _math_bwd(do, q, k, v, lse)

    @bwd.register_fake
    def _(do, q, k, v, lse, aux):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    if not mutated:
        @torch.library.custom_op(f"probe::{name}_fwd", mutates_args=(), tags=tags_f)
        def fwd(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
            out, lse = _math(q, k, v)
            return out, lse, torch.tensor([_file()], dtype=torch.int64)

        @fwd.register_fake
        def _(q, k, v):
            return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32), \
                torch.empty(1, dtype=torch.int64)

        def setup(ctx, inputs, output):
            ctx.save_for_backward(*inputs, output[1], output[2])

        def backward(ctx, dout, _dlse, _daux):
            q, k, v, lse, aux = ctx.saved_tensors
            return bwd(dout, q, k, v, lse, aux)
        fwd.register_autograd(backward, setup_context=setup)

        def call(q, k, v):
            return fwd(q, k, v)[0]
        return call

    @torch.library.custom_op(f"probe::{name}_fwd", mutates_args=("lse", "aux"), tags=tags_f)
    def fwd_m(q: Tensor, k: Tensor, v: Tensor, lse: Tensor, aux: Tensor) -> Tensor:
        out, l_ = _math(q, k, v)
        lse.copy_(l_)
        aux.fill_(_file())
        return out

    @fwd_m.register_fake
    def _(q, k, v, lse, aux):
        return torch.empty_like(q)

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            lse = q.new_empty(q.shape[:3], dtype=torch.float32)
            aux = torch.empty(1, dtype=torch.int64)
            out = fwd_m(q, k, v, lse, aux)
            ctx.save_for_backward(q, k, v, lse, aux)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, lse, aux = ctx.saved_tensors
            return bwd(dout, q, k, v, lse, aux)
    return Fn.apply


def run(name, **kw):
    torch._dynamo.reset()
    call = make_variant(name, **kw)
    g = torch.Generator(device="cuda").manual_seed(0)
    leaves = [torch.randn(2, 4, 128, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
              for _ in range(3)]
    do = torch.randn(2, 4, 128, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    fn = torch.compile(call, mode="reduce-overhead")
    COUNT.update(fwd=0, bwd=0)
    errs = []
    for step in range(4):
        with torch.no_grad():
            for x in leaves + [do]:
                x.copy_(torch.randn(x.shape, device="cuda", generator=g, dtype=x.dtype))
        for x in leaves:
            x.grad = None
        fn(*leaves).backward(do)
        torch.cuda.synchronize()
        ref = _math_bwd(do, *(x.detach() for x in leaves), _math(*(x.detach() for x in leaves))[1])
        errs.append([round(float((x.grad.float() - r.float()).norm() / r.float().norm()), 5)
                     for x, r in zip(leaves, ref)])
    return {"errors": errs, "python_calls": dict(COUNT)}


def main():
    variants = {"v0": dict(tag_fwd=False, tag_bwd=False, mutated=False),
                "v1": dict(tag_fwd=True, tag_bwd=True, mutated=False),
                "v2": dict(tag_fwd=True, tag_bwd=False, mutated=True),
                "v3": dict(tag_fwd=True, tag_bwd=True, mutated=True)}
    out = {}
    for name, kw in variants.items():
        try:
            out[name] = {"ok": True, **run(name, **kw)}
        except Exception as exc:  # noqa: BLE001 - each variant reported on its own
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300],
                         "where": traceback.format_exc()[-700:]}
        print(name, json.dumps(out[name])[:1200], flush=True)


if __name__ == "__main__":
    main()
