"""Public API: enable/disable/is_enabled/stats/attention, options from the environment, thread safety."""
import logging
import threading

import pytest
import torch
import torch.nn.functional as F

import gproj_patch
from gproj_patch.runtime import config, telemetry
from gproj_patch.layers import scope as layer_context
from gproj_patch.backends.reference import reference_backward


pytestmark = pytest.mark.usefixtures("patch_off")


def _inputs(dtype=torch.bfloat16, B=1, H=2, S=16, D=16, Hkv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv or H, S, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv or H, S, D, generator=g).to(dtype).requires_grad_()
    do = torch.randn(B, H, S, D, generator=g).to(dtype)
    return q, k, v, do


def test_enable_disable_restores_identity():
    """``F.scaled_dot_product_attention`` is never replaced (the SDPA hook is a dispatcher seam below it); the
    seam's registrations and HF's registry entries come and go with enable()/disable()."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
    from gproj_patch.hooks import sdpa as seam
    before = F.scaled_dot_product_attention
    had_attn = "gproj" in AttentionInterface._global_mapping
    assert not gproj_patch.is_enabled() and not seam.is_installed()
    h = gproj_patch.enable(targets=("sdpa", "transformers"))
    assert gproj_patch.is_enabled() and h.owner and seam.is_installed()
    assert F.scaled_dot_product_attention is before
    assert "gproj" in AttentionInterface._global_mapping and "gproj" in AttentionMaskInterface._global_mapping
    gproj_patch.disable()
    assert not gproj_patch.is_enabled() and not seam.is_installed()
    assert F.scaled_dot_product_attention is before
    assert ("gproj" in AttentionInterface._global_mapping) == had_attn
    gproj_patch.disable()  # twice: no-op


def test_enable_twice_is_noop_and_context_manager():
    from gproj_patch.hooks import sdpa as seam
    with gproj_patch.enable(targets=("sdpa",)) as outer:
        ops = seam.seam_ops()
        with gproj_patch.enable(targets=("sdpa",)) as inner:
            assert not inner.owner
            assert seam.seam_ops() == ops
        assert gproj_patch.is_enabled() and seam.is_installed()  # the inner, non-owning handle did not turn it off
        assert outer.owner
    assert not gproj_patch.is_enabled() and not seam.is_installed()


def test_threads_enable_once():
    from gproj_patch.hooks import sdpa as seam
    handles, barrier = [], threading.Barrier(6)

    def work():
        barrier.wait()
        handles.append(gproj_patch.enable(targets=("sdpa",)))
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(h.owner for h in handles) == 1
    assert seam.is_installed() and len(seam.INSTALLED.libraries) == len({o.partition("::")[0]
                                                                          for o in seam.seam_ops()})
    gproj_patch.disable()
    assert not seam.is_installed()


def test_env_options_and_errors(monkeypatch):
    monkeypatch.setenv("GPROJ_MODE", "fp32")
    monkeypatch.setenv("GPROJ_TARGETS", "sdpa, transformers")
    monkeypatch.setenv("GPROJ_LOG_LEVEL", "info")
    cfg = config.resolve()
    assert (cfg.mode, cfg.targets, cfg.log_level) == ("fp32", ("sdpa", "transformers"), 20)
    assert config.resolve(mode="gproj").mode == "gproj"  # explicit argument wins
    monkeypatch.setenv("GPROJ_MODE", "fast")
    with pytest.raises(ValueError, match="GPROJ_MODE"):
        gproj_patch.enable()
    monkeypatch.delenv("GPROJ_MODE")
    monkeypatch.setenv("GPROJ_TARGETS", "sdpa,xformers")
    with pytest.raises(ValueError, match="xformers"):
        config.resolve()
    monkeypatch.setenv("GPROJ_TARGETS", "sdpa")
    for var, bad in (("GPROJ_TIER", "cuda"), ("GPROJ_LOG_LEVEL", "loud"), ("GPROJ_DETECTOR_GRAPH", "maybe"),
                     ("GPROJ_SAMPLE_EVERY", "0")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            config.resolve()
        monkeypatch.delenv(var)
    with pytest.raises(ValueError, match="mode"):
        gproj_patch.enable(mode="sometimes")
    assert not gproj_patch.is_enabled()


def test_unknown_option_raises_and_policy_options_are_validated_at_enable(monkeypatch):
    with pytest.raises(ValueError, match="mdoe"):
        gproj_patch.enable(mdoe="fp32")  # a typo is an error, not silently ignored
    with pytest.raises(ValueError, match="deterministic"):
        gproj_patch.enable(deterministic=True)  # removed: every tier is deterministic
    assert not gproj_patch.is_enabled()
    for bad in (dict(sample_every=0), dict(gproj_enter=-1.0), dict(gproj_exit=0.5, gproj_enter=0.1),
                dict(max_rows=1), dict(sample_every="often")):
        with pytest.raises(ValueError):
            gproj_patch.enable(mode="auto", **bad)  # at enable(), not at the first backward
        assert not gproj_patch.is_enabled()
    cfg = gproj_patch.enable(mode="auto", sample_every=7, gproj_enter=0.03).config
    assert (cfg.policy.sample_every, cfg.policy.gproj_enter) == (7, 0.03)


def test_thresholds_below_both_defaults_as_keywords_or_variables():
    """An enter/exit pair below the defaults is valid together (each value's own range is checked with its partner
    equal; the order on the whole config), from keywords, variables or a mix; out of order it names its sources."""
    from gproj_patch.runtime.config import policy_options
    cfg = policy_options({}, gproj_enter=0.003, gproj_exit=0.001, fp32_enter=0.004, fp32_exit=0.003)
    assert (cfg.gproj_enter, cfg.gproj_exit, cfg.fp32_enter, cfg.fp32_exit) == (0.003, 0.001, 0.004, 0.003)
    cfg = policy_options({"GPROJ_AUTO_ENTER": "0.003"}, gproj_exit=0.002)
    assert (cfg.gproj_enter, cfg.gproj_exit) == (0.003, 0.002)
    with pytest.raises(ValueError, match=r"^gproj_exit \(0.005, the default\) must not exceed gproj_enter \(0.003\)$"):
        policy_options({}, gproj_enter=0.003)  # the default exit is above it
    with pytest.raises(ValueError, match=r"^GPROJ_AUTO_EXIT \(0.5\) must not exceed GPROJ_AUTO_ENTER \(0.2\)$"):
        policy_options({"GPROJ_AUTO_ENTER": "0.2", "GPROJ_AUTO_EXIT": "0.5"})
    with pytest.raises(ValueError, match="GPROJ_AUTO_ENTER"):
        policy_options({"GPROJ_AUTO_ENTER": "-1"})


def _resolve_error(given) -> str:
    """The ValueError message of resolve() with ``given``: GPROJ_* names as the environment, others as keywords."""
    environ = {k: v for k, v in given.items() if k.startswith("GPROJ_")}
    keywords = {k: v for k, v in given.items() if not k.startswith("GPROJ_")}
    with pytest.raises(ValueError) as info:
        config.resolve(environ=environ, **keywords)
    return str(info.value)


@pytest.mark.parametrize("given,message", [
    ({"sample_every": 0}, "sample_every must be an integer >= 1; got 0"),
    ({"GPROJ_SAMPLE_EVERY": "0"}, "GPROJ_SAMPLE_EVERY must be an integer >= 1; got 0"),
    ({"max_rows": 1}, "max_rows must be an integer >= 2; got 1"),
    ({"GPROJ_DETECTOR_ROWS": "1"}, "GPROJ_DETECTOR_ROWS must be an integer >= 2; got 1"),
    ({"max_amplification": 0.5}, "max_amplification must be a number >= 1; got 0.5"),
    # the exit threshold's own variable, not its pair's partner
    ({"GPROJ_FP32_EXIT": "-1"}, "GPROJ_FP32_EXIT must be a finite number >= 0 (a relative error, 0.005 = 0.5%); "
                                "got -1.0"),
    ({"GPROJ_AUTO_EXIT": "nan"}, "GPROJ_AUTO_EXIT must be a finite number >= 0 (a relative error, 0.005 = 0.5%); "
                                 "got nan"),
    ({"GPROJ_SAMPLE_EVERY": "--5"}, "GPROJ_SAMPLE_EVERY='--5': expected an integer"),
])
def test_policy_range_errors_name_the_keyword_or_variable_once(given, message):
    """The whole message, exactly: one name (the keyword or variable that was used), never a second prefix."""
    assert _resolve_error(given) == message


LEVELS = "DEBUG, INFO, WARNING, WARN, ERROR, CRITICAL"


@pytest.mark.parametrize("given,message", [
    ({"log_level": -5}, f"log_level must be one of {LEVELS} or an int >= 0; got -5"),
    ({"GPROJ_LOG_LEVEL": "-5"}, f"GPROJ_LOG_LEVEL must be one of {LEVELS} or an int >= 0; got '-5'"),
    ({"GPROJ_LOG_LEVEL": "--5"}, f"GPROJ_LOG_LEVEL must be one of {LEVELS} or an int >= 0; got '--5'"),
    ({"log_level": True}, f"log_level must be one of {LEVELS} or an int >= 0; got True"),
])
def test_a_log_level_is_a_level_name_or_a_non_negative_int(given, message):
    """logging's levels run from NOTSET (0) up; a negative number is no level (setLevel would take it and let
    every record through)."""
    assert _resolve_error(given) == message
    assert config.resolve(environ={"GPROJ_LOG_LEVEL": "0"}).log_level == logging.NOTSET
    assert config.resolve(environ={}, log_level=" info ").log_level == logging.INFO
    assert config.resolve(environ={"GPROJ_LOG_LEVEL": "+35"}).log_level == 35


def test_keyword_wins_over_an_invalid_environment_value(monkeypatch):
    monkeypatch.setenv("GPROJ_MODE", "bogus")
    monkeypatch.setenv("GPROJ_SAMPLE_EVERY", "zero")
    with pytest.raises(ValueError, match="GPROJ_MODE"):
        config.resolve(sample_every=3)
    cfg = config.resolve(mode="fp32", sample_every=3)
    assert (cfg.mode, cfg.policy.sample_every) == ("fp32", 3)


@pytest.mark.parametrize("source", ["keyword", "GPROJ_TIER"])
def test_tier_triton_refusal_names_what_can_set_it(monkeypatch, source):
    """tier "triton" on CPU bf16 (the interpreter's bf16 is inexact): refused where the SDPA seam decides, in the
    backward. Set by the keyword the message must not claim the variable was set; it names both ways the option
    is given."""
    pytest.importorskip("triton")
    if source == "keyword":
        gproj_patch.enable(targets=("sdpa",), tier="triton")
    else:
        monkeypatch.setenv("GPROJ_TIER", "triton")
        gproj_patch.enable(targets=("sdpa",))
    q, k, v = (torch.randn(1, 2, 16, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError) as info:
        out.float().sum().backward()
    assert str(info.value).startswith('tier="triton" (as a keyword or GPROJ_TIER=triton) but the GProj kernel '
                                      "cannot run: bfloat16"), str(info.value)


@pytest.mark.parametrize("targets", [(), [], ""])
def test_empty_targets_is_an_error(monkeypatch, targets):
    with pytest.raises(ValueError, match="empty"):
        gproj_patch.enable(targets=targets)
    monkeypatch.setenv("GPROJ_TARGETS", " , ")
    with pytest.raises(ValueError, match="GPROJ_TARGETS.*empty"):
        gproj_patch.enable()
    assert not gproj_patch.is_enabled()


def test_kernel_op_exists_after_import():
    import subprocess
    import sys
    code = "import gproj_patch, torch; print(hasattr(torch.ops.gproj, 'attention_backward'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr


def test_attention_without_enable_is_corrected_and_counted():
    q, k, v, do = _inputs(Hkv=1, H=2)
    out = gproj_patch.attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    out.backward(do)
    ref = reference_backward(q.detach(), k.detach(), v.detach(), do, causal=True)
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        assert ((got.double() - want).norm() / want.norm()) < 4e-3
    s = gproj_patch.stats()
    assert s["gproj"] + s["fp32"] == 1 and s["original"] == 0
    assert set(("gproj", "fp32", "original", "fallback_reasons")) <= set(s)
    gproj_patch.reset_stats()
    assert gproj_patch.stats()["fp32"] == 0


def test_mode_off_and_fp32(caplog):
    q, k, v, do = _inputs()
    with gproj_patch.enable(mode="off", targets=("sdpa",)):
        F.scaled_dot_product_attention(q, k, v).backward(do)
    assert gproj_patch.stats()["fp32"] == 0 and gproj_patch.stats()["gproj"] == 0
    with gproj_patch.enable(mode="fp32", targets=("sdpa",)):
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v).backward(do)
    s = gproj_patch.stats()
    assert s["fp32"] == 3 and not s["fallback_reasons"]  # asked for, not a fallback


def test_fallback_reason_logged_once(caplog, monkeypatch):
    """A reason is counted every time and logged once (here: bf16 asked to run the kernel in Triton's
    interpreter, which is inexact there, takes the FP32 tier)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, do = _inputs()
    with gproj_patch.enable(mode="gproj", targets=("sdpa",)), caplog.at_level("INFO", "gproj_patch"):
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v).backward(do)
    s = gproj_patch.stats()
    assert s["fp32"] == 3 and sum(s["fallback_reasons"].values()) == 3, s
    assert len([r for r in caplog.records if r.name == "gproj_patch"]) == 1


