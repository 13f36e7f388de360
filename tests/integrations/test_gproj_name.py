"""``attn_implementation="gproj"`` without ``enable()``: the name is registered by ``import gproj_patch`` as soon
as Transformers' modeling code is imported (either import order), nothing else changes, and calls through it are
corrected whether the patch is on or off.

Checked: in fresh interpreters, both import orders give the name with the patch off, HF's other registry entries
exactly those of a process that never imported gproj_patch (and, importing Transformers first, the very same
objects), no hook installed, and a "gproj" model's backward corrected; in this process, a model built before
``enable()`` trained by a Trainer whose ``GProjCallback`` enables with its own options (no "already enabled"
warning, the options in force); per call against the fp64 oracle, a "gproj" model corrected with the patch never
enabled and after ``disable()`` (where plain "sdpa" is far off); ``GPROJ_MODE=off`` making it HF's "sdpa";
``disable()`` restoring every other registry entry by identity.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import gproj_patch
from gproj_patch import policy
from gproj_patch.backends import compat
from tests.helpers import hf_models
from tests.helpers.paths import REPO

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

from gproj_patch.hooks import transformers as hf_gproj  # noqa: E402

BOUND = 5e-3           # BF16 through the FP32 tier on CPU, per call against the fp64 oracle
UNPATCHED_FAR = 0.05   # plain BF16 SDPA's dq error per call on the same model


@pytest.fixture(autouse=True)
def _off(patch_off):  # tests/conftest.py: the patch off, fresh state, no GPROJ_* in the environment
    policy.reset(keep_config=False)
    assert AttentionInterface._global_mapping.get("gproj") is hf_gproj.gproj_attention_forward
    yield
    policy.reset(keep_config=False)


# ------------------------------------------------------------------------------------- fresh interpreters
_REPORT = """
import json, sys
import torch
import torch.nn.functional as F
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface
from transformers.models.llama import modeling_llama

def names(mapping):
    return {k: f"{v.__module__}.{v.__qualname__}" for k, v in mapping.items() if k != "gproj"}

out = {"attention": names(AttentionInterface._global_mapping), "mask": names(AttentionMaskInterface._global_mapping)}
if "gproj_patch" in sys.modules:
    import gproj_patch
    from gproj_patch.hooks import transformers as hf_gproj
    from transformers.masking_utils import sdpa_mask
    att, msk = AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping
    out["ours"] = [att.get("gproj") is hf_gproj.gproj_attention_forward, msk.get("gproj") is sdpa_mask]
    out["enabled"] = gproj_patch.is_enabled()
    from gproj_patch.hooks import sdpa as seam
    out["hooks"] = [seam.is_installed() or F.scaled_dot_product_attention is not torch._C._nn.scaled_dot_product_attention,
                    hasattr(modeling_llama.eager_attention_forward, "__gproj_original__"),
                    any(hasattr(v, "__gproj_named__") for v in att.values())]
    out["same_objects"] = [k for k, v in BEFORE.items() if att.get(k) is not v] if "BEFORE" in globals() else None
    from tests.helpers import hf_models
    hf_models.llama("gproj")(**hf_models.token_batch()).loss.backward()
    st = gproj_patch.stats()
    out["corrected"] = st["gproj"] + st["fp32"]
