"""A call's backward reads only its record: for the hooks that record at the forward (flash-attn, FA4, HF eager,
flex) options changed and disable() called between a forward and its backward change nothing for that call, and
its layer is its forward's; the SDPA seam records in the backward op, with the options in force then and the layer
its forward's named scope gave the autograd node."""
import pytest
import torch
import torch.nn.functional as F

import gproj_patch
from gproj_patch import policy
from gproj_patch.hooks import sdpa as seam

from tests.helpers import fa4_standin


pytestmark = pytest.mark.usefixtures("patch_off")


def _inputs(offset=0.0, seed=0, S=48, D=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, S, D, generator=g).bfloat16().requires_grad_()
    k = (torch.randn(1, 2, S, D, generator=g) + offset).bfloat16().requires_grad_()
    v = torch.randn(1, 2, S, D, generator=g).bfloat16().requires_grad_()
    return q, k, v


def _seen_records(monkeypatch):
    seen = []
    real = seam.run_backward
    monkeypatch.setattr(seam, "run_backward", lambda record, *a, **kw: seen.append(record) or real(record, *a, **kw))
    return seen


def test_sdpa_record_is_made_in_the_backward_with_the_forwards_layer(monkeypatch):
    """The seam's record: the options in force at the backward (``policy.configure`` after the forward applies),
    the layer of the named scope the forward ran in (closed long before)."""
    seen = _seen_records(monkeypatch)
    q, k, v = _inputs()
    gproj_patch.enable(mode="auto", targets=("sdpa",), sample_every=3)
    with gproj_patch.layer_scope("blk.7"):
        out = F.scaled_dot_product_attention(q, k, v)
    policy.configure(sample_every=11)
    out.float().sum().backward()
    (record,) = seen
    assert (record.context.layer, record.context.source, record.context.policy.sample_every) == ("blk.7", "sdpa", 11)
    policy.reset(keep_config=False)


def test_named_layers_advance_the_step_and_are_resampled(monkeypatch):
    """A step starts at the first forward after a backward, named layers included: with sample_every=2 a
    named layer is sampled on steps 0, 2, 4 (the policy measures it again), not only once."""
    gproj_patch.enable(mode="auto", targets=("sdpa",), sample_every=2)
    q, k, v = _inputs()
    for _step in range(5):
        with gproj_patch.layer_scope("blk.0"):
            out = F.scaled_dot_product_attention(q, k, v)
        out.float().sum().backward()
    rec = policy.stats()["blk.0"]
    assert policy.current_step() == 4 and rec["samples"] == 3 and rec["last_sampled_step"] == 4
    assert sum(rec["calls"].values()) == 5 and gproj_patch.stats()["original"] == 5


def test_flash_attn_layer_is_the_forwards_and_auto_keeps_one_record_per_layer(monkeypatch):
    """FA4-style stand-in: two layers, one with a 300σ key offset. Backwards run after every forward scope has
    closed; each must land in its own policy record, and only the sick layer leaves the original backward."""
    func = fa4_standin.KeepOut(fa4_standin.install(monkeypatch))  # flash-attn-4 4.0.0b36's interface
    gproj_patch.enable(mode="auto", targets=("flash_attn",), sample_every=1)
    healthy = [t.transpose(1, 2).detach().requires_grad_() for t in _inputs(seed=1)]
    sick = [t.transpose(1, 2).detach().requires_grad_() for t in _inputs(seed=2)]
    with torch.no_grad():
        sick[1] += 300.0  # a common key offset far beyond the spread
    outs = []
    for name, (q, k, v) in (("layers.0", healthy), ("layers.1", sick)):
        with gproj_patch.layer_scope(name):
            outs.append(func.apply(q, k, v, True, None))
    sum(o.float().sum() for o in outs).backward()
    records = policy.stats()
    assert sorted(records) == ["layers.0", "layers.1"]
    assert records["layers.0"]["tier"] == "original"
    assert records["layers.1"]["tier"] == "fp32"  # the policy chose gproj; on CPU that runs the FP32 tier
    assert gproj_patch.stats()["layers"]["layers.1"]["policy_tier"] == "gproj"


def test_flash_attn_backward_without_forward_record_is_reported(monkeypatch):
    iface = fa4_standin.install(monkeypatch)  # flash-attn-4 4.0.0b36's interface
    q, k, v = (t.transpose(1, 2).detach() for t in _inputs())
    out, lse, *_ = iface._flash_attn_fwd(q, k, v, causal=True)  # before enable(): no record
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    iface._flash_attn_bwd(q, k, v, out, torch.ones_like(out), lse, causal=True)
    assert any("no forward record" in r for r in gproj_patch.stats()["fallback_reasons"])


def test_flash_attn_disable_between_forward_and_backward_changes_nothing(monkeypatch):
    """flash-attn's backward kernels are process-global: disable() keeps the corrected backward reachable until
    the forwards made under the patch have had their backward, then restores the originals by identity."""
    iface = fa4_standin.install(monkeypatch)  # flash-attn-4 4.0.0b36's interface
    func = fa4_standin.KeepOut(iface)
    original = iface._flash_attn_bwd
    gproj_patch.enable(mode="fp32", targets=("flash_attn",))
    q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in _inputs(offset=64.0))
    with gproj_patch.layer_scope("blk.3"):
        out = func.apply(q, k, v, True, None)
    gproj_patch.disable()
    assert iface._flash_attn_bwd is not original  # a forward made under the patch still awaits its backward
    out.float().sum().backward()
    assert gproj_patch.stats()["fp32"] == 1  # its record's mode, after disable()
    del out
    import gc
    gc.collect()
    assert iface._flash_attn_bwd is original  # restored once nothing awaits it
    q.grad = None
    func.apply(q, k, v, True, None).float().sum().backward()  # made after disable(): the original, uncounted
    assert gproj_patch.stats()["fp32"] == 1 and gproj_patch.stats()["original"] == 0
