"""FA4 forwards leave records their backwards find, on the CPU stand-in of flash-attn-4 4.0.0b36
(``tests/helpers/fa4_standin.py``: the release's autograd Functions verbatim, its forward and backward modelled).

4.0.0b36's ``FlashAttnFunc`` returns ``(out, lse)`` and saves ``lse`` — one of its own outputs — for the backward.
Autograd saves an output as a new tensor object sharing its storage, so the ``lse`` object the forward returned
dies as soon as the caller drops it (keeping only ``out``), and a record tied to that object died with it: every
FA4 backward then logged "no forward record" and every layer was filed as ``flash_attn_4:dense``. The records
now live as long as the LSE's storage, which the saved tensor holds until the backward has run.
"""
import gc
import logging

import pytest
import torch

import gproj_patch
from gproj_patch import policy
from gproj_patch.backends.reference import reference_backward
from gproj_patch.hooks import fa_records
from gproj_patch.hooks import flash_attn as fa_hook

from tests.helpers import fa4_standin
from tests.helpers.numerics import bhsd as _bhsd, rel as _rel

pytestmark = pytest.mark.usefixtures("patch_off")

B, H, HKV, S, D = 1, 4, 2, 64, 32
SICK_OFFSET = 300.0   # common key offset, in units of the keys' spread (σ = 1)
BOUND = 1e-2          # corrected BF16 gradients against fp64
FAR = 10.0            # the uncorrected backward's dq error on the sick layer: at least this many times BOUND
NO_RECORD = "no forward record"


@pytest.fixture
def fa4(monkeypatch):
    """The stand-in as ``flash_attn.cute.interface``; the FA2/FA3 ops left out (none exist on the CPU)."""
    return fa4_standin.install(monkeypatch)


def _layer_inputs(seed, offset, total=None):
    """BF16 q, k, v, do in FA4's layout ((B, S, H, D), or varlen (total, H, D)), keys shifted by ``offset``σ."""
    g = torch.Generator().manual_seed(seed)
    lead = (total,) if total is not None else (B, S)
    q, k, v, do = (torch.randn(*lead, h, D, generator=g) for h in (H, HKV, HKV, H))
    k = k + offset
    return tuple(t.bfloat16() for t in (q, k, v, do))


def _oracle(q, k, v, do, cu=None):
    varlen = cu is not None
    return reference_backward(*(_bhsd(t, varlen) for t in (q, k, v, do)), causal=True, causal_align="bottom_right",
                              cu_seqlens_q=cu, cu_seqlens_k=cu)


def _seen_records(monkeypatch):
    """The CallRecords the flash-attn backward hands the router, in call order."""
    seen = []
    real = fa_hook.run_backward
    monkeypatch.setattr(fa_hook, "run_backward", lambda record, *a, **kw: seen.append(record) or real(record, *a, **kw))
    return seen


def _no_record_logged(caplog):
    return NO_RECORD not in caplog.text and \
        not any(NO_RECORD in r for r in gproj_patch.stats()["fallback_reasons"])


def test_three_fa4_layers_keep_three_records_and_only_the_sick_one_is_corrected(fa4, caplog):
    """Three layers through ``flash_attn_func`` (the caller keeps ``out`` only), the middle one at a 300σ common
    key offset, backwards after every scope has closed: three policy records under the forwards' layer names,
    the healthy layers on FA4's own backward, the sick one corrected to the fp64 oracle."""
    caplog.set_level(logging.WARNING, logger="gproj_patch")
    layers = {"layers.0": _layer_inputs(1, 0.0), "layers.1": _layer_inputs(2, SICK_OFFSET),
              "layers.2": _layer_inputs(3, 0.0)}
    q, k, v, do = layers["layers.1"]
    out, lse = fa4._flash_attn_fwd(q, k, v, causal=True, return_lse=True)[:2]  # unpatched: FA4's own dq
    uncorrected_dq = fa4._flash_attn_bwd(q, k, v, out, do, lse, None, True)[0]
    fa4.CALLS.update(original=0)

    gproj_patch.enable(mode="auto", targets=("flash_attn",), sample_every=1)
    leaves, loss = {}, 0.0
    for name, (q, k, v, do) in layers.items():
        leaves[name] = [t.clone().requires_grad_() for t in (q, k, v)]
        with gproj_patch.layer_scope(name):
            out = fa4.flash_attn_func(*leaves[name], causal=True)[0]  # lse dropped here, as callers do
        loss = loss + (out.float() * do.float()).sum()
    gc.collect()
    assert fa_records.live_records() == 3, "each forward's record must outlive the LSE object it returned"
    loss.backward()

    assert sorted(policy.stats()) == sorted(layers)
    tiers = {name: rec["tier"] for name, rec in gproj_patch.stats()["layers"].items()}
    assert tiers == {"layers.0": "original", "layers.1": "fp32", "layers.2": "original"}  # CPU: gproj -> fp32 tier
    assert gproj_patch.stats()["layers"]["layers.1"]["policy_tier"] == "gproj"
    assert fa4.CALLS["original"] == 2
    assert _no_record_logged(caplog)

    q, k, v, do = layers["layers.1"]
    ref = _oracle(q, k, v, do)
    for got, want in zip((t.grad for t in leaves["layers.1"]), ref):
        assert _rel(_bhsd(got), want) < BOUND
    assert _rel(_bhsd(uncorrected_dq), ref[0]) > FAR * BOUND, "the sick layer must be one the original gets wrong"
    gc.collect()
    assert fa_records.live_records() == 0