print("REPORT " + json.dumps(out))
"""

_ORDERS = {
    "clean": "",
    "gproj_patch first": "import gproj_patch\nimport transformers\n",
    "transformers first": ("import transformers\nfrom transformers.modeling_utils import AttentionInterface\n"
                           "BEFORE = dict(AttentionInterface._global_mapping)\nimport gproj_patch\n"),
}


def _report(order: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPROJ_")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _ORDERS[order] + _REPORT], capture_output=True, text=True,
                          timeout=300, cwd=str(REPO), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
    assert len(line) == 1, done.stdout + done.stderr
    return json.loads(line[0][len("REPORT "):])


@pytest.fixture(scope="module")
def clean():
    """The registries of a process that never imports gproj_patch."""
    return _report("clean")


@pytest.mark.parametrize("order", ["gproj_patch first", "transformers first"])
def test_import_registers_the_name_and_nothing_else(order, clean):
    got = _report(order)
    assert got["ours"] == [True, True] and got["enabled"] is False
    assert got["hooks"] == [False, False, False]   # no SDPA seam and F's SDPA the builtin, no eager wrapper, no registry wrapper
    assert got["attention"] == clean["attention"] and got["mask"] == clean["mask"]
    if order == "transformers first":
        assert got["same_objects"] == []           # every entry present before the import is the same object
    assert got["corrected"] == 2                   # both layers' backwards corrected, the patch off


# ----------------------------------------------------------------------------------------- this process
def test_model_built_before_enable_then_the_callback_enables_with_its_options(tmp_path, caplog):
    from gproj_patch.integrations.trainer import GProjCallback
    model = hf_models.llama("gproj")   # the patch is off: the name alone
    assert not gproj_patch.is_enabled()
    cb = GProjCallback(mode="auto", sample_every=1, gproj_enter=0.02)
    with caplog.at_level(logging.WARNING, logger="gproj_patch"):
        trainer = hf_models.trainer(tmp_path, model, cb)
        trainer.train()
    assert not any("already enabled" in r.getMessage() for r in caplog.records), caplog.text
    assert cb.handle.owner and cb.handle.config.mode == "auto"
    assert (cb.handle.config.policy.sample_every, cb.handle.config.policy.gproj_enter) == (1, 0.02)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for entry in logged:   # per-layer records exist in auto mode only: the callback's mode is the one in force
        for layer in range(hf_models.LAYERS):
            assert entry[f"gproj/model.layers.{layer}.self_attn/tier"] >= 1.0, entry
        assert entry["gproj/calls/gproj"] + entry["gproj/calls/fp32"] == 2 * hf_models.LAYERS, entry


def _call_errors(impl: str, model) -> list:
    with hf_models.spy_calls(AttentionInterface._global_mapping, impl, none_means_causal=True) as calls:
        model.zero_grad(set_to_none=True)
        model(**hf_models.token_batch()).loss.backward()
    assert len(calls) == hf_models.LAYERS
    return [c.errors() for c in calls]


@pytest.mark.parametrize("history", ["never enabled", "after disable"])
def test_gproj_model_is_corrected_with_the_patch_off(history):
    before = {r: dict(compat.hf_registry_mapping(r)) for r in (AttentionInterface, AttentionMaskInterface)}
    if history == "after disable":
        gproj_patch.enable()
    model = hf_models.llama("gproj")
    gproj_patch.disable()
    for registry, entries in before.items():  # every entry restored by identity, "gproj" still ours
        mapping = compat.hf_registry_mapping(registry)
        assert mapping.keys() == entries.keys() and all(mapping[k] is v for k, v in entries.items())
    gproj_patch.reset_stats()
    got = _call_errors("gproj", model)
    s = gproj_patch.stats()
    assert s["fp32"] == hf_models.LAYERS and s["forward"] == {"patched": hf_models.LAYERS}, s
    model.set_attn_implementation("sdpa")
    plain = _call_errors("sdpa", model)
    for g, p in zip(got, plain):
        assert g["dq"] < BOUND and g["dk"] < BOUND, (got, plain)
        assert p["dq"] > UNPATCHED_FAR, (got, plain)


def test_environment_mode_off_makes_gproj_the_plain_sdpa_path(monkeypatch):
    """With the patch off, "gproj" takes the environment's options, as ``gproj_patch.attention`` does: under
    ``GPROJ_MODE=off`` its calls are HF's "sdpa" calls (nothing corrected, the same gradients)."""
    monkeypatch.setenv("GPROJ_MODE", "off")
    model = hf_models.llama("gproj")
    batch = hf_models.token_batch()
    grads = {}
    for impl in ("gproj", "sdpa"):
        model.set_attn_implementation(impl)
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(torch.equal(grads["gproj"][n], grads["sdpa"][n]) for n in grads["sdpa"])
    s = gproj_patch.stats()
    assert s["fp32"] == s["gproj"] == 0 and s["forward"] == {}, s
