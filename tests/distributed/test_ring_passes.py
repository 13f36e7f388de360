"""The corrected ring's passes (``backends/ring.py``) in one process on the CPU, and the context-parallel hook's
decision and bookkeeping (``hooks/context_parallel.py``) without a process group.

The kernel form runs the tl kernels through Triton's interpreter in FP16 (its BF16 is inexact there; BF16 and the
Gluon KV-major launch: ``test_context_parallel_gpu.py``); the FP32 form in PyTorch. The ring is simulated with
PyTorch's own step logic (``ring_sim``)."""
from __future__ import annotations

import logging

import pytest
import torch

from gproj_patch.backends import triton_bwd
from gproj_patch.backends.fp32_tier import fp32_backward
from gproj_patch.backends.ring import RingRows, kernel_reason
from gproj_patch.backends.triton_bwd import gproj_backward
from gproj_patch.hooks import context_parallel
from tests.distributed import ring_sim
from tests.distributed.shards import problem, whole
from tests.helpers.numerics import rel

triton = pytest.importorskip("triton")

#: the FP16 kernel form against fp64 (measured 2e-4 at S = 64, D = 64)
KERNEL_BOUND = 1.5e-3


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Outputs the kernels write filled with NaN first: an element a launch leaves unwritten fails the test."""
    monkeypatch.setattr(triton_bwd, "_POISON_OUTPUTS", True)


@pytest.mark.parametrize("causal", [False, True])
def test_one_shard_is_the_whole_row_backward(one_thread, causal):
    """With every key in one shard the ring's passes are the GProj backward: dk and dv bit for bit the kernel's
    (the same λ, D and LSE2 in the scratch), dq = A − λB against the kernel's α(Σt·K − λΣr·K) to fp16 rounding;
    the FP32 form against the FP32 tier given the same LSE and output. Odd head dim, GQA, Sq ≠ Sk."""
    p = problem(1, 4, 2, 40, 40, offset=16.0, causal=causal, seed=3, dtype=torch.float16)
    k, v = p.k[:, :, :33], p.v[:, :, :33]  # a top-left causal call with Sq ≠ Sk (rows past key 32 see them all)
    from gproj_patch.backends.reference import reference_forward
    o, lse = reference_forward(p.q, k, v, causal=causal)
    o16, lse32 = o.half(), lse.float()
    rows = RingRows(p.do, p.q, o16, lse32, kernel=True)
    rows.row_step(k, v, causal=causal)
    rows.finish()
    dk, dv = rows.column_step(k, v, causal=causal)
    ref = gproj_backward(p.do, p.q, k, v, o16, lse32, causal=causal)
    assert torch.equal(dk.half(), ref[1]) and torch.equal(dv.half(), ref[2])
    assert rel(rows.dq().half(), ref[0]) < 1e-3
    fp32 = RingRows(p.do, p.q, o16, lse32, kernel=False)
    fp32.row_step(k, v, causal=causal)
    fp32.finish()
    tier = fp32_backward(p.q, k, v, p.do, lse=lse32, out=o16, causal=causal)
    for got, want in zip((fp32.dq(),) + fp32.column_step(k, v, causal=causal), tier):
        assert rel(got, want) < 1e-5


@pytest.mark.parametrize("world,causal", [(2, True), (4, False)])
def test_simulated_ring_kernel_form_vs_fp64(one_thread, world, causal):
    """The kernel form over PyTorch's ring steps (load-balanced causal at 2 ranks: full, first-half-key and
    second-half-query steps; full at 4): within the FP16 bound of fp64 of the whole attention at a 200σ key
    offset, where the same ring with PyTorch's per-shard CPU flash backward (FP16 dS) has dq 7–8% off."""
    p = problem(1, 2, 1, 32, 32, offset=200.0, causal=causal, seed=4, dtype=torch.float16)
    ref = whole(p)
    with ring_sim.load_balance(causal):
        pieces = [ring_sim.shard(x, world, causal) for x in (p.q, p.k, p.v, p.do, p.o.half(), p.lse.float())]
        grads = ring_sim.corrected(*pieces, causal, kernel=True)
        plain = ring_sim.uncorrected(_cpu_flash_backward, *pieces, causal)
    errors = [rel(ring_sim.unshard(g, causal), r) for g, r in zip(grads, ref)]
    assert max(errors) < KERNEL_BOUND, errors
    assert rel(ring_sim.unshard(plain[0], causal), ref[0]) > 20 * KERNEL_BOUND


