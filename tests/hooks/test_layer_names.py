"""One layer naming scheme for an HF model, whatever its ``attn_implementation``.

The ``auto`` policy keeps its records per layer name (``stats()["layers"]``), so switching the implementation
must not change the keys: a model on "sdpa" must not name its calls ``call0``, ``call1`` (the SDPA hook knows
nothing of the module) while "eager", "gproj" and "flex_attention" name them ``"<AttentionClass>.<layer_idx>"``.
Every implementation gives ``"<AttentionClass>.<layer_idx>"``, or the module path when ``track_layers``
(the Trainer callback's hooks) is active — in eager code and under ``torch.compile`` (no graph break, one
compile). The registry wrapper that names the calls is checked to be invisible: same function identity after
``disable()``, same signature, same output bits, same errors.
"""
import inspect

import pytest
import torch
from torch._dynamo.utils import counters

import gproj_patch
from gproj_patch.layers.tracking import track_layers

transformers = pytest.importorskip("transformers")

IMPLEMENTATIONS = ("sdpa", "eager", "gproj", "flex_attention")
CLASS_NAMES = ["LlamaAttention.0", "LlamaAttention.1"]
MODULE_PATHS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
STEPS = 2


pytestmark = pytest.mark.usefixtures("patch_off")  # patch off, fresh runtime state, off again afterwards


def _fresh_dynamo() -> None:
    """No graph compiled by an earlier test, Dynamo's counters at zero."""
    torch._dynamo.reset()
    counters.clear()


def _tiny_llama(impl: str):
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.bfloat16)


def _flex_on_cpu(impl: str, monkeypatch) -> None:
    """HF's flex function compiles flex with Inductor (minutes of C++ codegen on CPU): aot_eager instead, as
    tests/integrations/test_flex.py does. PyTorch's flex has no CPU backward; the hook's FP32 tier trains."""
    if impl != "flex_attention":
        return
    fam = pytest.importorskip("torch.nn.attention.flex_attention")
    import transformers.integrations.flex_attention as hf_flex
    compiled = torch.compile(fam.flex_attention, backend="aot_eager")
    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda q, k, v, training=False, **kw: compiled(q, k, v, **kw))


def _train(model, loss_fn=None) -> None:
    loss_fn = loss_fn or (lambda m, ids: m(input_ids=ids, labels=ids).loss)
    for step in range(STEPS):
        ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(step))
        loss_fn(model, ids).backward()


def _backwards() -> int:
    s = gproj_patch.stats()
    return s["gproj"] + s["fp32"] + s["original"]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("tracked", [False, True], ids=["untracked", "track_layers"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_policy_keys_do_not_depend_on_the_implementation(impl, tracked, monkeypatch):
    _flex_on_cpu(impl, monkeypatch)
    gproj_patch.enable(mode="auto")
    model = _tiny_llama(impl)
    if tracked:
        track_layers(model)
    _train(model)
    assert sorted(gproj_patch.stats()["layers"]) == (MODULE_PATHS if tracked else CLASS_NAMES)
    assert _backwards() == 2 * STEPS, gproj_patch.stats()  # every call went through a hooked backward
    assert gproj_patch.current_layer() is None  # every scope the calls opened is closed again


def test_compiled_model_keeps_stable_names_without_graph_break():
    """fullgraph aot_eager: the compiled backward's SDPA calls are named in backward order (``sdpa0`` the last
    layer; no named scope runs per call in a traced forward), the same every step; one compile, no graph break."""
    _fresh_dynamo()
    gproj_patch.enable(mode="auto")
    model = _tiny_llama("sdpa")
    compiled = torch.compile(lambda m, ids: m(input_ids=ids, labels=ids).loss, backend="aot_eager", fullgraph=True)
    _train(model, compiled)
    assert sorted(gproj_patch.stats()["layers"]) == ["sdpa0", "sdpa1"]
    assert _backwards() == 2 * STEPS, gproj_patch.stats()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1 and not sum(counters["recompiles"].values())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compiled_flex_model_keeps_the_tracked_names():
    """HF flex compiled with ``track_layers``: the flex hook takes the traced scope (the module path), not
    ``"<AttentionClass>.<layer_idx>"``. Not fullgraph: HF's flex mask builder itself breaks the graph (a
    ``warnings.warn`` in ``create_block_mask``)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    _fresh_dynamo()
    gproj_patch.enable(mode="auto")
    model = _tiny_llama("flex_attention")
    track_layers(model)
    _train(model, torch.compile(lambda m, ids: m(input_ids=ids, labels=ids).loss, backend="aot_eager"))
    assert sorted(gproj_patch.stats()["layers"]) == MODULE_PATHS
    assert _backwards() == 2 * STEPS, gproj_patch.stats()


class _Attention(torch.nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_causal = True


def test_registry_wrapper_is_invisible():
    """The "sdpa" entry while enabled: another object that names the call, with the original's signature,
    output bits and errors; ``disable()`` puts the original object back."""
    from transformers.modeling_utils import AttentionInterface
    mapping = AttentionInterface._global_mapping
    before = dict(mapping)
    gproj_patch.enable(mode="auto")  # every target: the flex hook replaces the wrapped "flex_attention" entry
    wrapped = mapping["sdpa"]
    assert wrapped is not before["sdpa"] and wrapped.__wrapped__ is before["sdpa"]
    assert inspect.signature(wrapped) == inspect.signature(before["sdpa"])
    assert wrapped.__name__ == before["sdpa"].__name__
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g).bfloat16() for _ in range(3))
    module = _Attention(layer_idx=5)
    with torch.no_grad():
        got = wrapped(module, q, k, v, None, scaling=0.5)
        want = before["sdpa"](module, q, k, v, None, scaling=0.5)
    assert torch.equal(got[0], want[0]) and got[1] is want[1] is None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    wrapped(module, *leaves, None, scaling=0.5)[0].float().sum().backward()
    assert list(gproj_patch.stats()["layers"]) == ["_Attention.5"]
    for call in (lambda fn: fn(module, q, k, v), lambda fn: fn(module, q, k[..., :3], v, None)):
        with pytest.raises(Exception) as ours:
            call(wrapped)
        with pytest.raises(Exception) as theirs:
            call(before["sdpa"])
        assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)
    assert gproj_patch.current_layer() is None  # closed also when the call raised
    gproj_patch.disable()
    assert all(mapping.get(key) is fn for key, fn in before.items()) and set(mapping) == set(before)
