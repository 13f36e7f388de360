"""Multi-GPU: DDP / FSDP2 gradients, context parallel, and the per-shard GProj math, with the table last.

    python -m benchmarks.multi_gpu                      # 2 GPUs (NCCL ranks through torchrun): every part
    python -m benchmarks.multi_gpu --cpu                # the same on two gloo ranks (small sizes; ~2 min on 2 cores)
    python -m benchmarks.multi_gpu --part shards --cpu  # one part (dp and cp run under torchrun -m)

Without ``--part`` this process runs every part in a child process with its own time limit (a rank stuck in a
collective ends its part, not the run), then the two examples under ``GPROJ_PATCH=1`` (torchrun DDP, accelerate
FSDP2), appends every child's output to ``all.log`` with a start and an end line each, and prints the report.
``GPROJ_PATCH=1`` needs the start-up hook (a .pth in a site directory); it is installed when absent unless
``--no-hook-install`` (part dp then enables the patch in code and says so in its JSON).

Parts (``--part``; run in this order):

``dp`` (torchrun, 2 ranks; the patch on through ``GPROJ_PATCH=1`` — enabled in code if the start-up hook is
    absent, which the JSON records). A tiny Llama (``examples/multi_gpu_train.py``, loaded from its file: FP32
    parameters, BF16 autocast, one layer's keys driven into the large-key regime) takes one step on a global
    batch split over the ranks, wrapped in DDP and then in FSDP2. Rank 0 then runs, in one process on the same
    global batch: the patched model (the target), the same in two micro-batches of the ranks' shapes (the
    reduction-order noise floor), the unpatched model (how much the patch changes the gradients) and an FP64
    model (the truth).
    Criteria: ‖g_DDP − g_single‖/‖g_single‖ ≤ 2·noise + 1e-5, same for FSDP2; every rank's ``stats()`` shows
    the kernel tier (CUDA: ``gproj`` > 0; CPU: the FP32 tier) and no "original" backward.
``cp`` (torchrun, 2 ranks). ``torch.distributed.tensor.experimental.context_parallel`` on the audit's
    ``key_offset_128`` case (full and causal) and ``sink_offset_64``, for each SDPA backend PyTorch's ring
    attention runs (flash, efficient, cuDNN; CPU: the math backend, where DTensor redistributes instead of a
    ring), unpatched and with the patch enabled *before* the context (the supported order; see
    docs/distributed.md). Recorded: dq/dk/dv error of the gathered gradients against fp64 of the whole sequence,
    unpatched and patched, and the corrected backwards in ``stats()`` on every rank. Criteria: on CUDA the
    corrected ring (``hooks/context_parallel.py``) ran on every rank and the patched gradients are within
    0.5 % of fp64; on the CPU (the math backend: no ring and no fused backward to correct) the patched gradients
    are the unpatched ones bit for bit.
``shards`` (one process). The math that corrected CP would need (docs/distributed.md): the sequence cut into W chunks,
    every (query chunk, key chunk) block's backward run *separately* with the global output and the global LSE —
    exactly the blocks ring attention's backward runs — with GProj's projection per block (λ per key shard),
    dq summed over key chunks, dk/dv over query chunks. Backend: the GProj Triton kernel on CUDA, the
    rounding-exact emulation of a fused BF16 backward on the CPU; uncorrected blocks alongside. Then the same
    blocks in a small torch model (t = BF16(dS), r = BF16(P), contractions in fp64) for the candidate schemes:
    λ per shard, the row's global λ = Σρ/Σm, global λ with BF16 block partials, and global λ with BF16
    partials contracted with centered keys k − k̄. λ per shard cannot be accurate: every shard's exact dS row
    sum is non-zero, only the whole row's is (docs/distributed.md has the measured table). Criterion (the recipe
    a corrected CP backward would implement): global λ + centered keys ≤ 0.5 %.
``report``: reads the parts' JSON from ``--dir`` and prints the table (exit 1 if a criterion failed).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import torch

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "multi_gpu_train.py")

CP_CASES = (("key_offset_128", False), ("key_offset_128", True), ("sink_offset_64", False))
TOL_SHARD = 5e-3


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _flat(grads: dict) -> torch.Tensor:
    return torch.cat([grads[n].reshape(-1).double() for n in sorted(grads)])


def _grad_rel(a: dict, b: dict):
    """(global relative difference, worst per-parameter relative difference, its name)."""
    worst, name = 0.0, None
    for n in sorted(b):
        d = float((a[n].double() - b[n].double()).norm() / max(b[n].double().norm(), 1e-30))
        if d > worst:
            worst, name = d, n
    return _rel(_flat(a), _flat(b)), worst, name


def example():
    """``examples/multi_gpu_train.py`` as a module (the training loop this part checks), loaded from its file."""
    spec = importlib.util.spec_from_file_location("multi_gpu_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dist(train):
    import torch.distributed as dist
    rank, world, device = train.setup()
    if world < 2:
        raise SystemExit("run this part under torchrun --nproc-per-node 2 -m benchmarks.multi_gpu, or run every "
                         "part with python -m benchmarks.multi_gpu")
    return dist, rank, world, device


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


# ------------------------------------------------------------------------------------------------- part dp --
def part_dp(args):
    import gproj_patch
    from gproj_patch.integrations import startup
    train = example()
    full_grads, global_batch, local_slice, loss_of, make_model, wrap = (
        train.full_grads, train.global_batch, train.local_slice, train.loss_of, train.make_model, train.wrap)
    dist, rank, world, device = _dist(train)
    enabled_by = "GPROJ_PATCH=1 start-up hook" if startup.status()["state"] == "enabled" else None
    if not gproj_patch.is_enabled():
        gproj_patch.enable(mode="gproj")
        enabled_by = "gproj_patch.enable() in code (the start-up hook did not run)"
    small = device.type == "cpu"
    cfg = dict(layers=2, hidden=128 if small else 512, heads=4 if small else 8, kv_heads=2 if small else 4,
               drive_layer=1, offset=60.0)
    seq, gb = (64, 4) if small else (1024, 8)
    ids = global_batch(0, gb, seq)
    out = {"device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
           "world": world, "enabled_by": enabled_by, "model": cfg, "seq": seq, "global_batch": gb}
    grads = {}
    for how in ("ddp", "fsdp2"):
        gproj_patch.reset_stats()
        model = wrap(make_model(device, **cfg), how, device)
        loss_of(model, local_slice(ids, rank, world), device).backward()
        g = full_grads(model)  # FSDP2: a collective (every rank gathers)
        st = gproj_patch.stats()
        st.pop("layers", None)
        gathered = [None] * world
        dist.all_gather_object(gathered, st)
        grads[how] = g
        out[how] = {"stats_per_rank": gathered}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        def single(micro=1, patched=True, fp64=False):
            model = make_model(device, **cfg)
            if fp64:
                model = model.double()
            if not patched:
                gproj_patch.disable()
            try:
                for part in ids.chunk(micro):
                    if fp64:
                        x = part.to(device)
                        loss = model(input_ids=x, labels=x).loss
                    else:
                        loss = loss_of(model, part, device)
                    (loss / micro).backward()
            finally:
                if not patched:
                    gproj_patch.enable(mode="gproj")
            return full_grads(model)
        g1 = single()
        split = single(micro=world)
        unpatched = single(patched=False)
        g64 = single(fp64=True)
        noise = _grad_rel(split, g1)[0]
        out["noise_split_vs_single"] = noise
        out["unpatched_vs_single"] = _grad_rel(unpatched, g1)[0]
        out["fp64_err_patched"] = _grad_rel(g1, g64)[0]
        out["fp64_err_unpatched"] = _grad_rel(unpatched, g64)[0]
        probe = f"model.layers.{cfg['drive_layer']}.self_attn.q_proj.weight"  # the driven layer's query weights
        out["probe_param"] = probe
        out["probe_fp64_err"] = {"patched": _rel(g1[probe], g64[probe]),
                                 "unpatched": _rel(unpatched[probe], g64[probe])}
        for how in ("ddp", "fsdp2"):
            rel, worst, name = _grad_rel(grads[how], g1)
            tiers_ok = all((s["gproj"] > 0 if device.type == "cuda" else s["fp32"] + s["gproj"] > 0)
                           and s["original"] == 0 for s in out[how]["stats_per_rank"])
            out[how].update(probe_fp64_err=_rel(grads[how][probe], g64[probe]), rel_vs_single=rel,
                            worst_param_rel=worst, worst_param=name,
                            rel_vs_split=_grad_rel(grads[how], split)[0], fp64_err=_grad_rel(grads[how], g64)[0],
                            tiers_ok=tiers_ok, passed=bool(rel <= 2 * noise + 1e-5 and tiers_ok))
        _write(args.out, out)
        print(json.dumps({k: v for k, v in out.items() if k not in ("ddp", "fsdp2")}, default=str), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- part cp --
def _case_inputs(name, device, small):
    from gproj_patch.audit.cases import get_case
    inp = get_case(name).build(seed=0, dtype=torch.float64, device="cpu", quick=small)
    low = tuple(t.to(torch.bfloat16) for t in (inp.q, inp.k, inp.v, inp.do))
    # the oracle sees the same BF16-rounded inputs (as the audit): only the backward's own error is measured
    return tuple(t.double() for t in low), tuple(t.to(device) for t in low)


def _cp_once(mesh, backend, q, k, v, do, causal):
    """Gradients (and output) of one context-parallel SDPA call, gathered back in sequence order."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import sdpa_kernel
    bufs = [t.clone() for t in (q, k, v, do)]
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2]):
        ql, kl, vl = (t.detach().clone().requires_grad_() for t in bufs[:3])
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
        o.backward(bufs[3])
        grads = context_parallel_unshard(mesh, [ql.grad, kl.grad, vl.grad], [2, 2, 2])
        o = context_parallel_unshard(mesh, [o.detach()], [2])[0]
    return o.cpu(), [g.cpu() for g in grads]