def test_varlen_fa4_layers_keep_their_records(fa4, caplog, monkeypatch):
    """``flash_attn_varlen_func`` (FlashAttnVarlenFunc, the same saved-output pattern): two layers, two records
    filed as ``flash_attn_4:varlen``, the sick one corrected."""
    caplog.set_level(logging.WARNING, logger="gproj_patch")
    seen = _seen_records(monkeypatch)
    gproj_patch.enable(mode="auto", targets=("flash_attn",), sample_every=1)
    lens = (20, 37, 7)
    cu = torch.tensor((0, 20, 57, 64), dtype=torch.int32)
    grads = {}
    for name, offset, seed in (("attn.0", 0.0, 4), ("attn.1", SICK_OFFSET, 5)):
        q, k, v, do = _layer_inputs(seed, offset, total=sum(lens))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with gproj_patch.layer_scope(name):
            out = fa4.flash_attn_varlen_func(*leaves, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                                             max_seqlen_k=max(lens), causal=True)[0]
        out.backward(do)
        grads[name] = ([t.grad for t in leaves], _oracle(q, k, v, do, cu))
    assert [(r.context.layer, r.context.source) for r in seen] == [("attn.0", "flash_attn_4:varlen"),
                                                                  ("attn.1", "flash_attn_4:varlen")]
    assert all(r.problem.cu_seqlens_q is cu and r.problem.causal for r in seen)
    tiers = {name: rec["tier"] for name, rec in gproj_patch.stats()["layers"].items()}
    assert tiers == {"attn.0": "original", "attn.1": "fp32"}
    got, ref = grads["attn.1"]
    for g, want in zip(got, ref):
        assert _rel(_bhsd(g, True), want) < BOUND
    assert _no_record_logged(caplog)


