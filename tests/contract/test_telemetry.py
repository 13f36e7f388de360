"""What telemetry reports about a call (issue 19 item 6): the level of a fallback's log line, and the label of
the HF ``"gproj"`` attention path.

* On a CPU tensor the FP32 tier is the documented backward of mode ``gproj`` (the kernel runs on CUDA, on CPU
  only in Triton's interpreter): its line is INFO, not a WARNING on every CPU run. A call left on the original,
  uncorrected backward (dropout) still warns.
* HF's ``attn_implementation="gproj"`` calls are labelled ``hf_gproj`` (reasons and shape class), not ``sdpa``:
  they are not calls of ``F.scaled_dot_product_attention``.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import gproj_patch

CPU_REASON = "cpu tensor without GPROJ_TIER=triton/TRITON_INTERPRET=1"


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


def _lines(caplog, text):
    return [r for r in caplog.records if r.name == "gproj_patch" and text in r.getMessage()]


def test_cpu_fp32_tier_is_info_and_uncorrected_calls_still_warn(caplog):
    q, k, v = _inputs()
    with gproj_patch.enable(mode="gproj", targets=("sdpa",)):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        assert gproj_patch.stats()["fp32"] == 1
        fp32_lines = _lines(caplog, CPU_REASON)
        assert len(fp32_lines) == 1 and "-> fp32 tier for sdpa/cpu/bfloat16" in fp32_lines[0].getMessage()
        assert fp32_lines[0].levelno == logging.INFO
        assert not [r for r in caplog.records if r.name == "gproj_patch" and r.levelno >= logging.WARNING]

        q2, k2, v2 = _inputs(1)  # dropout: the fused forward and its own backward, not corrected
        F.scaled_dot_product_attention(q2, k2, v2, dropout_p=0.5).sum().backward()
    dropout_lines = _lines(caplog, "sdpa: dropout > 0")
    assert len(dropout_lines) == 1 and dropout_lines[0].levelno == logging.WARNING


def _hf_gproj_model(dropout: float):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, attention_dropout=dropout)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="gproj", dtype=torch.bfloat16)
    return model.train()


def test_hf_gproj_path_is_labelled_hf_gproj(caplog):
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with gproj_patch.enable(mode="gproj", targets=("sdpa", "transformers")):
        _hf_gproj_model(0.0)(ids, labels=ids).loss.backward()
        _hf_gproj_model(0.5)(ids, labels=ids).loss.backward()
        reasons = gproj_patch.stats()["fallback_reasons"]
    assert reasons[CPU_REASON] == 1  # the layer's backward: FP32 tier on CPU
    assert [r for r in reasons if "dropout" in r] == \
        ["hf_gproj: dropout > 0 (the fused kernel's dropout mask cannot be replayed by another backward)"]
    lines = [r.getMessage() for r in caplog.records if r.name == "gproj_patch" and " tier for " in r.getMessage()]
    assert lines and all(" tier for hf_gproj/cpu/bfloat16/16/" in m for m in lines), lines