def part_cp(args):
    import gproj_patch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.attention import SDPBackend

    from gproj_patch.backends.reference import reference_backward
    dist, rank, world, device = _dist(example())
    if gproj_patch.is_enabled():  # this part switches the patch itself (unpatched, then enabled before CP)
        gproj_patch.disable()
    mesh = DeviceMesh(device.type, list(range(world)))
    small = device.type == "cpu"
    backends = ([("math", SDPBackend.MATH)] if small else
                [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                 ("cudnn", SDPBackend.CUDNN_ATTENTION)])
    rows = []
    for name, causal in CP_CASES:
        if small and causal:
            continue  # math backend + is_causal on DTensors raises (a plain mask meets DTensors)
        (q64, k64, v64, do64), (q, k, v, do) = _case_inputs(name, device, small)
        ref = reference_backward(q64, k64, v64, do64, causal=causal)
        for bname, backend in backends:
            row = {"case": name + (" causal" if causal else ""), "backend": bname}
            try:
                _, g_u = _cp_once(mesh, backend, q, k, v, do, causal)
                gproj_patch.enable(mode="gproj")
                gproj_patch.reset_stats()
                try:
                    _, g_p = _cp_once(mesh, backend, q, k, v, do, causal)
                    st = gproj_patch.stats()
                finally:
                    gproj_patch.disable()
                corrected = [None] * world
                dist.all_gather_object(corrected, st["gproj"] + st["fp32"])
                row.update(err_unpatched=[_rel(g, r) for g, r in zip(g_u, ref)],
                           err_patched=[_rel(g, r) for g, r in zip(g_p, ref)],
                           bitwise_equal=all(torch.equal(a, b) for a, b in zip(g_u, g_p)),
                           corrected_per_rank=corrected, reasons=st["fallback_reasons"], ring=not small)
            except Exception as exc:  # noqa: BLE001 - a backend CP cannot run is a row, not a crash
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        _write(args.out, {"world": world, "rows": rows})
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- part shards --
def shard_backward(q, k, v, o, do, lse, world, causal, correct, backend):
    """dq, dk, dv from world × world (query chunk, key chunk) blocks, each run separately with the global o and
    LSE (ring attention's backward blocks); per-block projection when ``correct``."""
    S = q.shape[2]
    if S % world:
        raise ValueError(f"sequence {S} not divisible by {world}")
    n = S // world
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for i in range(world):
        rows = slice(i * n, (i + 1) * n)
        for j in range(world):
            if causal and j > i:
                continue
            cols = slice(j * n, (j + 1) * n)
            blk = (do[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], o[:, :, rows],
                   lse[:, :, rows].contiguous())
            block_causal = causal and i == j
            if backend == "triton":
                from gproj_patch.backends.triton_bwd import gproj_backward
                g = gproj_backward(*blk, causal=block_causal, correct=correct)
            else:
                from gproj_patch.backends.emulation import emulated_backward
                d_o, qq, kk, vv, oo, ll = blk
                g = emulated_backward(qq, kk, vv, oo, d_o, ll, fmt="bf16", correct=correct, causal=block_causal)
            dq[:, :, rows] += g[0].float()
            dk[:, :, cols] += g[1].float()
            dv[:, :, cols] += g[2].float()
    return dq, dk, dv