def _cpu_flash_backward(q, k, v, do, o, lse, causal):
    """One ring step of PyTorch's ring on the CPU: its flash backward with the merged output and LSE."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        do, q, k, v, o, lse, 0.0, causal, attn_mask=None, scale=None)


def test_pass_order_is_enforced(one_thread):
    p = problem(1, 1, 1, 16, 16, seed=5, dtype=torch.float16)
    rows = RingRows(p.do, p.q, p.o.half(), p.lse.float(), kernel=True)
    with pytest.raises(RuntimeError, match="before finish"):
        rows.dq()
    with pytest.raises(RuntimeError, match="before finish"):
        rows.column_step(p.k, p.v)
    rows.row_step(p.k, p.v, rows=slice(8, None))
    rows.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        rows.row_step(p.k, p.v)
    with pytest.raises(RuntimeError, match="no row step"):  # the kernels' scratch of rows [0, 16) was never made
        rows.column_step(p.k, p.v)
    assert kernel_reason(p.q.bfloat16(), p.k.bfloat16(), p.v.bfloat16()).startswith("cpu tensor")
    assert kernel_reason(p.q[..., :8], p.k[..., :8], p.v[..., :8], cpu_kernel=True) == "head_dim=8 < 16"


@pytest.fixture
def hook():
    context_parallel.install()
    yield ring_sim.cp_module()
    context_parallel.uninstall()


def test_fallback_reasons(hook):
    """One decision per call: each call the corrected ring cannot take is named (and then runs PyTorch's ring
    unchanged); a plain bf16 call has none."""
    aten = torch.ops.aten
    op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    p = problem(1, 2, 1, 16, 16, seed=6, dtype=torch.bfloat16)
    args = (p.do, p.q, p.k, p.v, p.o.bfloat16(), p.lse.float())
    reason = lambda *a, op=op, seq_dim=2, **kw: context_parallel.fallback_reason(op, seq_dim, *a, kw)  # noqa: E731
    assert reason(*args, dropout_p=0.0, scale=None) is None
    assert "op _scaled_dot_product_flash_attention_for_cpu " in reason(
        *args, op=aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert "dropout" in reason(*args, dropout_p=0.1)
    assert "attn_bias" in reason(*args, attn_bias=torch.zeros(16, 16))
    assert "seq_dim=1" in reason(*args, seq_dim=1)
    assert "float32" in reason(*(x.float() for x in args))
    assert "Parameter" in reason(p.do, torch.nn.Parameter(p.q), *args[2:])
    assert "an LSE of shape" in reason(*args[:5], p.lse.float()[:, :1])
    hook._cp_options.convert_to_f32 = False
    try:
        assert "convert_to_f32" in reason(*args)
    finally:
        hook._cp_options.convert_to_f32 = True


def test_install_and_uninstall_by_identity(caplog):
    cp = ring_sim.cp_module()
    original = cp._templated_ring_attention_backward
    context_parallel.install()
    assert cp._templated_ring_attention_backward is context_parallel.corrected_ring_backward
    assert context_parallel.install() == "installed"
    context_parallel.uninstall()
    assert cp._templated_ring_attention_backward is original
    context_parallel.install()
    other = lambda *a, **k: None  # noqa: E731 - someone replaced it after us: left alone, with a warning
    cp._templated_ring_attention_backward = other
    try:
        with caplog.at_level(logging.WARNING, logger="gproj_patch"):
            context_parallel.uninstall()
        assert cp._templated_ring_attention_backward is other and "left as it is" in caplog.text
    finally:
        cp._templated_ring_attention_backward = original


def test_a_changed_ring_module_is_refused(monkeypatch):
    """The hook's touch-points are checked at install(): a ring module without one is not hooked, and the status
    says why (``enable()`` goes on with the other targets)."""
    monkeypatch.delattr(ring_sim.cp_module(), "_partial_update")
    status = context_parallel.install()
    assert status.startswith("skipped") and "_partial_update" in status, status
    assert context_parallel.INSTALLED.module is None


def test_pass_launches_keep_the_row_pass_on_tl_under_gqa(monkeypatch):
    """Where both Gluon launches take a D=128 ring, the row pass gets the Gluon dQ-major launch only without GQA
    (under GQA its PARTIAL mode measured slower than tl); the column pass's KV-major choice does not depend on it."""
    from gproj_patch.backends import gluon_bwd, gluon_dq
    monkeypatch.setattr(gluon_dq, "dq_major_reason", lambda q, k, v, **_: None)
    monkeypatch.setattr(gluon_bwd, "kv_major_reason", lambda q, k, v, **_: None)
    q = torch.empty(1, 16, 64, 128, dtype=torch.bfloat16)
    mha, gqa = torch.empty(1, 16, 64, 128, dtype=torch.bfloat16), torch.empty(1, 4, 64, 128, dtype=torch.bfloat16)
    assert context_parallel.pass_launches(q, mha, mha) == ("gluon", "gluon")
    assert context_parallel.pass_launches(q, gqa, gqa) == ("tl", "gluon")
    q64, k64 = torch.empty(1, 16, 64, 64, dtype=torch.bfloat16), torch.empty(1, 16, 64, 64, dtype=torch.bfloat16)
    assert context_parallel.pass_launches(q64, k64, k64) == ("tl", "gluon")  # Gluon dQ: faster at D=128 only
