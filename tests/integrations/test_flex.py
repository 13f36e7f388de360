"""FlexAttention through the hook: same forward bits, backward within 0.5% of the fp64 oracle on
adversarial inputs, masks recognised only when provably equal, everything else passed through with a reason.

CPU: PyTorch's flex has no CPU backward, so the hooked calls run the FP32 tier there (the original raises);
``torch.compile`` is exercised with the aot_eager backend. GPU tests (marked ``gpu``): compiled flex (Inductor)
on CUDA, the GProj kernel, the uncorrected compiled flex as the witness of the leak. Run them with
``PYTHONPATH=. python -m pytest -q -m gpu tests/integrations/test_flex.py``.
"""
import os

import pytest
import torch

import gproj_patch
from gproj_patch.backends.reference import reference_backward
from gproj_patch.hooks import flex as hook
from gproj_patch.hooks import flex_masks

fam = pytest.importorskip("torch.nn.attention.flex_attention")
from tests.helpers.flex_cases import ORIGINAL_CODE, UNPATCHED, causal  # noqa: E402
from tests.helpers.flex_cases import block_mask as _bm, case_inputs as _case, check as _check, leaf as _leaf  # noqa: E402
from tests.helpers.memory import flat as _flat  # noqa: E402
from tests.helpers.numerics import rel as _rel  # noqa: E402
from gproj_patch.audit.cases import get_case  # noqa: E402


def unpatched(*args, **kwargs):
    """The original flex_attention, also while the hook is installed (``flex_reach``'s copy of it)."""
    return hook.original_flex()(*args, **kwargs)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _clean(patch_off):
    hook.uninstall()  # tests also install the hook directly
    yield
    hook.uninstall()


# ---- masks used below: module-level (pure) and closures ------------------------------------------------
def strictly_past(b, h, q_idx, kv_idx):
    return q_idx > kv_idx


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 20) | (q_idx >= kv_idx)


def head_dependent(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) | (h == 1)


def sliding(width):
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= width)
    return sliding_window