SCHEMES = ("uncorrected", "shard_zero", "global", "global_bf16", "global_centered_bf16")


def scheme_backward(q, k, v, o, do, lse, world, causal, scheme):
    """dq, dk (fp64) from the same world × world blocks, with t = BF16(dS) and r = BF16(P) formed in FP32 as a
    fused kernel forms them and the contractions in fp64 (isolates the projection). ``scheme``: "uncorrected";
    "shard_zero" (docs/distributed.md: λ per key shard, λ^(s) = ρ^(s)/m^(s)); "global" (λ = Σ_s ρ^(s) / Σ_s m^(s): the
    row's own λ, which needs every key shard's two row sums before dq/dk are formed); "global_bf16": the same with
    each block's dq/dk partial rounded to BF16 before the FP32 accumulation, as ring attention accumulates the
    BF16 outputs of a fused backward per block (a block's partial dq carries its shard's non-zero row sum times the
    common key offset, which only cancels across shards); "global_centered_bf16": BF16 partials again, but dq's
    partials contract with k_j − k̄ (k̄ the mean key of the whole sequence per (batch, head), one all-reduce), which
    changes nothing exactly (Σ_j (t − λr)_ij = 0 over the whole row) and keeps the offset out of the partials."""
    B, H, S, D = q.shape
    n, alpha = S // world, D ** -0.5
    qf, kf, vf, of, dof = (t.float() for t in (q, k, v, o, do))
    delta = (dof * of).sum(-1, keepdim=True)
    blocks, rho = {}, torch.zeros(B, H, S, 1, dtype=torch.float64, device=q.device)
    m = torch.zeros_like(rho)
    for i in range(world):
        for j in range(world):
            if causal and j > i:
                continue
            rows, cols = slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n)
            s = alpha * qf[:, :, rows] @ kf[:, :, cols].transpose(-1, -2)
            if causal and i == j:
                s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
            p = torch.exp(s - lse[:, :, rows, None])
            ds = p * (dof[:, :, rows] @ vf[:, :, cols].transpose(-1, -2) - delta[:, :, rows])
            t, r = ds.bfloat16().double(), p.bfloat16().double()
            blocks[i, j] = (rows, cols, t, r)
            rho[:, :, rows] += t.sum(-1, keepdim=True)
            m[:, :, rows] += r.sum(-1, keepdim=True)
    dq = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float64, device=q.device)
    keys = k.double() - (k.float().mean(2, keepdim=True).double() if scheme == "global_centered_bf16" else 0.0)
    for (i, j), (rows, cols, t, r) in blocks.items():
        if scheme == "shard_zero":
            t = t - t.sum(-1, keepdim=True) / r.sum(-1, keepdim=True).clamp_min(1e-300) * r
        elif scheme.startswith("global"):
            t = t - rho[:, :, rows] / m[:, :, rows].clamp_min(1e-300) * r
        pq, pk = alpha * t @ keys[:, :, cols], alpha * t.transpose(-1, -2) @ q[:, :, rows].double()
        if scheme.endswith("_bf16"):
            pq, pk = pq.bfloat16().float().double(), pk.bfloat16().float().double()
        dq[:, :, rows] += pq
        dk[:, :, cols] += pk
    return dq, dk


