"""The kernels' config table (``backends/configs.py``): every choice its gates make, pinned against tables written
out here for each head dim, dtype and launch, and every entry checked against what the kernels require of it.
Pure host work (no triton, no GPU)."""
from __future__ import annotations

import pytest
import torch

from gproj_patch.backends import configs
from gproj_patch.backends.configs import DqConfig, KernelConfig

#: the padded head dims the tl tables are keyed by (powers of two, 16 to 256)
PADDED = (16, 32, 64, 128, 256)
#: the tl configs each padded head dim gets, (BLOCK_M, BLOCK_N, num_warps, num_stages) for (dQ-major, KV-major)
EXPECTED_TL = {
    16: ((64, 64, 4, 3), (32, 128, 4, 3)),
    32: ((64, 64, 4, 3), (32, 128, 4, 3)),
    64: ((64, 32, 4, 3), (64, 64, 4, 3)),
    128: ((128, 64, 8, 3), (32, 64, 4, 3)),
    256: ((64, 64, 8, 1), (32, 32, 4, 1)),
}
EXPECTED_TL_FP32 = {
    16: ((64, 32, 4, 2), (64, 32, 4, 2)),
    32: ((64, 32, 4, 2), (64, 32, 4, 2)),
    64: ((64, 32, 4, 2), (64, 32, 4, 2)),
    128: ((64, 32, 4, 2), (64, 32, 4, 2)),
    256: ((16, 16, 4, 1), (16, 16, 4, 1)),
}
#: every config under Triton's interpreter
EXPECTED_INTERP = (16, 16, 4, 1)
#: the Gluon launches' configs per head dim, and the head dims where each is the plan's default
EXPECTED_GLUON_KV = {64: KernelConfig(128, 3, retire_tiles=True), 128: KernelConfig(64, 2, retire_tiles=True)}
EXPECTED_GLUON_DQ = {64: DqConfig(64, 2, overlap=True), 128: DqConfig(64, 2, overlap=True)}
EXPECTED_FASTER = {"kv_major": {64, 128}, "dq_major": {128}}
HEAD_DIMS = range(1, configs.MAX_HEAD_DIM + 1)


def _padded(head_dim: int) -> int:
    return next(p for p in PADDED if p >= head_dim)


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_head_dim_gets_the_pinned_tl_configs(dtype):
    expected = EXPECTED_TL_FP32 if dtype == torch.float32 else EXPECTED_TL
    for d in HEAD_DIMS:
        assert configs.block_d(d) == _padded(d), d
        assert configs.launch_configs(d, dtype, interpret=False) == expected[_padded(d)], (d, dtype)
        assert configs.launch_configs(d, dtype, interpret=True) == (EXPECTED_INTERP, EXPECTED_INTERP), (d, dtype)
        fp32 = dtype == torch.float32
        assert (configs.block_config("dq", _padded(d), fp32),
                configs.block_config("dkdv", _padded(d), fp32)) == expected[_padded(d)], (d, dtype)


def test_an_override_replaces_only_its_own_launch():
    mine = (16, 16, 4, 1)
    assert configs.launch_configs(128, torch.bfloat16, False, {"dq": mine}) == (mine, EXPECTED_TL[128][1])
    assert configs.launch_configs(128, torch.bfloat16, False, {"dkdv": mine}) == (EXPECTED_TL[128][0], mine)
    assert configs.launch_configs(128, torch.bfloat16, True, {"dq": mine}) == (EXPECTED_INTERP, EXPECTED_INTERP)


def test_dot_precision():
    assert configs.dot_precision(torch.float32) == "tf32x3"
    assert configs.dot_precision(torch.bfloat16) == configs.dot_precision(torch.float16) == "tf32"


def test_gluon_gates_are_pinned():
    for d in HEAD_DIMS:
        if d in EXPECTED_GLUON_KV:
            assert configs.gluon_kv_config(d) == EXPECTED_GLUON_KV[d]
            assert configs.gluon_dq_config(d) == EXPECTED_GLUON_DQ[d]
        else:
            with pytest.raises(KeyError):
                configs.gluon_kv_config(d)
            with pytest.raises(KeyError):
                configs.gluon_dq_config(d)
        for launch, faster in EXPECTED_FASTER.items():
            assert configs.gluon_measured_faster(launch, d) == (d in faster), (launch, d)
    with pytest.raises(ValueError, match="launch must be one of"):
        configs.gluon_measured_faster("dkdv", 128)


def test_tl_tables_fit_the_kernels():
    """Both tl tables cover every padded head dim for both launches; tiles are powers of two of at least 16 rows
    and keys (``tl.arange``, ``tl.dot``'s smallest shape), warps a power of two, at least one stage."""
    for table in (configs.TL_CONFIGS, configs.TL_CONFIGS_FP32):
        assert set(table) == set(configs.TL_KINDS)
        for kind, by_d in table.items():
            assert sorted(by_d) == list(PADDED), kind
            assert max(by_d) == configs.block_d(configs.MAX_HEAD_DIM) and min(by_d) == configs.MIN_BLOCK_D
            for d, (block_m, block_n, warps, stages) in by_d.items():
                where = (kind, d)
                assert _power_of_two(block_m) and block_m >= 16, where
                assert _power_of_two(block_n) and block_n >= 16, where
                assert _power_of_two(warps) and warps <= 16, where
                assert stages >= 1, where
    block_m, block_n, warps, stages = configs.INTERP_CONFIG
    assert block_m == block_n == configs.INTERP_BLOCK and _power_of_two(configs.INTERP_BLOCK) and stages >= 1


def test_gluon_tables_fit_the_kernels():
    """One entry per Gluon head dim in both tables; tiles powers of two a TMA box can hold (16 to 256 rows or
    keys); a ring of at least one slot; a paired release only on an even ring of at least 4 (``KernelConfig``
    refuses any other); the measured-faster head dims among the built ones."""
    assert set(configs.GLUON_KV_CONFIGS) == set(configs.GLUON_DQ_CONFIGS) == set(configs.GLUON_HEAD_DIMS)
    for d, cfg in configs.GLUON_KV_CONFIGS.items():
        assert isinstance(cfg, KernelConfig) and _power_of_two(cfg.block_m) and 16 <= cfg.block_m <= 256, d
        assert cfg.num_stages >= 1, d
        assert not cfg.release_pairs or (cfg.num_stages % 2 == 0 and cfg.num_stages >= 4), d
    for d, cfg in configs.GLUON_DQ_CONFIGS.items():
        assert isinstance(cfg, DqConfig) and _power_of_two(cfg.block_n) and 16 <= cfg.block_n <= 256, d
        assert cfg.num_stages >= 1, d
    for faster in (configs.GLUON_KV_FASTER_HEAD_DIMS, configs.GLUON_DQ_FASTER_HEAD_DIMS):
        assert set(faster) <= set(configs.GLUON_HEAD_DIMS)
    with pytest.raises(ValueError, match="release_pairs"):
        KernelConfig(64, 3, release_pairs=True)