def bottom_right(sq, sk):
    def causal_br(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + (sk - sq)
    return causal_br


def documents(doc_ids, is_causal=True):
    def doc_mask(b, h, q_idx, kv_idx):
        same = doc_ids[b, q_idx] == doc_ids[b, kv_idx]
        return same & (q_idx >= kv_idx) if is_causal else same
    return doc_mask


def _grads(fn, q, k, v, do, **kw):
    qq, kk, vv = (_leaf(t) for t in (q, k, v))
    out = fn(qq, kk, vv, **kw)
    out.backward(do)
    return out.detach(), (qq.grad, kk.grad, vv.grad)


def _step(fn, inp, bm):
    """One forward + backward of ``fn`` on the case's inputs (leaves reused, gradients dropped)."""
    q, k, v = (_leaf(t) for t in (inp.q, inp.k, inp.v))

    def step():
        fn(q, k, v, block_mask=bm).backward(inp.do)
        q.grad = k.grad = v.grad = None
    return step


# ---- install / uninstall ---------------------------------------------------------------------------------
def test_install_uninstall_restore_by_identity():
    pytest.importorskip("transformers")
    from transformers.modeling_utils import AttentionInterface
    hf_before = AttentionInterface._global_mapping["flex_attention"]
    assert hook.install() == "installed" and hook.install() == "installed"
    assert fam.flex_attention is UNPATCHED and UNPATCHED.__code__ is hook.flex_attention.__code__  # code swapped
    assert hook.original_flex() is not UNPATCHED and hook.original_flex().__code__ is ORIGINAL_CODE
    assert AttentionInterface._global_mapping["flex_attention"] is hook.hf_flex_attention_forward
    hook.uninstall()
    hook.uninstall()
    assert fam.flex_attention is UNPATCHED and UNPATCHED.__code__ is ORIGINAL_CODE
    assert AttentionInterface._global_mapping["flex_attention"] is hf_before


# ---- mask recognition (independent check: torch's own create_mask on the full grid) ----------------------
def _dense_of(verdict, B, H, sq, sk):
    """The mask a verdict stands for, built from its flags / offsets (not from the mask_mod)."""
    from gproj_patch.backends.spec import MaskSpec
    if verdict.dense is not None:
        return verdict.dense.expand(B, H, sq, sk)
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    spec = MaskSpec(causal=verdict.causal, causal_align=verdict.causal_align, window=verdict.window)
    if verdict.cu_seqlens is None:
        return spec.visible(i, j, sq, sk).expand(B, H, sq, sk)
    cu = verdict.cu_seqlens.tolist()
    out = torch.zeros(B * sq, B * sk, dtype=torch.bool)
    for a, e in zip(cu, cu[1:]):
        n = e - a
        out[a:e, a:e] = spec.visible(torch.arange(n)[:, None], torch.arange(n)[None, :], n, n)
    return torch.stack([out[b * sq:(b + 1) * sq, b * sk:(b + 1) * sk] for b in range(B)])[:, None].expand(B, H, sq, sk)


DOCS = torch.tensor([[0] * 70 + [1] * 30 + [2] * 100, [0] * 150 + [1] * 50])
MASKS = {
    "causal": (causal, 200, 200, "flags"),
    "causal_sq_lt_sk": (causal, 90, 200, "flags"),
    "bottom_right": (bottom_right(90, 200), 90, 200, "flags"),
    "bottom_right_sq_gt_sk": (bottom_right(200, 90), 200, 90, "flags"),
    "sliding_37": (sliding(37), 200, 200, "flags"),
    "documents_causal": (documents(DOCS), 200, 200, "varlen"),
    "documents_full": (documents(DOCS, is_causal=False), 200, 200, "varlen"),
    "strictly_past": (strictly_past, 200, 200, "dense"),
    "prefix_lm": (prefix_lm, 200, 200, "dense"),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_mask_verdict_equals_the_mask(name):
    mask_mod, sq, sk, kind = MASKS[name]
    B, H = 2, 2
    bm = _bm(mask_mod, sq, sk, B=B)
    v = flex_masks.analyse(bm.mask_mod, flex_masks.BlockStructure.of(bm), B, H, sq, sk, "cpu")
    assert v.reason is None
    assert kind == ("dense" if v.dense is not None else "varlen" if v.cu_seqlens is not None else "flags")
    truth = fam.create_mask(mask_mod, B, H, sq, sk, device="cpu")
    assert torch.equal(_dense_of(v, B, H, sq, sk), truth)


def test_mask_inconsistent_with_its_blocks_is_refused():
    # built for head 0 only (H=None) but the mask_mod depends on the head: compiled and eager flex differ
    bm = _bm(head_dependent, 256, 256)
    v = flex_masks.analyse(bm.mask_mod, flex_masks.BlockStructure.of(bm), 1, 2, 256, 256, "cpu")
    assert v.reason is not None and "disagrees" in v.reason
    # blocks of a causal mask with a full mask_mod: the upper blocks are missing
    v = flex_masks.analyse(fam.noop_mask, flex_masks.BlockStructure.of(_bm(causal, 256, 256)), 1, 1, 256, 256, "cpu")
    assert v.reason is not None
    assert flex_masks.reads_argument(head_dependent, 1) and not flex_masks.reads_argument(causal, 1)


# ---- eager calls: forward bits, gradients against fp64, stats ---------------------------------------------
EAGER = {
    "key_offset_128": ("key_offset_128", None, {}),
    "sink": ("sink_offset_64", None, {}),
    "causal_offset": ("key_offset_128", causal, {"causal": True}),
    "sliding_offset": ("key_offset_128", sliding(37), {"causal": True, "window": (37, -1)}),
}


@pytest.mark.parametrize("name", list(EAGER))
def test_eager_forward_bits_and_corrected_backward(name):
    case, mask_mod, flags = EAGER[name]
    inp = _case(case)
    S = inp.q.shape[2]
    bm = None if mask_mod is None else _bm(mask_mod, S, S)
    with torch.no_grad():
        want = UNPATCHED(inp.q, inp.k, inp.v, block_mask=bm)
    with pytest.raises(NotImplementedError):  # unpatched: no CPU backward at all
        UNPATCHED(_leaf(inp.q), inp.k, inp.v, block_mask=bm)
    hook.install()
    out, grads = _grads(fam.flex_attention, inp.q, inp.k, inp.v, inp.do, block_mask=bm)
    assert torch.equal(out, want)
    _check(grads, reference_backward(inp.q, inp.k, inp.v, inp.do, **flags))
    st = gproj_patch.stats()
    assert st["forward"].get("patched") == 1 and st["fp32"] == 1 and st["original"] == 0


def test_documents_batch_gqa_softcap():
    """Per-batch documents (packed varlen), GQA, a recognised softcap, key offset: one call, against fp64."""
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, S, D = 2, 4, 2, 200, 32
    q = torch.randn(B, H, S, D, generator=g).bfloat16()
    k = (torch.randn(B, Hkv, S, D, generator=g) + 40.0).bfloat16()
    v, do = torch.randn(B, Hkv, S, D, generator=g).bfloat16(), torch.randn(B, H, S, D, generator=g).bfloat16()
    bm = _bm(documents(DOCS), S, S, B=B)
    mod = hook.softcap_score_mod(20.0)
    with torch.no_grad():
        want = UNPATCHED(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=True)
    hook.install()
    out, grads = _grads(fam.flex_attention, q, k, v, do, score_mod=mod, block_mask=bm, enable_gqa=True)
    assert torch.equal(out, want)
    dense = fam.create_mask(documents(DOCS), B, None, S, S, device="cpu")
    _check(grads, reference_backward(q, k, v, do, attn_mask=dense, softcap=20.0))
    assert gproj_patch.stats()["fp32"] == 1


def test_packed_documents_pass_the_original_backward_through_unchanged():
    """Per-batch documents run packed (1, H, B·S, D); a backward that takes the caller's own (unpacked)
    gradients — mode "off", or the policy's "original" — returns them exactly as they were."""
    from gproj_patch.dispatch.record import CallRecord, Context
    g = torch.Generator().manual_seed(4)
    B, H, S, D = 2, 2, 200, 16
    q, k, v, do = (torch.randn(B, H, S, D, generator=g).bfloat16() for _ in range(4))
    bm = _bm(documents(DOCS), S, S, B=B)
    verdict = flex_masks.analyse(bm.mask_mod, flex_masks.BlockStructure.of(bm), B, H, S, S, "cpu")
    from gproj_patch.dispatch.plan import ForwardTensors, make_plan
    record = make_plan(CallRecord(hook.problem_for(verdict, 0.0, None, D),
                                  Context(mode="off", tier_option="auto", layer="l", source="flex")),
                       ForwardTensors(q, k, v, None, None), has_original=True)
    own = tuple(torch.randn(B, H, S, D, generator=g).bfloat16() for _ in range(3))
    got = hook.routed_backward(record, do, q, k, v, torch.zeros_like(q), None, lambda: own)
    assert all(torch.equal(a, b) for a, b in zip(got, own))
    assert gproj_patch.stats()["original"] == 1


def test_witness_exact_zero():
    inp = _case("witness")
    hook.install()
    _, grads = _grads(fam.flex_attention, inp.q, inp.k, inp.v, inp.do)
    assert grads[0][inp.expected["dq_index"]].item() == inp.expected["dq_exact"]


def test_kernel_through_interpreter_fp16(monkeypatch):
    """The GProj Triton kernel (Triton's CPU interpreter, FP16) fed with flex's own LSE: the four-key witness
    exactly 0, and a causal 128σ key offset against fp64."""
    pytest.importorskip("triton")
    monkeypatch.setenv("GPROJ_TIER", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gproj_patch.enable(targets=("sdpa",))
    hook.install()
    wit = _case("witness", dtype=torch.float16)
    _, grads = _grads(fam.flex_attention, wit.q, wit.k, wit.v, wit.do)
    assert grads[0][wit.expected["dq_index"]].item() == 0.0
    inp = _case("key_offset_128", dtype=torch.float16)
    S = inp.q.shape[2]
    _, grads = _grads(fam.flex_attention, inp.q, inp.k, inp.v, inp.do, block_mask=_bm(causal, S, S))
    errs = _check(grads, reference_backward(inp.q, inp.k, inp.v, inp.do, causal=True))
    assert max(errs) < 1e-3, errs  # FP16: u = 2^-11
    assert gproj_patch.stats()["gproj"] == 2 and gproj_patch.stats()["fp32"] == 0


def test_dense_fallback_mask_through_fp32_tier():
    inp = _case("key_offset_128")
    S = inp.q.shape[2]
    bm = _bm(prefix_lm, S, S)
    hook.install()
    _, grads = _grads(fam.flex_attention, inp.q, inp.k, inp.v, inp.do, block_mask=bm)
    _check(grads, reference_backward(inp.q, inp.k, inp.v, inp.do,
                                     attn_mask=fam.create_mask(prefix_lm, 1, 1, S, S, device="cpu")))


def _alibi(score, b, h, q_idx, kv_idx):
    return score + (kv_idx - q_idx)


@pytest.mark.parametrize("what", ["score_mod", "lse", "inconsistent_mask", "sliced_mask"])
def test_pass_through_with_reason(what):
    inp = _case("diffuse") if what != "inconsistent_mask" else \
        get_case("diffuse").build(seed=0, dtype=torch.bfloat16, quick=False)  # S = 512: several blocks
    S = inp.q.shape[2]
    kw = {"score_mod": _alibi} if what == "score_mod" else \
        {"return_aux": fam.AuxRequest(lse=True)} if what == "lse" else {"block_mask": _bm(head_dependent, S, S)}
    if what == "sliced_mask":  # flex raises its own error for these: the hook must leave that to it
        hook.install()
        sliced = _bm(causal, S, S)[:, :, :1]
        with pytest.raises((RuntimeError, NotImplementedError)):  # on CPU flex's device check comes first
            fam.flex_attention(_leaf(inp.q), inp.k, inp.v, block_mask=sliced)
        assert any("sliced" in r for r in gproj_patch.stats()["fallback_reasons"])
        return
    hook.install()
    with pytest.raises(NotImplementedError):  # the original ran: it has no CPU backward
        fam.flex_attention(_leaf(inp.q), inp.k, inp.v, **kw)
    st = gproj_patch.stats()
    assert st["forward"] == {"original": 1} and len(st["fallback_reasons"]) == 1
    with torch.no_grad():  # without a gradient the hook is not involved at all
        assert torch.equal(fam.flex_attention(inp.q, inp.k, inp.v, **kw) if what != "lse" else
                           fam.flex_attention(inp.q, inp.k, inp.v, **kw)[0],
                           unpatched(inp.q, inp.k, inp.v, **kw) if what != "lse" else
                           unpatched(inp.q, inp.k, inp.v, **kw)[0])


def test_enable_mode_off_and_fp32_inputs_untouched():
    inp = _case("diffuse", dtype=torch.float32)
    hook.install()
    with pytest.raises(NotImplementedError):  # fp32: nothing to repair, original path
        fam.flex_attention(_leaf(inp.q), inp.k, inp.v)
    assert gproj_patch.stats()["forward"] == {}


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_modes_through_enable(mode):
    inp = _case("key_offset_128")
    gproj_patch.enable(mode=mode, targets=("sdpa",))
    hook.install()
    if mode == "off":  # hooks installed, everything passes through: the original (no CPU backward)
        with pytest.raises(NotImplementedError):
            fam.flex_attention(_leaf(inp.q), inp.k, inp.v)
        return
    _, grads = _grads(fam.flex_attention, inp.q, inp.k, inp.v, inp.do)
    _check(grads, reference_backward(inp.q, inp.k, inp.v, inp.do))
    st = gproj_patch.stats()
    assert st["fp32"] + st["gproj"] == 1 and st["original"] == 0 and st["layers"], st


def test_memory_flat():
    inp = _case("key_offset_128")
    S = inp.q.shape[2]
    bm = _bm(causal, S, S)
    hook.install()
    _flat(_step(fam.flex_attention, inp, bm))


# ---- torch.compile (aot_eager on CPU) ---------------------------------------------------------------------
def test_compiled_fullgraph_corrected():
    inp = _case("sink_offset_64")
    S = inp.q.shape[2]
    bm = _bm(causal, S, S)
    with torch.no_grad():
        want = UNPATCHED(inp.q, inp.k, inp.v, block_mask=bm)
    hook.install()
    torch._dynamo.reset()
    compiled = torch.compile(fam.flex_attention, backend="aot_eager", fullgraph=True)
    out, grads = _grads(compiled, inp.q, inp.k, inp.v, inp.do, block_mask=bm)
    assert torch.equal(out, want)
    _check(grads, reference_backward(inp.q, inp.k, inp.v, inp.do, causal=True))
    assert gproj_patch.stats()["fp32"] == 1


def test_compiled_closure_mask_checked_in_graph():
    """A closure capturing a tensor (per-batch documents): evaluated inside the graph, classified by the backward
    op at run time (varlen documents over the packed batch)."""
    g = torch.Generator().manual_seed(2)
    B, H, S, D = 2, 2, 200, 32
    q, v, do = (torch.randn(B, H, S, D, generator=g).bfloat16() for _ in range(3))
    k = (torch.randn(B, H, S, D, generator=g) + 40.0).bfloat16()
    bm = _bm(documents(DOCS), S, S, B=B)
    with torch.no_grad():
        want = UNPATCHED(q, k, v, block_mask=bm)
    hook.install()
    torch._dynamo.reset()
    compiled = torch.compile(fam.flex_attention, backend="aot_eager", fullgraph=True)
    out, grads = _grads(compiled, q, k, v, do, block_mask=bm)
    assert torch.equal(out, want)
    _check(grads, reference_backward(q, k, v, do, attn_mask=fam.create_mask(documents(DOCS), B, 1, S, S, device="cpu")))
    assert gproj_patch.stats()["fp32"] == 1 and "attn_mask" not in gproj_patch.stats()["fallback_reasons"]


def test_row_intervals_rebuild_the_dense_mask():
    """What the compiled backward does without a dense mask: rows that are key intervals rebuild it exactly."""
    bm = _bm(prefix_lm, 200, 200)
    maps = flex_masks.BlockMaps(flex_masks.BlockStructure.of(bm), 200)
    _, rows, bad = flex_masks.evaluate_chunk(prefix_lm, maps, 1, 1, torch.arange(200), 200)
    verdict = flex_masks.classify(rows, None, 1, 200, 200)
    assert not bool(bad) and torch.equal(verdict.dense, fam.create_mask(prefix_lm, 1, 1, 200, 200, device="cpu"))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GPROJ_SLOW_TESTS") != "1", reason="Inductor's CPU codegen; GPROJ_SLOW_TESTS=1")
def test_compiled_inductor_cpu_same_bits():
    """Inductor (the GPU's backend, here its CPU codegen): the in-graph mask summary lowers, and the forward is
    bitwise the unpatched Inductor-compiled flex."""
    g = torch.Generator().manual_seed(2)
    B, H, S, D = 2, 2, 200, 32
    q, v, do = (torch.randn(B, H, S, D, generator=g).bfloat16() for _ in range(3))
    k = (torch.randn(B, H, S, D, generator=g) + 40.0).bfloat16()
    bm = _bm(documents(DOCS), S, S, B=B)
    torch._dynamo.reset()
    with torch.no_grad():
        want = torch.compile(UNPATCHED)(q, k, v, block_mask=bm)
    hook.install()
    torch._dynamo.reset()
    out, grads = _grads(torch.compile(fam.flex_attention, fullgraph=True), q, k, v, do, block_mask=bm)
    assert torch.equal(out, want)
    _check(grads, reference_backward(q, k, v, do, attn_mask=fam.create_mask(documents(DOCS), B, 1, S, S, device="cpu")))


def test_compiled_pass_through_and_loud_failure():
    inp = get_case("diffuse").build(seed=0, dtype=torch.bfloat16, quick=False)  # S = 512: several blocks
    S = inp.q.shape[2]
    hook.install()
    torch._dynamo.reset()
    compiled = torch.compile(fam.flex_attention, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="backward on CPU"):  # an unreadable score_mod: the original compiled call
        compiled(_leaf(inp.q), inp.k, inp.v, score_mod=_alibi)
    assert any("score_mod is not readable" in r for r in gproj_patch.stats()["fallback_reasons"])
    out = compiled(_leaf(inp.q), inp.k, inp.v, block_mask=_bm(head_dependent, S, S))
    with pytest.raises(RuntimeError, match="disagrees"):  # no silent wrong gradient
        out.backward(inp.do)


# ---- HF "flex_attention" ------------------------------------------------------------------------------------
class _Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_idx = 3


def test_hf_flex_attention_forward(monkeypatch):
    pytest.importorskip("transformers")
    import transformers.integrations.flex_attention as hf_flex
    from transformers.modeling_utils import AttentionInterface
    eager_compiled = torch.compile(UNPATCHED, backend="aot_eager")  # instead of Inductor's CPU codegen (slow)
    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda q, k, v, training=False, **kw: eager_compiled(q, k, v, **kw))
    inp = _case("key_offset_128")
    S = inp.q.shape[2]
    bm, module = _bm(causal, S, S), _Attn()
    with torch.no_grad():
        want, _ = hf_flex.flex_attention_forward(module, inp.q, inp.k, inp.v, bm, softcap=25.0)
    hook.install()
    fn = AttentionInterface._global_mapping["flex_attention"]
    qq, kk, vv = (_leaf(t) for t in (inp.q, inp.k, inp.v))
    out, weights = fn(module, qq, kk, vv, bm, softcap=25.0)
    assert torch.equal(out, want) and weights is None
    out.backward(inp.do.transpose(1, 2))
    _check((qq.grad, kk.grad, vv.grad), reference_backward(inp.q, inp.k, inp.v, inp.do, causal=True, softcap=25.0))
    assert gproj_patch.stats()["fp32"] == 1
    with pytest.raises(NotImplementedError):  # position bias: HF's own function, original flex
        fn(module, _leaf(inp.q), inp.k, inp.v, bm, position_bias=torch.zeros(1, 1, S, S, dtype=torch.bfloat16))
    assert "hf flex: position bias" in gproj_patch.stats()["fallback_reasons"]
    # inside a compiled region (HF model compiled): the softcap is known from the arguments, not the closure
    gproj_patch.reset_stats()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fn(module, q, k, v, bm, softcap=25.0)[0], backend="aot_eager",
                             fullgraph=True)
    qq, kk, vv = (_leaf(t) for t in (inp.q, inp.k, inp.v))
    out = compiled(qq, kk, vv)
    assert torch.equal(out, want)
    out.backward(inp.do.transpose(1, 2))
    _check((qq.grad, kk.grad, vv.grad), reference_backward(inp.q, inp.k, inp.v, inp.do, causal=True, softcap=25.0))
    assert gproj_patch.stats()["fp32"] == 1


def test_hf_score_mod_closure_recognised():
    """HF's own score_mod closure (its code object, with cells as HF fills them) is read exactly."""
    import types
    hf_flex = pytest.importorskip("transformers.integrations.flex_attention")
    code = hook._hf_score_mod_code()
    assert code is not None and set(code.co_freevars) == {"softcap", "score_mask", "position_bias"}

    def closure(**cells):
        return types.FunctionType(code, vars(hf_flex), "score_mod", None,
                                  tuple(types.CellType(cells.get(n)) for n in code.co_freevars))
    assert hook.score_mod_softcap(closure(softcap=25.0)) == (25.0, None)
    assert hook.score_mod_softcap(closure()) == (0.0, None)
    assert hook.score_mod_softcap(closure(score_mask=torch.zeros(1, 1, 4, 4)))[1] is not None
    inp = _case("key_offset_128")
    hook.install()
    _, grads = _grads(fam.flex_attention, inp.q, inp.k, inp.v, inp.do, score_mod=closure(softcap=25.0))
    _check(grads, reference_backward(inp.q, inp.k, inp.v, inp.do, softcap=25.0))


# ---- the audit's backends ---------------------------------------------------------------------------------
def test_audit_backends_on_cpu():
    from gproj_patch.audit.cases import get_case as case_named
    backends = {name: (run, why) for name, run, why in hook.audit_backends(torch.device("cpu"))}
    inp = case_named("causal_bottom_right").build(seed=0, dtype=torch.bfloat16, quick=True)
    run, why = backends["flex-gproj"]
    assert why(inp) is None and backends["flex-uncorrected"][1](inp) is not None
    _check(run(inp, inp.k, None), reference_backward(inp.q, inp.k, inp.v, inp.do, **inp.mask))


# ---- GPU (H200): compiled flex with Inductor, the GProj kernel -----------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case,mask", [("key_offset_128", None), ("sink_offset_64", None),
                                       ("key_offset_128", "causal"), ("sink_offset_64", "causal")])
