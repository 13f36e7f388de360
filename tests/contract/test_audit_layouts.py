"""The dO-layout cases of the audit: a backend's backward run twice at one shape no other case uses, with dO
contiguous (B, H, S, D) and as a (B, S, H, D) view of the same values, in both orders, each compared with fp64.

The defect they are built to find: a backward that keeps per-shape state keyed on q, k, v only (PyTorch 2.11's
cuDNN SDPA backward caches its execution plan so) and reads a later call's dO with the first call's strides.
``plan_cached_attention`` below has exactly that defect; the CPU's backends have none."""
import pytest
import torch
import torch.nn.functional as F

from gproj_patch.audit import check
from gproj_patch.audit import run as audit_run
from gproj_patch.audit.backends import Backend
from gproj_patch.audit.cases import DO_LAYOUTS, get_case, select_cases, with_do_layout
from gproj_patch.audit.report import render_checks

pytestmark = pytest.mark.usefixtures("one_thread")

LAYOUT_CASES = "do_layout_*"
#: bounded by the suite's shapes: one entry per (q, k, v) shape class the tests below meet
PLANS = {}


class _PlanCachedSdpa(torch.autograd.Function):
    """SDPA whose backward reads dO with the strides of the first dO it met at this q/k/v shape."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        strides = PLANS.setdefault((q.shape, k.shape, v.shape, q.dtype), do.stride())
        do = do.as_strided(do.shape, strides)
        with torch.enable_grad():
            qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
            out = F.scaled_dot_product_attention(qq, kk, vv, scale=ctx.scale)
            return (*torch.autograd.grad(out, (qq, kk, vv), do), None)


def plan_cached_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    if attn_mask is not None or is_causal:
        raise NotImplementedError("dense only")
    return _PlanCachedSdpa.apply(q, k, v, scale)


def sdpa_attention(q, k, v, attn_mask=None, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def test_the_cases_ask_for_both_orders_at_shapes_no_other_case_uses():
    layout_cases = select_cases(LAYOUT_CASES)
    assert [c.do_layouts for c in layout_cases] == [("bhsd", "bshd"), ("bshd", "bhsd")]
    for quick in (True, False):
        shapes = {c.name: tuple(c.build(quick=quick).q.shape) for c in select_cases(None) if c.name != "varlen"}
        for c in layout_cases:
            assert list(shapes.values()).count(shapes[c.name]) == 1, (c.name, quick)
    inp = get_case("do_layout_bhsd_bshd").build(quick=True)
    bhsd, bshd = (with_do_layout(inp, layout).do for layout in DO_LAYOUTS)
    assert torch.equal(bhsd, bshd) and bhsd.is_contiguous() and bshd.transpose(1, 2).is_contiguous()
    assert not bshd.is_contiguous()


def test_a_backward_that_reuses_the_first_layout_fails_in_both_orders():
    PLANS.clear()
    bad = check(plan_cached_attention, cases=LAYOUT_CASES, device="cpu")
    good = check(sdpa_attention, cases=LAYOUT_CASES, device="cpu")
    assert bad.criteria["pass_do_layout"] is False and not bad.passed
    assert good.criteria["pass_do_layout"] is True and good.figures["worst_do_layout"] == 0.0
    for c in bad.raw_cases:
        r = c["results"][bad.backend]
        first, second = r["do_layouts"]
        assert (first["layout"], second["layout"]) == get_case(c["name"]).do_layouts  # in the case's order
        assert first["dq"] < 0.01 and second["dq"] > 0.3 and r["do_layout_spread"] > 0.3  # measured ~1.4
        assert r["dq"] == second["dq"]  # the table shows the worst call
    line = next(ln for ln in bad.explain().splitlines() if "dO layouts" in ln)
    assert line.startswith("  dO layouts (contiguous vs a (B, S, H, D) view), gradients apart:") and line.endswith("FAIL")


def test_a_built_in_backend_with_the_defect_fails_the_built_in_criterion(capsys):
    PLANS.clear()

    def run(inp, k, saved):
        q, kk, v = (x.detach().clone().requires_grad_(True) for x in (inp.q, k, inp.v))
        plan_cached_attention(q, kk, v, scale=inp.mask.get("scale")).backward(inp.do)
        return q.grad, kk.grad, v.grad

    def sdpa_run(inp, k, saved):
        q, kk, v = (x.detach().clone().requires_grad_(True) for x in (inp.q, k, inp.v))
        sdpa_attention(q, kk, v, scale=inp.mask.get("scale")).backward(inp.do)
        return q.grad, kk.grad, v.grad

    backends = [Backend("cached-plan", run), Backend("sdpa-math", sdpa_run)]
    results = [audit_run.run_case(c, backends, torch.bfloat16, torch.device("cpu"), True, 0)
               for c in select_cases(LAYOUT_CASES + ",diffuse")]
    assert "do_layouts" not in results[-1]["results"]["sdpa-math"]  # one backward per key set elsewhere
    ch = audit_run.checks(results, "bf16")
    assert ch["pass_do_layout"] is False and ch["do_layout_failed"] == ["cached-plan"]
    assert ch["do_layout_spread"]["sdpa-math"] == 0.0 and ch["do_layout_max"] == 2.56 * 2.0 ** -8
    assert audit_run.strict_status(ch)[0] == audit_run.EXIT_FAILED
    render_checks(ch, "bf16")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("same gradients for dO"))
    assert "FAIL; beyond it: cached-plan" in line
