"""Every head dim 1..256 in the GProj Triton kernel (a head dim missing from the per-head-dim config table must
take a config, not crash the CUDA backward with ``KeyError: 16``).

On CPU: the padded block_d and the block config of every head dim (the lookup the CUDA path makes, never a
KeyError; the nearest-config rule on a table with gaps), the single predicate ``kernel_unsupported_reason``,
and the kernels themselves in Triton's interpreter (FP16) for D in {1, 8, 16, 24, 40, 72} with causal masking
and GQA against the fp64 oracle and the FP16 emulation (head dims below 16 zero-padded to 16 on the host: on
the H200, ptxas crashed compiling their masked tiles for D = 1 and 8). On a GPU (marker ``gpu``): the compiled BF16 kernels,
which take their tiles from ``block_config``, for head dims from 1 to 256.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from gproj_patch.backends import configs, triton_bwd  # noqa: E402
from gproj_patch.backends.emulation import emulated_backward  # noqa: E402
from gproj_patch.backends.reference import reference_backward  # noqa: E402
from tests.helpers.numerics import kernel_inputs as make, rel, saved_forward  # noqa: E402

LOOSE = {torch.float16: 1.5e-3, torch.bfloat16: 5e-3}  # kernel vs fp64 (tests/kernels/test_triton_kernel.py, the 0.5% target)
TIGHT = {torch.float16: 3e-4, torch.bfloat16: 3e-3}    # kernel vs the emulation in the same format
FMT = {torch.float16: "fp16", torch.bfloat16: "bf16"}
CPU_HEAD_DIMS = (1, 8, 16, 24, 40, 72)
GPU_HEAD_DIMS = (1, 8, 16, 24, 40, 72, 136, 256)  # every padded block_d: 16, 32, 64, 128, 256


def test_every_head_dim_has_a_block_d_and_a_config(monkeypatch):
    monkeypatch.setenv("GPROJ_TIER", "triton")
    for d in range(1, configs.MAX_HEAD_DIM + 1):
        bd = configs.block_d(d)
        assert bd >= max(d, configs.MIN_BLOCK_D) and bd & (bd - 1) == 0 and bd < 2 * max(d, 16), (d, bd)
        for kind in ("dq", "dkdv"):
            cfg = configs.block_config(kind, bd)
            assert len(cfg) == 4 and all(isinstance(x, int) and x > 0 for x in cfg), (d, kind, cfg)
        x = torch.zeros(1, 2, 3, d, dtype=torch.float16)
        assert triton_bwd.kernel_unsupported_reason(x, x[:, :1], x[:, :1], cpu_kernel=True) is None, d
    assert configs.block_config("dq", 16) == configs.TL_CONFIGS["dq"][16]  # its own entry
    big = torch.zeros(1, 1, 3, configs.MAX_HEAD_DIM + 1, dtype=torch.float16)
    assert triton_bwd.kernel_unsupported_reason(big, big, big, cpu_kernel=True) == \
        f"head_dim={configs.MAX_HEAD_DIM + 1}"


def test_nearest_config_rule(monkeypatch):
    """A table with gaps: the smallest tuned block_d above, else the largest tuned."""
    a, b = (64, 32, 4, 3), (32, 64, 8, 1)
    monkeypatch.setattr(configs, "TL_CONFIGS", {"dq": {32: a, 128: b}, "dkdv": {32: a}})
    assert configs.block_config("dq", 16) == a
    assert configs.block_config("dq", 32) == a
    assert configs.block_config("dq", 64) == b
    assert configs.block_config("dq", 256) == b
    assert configs.block_config("dkdv", 256) == a


def check(q, k, v, do, **mask):
    """Kernel (both dk forms) against fp64 and against the emulation in the same format."""
    o, lse = saved_forward(q, k, v, **mask)
    ref = reference_backward(q, k, v, do, **mask)
    block = 16 if q.device.type == "cpu" else 64
    for form in ("two_product", "fused"):
        got = triton_bwd.gproj_backward(do, q, k, v, o, lse, dk_form=form, **mask)
        emu = emulated_backward(q, k, v, o, do, lse, fmt=FMT[q.dtype], dk_form=form, block_m=block,
                                block_n=block, **mask)
        for name, a, e, r in zip(("dq", "dk", "dv"), got, emu, ref):
            assert a.dtype == q.dtype and a.shape == r.shape and torch.isfinite(a).all(), name
            assert rel(a, r) < LOOSE[q.dtype], (form, name, rel(a, r))
            assert rel(a, e.to(a.dtype)) < TIGHT[q.dtype], (form, name, rel(a, e.to(a.dtype)))


@pytest.mark.parametrize("D", CPU_HEAD_DIMS)
def test_kernel_head_dims_interpreter(monkeypatch, D):
    monkeypatch.setenv("GPROJ_TIER", "triton")
    monkeypatch.setattr(triton_bwd, "_POISON_OUTPUTS", True)
    widths = []
    launch = triton_bwd._launch
    monkeypatch.setattr(triton_bwd, "_launch", lambda km, interp, job: widths.append(job.q.shape[-1]) or
                        launch(km, interp, job))
    q, k, v, do = make(1, 4, 2, 17, 23, D, offset=8.0, seed=D)
    check(q, k, v, do, causal=True, causal_align="bottom_right")
    # head dims below 16 reach the kernels zero-padded to 16 (ptxas crashed on their masked 16-wide tiles)
    assert set(widths) == {max(D, configs.MIN_BLOCK_D)}


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("D", GPU_HEAD_DIMS)
def test_gpu_head_dims_bf16(monkeypatch, D):
    monkeypatch.setattr(triton_bwd, "_POISON_OUTPUTS", True)
    q, k, v, do = (x.cuda() for x in make(2, 4, 2, 200, 264, D, offset=32.0, seed=D, dtype=torch.bfloat16))
    check(q, k, v, do, causal=True, causal_align="bottom_right")
    check(q[:, :, :128], k[:, :, :128], v[:, :, :128], do[:, :, :128], causal=True)  # even tiles, top-left