def part_shards(args):
    from gproj_patch.backends.reference import reference_backward, reference_forward
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    backend = "triton" if device.type == "cuda" else "emulation"
    rows = []
    for name, causal in CP_CASES:
        (q64, k64, v64, do64), (q, k, v, do) = _case_inputs(name, device, False)  # the audit's full sizes
        o64, lse64 = reference_forward(q64, k64, v64, causal=causal)
        ref = reference_backward(q64, k64, v64, do64, causal=causal)
        o = o64.to(torch.bfloat16).to(device)   # the forward's BF16 output and FP32 LSE (ring: merged exactly)
        lse = lse64.float().to(device)
        for world in (1, 2, 4):
            row = {"case": name + (" causal" if causal else ""), "shards": world, "backend": backend,
                   "S": q.shape[2]}
            for label, correct in (("gproj", True), ("uncorrected", False)):  # the real backward, per block
                t0 = time.time()
                g = shard_backward(q, k, v, o, do, lse, world, causal, correct, backend)
                row[f"err_{label}"] = [_rel(a.cpu(), r) for a, r in zip(g, ref)]
                row[f"s_{label}"] = round(time.time() - t0, 2)
            for scheme in SCHEMES:
                g = scheme_backward(q, k, v, o, do, lse, world, causal, scheme)
                row[f"scheme_{scheme}"] = [_rel(a.cpu(), r) for a, r in zip(g, ref[:2])]
            row["passed"] = max(row["scheme_global_centered_bf16"]) <= TOL_SHARD
            rows.append(row)
            print(json.dumps(row), flush=True)
    _write(args.out, {"device": str(device), "backend": backend, "rows": rows})


