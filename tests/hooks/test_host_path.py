"""The per-call host path of the SDPA hook: what it caches cannot give a stale answer.

``plan.kernel_reason`` keeps its answers per (device type, CPU kernel switch, dtypes, head dims, B·H) in the
runtime state; the switch (``TRITON_INTERPRET=1`` here) is resolved at ``enable()`` and recorded in each call's
context, so the answer depends on nothing else (fp16 runs the interpreted kernel, bf16 is refused). The backend
compute is replaced by zero gradients: the tests are about which tier each call gets and what ``stats()``
counts, call after call, as dtype, head dim, B·H, causal, mode and ``enable()`` options change in between.
The seam's ``_problem`` shares one frozen ``Problem`` per (scale, flags) among calls without a mask tensor.
"""
import threading

import pytest
import torch
import torch.nn.functional as F

import gproj_patch
from gproj_patch.dispatch import plan as plan_mod, router
from gproj_patch.backends import triton_bwd
from gproj_patch.runtime.state import STATE

pytestmark = pytest.mark.usefixtures("patch_off")

BF16_REASON = "bfloat16 under the Triton interpreter (inexact)"


@pytest.fixture
def cached_cpu(monkeypatch):
    """Kernel tier choosable on CPU, kernel_reason cached for CPU tensors, backend compute stubbed; returns the
    list of (tier, dtype) each backward ran."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (GPROJ_TIER=triton would also make a refusal an error)
    ran = []

    def stub(tier):
        def run(t, problem, kernel_plan):
            ran.append((tier, t.q.dtype, bool(problem.causal)))
            return torch.zeros_like(t.q), torch.zeros_like(t.k), torch.zeros_like(t.v)
        return run
    monkeypatch.setattr(router, "_run_kernel", stub("gproj"))
    monkeypatch.setattr(router, "_run_fp32", stub("fp32"))
    return ran


def _call(dtype=torch.float16, B=1, H=2, S=8, D=16, causal=True):
    q, k, v = (torch.randn(B, H, S, D).to(dtype).requires_grad_() for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()


def test_dtype_head_dim_and_batch_heads_changes_get_their_own_answer(cached_cpu):
    gproj_patch.enable(mode="gproj", targets=("sdpa",))
    for _ in range(2):  # the second round is answered from the cache: the same tiers
        _call(torch.float16)
        _call(torch.bfloat16)
        _call(torch.float16, D=300)             # head dim above the kernel's 256
        _call(torch.float16, B=1, H=70000, S=1)  # B·H over the CUDA grid limit
        _call(torch.float16, B=2, H=3)
    assert [t for t, _, _ in cached_cpu] == ["gproj", "fp32", "fp32", "fp32", "gproj"] * 2
    s = gproj_patch.stats()
    assert (s["gproj"], s["fp32"]) == (4, 6)
    assert s["fallback_reasons"][BF16_REASON] == 2
    assert s["fallback_reasons"]["head_dim=300"] == 2
    assert sum(n for r, n in s["fallback_reasons"].items() if r.startswith("batch·heads")) == 2
    assert len(STATE.kernel_reasons) == 5


def test_cached_answers_equal_the_predicate(cached_cpu):
    """Every cached answer is what kernel_unsupported_reason says for those inputs now."""
    gproj_patch.enable(mode="gproj", targets=("sdpa",))
    for dtype in (torch.float16, torch.bfloat16):
        for D in (1, 64, 256, 257):
            _call(dtype, D=D, S=4)
    assert len(STATE.kernel_reasons) == 8
    for (device, cpu_kernel, dtype, _kd, _vd, bh, d, _dk, _dv), reason in STATE.kernel_reasons.items():
        q = torch.zeros(1, bh, 4, d, dtype=dtype, device=device)
        assert cpu_kernel and reason == triton_bwd.kernel_unsupported_reason(q, q, q, cpu_kernel=True), (dtype, d)


def _enable(**options):
    gproj_patch.disable()
    gproj_patch.enable(targets=("sdpa",), **options)


def test_mode_causal_and_enable_options_between_calls(cached_cpu):
    _enable(mode="gproj")
    _call(torch.float16, causal=True)
    _call(torch.float16, causal=False)
    _enable(mode="fp32")
    _call(torch.float16)
    _enable(mode="gproj", tier="fp32")
    _call(torch.float16)
    _enable(mode="gproj")
    _call(torch.float16, causal=False)
    _call(torch.bfloat16)
    _enable(mode="gproj", tier="triton")
    with pytest.raises(RuntimeError, match="bfloat16 under the Triton interpreter"):
        _call(torch.bfloat16)  # tier "triton" turns the cached refusal into the error, as uncached
    assert [(t, c) for t, _, c in cached_cpu] == [("gproj", True), ("gproj", False), ("fp32", True),
                                                  ("fp32", True), ("gproj", False), ("fp32", True)]
    s = gproj_patch.stats()
    assert (s["gproj"], s["fp32"], s["fallback_reasons"][BF16_REASON]) == (3, 3, 1)


def test_reset_stats_clears_the_cache(cached_cpu):
    gproj_patch.enable(mode="gproj", targets=("sdpa",))
    _call(torch.float16)
    assert STATE.kernel_reasons
    gproj_patch.reset_stats()
    assert not STATE.kernel_reasons


def test_cpu_switch_is_resolved_at_enable_and_keys_the_cache(monkeypatch):
    """The CPU kernel switch is an option resolved at ``enable()``, part of the cache key: unsetting
    TRITON_INTERPRET between calls changes nothing; enabling again with it unset gives the FP32 tier."""
    ran = []
    monkeypatch.setattr(router, "_run_kernel", lambda t, p, k: ran.append("gproj") or (t.q * 0, t.k * 0, t.v * 0))
    monkeypatch.setattr(router, "_run_fp32", lambda t, p, k: ran.append("fp32") or (t.q * 0, t.k * 0, t.v * 0))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gproj_patch.enable(mode="gproj", targets=("sdpa",))
    _call(torch.float16)
    monkeypatch.delenv("TRITON_INTERPRET")
    _call(torch.float16)
    _enable(mode="gproj")
    _call(torch.float16)
    assert ran == ["gproj", "gproj", "fp32"]
    # without the switch a CPU call is planned on the FP32 tier without asking the kernel: one key, the switch's
    assert sorted(key[1] for key in STATE.kernel_reasons) == [True]


def test_threads_count_every_call(cached_cpu):
    gproj_patch.enable(mode="gproj", targets=("sdpa",))
    errors = []

    def work(dtype):
        try:
            for _ in range(20):
                _call(dtype)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(d,)) for d in (torch.float16, torch.bfloat16) * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = gproj_patch.stats()
    assert (s["gproj"], s["fp32"], s["fallback_reasons"][BF16_REASON]) == (60, 60, 60)
    assert sorted(set((t, d) for t, d, _ in cached_cpu), key=str) == \
        sorted({("gproj", torch.float16), ("fp32", torch.bfloat16)}, key=str)


def test_problem_shared_per_flags_and_fresh_with_a_mask():
    """The seam's problem of a call without a mask is one frozen instance per (scale, flags) (host time); an exact
    causal bias becomes those flags; any other mask a fresh problem holding it."""
    from gproj_patch.hooks import sdpa as seam
    q = torch.randn(1, 2, 8, 16).bfloat16()

    def call(causal=False, mask=None, scale=16 ** -0.5):
        return seam.SeamCall(do=q, q=q, k=q, v=q, out=q, lse=q[..., 0].float(), scale=scale, causal=causal,
                             align="top_left", window=(-1, -1), mask=mask, dropout_p=0.0, bias_grad=False)
    a = seam._problem(call(causal=True))
    assert seam._problem(call(causal=True)) is a
    assert (a.scale, a.causal, a.attn_mask, a.padded) == (16 ** -0.5, True, None, False)
    b = seam._problem(call(scale=0.5))
    assert b is not a and (b.scale, b.causal) == (0.5, False)
    bias = torch.zeros(8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    assert seam._problem(call(mask=bias)) is a  # SDPA's bias of an exact causal mask becomes the flags
    cudnn_bias = torch.zeros(8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), -65504.0).bfloat16()
    assert seam._problem(call(mask=cudnn_bias)) is a  # the cuDNN op's conversion (-65504 where hidden) too
    band = torch.ones(8, 8, dtype=torch.bool).tril() & ~torch.ones(8, 8, dtype=torch.bool).tril(-3)
    band[5] = False  # a row that sees no key: under a finite bias it attends uniformly, not a boolean mask
    finite = torch.zeros(8, 8).masked_fill(~band, -65504.0)
    kept = seam._problem(call(mask=finite))
    assert kept.attn_mask is finite and not kept.padded  # stays an additive bias (the FP32 tier adds it)
    mask = torch.rand(8, 8) > 0.5
    m = seam._problem(call(mask=mask))
    assert m.attn_mask is mask and m.padded and seam._problem(call(mask=mask)) is not m


def test_lse_in_any_layout_reaches_the_tiers_as_b_h_s(monkeypatch):
    """The router skips normalize_lse only for an LSE already (B, H, Sq) fp32; other layouts are normalized."""
    seen = []
    monkeypatch.setattr(router, "_run_fp32", lambda t, p, o="auto": seen.append(t.lse) or (t.q * 0, t.k * 0, t.v * 0))
    q = torch.randn(2, 3, 5, 8)
    lse = torch.randn(2, 3, 5)
    record = router.CallRecord(router.Problem(scale=8 ** -0.5),
                               gproj_patch.dispatch.record.make_context("sdpa", "x", gproj_patch.runtime.config.resolve(mode="fp32")))
    record = plan_mod.make_plan(record, plan_mod.ForwardTensors(q, q, q, q, lse), has_original=False)
    for given in (lse, lse[..., None], torch.cat([lse, torch.zeros(2, 3, 27)], -1), lse.double()):
        router.run_backward(record, router.BackwardTensors(q, q, q, q, q, given))
    assert seen[0] is lse
    for got in seen:
        assert got.shape == (2, 3, 5) and got.dtype == torch.float32 and torch.equal(got, lse)


def test_create_graph_backward_keeps_the_once_differentiable_guard(monkeypatch):
    """The SDPA Function's backward skips once_differentiable's wrapper only where it changes nothing (grad mode
    off); under create_graph the gradients still carry its double-backward error, and the values are equal."""
    monkeypatch.setattr(router, "_run_fp32", lambda t, p, o="auto": (t.q * 0 + 1, t.k * 0 + 2, t.v * 0 + 3))
    gproj_patch.enable(mode="fp32", targets=("sdpa",))
    q, k, v = (torch.randn(1, 2, 8, 16).bfloat16().requires_grad_() for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad((out.float() ** 2).sum(), (q, k, v), create_graph=True)
    assert dq.requires_grad and type(dq.grad_fn).__name__ == "Error"  # the DelayedError node
    assert (dq == 1).all() and (dk == 2).all() and (dv == 3).all()
    with pytest.raises(RuntimeError, match="corrected attention backward is not differentiable"):
        dq.float().sum().backward()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    dq, = torch.autograd.grad((out.float() ** 2).sum(), (q,))
    assert not dq.requires_grad and (dq == 1).all()
    assert gproj_patch.stats()["fp32"] == 2


def test_launch_plans_are_cached_on_every_input_of_the_gluon_predicates(monkeypatch):
    """``plan._kernel_plan`` answers a call from ``STATE.kernel_plans`` only when the launch options, compiled-graph
    flag, dtypes, shapes, strides, TMA base alignment and mask flags are those of a call the predicates answered.
    The predicates are replaced by ones whose answer spells all of that, so a key missing any input would hand one
    call another's answer; each cached plan is compared with the predicates asked again."""
    from gproj_patch.backends import gluon_bwd, gluon_dq
    from gproj_patch.dispatch.record import CallRecord, Context, Problem
    asked = []

    def spelled(q, k, v, **mask):
        asked.append(1)
        return repr([(x.dtype, tuple(x.shape), x.stride(), x.data_ptr() % 16) for x in (q, k, v)]
                    + sorted(mask.items()))
    monkeypatch.setattr(gluon_bwd, "kv_major_reason", spelled)
    monkeypatch.setattr(gluon_dq, "dq_major_reason", lambda q, k, v, **m: "dq " + spelled(q, k, v, **m))
    STATE.kernel_plans.clear()
    base = torch.randn(2, 4, 8, 16, dtype=torch.float16)
    flat = torch.randn(2 * 4 * 8 * 16 + 1, dtype=torch.float16)
    variants = {
        "contiguous": (base, base, base),
        "bshd strides": (base.transpose(1, 2).contiguous().transpose(1, 2),) * 3,
        "base off 16 bytes": (flat[1:].view(2, 4, 8, 16), base, base),
        "bf16": (base.bfloat16(),) * 3,
        "GQA shape": (base, base[:, :2], base[:, :2]),
        "v strides differ": (base, base, base.transpose(2, 3).contiguous().transpose(2, 3)),
    }
    problems = {"flags": Problem(scale=0.25), "window": Problem(scale=0.25, window=(3, 0)),
                "softcap": Problem(scale=0.25, softcap=30.0)}
    contexts = {"auto": Context("gproj", "auto", "l", "sdpa"), "kv tl": Context("gproj", "auto", "l", "sdpa", kv_major="tl"),
                "in graph": Context("gproj", "auto", "l", "sdpa", in_graph=True)}
    for _ in range(2):  # the second round is answered from the cache
        for q, k, v in variants.values():
            for problem in problems.values():
                for ctx in contexts.values():
                    t = plan_mod.ForwardTensors(q, k, v, q, q[..., 0].float())
                    record = CallRecord(problem, ctx)
                    cached = plan_mod._kernel_plan(t, problem, record, fp32=False)
                    assert cached == plan_mod._launch_plan(t, problem, record)
    assert len(STATE.kernel_plans) == len(variants) * len(problems) * len(contexts)
    # predicates asked per plan (the option kv_major="tl" asks only the dQ one); plans made per call: the first
    # round's cached one and both rounds' comparisons
    asks = {"auto": 2, "kv tl": 1, "in graph": 2}
    assert len(asked) == len(variants) * len(problems) * sum(asks.values()) * 3
    gproj_patch.reset_stats()
    assert not STATE.kernel_plans


def test_plan_cache_reads_tma_alignment_as_the_gluon_predicate_does():
    from gproj_patch.backends import gluon_bwd
    assert plan_mod._TMA_ALIGN == gluon_bwd.TMA_ALIGN_BYTES