@pytest.mark.parametrize("mode", ["auto", "audit"])
def test_policy_modes(mode):
    q, k, v, do = _inputs()
    with gproj_patch.enable(mode=mode, targets=("sdpa",)):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(do)
    s = gproj_patch.stats()
    assert s["gproj"] + s["fp32"] + s["original"] == 1
    assert torch.isfinite(q.grad).all()


def test_layer_context():
    layer_context.new_step()
    assert layer_context.layer_id() == "call0" and layer_context.layer_id() == "call1"
    with gproj_patch.layer_scope("blk.3"):
        assert gproj_patch.current_layer() == "blk.3" and layer_context.layer_id() == "blk.3"
    layer_context.backward_ran()
    assert layer_context.layer_id() == "call0"  # a backward ran: a new step starts


def test_stats_shape_class_and_threads():
    telemetry.record_backward("fp32", "r1", ("x",))
    telemetry.record_backward("fp32", "r1", ("y",))
    telemetry.record_backward("original")
    s = gproj_patch.stats()
    assert s["fp32"] == 2 and s["original"] == 1 and s["fallback_reasons"] == {"r1": 2}
    with pytest.raises(ValueError):
        telemetry.record_backward("tf32")


def test_enable_keeps_a_log_level_the_application_set(monkeypatch):
    import logging
    monkeypatch.delenv("GPROJ_LOG_LEVEL", raising=False)
    gproj_patch.disable()
    log = logging.getLogger("gproj_patch")
    before = log.level
    try:
        log.setLevel(logging.DEBUG)
        with gproj_patch.enable(targets=("sdpa",)):
            assert log.level == logging.DEBUG
        with gproj_patch.enable(targets=("sdpa",), log_level="ERROR"):
            assert log.level == logging.ERROR
        assert log.level == logging.DEBUG
        monkeypatch.setenv("GPROJ_LOG_LEVEL", "")  # empty: unset, as for every option resolve() reads
        with gproj_patch.enable(targets=("sdpa",)):
            assert log.level == logging.DEBUG
        monkeypatch.setenv("GPROJ_LOG_LEVEL", "ERROR")
        with gproj_patch.enable(targets=("sdpa",)):
            assert log.level == logging.ERROR
        assert log.level == logging.DEBUG
    finally:
        log.setLevel(before)


def test_attention_without_enable_reads_the_environment(monkeypatch):
    gproj_patch.disable()
    monkeypatch.setenv("GPROJ_MODE", "nonsense")
    q = torch.randn(1, 2, 8, 16).bfloat16().requires_grad_()
    with pytest.raises(ValueError, match="GPROJ_MODE"):
        gproj_patch.attention(q, q, q)
    monkeypatch.setenv("GPROJ_MODE", "fp32")
    gproj_patch.reset_stats()
    gproj_patch.attention(q, q, q).sum().backward()
    assert gproj_patch.stats()["fp32"] == 1