# --------------------------------------------------------------------------------------------- part report --
def _pct(xs):
    return "/".join(f"{100 * x:.2f}" for x in xs)


def part_report(args):
    def load(name):
        p = os.path.join(args.dir, name)
        return json.load(open(p)) if os.path.exists(p) else None
    ok = True
    lines = []
    dp = load("dp.json")
    if dp is None:
        lines.append("dp      | not run (no dp.json)")
        ok = False
    else:
        lines.append(f"dp      | {dp['device']} x{dp['world']}, patch: {dp['enabled_by']}; noise (split vs single) "
                     f"{dp['noise_split_vs_single']:.2e}; unpatched vs patched single {dp['unpatched_vs_single']:.2e}; "
                     f"err vs fp64: patched {dp['fp64_err_patched']:.2e}, unpatched {dp['fp64_err_unpatched']:.2e}; "
                     f"{dp['probe_param']} vs fp64: patched {dp['probe_fp64_err']['patched']:.2e}, unpatched "
                     f"{dp['probe_fp64_err']['unpatched']:.2e}")
        for how in ("ddp", "fsdp2"):
            r = dp[how]
            tiers = "; ".join(f"r{i}: gproj={s['gproj']} fp32={s['fp32']} original={s['original']}"
                              for i, s in enumerate(r["stats_per_rank"]))
            lines.append(f"{how:7s} | grads vs single {r['rel_vs_single']:.2e} (worst param {r['worst_param_rel']:.2e}), "
                         f"vs split {r['rel_vs_split']:.2e}, probe vs fp64 {r['probe_fp64_err']:.2e} | {tiers} | "
                         f"{'PASS' if r['passed'] else 'FAIL'}")
            ok &= bool(r["passed"])
    cp = load("cp.json")
    if cp is None:
        lines.append("cp      | not run (no cp.json)")
        ok = False
    else:
        for r in cp["rows"]:
            if "error" in r:
                lines.append(f"cp      | {r['case']:22s} {r['backend']:9s} | error: {r['error']}")
                continue
            if r["ring"]:  # CUDA: the corrected ring on every rank, within the target
                passed = max(r["err_patched"]) <= TOL_SHARD and all(n > 0 for n in r["corrected_per_rank"])
            else:  # CPU math backend: nothing reachable to correct, nothing changed
                passed = bool(r["bitwise_equal"])
            lines.append(f"cp      | {r['case']:22s} {r['backend']:9s} | dq/dk/dv % unpatched {_pct(r['err_unpatched'])}"
                         f", patched {_pct(r['err_patched'])} | corrected per rank {r['corrected_per_rank']}, same "
                         f"bits {r['bitwise_equal']} | {'PASS' if passed else 'FAIL'}")
            ok &= passed
    sh = load("shards.json")
    if sh is None:
        lines.append("shards  | not run (no shards.json)")
        ok = False
    else:
        for r in sh["rows"]:
            lines.append(f"shards  | {r['case']:22s} W={r['shards']} | dq/dk % global λ {_pct(r['scheme_global'])}, "
                         f"same, BF16 partials {_pct(r['scheme_global_bf16'])}, centered "
                         f"{_pct(r['scheme_global_centered_bf16'])}, λ per shard {_pct(r['scheme_shard_zero'])}, "
                         f"uncorrected "
                         f"{_pct(r['scheme_uncorrected'])} | {r['backend']} per block dq/dk/dv "
                         f"{_pct(r['err_gproj'])} | global λ + centered ≤0.5%: {'PASS' if r['passed'] else 'FAIL'}")
            ok &= bool(r["passed"])
    print("\n".join(lines))
    print("overall (dp + cp path + shard math):", "PASS" if ok else "FAIL")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------- every part --

