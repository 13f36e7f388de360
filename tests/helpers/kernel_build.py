"""Kernel build inspection on a GPU-less machine: compile for sm_90a with Triton's own ptxas and read the
registers, stack (spills) and shared memory. Used by the kernel tests (``tests/kernels/test_kv_major.py``) and
by ``python -m benchmarks.ptx`` (``--gluon``, ``--spills``, ``--wgmma``)."""
import os
import re
import subprocess
import tempfile
from typing import Dict, List

import torch

from gproj_patch.backends import gluon_bwd
from gproj_patch.backends.configs import GLUON_DQ_CONFIGS, KernelConfig


def _nvidia_tool(name: str) -> str:
    """The path of one of Triton's own CUDA tools (ptxas, cuobjdump)."""
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _cuobjdump(kernel, flag: str) -> str:
    """``cuobjdump <flag>`` of a compiled kernel's cubin (Triton's own cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
        tmp.write(kernel.asm["cubin"])
        tmp.flush()
        return subprocess.run([_nvidia_tool("cuobjdump"), flag, tmp.name], capture_output=True, text=True).stdout


def cubin_resources(kernel) -> Dict[str, int]:
    """Registers and stack bytes a thread (spills) of a compiled kernel, from Triton's own ptxas/cuobjdump."""
    res = _cuobjdump(kernel, "-res-usage")
    usage = next((ln.strip() for ln in res.splitlines() if "REG:" in ln), "")
    fields = dict(part.split(":", 1) for part in usage.split() if ":" in part)
    return dict(regs=int(fields.get("REG", -1)), stack=int(fields.get("STACK", -1)))


def _serialized_sass(sass: str) -> bool:
    """A ``WARPGROUP.DEPBAR`` for every ``HGMMA`` of the SASS: ptxas serialized the wgmmas."""
    return sass.count("WARPGROUP.DEPBAR") >= sass.count("HGMMA") > 0


def wgmma_serialized(kernel) -> bool:
    """True when ptxas serialized the kernel's wgmmas (a ``WARPGROUP.DEPBAR`` after every ``HGMMA``: its info
    C7511/C7512/C7515, which Triton does not surface), read from the SASS with Triton's own cuobjdump."""
    return _serialized_sass(_cuobjdump(kernel, "-sass"))


#: ptxas' C75xx info codes about wgmma (C7510–C7515: "wgmma.mma_async instructions are serialized due to ...")
_SERIALIZED_INFO = re.compile(r"\bC75\d\d\b")


