"""What telemetry reports about a call: the level of a reason's log line, and the label of HF's ``"gproj"``
attention path.

* On a CPU tensor the FP32 tier is the documented backward of mode ``gproj`` (the kernel runs on CUDA, on CPU
  only in Triton's interpreter): the plan gives it no reason, and nothing is logged.
* A call passed to PyTorch's own backward because it cannot be corrected exactly (dropout > 0, ...) is counted
  and logged at DEBUG: PyTorch's behaviour, not an alarm. A CUDA call that takes the slower FP32 tier where the
  mode asked for the kernel is a WARNING.
* HF's ``attn_implementation="gproj"`` without ``enable()`` labels its calls ``hf_gproj`` (reasons and shape
  class); enabled, its calls are SDPA calls, reached and labelled by the seam.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import gproj_patch
from gproj_patch.runtime import telemetry


@pytest.fixture(autouse=True)
def _cpu_default_tiers(monkeypatch, caplog):
    """No interpreter, no tier option: a CPU call in mode gproj takes the FP32 tier. The package logger at
    DEBUG (set before ``enable()``, which then leaves it) so the level of every line is visible."""
    for var in ("TRITON_INTERPRET", "GPROJ_TIER", "GPROJ_MODE", "GPROJ_LOG_LEVEL"):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.DEBUG, logger="gproj_patch")
    gproj_patch.disable()
    gproj_patch.reset_stats()
    yield
    gproj_patch.disable()


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, 16, 32, generator=g).bfloat16().requires_grad_() for _ in range(3)]


def _package_lines(caplog, min_level=logging.DEBUG):
    return [r for r in caplog.records if r.name == "gproj_patch" and r.levelno >= min_level]


def test_cpu_fp32_tier_is_no_fallback_and_pass_throughs_are_debug(caplog):
    q, k, v = _inputs()
    with gproj_patch.enable(mode="gproj", targets=("sdpa",)):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        s = gproj_patch.stats()
        assert s["fp32"] == 1 and s["fallback_reasons"] == {}, s
        assert _package_lines(caplog) == []
        # a pass-through (dropout > 0: the seam's decision, driven with the CPU op's arguments)
        from gproj_patch.hooks import sdpa as seam
        from gproj_patch.runtime import config
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        b = seam.bind(op, (torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, lse, 0.5, True), {})
        seam.corrected(seam.spec_of(op), b, lambda: (q, k, v), config.active())
    lines = _package_lines(caplog)
    assert len(lines) == 1 and "sdpa: dropout > 0" in lines[0].getMessage() and lines[0].levelno == logging.DEBUG


def test_a_cuda_call_off_the_kernel_warns():
    """The level of a reason follows what it means: the FP32 tier on a CUDA tensor (slower than asked) warns,
    on a CPU tensor it is INFO, a pass-through is DEBUG."""
    assert telemetry._log_level("fp32", ("sdpa", "cuda", "bfloat16", 64, "mha")) == logging.WARNING
    assert telemetry._log_level("fp32", ("sdpa", "cpu", "bfloat16", 64, "mha")) == logging.INFO
    assert telemetry._log_level("original", ("sdpa", "cuda", "bfloat16", 64, "mha")) == logging.DEBUG


def _hf_gproj_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="gproj", dtype=torch.bfloat16)
    return model.train()


def test_hf_gproj_path_is_labelled_hf_gproj_without_the_seam(monkeypatch, caplog):
    """Without the SDPA seam (the ``sdpa`` target not enabled) the "gproj" attention runs its own corrected
    backward, under its own label: a reason it meets (bf16 asked to run the kernel in Triton's interpreter,
    inexact there) is logged for the shape class ``hf_gproj/...``."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with gproj_patch.enable(targets=("transformers",)):
        _hf_gproj_model()(ids, labels=ids).loss.backward()
        s = gproj_patch.stats()
    assert s["fp32"] == 1 and s["fallback_reasons"], s
    lines = [r.getMessage() for r in _package_lines(caplog) if " tier for " in r.getMessage()]
    assert lines and all(" tier for hf_gproj/cpu/bfloat16/16/" in m for m in lines), lines