def test_record_is_complete_at_the_forward(fa4, monkeypatch):
    """The backward runs the CallRecord its forward made (problem and context), not one rebuilt from its own
    arguments: the same object, with the forward's scale, window and layer."""
    made, seen = [], _seen_records(monkeypatch)
    real_make = fa_records.make_call_record
    monkeypatch.setattr(fa_records, "make_call_record", lambda *a, **kw: made.append(real_make(*a, **kw)) or made[-1])
    gproj_patch.enable(mode="fp32", targets=("flash_attn",))
    q, k, v, do = _layer_inputs(6, 64.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with gproj_patch.layer_scope("blk.9"):
        out = fa4.flash_attn_func(*leaves, softmax_scale=0.125, causal=True, window_size=(9, 0))[0]
    out.backward(do)
    assert len(made) == 1 and seen == made
    (record,) = seen
    assert (record.problem.scale, record.problem.causal, record.problem.window) == (0.125, True, (9, 0))
    assert (record.context.layer, record.context.mode) == ("blk.9", "fp32")
    ref = reference_backward(*(_bhsd(t) for t in (q, k, v, do)), scale=0.125, causal=True,
                             causal_align="bottom_right", window=(9, 0))
    for got, want in zip((t.grad for t in leaves), ref):
        assert _rel(_bhsd(got), want) < BOUND


def test_retained_graph_finds_the_record_twice_and_frees_it_with_the_graph(fa4):
    """The record lives as long as the LSE's storage: a second backward (retain_graph) finds it again, and it is
    freed with the graph — also when no backward ever runs."""
    gproj_patch.enable(mode="fp32", targets=("flash_attn",))
    q, k, v, do = _layer_inputs(7, 0.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa4.flash_attn_func(*leaves, causal=True)[0]
    out.backward(do, retain_graph=True)
    out.backward(do)
    assert gproj_patch.stats()["fp32"] == 2 and not gproj_patch.stats()["fallback_reasons"]
    del out
    gc.collect()
    assert fa_records.live_records() == 0
    out = fa4.flash_attn_func(*leaves, causal=True)[0]
    assert fa_records.live_records() == 1
    del out
    gc.collect()
    assert fa_records.live_records() == 0


def test_a_record_that_disagrees_with_its_backward_is_not_used(fa4):
    """A backward whose arguments contradict the record filed under its LSE (here: called directly with another
    causal flag) takes FA4's own backward, reason counted, never a correction of the wrong problem."""
    gproj_patch.enable(mode="gproj", targets=("flash_attn",))
    q, k, v, do = _layer_inputs(8, 0.0)
    out, lse = fa4._flash_attn_fwd(q, k, v, causal=True, return_lse=True)[:2]
    assert fa_records.live_records() == 1
    fa4._flash_attn_bwd(q, k, v, out, do, lse, None, False)
    s = gproj_patch.stats()
    assert fa4.CALLS["original"] == 1 and s["original"] == 1
    assert any("disagree" in r for r in s["fallback_reasons"])


_MAKE_CALL_RECORD = fa_records.make_call_record  # the module's own, whatever a test has patched in since


def _auto_fa4_steps(fa4, monkeypatch, settled: bool, steps: int = 7):
    """A healthy and a sick FA4 layer over ``steps`` training steps in ``auto`` (sampled every 3 steps): the
    (step, layer) of every complete record made, the gradients of every step, the counters, FA4's own backward
    calls. ``settled=False``: every forward makes the complete record (the settled-layer shortcut off)."""
    if not settled:
        monkeypatch.setattr(fa_records, "settled_original", lambda cfg, layer, has_original: False)
    made = []
    monkeypatch.setattr(fa_records, "make_call_record", lambda b, source, sink, result=None, **kw: made.append(
        (policy.current_step(), kw.get("layer"))) or _MAKE_CALL_RECORD(b, source, sink, result, **kw))
    gproj_patch.disable()
    gproj_patch.reset_stats()
    fa4.CALLS.update(original=0)
    gproj_patch.enable(mode="auto", targets=("flash_attn",), sample_every=3)
    layers = {"healthy": _layer_inputs(8, 0.0), "sick": _layer_inputs(9, SICK_OFFSET)}
    grads = []
    for _ in range(steps):
        leaves, loss = {}, 0.0
        for name, (q, k, v, do) in layers.items():
            leaves[name] = [t.clone().requires_grad_() for t in (q, k, v)]
            with gproj_patch.layer_scope(name):
                out = fa4.flash_attn_func(*leaves[name], causal=True)[0]
            loss = loss + (out.float() * do.float()).sum()
        loss.backward()
        grads.append([t.grad for name in layers for t in leaves[name]])
    s = gproj_patch.stats()
    counts = ({t: s[t] for t in ("original", "gproj", "fp32")}, dict(s["fallback_reasons"]))
    records = {n: {key: r[key] for key in ("tier", "calls", "samples", "last_sampled_step")}
               for n, r in policy.stats().items()}
    gproj_patch.disable()
    gc.collect()
    return made, grads, counts, records, fa4.CALLS["original"], layers


def test_auto_settled_fa4_layer_files_no_plan_same_outcome(fa4, monkeypatch):
    """``auto``: an FA4 layer settled on the original backward files only its layer at the forward between its
    samples (no record, no plan: host time) and its backward runs FA4's own; gradients, counters and the
    policy's layers are those of the complete record every call, and no record outlives its backward."""
    made, grads, counts, records, fa4_own, layers = _auto_fa4_steps(fa4, monkeypatch, settled=True)
    assert fa_records.live_records() == 0
    full_made, full_grads, full_counts, full_records, full_fa4_own, _ = _auto_fa4_steps(fa4, monkeypatch,
                                                                                       settled=False)
    assert [s for s, n in made if n == "healthy"] == [0, 3, 6]
    assert [s for s, n in made if n == "sick"] == list(range(7))
    assert len(full_made) == 14
    assert counts == full_counts and counts[0]["original"] == 7 and not counts[1]
    assert records == full_records and records["healthy"]["calls"]["original"] == 7
    assert fa4_own == full_fa4_own == 7
    for got, want in zip(grads, full_grads):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    q, k, v, do = layers["sick"]
    for got, want in zip(grads[-1][3:], _oracle(q, k, v, do)):
        assert _rel(_bhsd(got), want) < BOUND