def test_gpu_compiled_flex_corrected(case, mask):
    inp = get_case(case).build(seed=0, dtype=torch.bfloat16, device="cuda", quick=False)
    S = inp.q.shape[2]
    bm = None if mask is None else _bm(causal, S, S, device="cuda")
    flags = {} if mask is None else {"causal": True}
    ref = reference_backward(inp.q, inp.k, inp.v, inp.do, **flags)
    torch._dynamo.reset()
    plain = torch.compile(UNPATCHED, dynamic=False)
    want, base = _grads(plain, inp.q, inp.k, inp.v, inp.do, block_mask=bm)
    assert _rel(base[0], ref[0]) > 0.05  # the unpatched compiled flex leaks (H200: 36.5% at 128σ)
    hook.install()
    torch._dynamo.reset()
    patched = torch.compile(fam.flex_attention, dynamic=False, fullgraph=True)
    out, grads = _grads(patched, inp.q, inp.k, inp.v, inp.do, block_mask=bm)
    assert torch.equal(out, want)
    _check(grads, ref)
    assert gproj_patch.stats()["gproj"] == 1


@pytest.mark.gpu
@gpu
def test_gpu_compiled_documents():
    """Document masking as in packed pretraining: a closure over per-batch document ids, compiled; the backward
    runs the kernel as varlen over the packed batch."""
    g = torch.Generator().manual_seed(3)
    B, H, S, D = 2, 4, 512, 64
    q, v, do = (torch.randn(B, H, S, D, generator=g).bfloat16().cuda() for _ in range(3))
    k = (torch.randn(B, H, S, D, generator=g) + 128.0).bfloat16().cuda()
    doc_ids = torch.tensor([[0] * 200 + [1] * 112 + [2] * 200, [0] * 64 + [1] * 448]).cuda()
    bm = _bm(documents(doc_ids), S, S, B=B, device="cuda")
    ref = reference_backward(q, k, v, do, attn_mask=fam.create_mask(documents(doc_ids), B, 1, S, S, device="cuda"))
    torch._dynamo.reset()
    want, base = _grads(torch.compile(UNPATCHED, dynamic=False), q, k, v, do, block_mask=bm)
    hook.install()
    torch._dynamo.reset()
    out, grads = _grads(torch.compile(fam.flex_attention, dynamic=False, fullgraph=True), q, k, v, do, block_mask=bm)
    assert torch.equal(out, want)
    _check(grads, ref)
    assert _rel(base[0], ref[0]) > 0.05 and gproj_patch.stats()["gproj"] == 1