#: (name, seconds, the command after ``python -m``, GPROJ_PATCH on) of every step, in order; ``{dir}`` and the
#: CPU flag are filled in by ``run_all``
TORCHRUN = ("torch.distributed.run", "--standalone", "--nproc-per-node", "2")
STEPS = (
    ("dp", 130, TORCHRUN + ("-m", "benchmarks.multi_gpu", "--part", "dp", "--dir", "{dir}"), True),
    ("cp", 110, TORCHRUN + ("-m", "benchmarks.multi_gpu", "--part", "cp", "--dir", "{dir}"), False),
    ("shards", 120, ("benchmarks.multi_gpu", "--part", "shards", "--dir", "{dir}", "{cpu}"), False),
    ("example_torchrun_ddp", 45, TORCHRUN + (EXAMPLE, "--wrap", "ddp", "--drive-layer", "1"), True),
    ("example_accelerate_fsdp2", 60, ("accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                                      "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                                      EXAMPLE, "--wrap", "fsdp2", "--drive-layer", "1"), True),
)


def run_step(name, limit, argv, env, log_path) -> int:
    """``python -m argv`` in a session of its own, its output appended to the log between a start and an end
    line; at ``limit`` seconds its process group is stopped (SIGTERM, then SIGKILL): a rank stuck in a collective
    ends this step, not the run."""
    with open(log_path, "a") as log:
        line = f"=== {name} (limit {limit}s): python -m {' '.join(argv)}"
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
        line = f"=== {name} rc={rc} in {time.time() - t0:.0f}s"
        print(line, flush=True)
        log.write(line + "\n")
    return rc


def run_all(args) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"),
               PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
    if args.cpu:  # two gloo ranks on the CPU, whatever GPUs the machine has
        env.update(CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    log_path = os.path.join(args.dir, "all.log")
    open(log_path, "w").close()
    print(common.banner(common.environment()), f"gpus {torch.cuda.device_count()}", flush=True)
    check = [sys.executable, "-m", "gproj_patch.integrations.startup", "--check"]
    status = subprocess.run(check, env=env, capture_output=True, text=True).stdout
    if "hook installed: ['/" not in status and not args.no_hook_install:
        subprocess.run([sys.executable, "-m", "gproj_patch.integrations.startup", "--install"], env=env)
        status = subprocess.run(check, env=env, capture_output=True, text=True).stdout
    print(status.strip(), flush=True)
    for name, limit, argv, patched in STEPS:
        argv = [a.format(dir=args.dir, cpu="--cpu" if args.cpu else "") for a in argv]
        step_env = dict(env, GPROJ_PATCH="1", GPROJ_MODE="gproj") if patched else env
        run_step(name, limit, [a for a in argv if a], step_env, log_path)
    with open(log_path) as f:
        for line in f:
            if line.startswith("[rank "):
                print(line.rstrip())
    return part_report(args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["dp", "cp", "shards", "report"], default=None,
                    help="one part (dp and cp under torchrun); default: every part, then the report")
    ap.add_argument("--out", default=None, help="JSON file of this part (default DIR/<part>.json)")
    ap.add_argument("--dir", default=None, help="the parts' folder (default $OUT/multi_gpu)")
    ap.add_argument("--cpu", action="store_true", help="two gloo ranks on the CPU (shards: the CPU backend)")
    ap.add_argument("--no-hook-install", action="store_true",
                    help="every part: leave the GPROJ_PATCH=1 start-up hook uninstalled where it is absent")
    args = ap.parse_args(argv)
    args.dir = common.out_dir("multi_gpu", args.dir)
    if args.part is None:
        return run_all(args)
    if args.part != "report" and args.out is None:
        args.out = os.path.join(args.dir, f"{args.part}.json")
    import faulthandler
    faulthandler.dump_traceback_later(420, exit=True)  # a rank stuck in a collective ends the part
    rc = {"dp": part_dp, "cp": part_cp, "shards": part_shards, "report": part_report}[args.part](args)
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
