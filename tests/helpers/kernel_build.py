"""Kernel build inspection on a GPU-less machine: compile for sm_90a with Triton's own ptxas and read the
registers, stack (spills) and shared memory. Used by the kernel tests (``tests/kernels/test_kv_major.py``) and
by ``benchmarks/gluon_check.py --compile-only`` / ``benchmarks/ptx_snapshot.py --spills``."""
import os
import subprocess
import tempfile
from typing import Dict

import torch

from gproj_patch.backends import gluon_bwd
from gproj_patch.backends.gluon_bwd import KernelConfig


def cubin_resources(kernel) -> Dict[str, int]:
    """Registers and stack bytes a thread (spills) of a compiled kernel, from Triton's own ptxas/cuobjdump."""
    import triton
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
        tmp.write(kernel.asm["cubin"])
        tmp.flush()
        res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", tmp.name],
                             capture_output=True, text=True).stdout
    usage = next((ln.strip() for ln in res.splitlines() if "REG:" in ln), "")
    fields = dict(part.split(":", 1) for part in usage.split() if ":" in part)
    return dict(regs=int(fields.get("REG", -1)), stack=int(fields.get("STACK", -1)))


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


def gluon_compile_report(head_dims=(64, 128), block_ms=(32, 64, 128), stages=(2, 3), release_pairs=(False,),
                         retire_tiles=(False,), causal=True):
    """Registers, spills (bytes of stack a thread), shared memory and whether ptxas serialized the wgmmas
    (``wgmma_serialized``) of the Gluon KV-major kernel compiled for sm_90a with Triton's own ptxas; runs
    without a GPU (the configs of ``gluon_bwd.CONFIGS`` come from it). ``release_pairs``, ``retire_tiles``: the
    variants to build (``KernelConfig``'s flags; rings ``release_pairs`` cannot take are skipped); ``causal``:
    the mask of the call compiled for (causal or full)."""
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    from gproj_patch.backends import gluon_kernels
    from gproj_patch.backends.triton_launch import Launch
    fn = gluon_kernels._dkdv_kernel
    params = list(inspect.signature(fn.fn).parameters)
    constexprs = [n for n, p in inspect.signature(fn.fn).parameters.items()
                  if "constexpr" in str(p.annotation) and n != "num_warps"]
    rows = []
    for D in head_dims:
        # CPU tensors shaped like a causal 2·4·1024·D call; the arguments are built as the launch builds them
        x = torch.empty(2, 4, 1024, D, dtype=torch.bfloat16)
        f = torch.empty(2 * 4, 1024, dtype=torch.float32)
        job = Launch(do=x, q=x, k=x, v=x, o=x, lse=f, dq=x, dk=x, dv=x, sink=None, cu_q=x, cu_k=x, varlen=False,
                     n_problems=2, max_q=1024, max_k=1024, window=(-1, 0 if causal else -1), bottom_right=False,
                     alpha=D ** -0.5,
                     softcap=0.0, correct=True, fused=True, cfg_dq=(64, 64, 4, 2), cfg_dkdv=(32, 64, 4, 2))
        for bm, st, pairs, rt in ((bm, st, p, r) for bm in block_ms for st in stages for p in release_pairs
                                  for r in retire_tiles):
            if pairs and (st % 2 or st < 4):
                continue
            tag = dict(D=D, block_m=bm, stages=st, **({"release_pairs": True} if pairs else {}),
                       **({"retire_tiles": True} if rt else {}))
            args = gluon_bwd.dkdv_arguments(job, f, f, f, KernelConfig(bm, st, pairs, retire_tiles=rt))
            const = {n: args[n] for n in constexprs}
            const["num_warps"] = gluon_bwd.NUM_WARPS
            sig = {p: "constexpr" if p in const else mangle_type(args[p]) for p in params}
            src = GluonASTSource(fn, sig, {(params.index(n),): c for n, c in const.items()})
            try:
                k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=gluon_bwd.NUM_WARPS, maxnreg=gluon_bwd.MAXNREG))
            except Exception as e:
                rows.append(dict(tag, error=f"{type(e).__name__}: {e}"[:200]))
                continue
            rows.append(dict(tag, **cubin_resources(k), smem=k.metadata.shared, serialized=wgmma_serialized(k)))
    return rows
