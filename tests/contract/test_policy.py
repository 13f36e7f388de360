"""auto/audit policy: tier transitions with hysteresis, sampling, layer naming, audit records, options."""
import pytest
import torch

from gproj_patch import policy
from gproj_patch.policy import PolicyConfig, next_tier
from gproj_patch.dispatch.record import CallRecord, Context, Problem


def _record(layer, mode="auto", scale=32 ** -0.5):
    ctx = Context(mode=mode, tier_option="auto", layer=layer, source="test", policy=policy.config())
    return CallRecord(Problem(scale=scale), ctx)


def _decide(layer="L", mode="auto", q=None, k=None, lse=None, scale=32 ** -0.5, dtype=None):
    """policy.decide for a call recorded now with these options (what the router does)."""
    return policy.decide(_record(layer, mode, scale), q=q, k=k, lse=lse)


def _after(layer, mode, tier, grads, fp32_grads):
    policy.after_backward(_record(layer, mode), tier=tier, grads=grads, fp32_grads=fp32_grads)


@pytest.fixture(autouse=True)
def fresh_policy():
    policy.reset(keep_config=False)
    yield
    policy.reset(keep_config=False)


def _qk(k_off=0.0, q_off=0.0, S=64, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, S, D, generator=g)
    k = torch.randn(1, 2, S, D, generator=g)
    k[..., 0] += k_off
    q[..., 0] += q_off
    q, k = q.bfloat16(), k.bfloat16()
    lse = torch.logsumexp(D ** -0.5 * q.float() @ k.float().transpose(-1, -2), -1)
    return dict(q=q, k=k, lse=lse, scale=D ** -0.5, dtype=torch.bfloat16)


def _offset_for_rk(rk, D=32):
    return rk * D ** 0.5  # spread of a standard normal key is sqrt(D)


def test_next_tier_hysteresis_band():
    cfg = PolicyConfig(gproj_enter=0.01, gproj_exit=0.005, fp32_enter=0.1, fp32_exit=0.05)
    assert next_tier("original", 0.009, 0.0, cfg) == "original"
    assert next_tier("original", 0.010, 0.0, cfg) == "gproj"
    assert next_tier("gproj", 0.006, 0.0, cfg) == "gproj"       # inside the band: stays
    assert next_tier("gproj", 0.004, 0.0, cfg) == "original"
    assert next_tier("gproj", 0.02, 0.11, cfg) == "fp32"
    assert next_tier("fp32", 0.02, 0.06, cfg) == "fp32"          # inside the fp32 band: stays
    assert next_tier("fp32", 0.006, 0.04, cfg) == "gproj"        # leaves fp32, still above gproj_exit
    assert next_tier("fp32", 0.001, 0.04, cfg) == "original"
    assert next_tier("original", 0.0, 0.2, cfg) == "fp32"        # query offset alone needs fp32


def test_layer_does_not_flap_between_thresholds():
    policy.configure(sample_every=1, sink_amplification=False)
    seq = [0.2, 3.0, 1.0, 0.9, 1.1, 0.8, 0.3, 1.0, 2.0]  # R_k per step; enter 1.28, exit 0.64 (bf16)
    tiers = []
    for step, rk in enumerate(seq):
        policy.set_step(step)
        tiers.append(_decide(layer="L", mode="auto", **_qk(k_off=_offset_for_rk(rk), seed=step)))
    assert tiers == ["original", "gproj", "gproj", "gproj", "gproj", "gproj", "original", "original", "gproj"]
    rec = policy.stats()["L"]
    assert rec["transitions"] == 3 and rec["samples"] == len(seq)
    events = policy.pop_events()
    assert [(e["from"], e["to"], e["step"]) for e in events] == [
        ("original", "gproj", 1), ("gproj", "original", 6), ("original", "gproj", 8)]
    assert policy.pop_events() == []


def test_events_name_the_tier_that_ran_until_popped():
    """after_backward marks the layer's own events that still lack "ran" (kept per layer, not found by a scan of
    every event); an event popped before its backward is the caller's and stays unmarked."""
    policy.configure(sample_every=1, sink_amplification=False)
    policy.set_step(0)
    assert _decide(layer="A", **_qk(k_off=_offset_for_rk(3.0))) == "gproj"
    assert _decide(layer="B", **_qk(k_off=_offset_for_rk(3.0))) == "gproj"
    _after("A", "auto", "fp32", (), None)  # e.g. the kernel did not apply: the FP32 tier ran
    popped = policy.pop_events()
    assert [(e["layer"], e.get("ran")) for e in popped] == [("A", "fp32"), ("B", None)]
    _after("B", "auto", "gproj", (), None)
    assert "ran" not in popped[1]
    policy.set_step(1)
    assert _decide(layer="B", **_qk(seed=1)) == "original"
    _after("B", "auto", "original", (), None)
    _after("B", "auto", "gproj", (), None)  # a later backward does not rewrite it
    assert [(e["layer"], e["from"], e["to"], e["ran"]) for e in policy.pop_events()] == [("B", "gproj", "original",
                                                                                           "original")]


def test_fp32_when_queries_carry_a_large_common_offset():
    policy.configure(sample_every=1, sink_amplification=False)
    assert _decide(layer="A", **_qk(q_off=_offset_for_rk(20))) == "fp32"
    assert _decide(layer="B", **_qk(k_off=_offset_for_rk(20))) == "gproj"
    assert _decide(layer="C", **_qk()) == "original"


