"""The dQ-major launch alone, tl or Gluon, on one dense/causal call (``tests/kernels/test_gluon_dq.py``,
``benchmarks/gluon_dq_check.py``): a ``triton_launch.Launch`` built as ``triton_bwd`` builds it for such a call,
each launch run into fresh (NaN-poisoned) outputs and scratch, and the Gluon kernel compiled for sm_90a on a
machine without a GPU (registers, spills, shared memory)."""
from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import tempfile
from typing import Optional

import torch

from gproj_patch.backends import gluon_dq, triton_bwd, triton_launch
from gproj_patch.backends.spec import default_scale, normalize_lse
from gproj_patch.backends.triton_launch import Launch, Scratch
from tests.helpers.kernel_build import cubin_resources


def dense_job(do, q, k, v, o, lse, *, causal: bool = False, causal_align: str = "top_left",
              scale: Optional[float] = None) -> Launch:
    """The ``Launch`` of a dense or causal GProj backward (no window, sink, softcap, varlen), with dq poisoned
    (NaN) and the tl configs of ``triton_bwd``; dk, dv are allocated and untouched (the dQ-major launch only)."""
    B, H, SQ, D = q.shape
    dq = torch.full_like(q, float("nan"))
    bd = triton_bwd.block_d(D)
    return Launch(do=do, q=q, k=k, v=v, o=o, lse=normalize_lse(lse, B, H, SQ), dq=dq, dk=torch.empty_like(k),
                  dv=torch.empty_like(v), sink=None, cu_q=q, cu_k=q, varlen=False, n_problems=B, max_q=SQ,
                  max_k=k.shape[2], window=(-1, 0 if causal else -1), bottom_right=causal_align == "bottom_right",
                  alpha=default_scale(D, scale), softcap=0.0, correct=True, fused=True,
                  cfg_dq=triton_bwd.block_config("dq", bd), cfg_dkdv=triton_bwd.block_config("dkdv", bd))


def case_inputs(name: str, seed: int):
    """(q, k, v, do, o, lse, mask kwargs) of an adversarial case on the GPU (``tests/helpers/adversarial``: the
    suite's cases, ``ODD_CASES``, and "witness" as ``witness_rows4``), o and lse from the fp64 oracle's forward."""
    from gproj_patch.backends.reference import reference_forward
    from tests.helpers import adversarial as adv
    if name == "witness":
        inp, kw = adv.witness_rows4(), {}
    elif name in adv.ODD_CASES:
        inp, kw = adv.make_odd(name, seed)
    else:
        inp, kw, _ = adv.make_case(name, seed=seed)
    out, lse = reference_forward(inp["q"], inp["k"], inp["v"], **kw)
    return inp["q"], inp["k"], inp["v"], inp["do"], out.to(inp["q"].dtype), lse.float(), kw


def case_job(do, q, k, v, o, lse, kw: dict) -> Launch:
    """``dense_job`` with a case's mask kwargs (causal, causal_align)."""
    return dense_job(do, q, k, v, o, lse, causal=kw.get("causal", False),
                     causal_align=kw.get("causal_align", "top_left"))


def poisoned_scratch(job: Launch) -> Scratch:
    """``triton_launch.allocate_scratch`` with every buffer NaN (a row the launch does not write stays NaN)."""
    scratch = triton_launch.allocate_scratch(job)
    for x in (scratch.delta, scratch.lse2, scratch.lam):
        x.fill_(float("nan"))
    return scratch


def run_tl(job: Launch) -> Scratch:
    """The tl dQ-major launch (``triton_kernels._bwd_dq``) of ``job`` into poisoned scratch; dq into job.dq."""
    scratch = poisoned_scratch(job)
    km = triton_bwd.kernel_module(False)
    km._bwd_dq[triton_launch.grid("dq", job)](
        **triton_launch.kernel_arguments("dq", job, scratch, block_d=triton_bwd.block_d(job.q.shape[-1])))
    return scratch


def run_gluon(job: Launch, config=None) -> Scratch:
    """The Gluon dQ-major launch (``gluon_dq.launch_dq``) of ``job`` into poisoned scratch; dq into job.dq."""
    scratch = poisoned_scratch(job)
    gluon_dq.launch_dq(job, scratch, config)
    return scratch


def fresh(job: Launch) -> Launch:
    """``job`` with a new poisoned dq (two launches compared on the same inputs)."""
    return dataclasses.replace(job, dq=torch.full_like(job.q, float("nan")))


def wgmma_serialized(kernel) -> bool:
    """True when ptxas serialized the kernel's wgmmas (a ``WARPGROUP.DEPBAR`` after every ``HGMMA``: its info
    C7511/C7512/C7515, which Triton does not surface), read from the SASS with Triton's own cuobjdump."""
    import triton
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
        tmp.write(kernel.asm["cubin"])
        tmp.flush()
        sass = subprocess.run([cuobjdump, "-sass", tmp.name], capture_output=True, text=True).stdout
    return sass.count("WARPGROUP.DEPBAR") >= sass.count("HGMMA") > 0


def compile_report(head_dims=(64, 128), configs=None, causal=(True, False)):
    """Registers, spills (bytes of stack a thread), shared memory and whether ptxas serialized the wgmmas, of the
    Gluon dQ-major kernel compiled for sm_90a with Triton's own ptxas; runs without a GPU (``gluon_dq.CONFIGS``
    come from it). ``configs``: {head_dim: [DqConfig, ...]} (default: the shipped one of each head dim)."""
    rows = []
    for D in head_dims:
        for cfg in (configs or {}).get(D, [gluon_dq.CONFIGS[D]]):
            for is_causal in causal:
                row = dict(D=D, causal=is_causal, **dataclasses.asdict(cfg))
                try:
                    k = _compile_sm90a(D, cfg, is_causal)
                except Exception as e:
                    rows.append(dict(row, error=f"{type(e).__name__}: {e}"[:300]))
                    continue
                rows.append(dict(row, **cubin_resources(k), smem=k.metadata.shared, serialized=wgmma_serialized(k)))
    return rows


def _compile_sm90a(D: int, cfg, causal: bool):
    """The kernel compiled for sm_90a from the arguments the launch builds for a 2·4·1024·D call (CPU tensors)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    from gproj_patch.backends import gluon_dq_kernels
    fn = gluon_dq_kernels._dq_kernel
    params = list(inspect.signature(fn.fn).parameters)
    x = torch.empty(2, 4, 1024, D, dtype=torch.bfloat16)
    f = torch.empty(2, 4, 1024, dtype=torch.float32)
    job = dataclasses.replace(dense_job(x, x, x, x, x, f, causal=causal), dq=x)
    args = gluon_dq.dq_arguments(job, triton_launch.allocate_scratch(job), cfg)
    const = {n: args[n] for n in params if n in ("CAUSAL", "NUM_STAGES", "RK_IN_FLIGHT")}
    const["num_warps"] = gluon_dq.NUM_WARPS
    sig = {p: "constexpr" if p in const else mangle_type(args[p]) for p in params}
    src = GluonASTSource(fn, sig, {(params.index(n),): value for n, value in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=gluon_dq.NUM_WARPS, maxnreg=gluon_dq.MAXNREG))