def ptxas_wgmma_info(kernel) -> List[str]:
    """ptxas' own C75xx info lines about the kernel's wgmmas (serialized, and why), from Triton's ptxas re-run on
    the kernel's PTX the way Triton runs it (``-lineinfo -v --gpu-name=sm_XXa``; Triton 3.6 drops this log):
    a second, independent witness of what ``wgmma_serialized`` reads from the SASS."""
    arch = kernel.asm["ptx"].split(".target", 1)[1].split()[0]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as fh:
            fh.write(kernel.asm["ptx"])
        run = subprocess.run([_nvidia_tool("ptxas"), "-lineinfo", "-v", f"--gpu-name={arch}", src, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    return [ln.strip() for ln in (run.stdout + run.stderr).splitlines() if _SERIALIZED_INFO.search(ln)]


def mma_report(kernel) -> Dict[str, object]:
    """How a kernel's dots were lowered and scheduled, from its SASS and ptxas' log: ``hgmma`` (wgmma, sm_90's
    warpgroup MMA) and ``hmma`` (mma.sync) instruction counts, ``depbar`` (``WARPGROUP.DEPBAR`` waits),
    ``serialized`` (``wgmma_serialized``'s reading of the SASS), ``ptxas_serialized`` (ptxas said so: a C75xx
    line "... wgmma.mma_async instructions are serialized ...") and ``c75`` (the C75xx codes ptxas printed, e.g.
    C7519, an injected ``warpgroup.arrive``, which serializes nothing)."""
    sass = _cuobjdump(kernel, "-sass")
    info = ptxas_wgmma_info(kernel)
    return dict(hgmma=sass.count("HGMMA"), hmma=len(re.findall(r"\bHMMA\.", sass)),
                depbar=sass.count("WARPGROUP.DEPBAR"), serialized=_serialized_sass(sass),
                ptxas_serialized=any("serialized" in ln for ln in info),
                c75=sorted({m.group(0) for m in map(_SERIALIZED_INFO.search, info) if m}))


def gluon_compile_report(head_dims=(64, 128), block_ms=(32, 64, 128), stages=(2, 3), release_pairs=(False,),
                         retire_tiles=(False,), causal=True):
    """Registers, spills (bytes of stack a thread), shared memory and whether ptxas serialized the wgmmas
    (``wgmma_serialized``) of the Gluon KV-major kernel compiled for sm_90a with Triton's own ptxas; runs
    without a GPU (the configs of ``configs.GLUON_KV_CONFIGS`` come from it). ``release_pairs``, ``retire_tiles``: the
    variants to build (``KernelConfig``'s flags; rings ``release_pairs`` cannot take are skipped); ``causal``:
    the mask of the call compiled for (causal or full)."""
    from gproj_patch.backends import gluon_kernels
    fn = gluon_kernels._dkdv_kernel
    rows = []
    for D in head_dims:
        job, f = _cpu_job(D, causal)
        for bm, st, pairs, rt in ((bm, st, p, r) for bm in block_ms for st in stages for p in release_pairs
                                  for r in retire_tiles):
            if pairs and (st % 2 or st < 4):
                continue
            tag = dict(D=D, block_m=bm, stages=st, **({"release_pairs": True} if pairs else {}),
                       **({"retire_tiles": True} if rt else {}))
            args = gluon_bwd.dkdv_arguments(job, f, f, f, KernelConfig(bm, st, pairs, retire_tiles=rt))
            rows.append(dict(tag, **_sm90a_build(fn, args)))
    return rows


def _cpu_job(D: int, causal: bool, sink: bool = False):
    """(``triton_launch.Launch``, an fp32 (B·H, Sq) row buffer) of CPU tensors shaped like a 2·4·1024·D BF16 call
    (causal or full, with a sink of 4 heads or none): the compile reports build their arguments from it as the
    launches do."""
    from gproj_patch.backends.triton_launch import Launch
    x = torch.empty(2, 4, 1024, D, dtype=torch.bfloat16)
    f = torch.empty(2 * 4, 1024, dtype=torch.float32)
    job = Launch(do=x, q=x, k=x, v=x, o=x, lse=torch.empty(2, 4, 1024), dq=x, dk=x, dv=x,
                 sink=torch.zeros(4) if sink else None, cu_q=x, cu_k=x, varlen=False, n_problems=2, max_q=1024,
                 max_k=1024, window=(-1, 0 if causal else -1), bottom_right=False, alpha=D ** -0.5, softcap=0.0,
                 correct=True, fused=True, cfg_dq=(64, 64, 4, 2), cfg_dkdv=(32, 64, 4, 2))
    return job, f


def _sm90a_build(fn, args: dict) -> dict:
    """Compile the Gluon kernel ``fn`` for sm_90a from its launch's keyword arguments (constexprs included), with
    the launch's warps and maxnreg: registers, stack bytes, shared memory and ``serialized`` — or ``error``."""
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    params = list(inspect.signature(fn.fn).parameters)
    const = {n: args[n] for n, p in inspect.signature(fn.fn).parameters.items()
             if "constexpr" in str(p.annotation) and n != "num_warps"}
    const["num_warps"] = gluon_bwd.NUM_WARPS
    sig = {p: "constexpr" if p in const else mangle_type(args[p]) for p in params}
    src = GluonASTSource(fn, sig, {(params.index(n),): c for n, c in const.items()})
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=gluon_bwd.NUM_WARPS, maxnreg=gluon_bwd.MAXNREG))
    except Exception as e:
        return dict(error=f"{type(e).__name__}: {e}"[:200])
    return dict(**cubin_resources(k), smem=k.metadata.shared, serialized=wgmma_serialized(k))


def gluon_dq_compile_report(head_dims=(64, 128), configs=None, causal=True, sink=False):
    """``gluon_compile_report`` for the Gluon dQ-major kernel: one row per (head dim, ``configs.DqConfig``;
    default the shipped ``configs.GLUON_DQ_CONFIGS``), compiled for sm_90a without a GPU (the one-hot columns stand on
    the CPU: only their descriptor's type enters the build)."""
    from unittest import mock
    from gproj_patch.backends import gluon_dq, gluon_dq_kernels
    from gproj_patch.backends.triton_launch import Scratch
    rows = []
    for D in head_dims:
        job, f = _cpu_job(D, causal, sink)
        scratch = Scratch(delta=f, lse2=f, lam=f, target=f)
        for cfg in configs or (GLUON_DQ_CONFIGS[D],):
            one_hot = lambda device, dtype, n: torch.zeros(2 * n, gluon_dq.ROWSUM_WIDTH, dtype=dtype)  # noqa
            with mock.patch.object(gluon_dq, "_one_hot", one_hot):
                gluon_dq._launch_class.cache_clear()
                args = gluon_dq.dq_arguments(job, scratch, cfg)
                gluon_dq._launch_class.cache_clear()
            rows.append(dict(D=D, block_n=cfg.block_n, stages=cfg.num_stages,
                             **_sm90a_build(gluon_dq_kernels._dq_kernel, args)))
    return rows
