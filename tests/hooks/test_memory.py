"""Nothing of a call outlives its backward: live tensor bytes stay flat over repeated forward+backward on every
path (a hook's saved-tensor hooks can keep every call's output, LSE and q/k/v aliases alive)."""
import gc

import pytest
import torch
import torch.nn.functional as F

import gproj_patch
from gproj_patch.hooks import fa_records
from gproj_patch.runtime.config import TIERS
from tests.helpers import fa4_standin
from tests.helpers.memory import CALLS, assert_tier_ran, flat as _flat

pytestmark = pytest.mark.usefixtures("patch_off")


def _inputs(dtype=torch.bfloat16, B=1, H=2, S=64, D=32, Hkv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv or H, S, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv or H, S, D, generator=g).to(dtype).requires_grad_()
    return q, k, v


def _sdpa_step(q, k, v, **kw):
    def step():
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        out.float().sum().backward()
        for t in (q, k, v):
            t.grad = None
    return step


#: the tier each mode runs on these CPU inputs: gproj's kernel needs CUDA (or the interpreter), so the FP32 tier;
#: auto/audit keep the original on benign inputs; mode off counts nothing
CPU_TIER = {"gproj": "fp32", "fp32": "fp32", "auto": "original", "audit": "original", "off": None}


@pytest.mark.parametrize("mode", ["gproj", "fp32", "auto", "audit", "off"])
def test_sdpa_eager_every_mode(mode):
    gproj_patch.enable(mode=mode, targets=("sdpa",))
    _flat(_sdpa_step(*_inputs(), is_causal=True))
    if CPU_TIER[mode] is None:
        assert all(gproj_patch.stats()[t] == 0 for t in TIERS), gproj_patch.stats()
    else:
        assert assert_tier_ran(CPU_TIER[mode], CALLS)[CPU_TIER[mode]] == CALLS


def test_sdpa_kernel_tier_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("GPROJ_TIER", "triton")
    gproj_patch.enable(mode="gproj", targets=("sdpa",))
    _flat(_sdpa_step(*_inputs(torch.float16, S=32, D=16), is_causal=True))
    assert assert_tier_ran("gproj", CALLS)["gproj"] == CALLS


def test_sdpa_mask_and_gqa():
    gproj_patch.enable(mode="gproj", targets=("sdpa",))
    q, k, v = _inputs(H=4, Hkv=2)
    mask = torch.rand(64, 64, generator=torch.Generator().manual_seed(1)) > 0.3
    _flat(_sdpa_step(q, k, v, attn_mask=mask, enable_gqa=True))
    assert_tier_ran("fp32", CALLS)


def test_gproj_attention_without_enable():
    q, k, v = _inputs()

    def step():
        gproj_patch.attention(q, k, v, is_causal=True).float().sum().backward()
    _flat(step)
    assert_tier_ran("fp32", CALLS)


def test_sdpa_compiled():
    gproj_patch.enable(mode="gproj", targets=("sdpa",))
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), backend="aot_eager",
                       fullgraph=True)
    q, k, v = _inputs()

    def step():
        fn(q, k, v).float().sum().backward()
    _flat(step)
    assert_tier_ran("fp32", CALLS)


@pytest.mark.parametrize("mode,tier", [("auto", "original"), ("gproj", "fp32")])
def test_hf_gproj_attention(mode, tier):
    """auto keeps the original on this benign tiny model; gproj runs the FP32 tier (CPU): both flat."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    gproj_patch.enable(mode=mode)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="gproj", dtype=torch.bfloat16)
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
    _flat(step)
    assert_tier_ran(tier, CALLS * cfg.num_hidden_layers)


@pytest.mark.parametrize("mode,tier", [("auto", "original"), ("gproj", "fp32")])
def test_flash_attn_records_do_not_outlive_their_backward(monkeypatch, mode, tier):
    """auto keeps the original on these benign inputs; gproj runs the FP32 tier (CPU): no record left either way."""
    iface = fa4_standin.install(monkeypatch)  # flash-attn-4 4.0.0b36's interface, on CPU
    func = fa4_standin.KeepOut(iface)
    gproj_patch.enable(mode=mode, targets=("flash_attn",))
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in _inputs())

    def step():
        func.apply(q, k, v, True, None).float().sum().backward()
    _flat(step)
    gc.collect()
    assert fa_records.live_records() == 0
    assert assert_tier_ran(tier, CALLS)[tier] == CALLS


def test_fa4_original_path_keeps_function_attributes(monkeypatch):
    """FA4's own backward (mode off: the original) reads ``_flash_attn_bwd.compile_cache`` through the module
    global: with the proxy in place that still works (a plain wrapper function in its place raises
    AttributeError). The sink-specific version is tests/integrations/test_fa4_sinks.py."""
    iface = fa4_standin.install(monkeypatch)  # flash-attn-4 4.0.0b36's interface, on CPU
    func = fa4_standin.KeepOut(iface)
    original = iface._flash_attn_bwd
    gproj_patch.enable(mode="off", targets=("flash_attn",))
    assert iface._flash_attn_bwd is not original and iface._flash_attn_bwd.compile_cache is original.compile_cache
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in _inputs())
    func.apply(q, k, v, True, None).float().sum().backward()  # mode off: the original backward
    assert original.compile_cache == {"key": "compiled"}
    assert gproj_patch.stats()["original"] == 1
    iface._flash_attn_bwd.extra = 1  # writes reach the original too
    assert original.extra == 1
    gproj_patch.disable()
    assert iface._flash_attn_bwd is original
