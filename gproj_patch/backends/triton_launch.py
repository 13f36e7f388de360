"""The launches of one GProj backward (host side of ``triton_kernels.py``): the dQ-major kernel (which also writes
D, the base-2 LSE and the sink target for the next launch) and the KV-major kernel, and the learnable sink's
gradient. ``triton_bwd`` checks
the inputs, allocates the outputs, picks block configs and builds the ``Launch``; ``kernel_arguments`` turns it
into each launch's keyword arguments (the one place that knows the kernels' parameter names)."""
from __future__ import annotations

import math
from types import MappingProxyType
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .launch_cache import PREPARED
from .spec import shard_mass_tolerance


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
    gluon_config: Optional[object] = None  # configs.KernelConfig override (benchmarks)
    dq_major: str = "tl"  # the dQ-major launch's kernel: "tl" (below) or "gluon" (gluon_dq.launch_dq)
    gluon_dq_config: Optional[object] = None  # configs.DqConfig override (benchmarks)
    partial_rows: Optional[torch.Tensor] = None  # int32 (1,) on the device: the dQ-major launch adds its shard rows
    # a ring's row pass (backends/ring.py): the dQ-major launch stores its key shard's sums instead of dq and λ:
    # A = α Σ t·K in ``dq`` (fp32, a (B, H, Sq, 2, D) buffer's [..., 0, :]), B = α Σ r·K in its [..., 1, :], ρ and
    # m in the scratch's λ and T rows
    partial: bool = False
    own_outputs: bool = False  # dq, dk, dv not ``empty_like`` q, k, v (the ring's): their layouts join the key


def sink_gradient(target: torch.Tensor, job: Launch) -> torch.Tensor:
    """dsink_h = −Σ_{b,i} T_i over the rows of every problem (varlen: rows past the last sequence excluded),
    a fixed-shape PyTorch reduction (deterministic), in the sink's dtype."""
    if job.varlen:
        rows = torch.arange(target.shape[-1], device=target.device)
        inside = (rows < job.cu_q[-1]).view(1, 1, -1)  # no sync: cu_q stays on the device
        target = torch.where(inside, target, torch.zeros_like(target))
    return (-target.sum(dim=(0, 2))).to(job.sink.dtype)


#: log2(e): the kernels work in base 2 (scale_log2 = α·log2 e; softcap: cap_out = c·log2 e)
LOG2_E = math.log2(math.e)
#: the kernel of each launch in ``triton_kernels``
KERNELS = MappingProxyType({"dq": "_bwd_dq", "dkdv": "_bwd_dkdv"})


@dataclass(frozen=True)
class Scratch:
    """The fp32 (B·H, SQ) per-row buffers the dQ-major launch writes and the KV-major launch reads: D, the base-2
    LSE, λ and T = P_sink·D. D's buffer stands in as a placeholder pointer for λ when uncorrected and for T
    without a sink (the kernels never touch a placeholder: its flag is off)."""
    delta: torch.Tensor
    lse2: torch.Tensor
    lam: torch.Tensor
    target: torch.Tensor


def allocate_scratch(job: Launch) -> Scratch:
    """The ``Scratch`` of ``job`` (uninitialised: the dQ-major launch writes every row the other one reads): one
    allocation, a contiguous (B·H, SQ) row block per buffer (one allocation instead of up to four: host time)."""
    B, H, SQ, _ = job.q.shape
    n = 2 + bool(job.correct) + (job.sink is not None)
    rows = torch.empty((n, B * H, SQ), dtype=torch.float32, device=job.q.device).unbind(0)
    delta = rows[0]
    return Scratch(delta=delta, lse2=rows[1], lam=rows[2] if job.correct else delta,
                   target=rows[n - 1] if job.sink is not None else delta)


def _strides(prefix: str, x: torch.Tensor, dims: str = "bhsd") -> dict:
    """``{prefix_b: x.stride(0), prefix_h: ..., ...}``: a tensor's strides under the kernels' parameter names."""
    return {f"{prefix}_{d}": stride for d, stride in zip(dims, x.stride())}


