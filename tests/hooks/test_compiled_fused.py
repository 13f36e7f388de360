"""Under ``torch.compile`` the SDPA hook runs the fused aten op SDPA itself picks, keeps that op's own LSE and, for an
``"original"`` plan, calls that op's own backward (issue 21, item 2; ``ops/sdpa_fused.py``).

On CPU, SDPA picks ``_scaled_dot_product_flash_attention_for_cpu`` (which returns its logsumexp) for BF16/FP16:
the compiled forward is bitwise the unpatched compiled forward, the LSE the backward gets is that op's own (no
recompute, no reason counted), ``auto`` with a benign layer gives bitwise the unpatched compiled gradients, and
``gproj`` on an adversarial key offset is within the suite's target of the fp64 oracle with the kernel reading
that LSE. Where no fused op runs (the math backend) the recompute path stays, with its reason counted. The CUDA
tests (``-k cuda``, H200) do the same for cuDNN, flash and efficient, D=64/128, ``is_causal`` and the causal
boolean mask HF passes under compile.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel

import gproj_patch
from gproj_patch.backends import compat
from gproj_patch.backends.reference import reference_backward
from gproj_patch.ops import sdpa_compiled, sdpa_fused
from tests.helpers import adversarial
from tests.helpers.switches import cpu_kernel_on

aten = torch.ops.aten
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _fresh(patch_off, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _inputs(seed, shape=(2, 2, 32, 16), hkv=None, offset=0.0, dtype=torch.bfloat16, device="cpu", bshd=False):
    g = torch.Generator().manual_seed(seed)
    B, H, S, D = shape
    kv = (B, hkv or H, S, D)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(kv, generator=g, dtype=torch.float64) + offset * torch.randn(D, generator=g, dtype=torch.float64)
    v = torch.randn(kv, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, S, D, generator=g, dtype=torch.float64).to(dtype).to(device)
    out = []
    for t in (q, k, v):
        t = t.to(dtype).to(device)
        if bshd:  # (B, S, H, D) memory, as HF's projections give it
            t = t.transpose(1, 2).contiguous().transpose(1, 2)
        out.append(t.requires_grad_())
    return (*out, do)


def _causal_mask(B, S, device="cpu"):
    """The causal boolean mask HF materialises under compile: (B, 1, S, S), batch broadcast."""
    return torch.ones(S, S, dtype=torch.bool, device=device).tril().expand(B, 1, S, S)


CASES = {  # name -> (SDPA keyword arguments given (B, S, device), input kwargs)
    "is_causal": (lambda B, S, dev: dict(is_causal=True), {}),
    "no_mask": (lambda B, S, dev: {}, {}),
    "hf_causal_mask": (lambda B, S, dev: dict(attn_mask=_causal_mask(B, S, dev)), dict(bshd=True)),
    "padding_mask": (lambda B, S, dev: dict(attn_mask=torch.arange(S, device=dev)[None, None, None, :]
                                            < torch.tensor([S, S - 5], device=dev)[:, None, None, None]), {}),
    "gqa": (lambda B, S, dev: dict(is_causal=True, enable_gqa=True), dict(hkv=1)),
}


def _compiled(kw):
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kw)
    return torch.compile(attend, backend="aot_eager", fullgraph=True)


def _run(fn, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _unpatched(kw, *inputs):
    """The unpatched compiled call's (output, dq, dk, dv) on each (q, k, v, do) of ``inputs`` (one compile)."""
    gproj_patch.disable()
    torch._dynamo.reset()
    fn = _compiled(kw)
    runs = [_run(fn, *x) for x in inputs]
    return runs[0] if len(runs) == 1 else runs


def _no_recompute():
    """No reason of the compiled SDPA's fallback (LSE recompute / no LSE / stand-in) was counted."""
    reasons = gproj_patch.stats()["fallback_reasons"]
    return not [r for r in reasons if "torch.compile" in r], reasons