@pytest.mark.gpu
@gpu
def test_gpu_witness_and_eager():
    inp = get_case("witness").build(seed=0, dtype=torch.bfloat16, device="cuda")
    hook.install()
    _, grads = _grads(fam.flex_attention, inp.q, inp.k, inp.v, inp.do)
    assert grads[0][inp.expected["dq_index"]].item() == 0.0
    assert gproj_patch.stats()["gproj"] == 1


@pytest.mark.gpu
@gpu
def test_gpu_hf_model_flex(monkeypatch):
    """A Llama on HF's "flex_attention": eager model (HF compiles flex itself) and the whole model compiled (HF
    builds its BlockMask inside the graph; the hook checks it there). Same logits as unpatched, every layer's
    backward through the kernel.

    Whole-model compile: the corrected backward changes the joint graph, so AOTAutograd's partitioner may save
    other activations and Inductor fuse the forward's pointwise chains differently; by default Inductor keeps
    fused intermediates in fp32 past explicit BF16 casts, so such a regrouping alone moves logits by a few BF16
    ulps (H200: max |Δlogit| 0.0078 patched vs unpatched, 0 between two unpatched compiles and with or
    without labels). With ``emulate_precision_casts`` (every cast rounds, whatever the fusion) the logits are
    bitwise equal: the flex forward itself is unchanged."""
    import torch._inductor.config as inductor_config
    monkeypatch.setattr(inductor_config, "emulate_precision_casts", True)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="flex_attention",
                                                          dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, 64, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    want = model(input_ids=ids).logits.detach()
    torch._dynamo.reset()
    want_compiled = torch.compile(model)(input_ids=ids).logits.detach()
    gproj_patch.enable()
    hook.install()
    for run in (model, torch.compile(model)):
        gproj_patch.reset_stats()
        torch._dynamo.reset()
        res = run(input_ids=ids, labels=ids)
        assert torch.equal(res.logits.detach(), want if run is model else want_compiled)
        res.loss.backward()
        st = gproj_patch.stats()
        assert st["gproj"] == cfg.num_hidden_layers, st


@pytest.mark.gpu
@gpu
def test_gpu_memory_flat_compiled():
    inp = get_case("key_offset_128").build(seed=0, dtype=torch.bfloat16, device="cuda", quick=True)
    S = inp.q.shape[2]
    bm = _bm(causal, S, S, device="cuda")
    hook.install()
    torch._dynamo.reset()
    compiled = torch.compile(fam.flex_attention, dynamic=False, fullgraph=True)
    _flat(_step(compiled, inp, bm))


@pytest.mark.gpu
@gpu
def test_gpu_memory_flat_eager():
    inp = get_case("key_offset_128").build(seed=0, dtype=torch.bfloat16, device="cuda", quick=True)
    S = inp.q.shape[2]
    bm = _bm(sliding(37), S, S, device="cuda")
    hook.install()
    _flat(_step(fam.flex_attention, inp, bm))
    assert gproj_patch.stats()["gproj"] == 6
