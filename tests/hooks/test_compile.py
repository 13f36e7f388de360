"""torch.compile(fullgraph=True): a tiny HF model trains with the patch on CPU (the seam in the compiled backward,
no graph break)."""
import copy
import os

import pytest
import torch
import torch.nn.functional as F

import gproj_patch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402


@pytest.fixture(autouse=True)
def _enabled(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # no stale compiled graphs from other runs
    gproj_patch.disable()
    gproj_patch.reset_stats()
    gproj_patch.enable(targets=("sdpa", "transformers"))
    yield
    gproj_patch.disable()
    torch._dynamo.reset()


@pytest.mark.parametrize("impl,backend", [("gproj", "aot_eager"),
                                          pytest.param("sdpa", "inductor", marks=[pytest.mark.slow, pytest.mark.skipif(
                                              os.environ.get("GPROJ_SLOW_TESTS") != "1",
                                              reason="inductor C++ codegen is slow on CPU; GPROJ_SLOW_TESTS=1")])])
def test_compiled_fullgraph_trains(impl, backend):
    """aot_eager checks Dynamo (fullgraph) + AOTAutograd through the seam quickly; the inductor run
    (C++ codegen, ~1 min on 2 cores) is marked slow."""
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=torch.bfloat16)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_fn(m, ids):
        return m(input_ids=ids, labels=ids).loss

    compiled = torch.compile(loss_fn, fullgraph=True, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        loss = compiled(model, ids)
        loss.backward()
        if step == 0:
            ref = loss_fn(eager, ids)
            ref.backward()
            assert torch.allclose(loss.float(), ref.float(), rtol=2e-2)
            for (n, p), pe in zip(model.named_parameters(), eager.parameters()):
                assert torch.allclose(p.grad.float(), pe.grad.float(), rtol=5e-2, atol=5e-3), n
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[1] < losses[0]
    s = gproj_patch.stats()
    assert s["fp32"] + s["gproj"] >= 3, s  # both compiled steps and the eager step ran the corrected backward


def test_compiled_output_keeps_the_query_layout():
    """Under torch.compile the hooked SDPA returns its output in q's dimension order (cuDNN's contract, checked by
    PyTorch's test_cudnn_attention_preserves_query_layout), eager and compiled alike."""
    import itertools
    gproj_patch.enable(targets=("sdpa",))
    for order in itertools.permutations([0, 1, 2]):
        perm = list(order) + [3]
        rev = [perm.index(i) for i in range(4)]
        shape = [[2, 4, 16, 8][i] for i in perm]
        q, k, v = (torch.randn(*shape, dtype=torch.bfloat16).permute(rev).requires_grad_() for _ in range(3))
        fn = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), backend="aot_eager",
                           fullgraph=True)
        out = fn(q, k, v)
        assert out.permute(perm).is_contiguous(), perm
        assert torch.equal(out, torch._C._nn.scaled_dot_product_attention(q, k, v))
        out.float().sum().backward()