def _lse_spy(monkeypatch):
    """The LSE every compiled backward hands the router."""
    seen, run = [], sdpa_compiled.run_backward

    def spy(record, tensors, *a, **kw):
        seen.append(tensors.lse)
        return run(record, tensors, *a, **kw)
    monkeypatch.setattr(sdpa_compiled, "run_backward", spy)
    return seen


def _no_lse_pass(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("the LSE was recomputed")
    monkeypatch.setattr(sdpa_compiled, "_recomputed_lse", refuse)
    monkeypatch.setattr(sdpa_compiled, "lse_fp32", refuse)


# ----------------------------------------------------------------------------------------------------------
# CPU: the flash-for-CPU op
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_auto_gradients_are_the_unpatched_compiled_ones(case, monkeypatch):
    """Same bits as the unpatched compiled call: the output in every mode, and in ``auto`` on a benign layer
    (the policy keeps "original") the gradients — the fused op's own backward, not a stand-in."""
    make_kw, inp_kw = CASES[case]
    q, k, v, do = _inputs(0, **inp_kw)
    kw = make_kw(q.shape[0], q.shape[2], "cpu")
    ref = _unpatched(kw, (q, k, v, do))
    _no_lse_pass(monkeypatch)
    for mode in ("auto", "gproj"):
        torch._dynamo.reset()
        gproj_patch.enable(mode=mode, targets=("sdpa",))
        gproj_patch.reset_stats()
        got = _run(_compiled(kw), q, k, v, do)
        assert torch.equal(got[0], ref[0]), mode
        s = gproj_patch.stats()
        if mode == "auto":
            assert s["original"] == 1, s
            for a, b in zip(got[1:], ref[1:]):
                assert torch.equal(a, b)
        else:
            assert s["fp32"] + s["gproj"] == 1, s
        assert _no_recompute()[0], _no_recompute()[1]
        gproj_patch.disable()


@pytest.mark.parametrize("case", ["is_causal", "hf_causal_mask", "gqa"])
def test_the_lse_is_the_fused_ops_own(case, monkeypatch):
    """The backward gets the LSE the flash-for-CPU op returned (called here directly on the same inputs, with
    the mask as SDPA converts it), bit for bit; no LSE pass ran."""
    make_kw, inp_kw = CASES[case]
    q, k, v, do = _inputs(1, **inp_kw)
    kw = make_kw(q.shape[0], q.shape[2], "cpu")
    seen = _lse_spy(monkeypatch)
    _no_lse_pass(monkeypatch)
    gproj_patch.enable(mode="gproj", targets=("sdpa",))
    _run(_compiled(kw), q, k, v, do)
    mask = kw.get("attn_mask")
    bias = None if mask is None else torch.zeros((), dtype=q.dtype).masked_fill(~mask, float("-inf"))
    own = aten._scaled_dot_product_flash_attention_for_cpu.default(
        q.detach(), k.detach(), v.detach(), 0.0, kw.get("is_causal", False), attn_mask=bias)[1]
    assert len(seen) == 1 and seen[0] is not None and torch.equal(seen[0], own)
    assert _no_recompute()[0], _no_recompute()[1]


@pytest.mark.parametrize("dtype,tier", [(torch.float16, "gproj"), (torch.bfloat16, "fp32")])
def test_gproj_reads_the_ops_lse_and_matches_fp64(dtype, tier, monkeypatch):
    """Kernel through Triton's interpreter on CPU (fp16: the GProj kernel; bf16: the FP32 tier's kernel form),
    reading the fused op's LSE: on the suite's 128σ key-offset case (a slice of it) dq, dk, dv are within the
    suite's target of the fp64 oracle, where the unpatched compiled backward is far off."""
    inp, kw, _ = adversarial.make_case("offset128", device="cpu", dtype=dtype)
    q, k, v, do = (inp[n][:1, :2, :128].contiguous() for n in ("q", "k", "v", "do"))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = reference_backward(q.detach(), k.detach(), v.detach(), do, **kw)
    plain = _unpatched({}, (q, k, v, do))
    torch._dynamo.reset()
    gproj_patch.enable(mode="gproj", targets=("sdpa",))
    cpu_kernel_on(monkeypatch)
    _no_lse_pass(monkeypatch)
    seen = _lse_spy(monkeypatch)
    got = _run(_compiled({}), q, k, v, do)
    assert torch.equal(got[0], plain[0])
    assert gproj_patch.stats()[tier] == 1 and seen[0] is not None, gproj_patch.stats()
    errs = [adversarial.rel(a, r) for a, r in zip(got[1:], ref)]
    assert max(errs) < adversarial.TARGET < adversarial.rel(plain[1], ref[0]), errs


def test_math_backend_keeps_the_recompute_path_with_its_reason():
    """SDPA limited to the math backend: no fused op, so the compiled op counts why, plans without an LSE on CPU
    and runs ``auto``'s "original" as the stand-in (its reason counted); the output is still the unpatched one."""
    q, k, v, do = _inputs(2)
    kw = dict(is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        ref = _unpatched(kw, (q, k, v, do))
        torch._dynamo.reset()
        gproj_patch.enable(mode="auto", targets=("sdpa",))
        got = _run(_compiled(kw), q, k, v, do)
    assert torch.equal(got[0], ref[0])
    reasons = gproj_patch.stats()["fallback_reasons"]
    assert any(sdpa_fused.MATH_BACKEND in r and "no LSE" in r for r in reasons), reasons
    assert sdpa_compiled.STAND_IN_REASON in reasons, reasons
    for a, b in zip(got[1:], ref[1:]):  # the stand-in: the same math, its own rounding
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)


@pytest.mark.parametrize("case", ["is_causal", "hf_causal_mask", "gqa"])
def test_fake_kernels_agree_with_the_fused_path(case):
    """The fake kernels state what the real ops return on the fused path (mask and GQA included)."""
    make_kw, inp_kw = CASES[case]
    q, k, v, do = _inputs(3, **inp_kw)
    kw = make_kw(q.shape[0], q.shape[2], "cpu")
    args = (q, k, v, kw.get("attn_mask"), kw.get("is_causal", False), None, kw.get("enable_gqa", False), "l", "auto")
    torch.library.opcheck(sdpa_compiled._sdpa_fwd, args, test_utils=("test_schema", "test_faketensor"))
    out, lse, aux = sdpa_compiled._sdpa_fwd(*args)
    torch.library.opcheck(sdpa_compiled._sdpa_bwd, (do, q, k, v, out, lse, args[3], aux, args[4], None),
                          test_utils=("test_schema", "test_faketensor"))


def test_compat_sees_the_fused_op_and_its_bias():
    """``compat.sdpa_fused_call`` names the op the composite ran (with the caller's own query) and its output
    is the builtin's; with ``stop`` it returns the bias the op would take without running the op."""
    q, k, v, _ = _inputs(4)
    mask = _causal_mask(2, 32)
    out, call = compat.sdpa_fused_call(q, k, v, mask, False, None, False)
    assert call.op == "_scaled_dot_product_flash_attention_for_cpu" and call.args["query"] is q
    assert call.args["key"] is k and torch.equal(out, compat.BUILTIN_SDPA(q, k, v, attn_mask=mask))
    none, stopped = compat.sdpa_fused_call(q, k, v, mask, False, None, False, stop=True, backend="FLASH_ATTENTION")
    assert none is None and stopped.outputs == ()
    assert torch.equal(stopped.args["attn_mask"], call.args["attn_mask"])
    assert stopped.args["attn_mask"].dtype == q.dtype and (stopped.args["attn_mask"][~mask.expand(2, 1, 32, 32)]
                                                           == float("-inf")).all()


# ----------------------------------------------------------------------------------------------------------
# CUDA (H200): cuDNN, flash, efficient
# ----------------------------------------------------------------------------------------------------------

CUDA_BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}
CUDA_OPS = {"cudnn": "_scaled_dot_product_cudnn_attention", "flash": "_scaled_dot_product_flash_attention",
            "efficient": "_scaled_dot_product_efficient_attention"}


