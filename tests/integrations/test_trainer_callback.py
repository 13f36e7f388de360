"""GProjCallback in a real (tiny, CPU) HF Trainer run: keys reach log_history, order, warnings, layer names."""
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gproj_patch  # noqa: E402
from gproj_patch import policy  # noqa: E402
from gproj_patch.runtime.config import TIERS  # noqa: E402
from gproj_patch.runtime.state import STATE  # noqa: E402
from gproj_patch.integrations.trainer import GProjCallback  # noqa: E402
from tests.helpers.paths import REPO  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, seq=32, vocab=128):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model(k_bias_layer=None):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_bias=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.zero_()
        if k_bias_layer is not None:  # a common key offset far beyond the key spread: the large-key regime
            # (on the lowest RoPE frequency, dim head_dim/2 - 1 of each KV head, which RoPE barely rotates)
            hd = cfg.hidden_size // cfg.num_attention_heads
            model.model.layers[k_bias_layer].self_attn.k_proj.bias[hd // 2 - 1::hd] = 40.0
    return model.to(torch.bfloat16)


def _trainer(tmp_path, model, cb, steps=4):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
                                          logging_steps=2, report_to=[], save_strategy="no", use_cpu=True,
                                          disable_tqdm=True, learning_rate=1e-3, dataloader_num_workers=0)
    return transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb])


@pytest.fixture(autouse=True)
def clean_state():
    gproj_patch.disable()
    gproj_patch.reset_stats()
    policy.reset(keep_config=False)
    yield
    gproj_patch.disable()
    policy.reset(keep_config=False)


def test_keys_reach_log_history_and_the_driven_layer_is_flagged(tmp_path, caplog):
    cb = GProjCallback(mode="auto", sample_every=1)
    trainer = _trainer(tmp_path, _model(k_bias_layer=1), cb)
    assert trainer.callback_handler.callbacks[0] is cb  # moved in front of the reporters at init
    assert gproj_patch.is_enabled()  # before the first forward
    with caplog.at_level(logging.WARNING, logger="gproj_patch"):
        trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    last = logged[-1]
    for layer in ("model.layers.0.self_attn", "model.layers.1.self_attn"):
        for stat in ("tier", "r_k", "r_q", "leak_dq", "leak_dk", "logit_bound", "lse_gap", "p_sink"):
            assert f"gproj/{layer}/{stat}" in last, (layer, stat, sorted(last))
    assert last["gproj/model.layers.0.self_attn/tier"] == 0.0
    assert last["gproj/model.layers.1.self_attn/tier"] >= 1.0
    assert last["gproj/model.layers.1.self_attn/r_k"] > 10 > 1 > last["gproj/model.layers.0.self_attn/r_k"]
    assert last["gproj/layers/original"] == 1.0
    # calls per tier are deltas per logging window: 2 steps x 2 layers
    assert sum(last[f"gproj/calls/{t}"] for t in TIERS) == 4
    danger = [r.getMessage() for r in caplog.records if "entered the large-key regime" in r.getMessage()]
    assert len(danger) == 1 and "model.layers.1.self_attn" in danger[0]


def test_audit_mode_records_measured_discrepancy(tmp_path):
    cb = GProjCallback(mode="audit", sample_every=2)
    trainer = _trainer(tmp_path, _model(), cb, steps=2)
    trainer.train()
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    errs = [v for k, v in last.items() if k.endswith("/audit_err_dq")]
    assert len(errs) == 2 and all(0 <= e < 0.05 for e in errs)


def test_log_keys_are_added_before_reporters_run(tmp_path):
    seen = {}

    class Reporter(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            seen.update(logs)

    cb = GProjCallback(mode="gproj", track_layers=False)
    trainer = _trainer(tmp_path, _model(), cb, steps=2)
    trainer.add_callback(Reporter())
    trainer.callback_handler.callbacks.insert(0, trainer.callback_handler.pop_callback(Reporter))
    trainer.train()  # on_train_begin moves the callback in front again
    assert trainer.callback_handler.callbacks[0] is cb
    assert any(k.startswith("gproj/calls/") for k in seen)
    assert not any(k.startswith("gproj/model.") for k in seen)  # mode gproj: no policy records


def test_gproj_mode_reports_no_false_layer_counts(tmp_path):
    """Mode gproj keeps no per-layer records: the callback logs what ran (calls per tier) and no
    ``gproj/layers/<tier>`` (it logged all three as 0 while every layer ran the FP32 tier)."""
    cb = GProjCallback(mode="gproj")
    trainer = _trainer(tmp_path, _model(), cb, steps=4)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for entry in logged:
        assert not any(k.startswith("gproj/layers/") for k in entry), sorted(entry)
        assert entry["gproj/calls/fp32"] == 4.0  # 2 steps x 2 layers, every one on the FP32 tier (CPU)
        assert entry["gproj/calls/gproj"] == entry["gproj/calls/original"] == 0.0


def test_summary_and_eval_logs_get_no_gproj_keys(tmp_path):
    """The end-of-training summary (train_runtime, ...) and evaluation metrics carry no gproj/... values: the
    reporters would plot them as a second (zero) value at that step. Their deltas go to the next training log."""
    seen = []

    class Reporter(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            seen.append(dict(logs))

    cb = GProjCallback(mode="gproj", track_layers=False)
    trainer = _trainer(tmp_path, _model(), cb, steps=4)
    trainer.add_callback(Reporter())
    trainer.train()
    trainer.log({"eval_loss": 1.0})
    summary = [e for e in seen if "train_runtime" in e]
    evals = [e for e in seen if "eval_loss" in e]
    assert len(summary) == 1 and len(evals) == 1
    for entry in summary + evals:
        assert not any(k.startswith("gproj/") for k in entry), sorted(entry)
    assert not any(k.startswith("gproj/") for k in trainer.state.log_history[-1])
    assert [e["gproj/calls/fp32"] for e in seen if "loss" in e] == [4.0, 4.0]


def test_only_main_process_warns(caplog):
    cb = GProjCallback()
    STATE.events.append({"layer": "L", "step": 0, "from": "original", "to": "gproj", "leak_dq": 0.1,
                         "leak_dk": 0.0, "r_k": 10.0, "r_q": 0.1, "p_sink": 0.0})

    class State:
        is_world_process_zero = False

    with caplog.at_level(logging.WARNING, logger="gproj_patch"):
        cb._emit_warnings(State())
    assert not caplog.records and policy.pop_events() == []


def test_example_script_runs(tmp_path, capsys):
    import importlib.util
    from pathlib import Path
    path = REPO / "examples" / "train_tiny_llama.py"
    spec = importlib.util.spec_from_file_location("train_tiny_llama", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--steps", "3", "--seq", "32", "--drive-layer", "1", "--sample-every", "1",
              "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    # on CPU the policy's "gproj" choice runs the FP32 tier (no GPU kernel): reports name the tier that ran
    assert "model.layers.1.self_attn" in out and "tier=fp32" in out


@pytest.mark.parametrize("bad", [dict(mode="fast"), dict(sample_every=0), dict(gproj_enter="high"), dict(tresh=1)])
def test_callback_validates_options_when_constructed(bad):
    with pytest.raises(ValueError):
        GProjCallback(**bad)
    assert not gproj_patch.is_enabled()