def tensor_arguments(kind: str, job: Launch, scratch: Scratch) -> dict:
    """The tensor arguments of the ``kind`` launch by parameter name (placeholders included: a pointer whose flag is
    off is never read)."""
    if kind not in KERNELS:
        raise ValueError(f"kind must be one of {tuple(KERNELS)}, got {kind!r}")
    args = dict(Q=job.q, K=job.k, V=job.v, DO=job.do, Delta=scratch.delta, LSE2=scratch.lse2, LAM=scratch.lam,
                CU_Q=job.cu_q, CU_K=job.cu_k)
    if kind == "dq":
        args.update(O=job.o, LSE=job.lse, SINK=job.sink if job.sink is not None else scratch.delta, DQ=job.dq,
                    TGT=scratch.target,
                    PARTIAL_ROWS=job.partial_rows if job.partial_rows is not None else scratch.delta)
    else:
        args.update(DK=job.dk, DV=job.dv)
    return args


def kernel_arguments(kind: str, job: Launch, scratch: Scratch, *, block_d: int) -> dict:
    """Every keyword argument of the ``kind`` launch ("dq": ``_bwd_dq``, "dkdv": ``_bwd_dkdv``) of ``job``: the
    kernel's parameters by name (constexpr flags included) plus the launch options num_warps and num_stages.
    Pure host work: the launch passes exactly this, and a compile check (``python -m benchmarks.ptx``) compiles
    from it on a machine without a GPU. Everything but the tensors is a function of ``launch_key(job)``."""
    args = tensor_arguments(kind, job, scratch)
    q, k, v, do = job.q, job.k, job.v, job.do
    _, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    left, right = job.window
    block_m, block_n, num_warps, num_stages = job.cfg_dq if kind == "dq" else job.cfg_dkdv
    has_softcap = job.softcap > 0
    # softcap c: score = c·tanh(α s / c), the kernel takes cap_in = α / c and cap_out = c·log2 e (else unused)
    cap_in, cap_out = (job.alpha / job.softcap, job.softcap * LOG2_E) if has_softcap else (1.0, 1.0)
    args.update(
        **_strides("sq", q), **_strides("sk", k), **_strides("sv", v), **_strides("sdo", do),
        H=H, GROUP=H // HKV, SQ=SQ, SK=SK, HEAD_DIM=D, win_left=left, win_right=right,
        scale=job.alpha, scale_log2=job.alpha * LOG2_E, cap_in=cap_in, cap_out=cap_out,
        SOFTCAP=has_softcap, BOTTOM_RIGHT=job.bottom_right, HAS_L=left >= 0, HAS_R=right >= 0, VARLEN=job.varlen,
        CORRECT=job.correct,
        # varlen sequences end anywhere: only fixed lengths that are multiples of the tile load without masks
        EVEN_M=(not job.varlen) and SQ % block_m == 0, EVEN_N=(not job.varlen) and SK % block_n == 0,
        EVEN_D=block_d == D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_PRECISION=job.dot_precision,
        num_warps=num_warps, num_stages=num_stages)
    if kind == "dq":
        rel_tol, abs_tol = shard_mass_tolerance(q.dtype, job.max_k)
        args.update(**_strides("so", job.o), **_strides("sl", job.lse, "bhs"),
                    ssink=job.sink.stride(0) if job.sink is not None else 0, **_strides("sdq", job.dq),
                    mass_rel_tol=rel_tol, mass_abs_tol=abs_tol, HAS_SINK=job.sink is not None,
                    PARTIAL=job.partial, COUNT_PARTIAL=job.partial_rows is not None)
    else:
        args.update(**_strides("sdk", job.dk), **_strides("sdv", job.dv), FUSED=job.fused)
    return args