def _forced(backend):
    return sdpa_kernel([CUDA_BACKENDS[backend]]) if CUDA_BACKENDS[backend] is not None else \
        __import__("contextlib").nullcontext()


def _fused_ops_seen(monkeypatch):
    ops, real = [], sdpa_compiled.fused_forward

    def spy(*a, **kw):
        res = real(*a, **kw)
        ops.append(res.fused.op if res.fused is not None else res.reason)
        return res
    monkeypatch.setattr(sdpa_compiled, "fused_forward", spy)
    return ops


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", ["is_causal", "hf_causal_mask"])
@pytest.mark.parametrize("backend", list(CUDA_BACKENDS))
def test_cuda_fused_backends(backend, case, D, monkeypatch):
    """Per backend torch picks (or is forced to): the compiled forward is bitwise the unpatched compiled one,
    ``auto`` on benign keys gives bitwise the unpatched compiled gradients, ``gproj`` at a 128σ key offset is
    within the suite's target of fp64 with the fused op's own LSE, and no LSE pass runs."""
    make_kw, inp_kw = CASES[case]
    B, H, S = 2, 4, 256
    kw = make_kw(B, S, "cuda")
    benign = _inputs(5, shape=(B, H, S, D), device="cuda", **inp_kw)
    sick = _inputs(6, shape=(B, H, S, D), device="cuda", offset=128.0, **inp_kw)
    with _forced(backend):
        qc = benign[0].detach().requires_grad_()
        try:
            chosen = SDPBackend(torch._fused_sdp_choice(qc, benign[1], benign[2], attn_mask=kw.get("attn_mask"),
                                                        is_causal=kw.get("is_causal", False)))
        except RuntimeError as exc:
            pytest.skip(f"{backend}: {exc}")
        if chosen == SDPBackend.MATH or (backend != "default" and chosen != CUDA_BACKENDS[backend]):
            pytest.skip(f"{backend}/{case}/D={D}: torch picks {chosen.name} here")
        ref_benign, ref_sick = _unpatched(kw, benign, sick)
        _no_lse_pass(monkeypatch)
        ops = _fused_ops_seen(monkeypatch)
        for mode, inputs, ref in (("auto", benign, ref_benign), ("gproj", sick, ref_sick)):
            torch._dynamo.reset()
            gproj_patch.enable(mode=mode, targets=("sdpa",))
            gproj_patch.reset_stats()
            got = _run(_compiled(kw), *inputs)
            assert torch.equal(got[0], ref[0]), (mode, chosen)
            s = gproj_patch.stats()
            if mode == "auto":
                assert s["original"] == 1, s
                for a, b in zip(got[1:], ref[1:]):
                    assert torch.equal(a, b), (chosen, (a.float() - b.float()).abs().max())
            else:
                assert s["gproj"] == 1, s
                oracle = reference_backward(*(t.detach().double().cpu() for t in inputs[:3]), inputs[3].cpu(),
                                            causal=True)
                errs = [adversarial.rel(a.cpu(), r) for a, r in zip(got[1:], oracle)]
                assert max(errs) < adversarial.TARGET, (chosen, errs)
            assert _no_recompute()[0], _no_recompute()[1]
            gproj_patch.disable()
    want = CUDA_OPS.get(backend) or {SDPBackend.CUDNN_ATTENTION: CUDA_OPS["cudnn"],
                                     SDPBackend.FLASH_ATTENTION: CUDA_OPS["flash"],
                                     SDPBackend.EFFICIENT_ATTENTION: CUDA_OPS["efficient"]}[chosen]
    assert ops == [want, want], ops
    print(f"\n{backend}/{case}/D={D}: torch picks {chosen.name} -> {want}")