def test_sampling_every_n_steps_reuses_the_decision():
    policy.configure(sample_every=5, sink_amplification=False)
    big, small = _qk(k_off=_offset_for_rk(10)), _qk()
    got = []
    for step in range(12):
        policy.set_step(step)
        got.append(_decide(layer="L", **(big if step >= 3 else small)))
        _after("L", "auto", got[-1], (), None)  # the router reports the tier that ran
    # sampled at steps 0, 5, 10: the regime change at step 3 is seen at step 5
    assert got == ["original"] * 5 + ["gproj"] * 7
    rec = policy.stats()["L"]
    assert rec["samples"] == 3 and rec["calls"] == {"original": 5, "gproj": 7, "fp32": 0}


def test_unsampled_calls_do_not_touch_tensors():
    policy.configure(sample_every=100)
    policy.set_step(0)
    _decide(layer="L", **_qk())
    policy.set_step(1)
    assert _decide(layer="L", q=None, k=None, lse=None) == "original"


def test_unnamed_layers_are_numbered_per_step_at_the_forward():
    """Unnamed calls are named call0, call1, ... in forward order when their record is made; a forward after
    a backward starts a new step (one step notion, state.py)."""
    import gproj_patch
    from gproj_patch.dispatch.record import make_context
    gproj_patch.reset_stats()
    names = []
    for step in range(2):
        names.append([make_context("test").layer for _ in range(3)])
        gproj_patch.layers.scope.backward_ran()
    assert names == [["call0", "call1", "call2"]] * 2
    assert policy.current_step() == 1
    with gproj_patch.layer_scope("blk.0"):
        assert make_context("test").layer == "blk.0"


def test_audit_records_measured_discrepancy_on_sampled_calls_only():
    policy.configure(sample_every=2)
    calls = []
    ref = (torch.ones(4), torch.ones(4), torch.ones(4))

    def fp32_grads():
        calls.append(1)
        return ref

    grads = (torch.ones(4) * 1.01, torch.ones(4), torch.full((4,), 2.0))
    for step in range(4):
        policy.set_step(step)
        tier = _decide(layer="L", mode="audit", **_qk())
        _after("L", "audit", tier, grads, fp32_grads)
    assert len(calls) == 2  # steps 0 and 2
    audit = policy.stats()["L"]["audit"]
    assert audit["err_dq"] == pytest.approx(0.01, rel=1e-3)
    assert audit["err_dk"] == 0.0 and audit["err_dv"] == pytest.approx(1.0)
    assert audit["step"] == 2
    logs = policy.log_dict()
    assert logs["gproj/L/audit_err_dq"] == pytest.approx(0.01, rel=1e-3)
    assert logs["gproj/L/tier"] == 0.0 and logs["gproj/layers/original"] == 1.0
    # auto mode never evaluates the reference
    policy.reset()
    _decide(layer="M", mode="auto", **_qk())
    _after("M", "auto", "original", grads, fp32_grads)
    assert len(calls) == 2


def test_sink_amplification_flags_sharp_attention():
    S, D = 64, 32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, S, D, generator=g)
    k = torch.randn(1, 1, S, D, generator=g)
    q[..., 0] = 3.0
    k[:, :, 0, 0] = 40.0  # every row attends to key 0
    q, k = q.bfloat16(), k.bfloat16()
    lse = torch.logsumexp(D ** -0.5 * q.float() @ k.float().transpose(-1, -2), -1)
    args = dict(q=q, k=k, lse=lse, scale=D ** -0.5)
    policy.configure(sink_amplification=False)
    assert _decide(layer="plain", **args) == "original"
    policy.configure(sink_amplification=True)
    assert _decide(layer="amplified", **args) == "gproj"
    assert policy.stats()["amplified"]["stats"]["p_sink"] > 0.9


def test_options_validation_and_environment():
    with pytest.raises(ValueError, match="sample_every"):
        policy.configure(sample_every=0)
    with pytest.raises(ValueError, match="unknown policy option"):
        policy.configure(treshold=0.1)
    with pytest.raises(ValueError, match="gproj_exit"):
        policy.configure(gproj_enter=0.01, gproj_exit=0.02)
    env = {"GPROJ_SAMPLE_EVERY": "7", "GPROJ_AUTO_ENTER": "0.02", "GPROJ_SINK_AMPLIFICATION": "0"}
    assert policy.options_from_env(env) == {"sample_every": 7, "gproj_enter": 0.02, "sink_amplification": False}
    with pytest.raises(ValueError, match="GPROJ_SAMPLE_EVERY"):
        policy.options_from_env({"GPROJ_SAMPLE_EVERY": "x"})
    with pytest.raises(ValueError, match="mode"):
        _decide(layer="L", mode="gproj", **_qk())


def test_detector_failure_keeps_tier_and_warns_once(caplog):
    policy.configure(sample_every=1)
    bad = dict(q=torch.zeros(2), k=torch.zeros(2), lse=None)
    with caplog.at_level("WARNING", logger="gproj_patch.policy"):
        assert _decide(layer="L", **bad) == "original"
        policy.set_step(1)
        assert _decide(layer="L", **bad) == "original"
    assert sum("detector failed" in r.message for r in caplog.records) == 1


def test_options_from_enable_and_environment_apply(monkeypatch):
    from gproj_patch.runtime import config as patch_config
    monkeypatch.setenv("GPROJ_SAMPLE_EVERY", "9")
    policy.reset(keep_config=False)
    assert policy.config().sample_every == 9
    cfg = patch_config.resolve(mode="auto", sample_every=4, gproj_enter=0.03)
    monkeypatch.setattr(patch_config.ACTIVE, "config", cfg)
    assert policy.config().sample_every == 4 and policy.config().gproj_enter == 0.03
    policy.configure(sample_every=2)
    assert policy.config().sample_every == 2 and policy.config().gproj_enter == 0.03