def launch_key(job: Launch) -> tuple:
    """What fixes every non-tensor argument of both launches of ``job`` and the dtype and strides of every tensor
    (``launch_cache``): the inputs' dtypes, shapes and strides, the sink's, the varlen sizes, the mask and the
    options. The outputs and the scratch are not in it: ``triton_bwd`` allocates them from the inputs (dq, dk, dv
    ``empty_like`` q, k, v, whose strides follow from those; the scratch contiguous of a fixed shape), and each
    tensor's 16-byte alignment is checked at every replay; a job with ``own_outputs`` (the ring's fp32 outputs)
    adds their dtypes and strides. The cu_seqlens placeholder (q) adds nothing."""
    q, k, v, do, o, lse, sink = job.q, job.k, job.v, job.do, job.o, job.lse, job.sink
    inputs = (q.dtype, q.device.index, tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), tuple(v.shape),
              v.stride(), do.dtype, do.stride(), o.dtype, o.stride(), lse.stride(),
              None if sink is None else (sink.dtype, sink.stride()),
              (job.cu_q.dtype, job.cu_q.stride(), job.cu_k.stride()) if job.varlen else None)
    outputs = None
    if job.own_outputs:
        outputs = tuple((x.dtype, x.stride()) for x in (job.dq, job.dk, job.dv))
    return inputs + (job.varlen, job.n_problems, job.max_q, job.max_k, job.window, job.bottom_right, job.alpha,
                     job.softcap, job.correct, job.fused, job.cfg_dq, job.cfg_dkdv, job.dot_precision,
                     job.partial, job.partial_rows is not None, outputs)


def _cdiv(n: int, block: int) -> int:
    """⌈n / block⌉ in host integers (``triton.cdiv`` is a JIT function: ~2 µs a host call)."""
    return -(-n // block)


def grid(kind: str, job: Launch) -> Tuple[int, int, int]:
    """The ``kind`` launch's grid: (query blocks, query heads, problems) for "dq", (key blocks, KV heads,
    problems) for "dkdv" (blocks of the longest sequence; programs past a shorter one return at once)."""
    if kind == "dq":
        return _cdiv(job.max_q, job.cfg_dq[0]), job.q.shape[1], job.n_problems
    return _cdiv(job.max_k, job.cfg_dkdv[1]), job.k.shape[1], job.n_problems


def launch(km, interpret: bool, job: Launch, *, block_d: int, parts, last_kernels: dict,
           scratch: Optional[Scratch] = None) -> torch.Tensor:
    """Run the launches ``parts`` names ("dq", "dkdv"; benchmarks time them apart: the dK/dV launch alone then
    reads scratch the dQ launch did not write, a timing, not a result); returns the fp32 (B·H, SQ) buffer of
    T = P_sink·D (D itself without a sink). Arguments by keyword from ``kernel_arguments``; ``scratch`` the
    caller's (a ring's passes: one scratch for both) or ``allocate_scratch``'s."""
    scratch = allocate_scratch(job) if scratch is None else scratch
    kq = kk = None
    if job.max_q == 0:
        return scratch.target  # every sequence has no query: dk, dv are the zeros already there
    # compiled launches replay a prepared launch of the same shape class (launch_cache); interpreted ones bind.
    # The Gluon launches key their own shape classes: with both Gluon, no tl key is built (host time)
    both_gluon = job.dq_major == "gluon" and job.kv_major == "gluon"
    key = None if interpret or both_gluon else launch_key(job)

    def run(kind: str):
        fn = getattr(km, KERNELS[kind])
        if interpret:
            return fn[grid(kind, job)](**kernel_arguments(kind, job, scratch, block_d=block_d))
        return PREPARED.launch(fn, None if key is None else (kind, id(fn)) + key, grid(kind, job),
                               job.q.device.index, lambda: tensor_arguments(kind, job, scratch),
                               lambda: kernel_arguments(kind, job, scratch, block_d=block_d))

    if "dq" in parts and job.dq_major == "gluon":
        from .gluon_dq import launch_dq
        kq = launch_dq(job, scratch, job.gluon_dq_config)
    elif "dq" in parts:  # also when every sequence has no key: it writes dq = 0 and the sink target
        kq = run("dq")
    if "dkdv" in parts and job.max_k > 0 and job.kv_major == "gluon":
        from .gluon_bwd import launch_dkdv
        kk = launch_dkdv(job, scratch.delta, scratch.lse2, scratch.lam, job.gluon_config)
    elif "dkdv" in parts and job.max_k > 0:
        kk = run("dkdv")
    if not interpret:
        last_kernels.clear()
        for name, kern in (("dq", kq), ("dkdv", kk)):
            last_kernels[name] = dict(regs=getattr(kern, "n_regs", None), spills=getattr(kern, "n_spills", None))
        last_kernels["kv_major"] = job.kv_major
        last_kernels["dq_major"] = job.dq_major
    return scratch.target
