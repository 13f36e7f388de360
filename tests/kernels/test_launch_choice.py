"""What the two launches of the GProj backward share in their per-call kernel choice (Gluon on sm_90, tl
elsewhere), once for each: the predicate's reasons for uncovered options, the plan's speed preference, the
explicit ``kv_major=`` / ``dq_major=`` argument, the option (recorded at the forward, counted in ``stats()``)
and its validation. What only one launch has stays in ``test_kv_major.py`` / ``test_dq_major.py``."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import gproj_patch
from gproj_patch.backends import configs, gluon_bwd, gluon_dq
from gproj_patch.backends.reference import reference_backward, reference_forward
from gproj_patch.backends.triton_bwd import gproj_backward
from gproj_patch.dispatch import plan
from gproj_patch.dispatch.plan import ForwardTensors
from gproj_patch.dispatch.record import Problem
from tests.helpers.launch_choice import qkv, sdpa_fp16_causal


@dataclass(frozen=True)
class LaunchUnderTest:
    option: str     # the keyword of gproj_backward / enable and the key of stats(): "kv_major" | "dq_major"
    module: object  # the host module holding the predicate
    faster: str     # the ``configs`` constant of the head dims where Gluon was measured faster
    label: str      # the launch's name in the plan's reasons
    env: str        # the option's environment variable

    @property
    def predicate(self):
        return getattr(self.module, f"{self.option}_reason")

    def choice(self, q, k, v, option="auto"):
        """The plan's choice for a dense call (``plan.kv_major_choice`` / ``plan.dq_major_choice``)."""
        choose = getattr(plan, f"{self.option}_choice")
        return choose(ForwardTensors(q, k, v, None, None), Problem(scale=q.shape[-1] ** -0.5), option)


LAUNCHES = [LaunchUnderTest("kv_major", gluon_bwd, "GLUON_KV_FASTER_HEAD_DIMS", "KV-major", "GPROJ_KV_MAJOR"),
            LaunchUnderTest("dq_major", gluon_dq, "GLUON_DQ_FASTER_HEAD_DIMS", "dQ-major", "GPROJ_DQ_MAJOR")]
OTHER = {"kv_major": "dq_major", "dq_major": "kv_major"}
by_launch = pytest.mark.parametrize("launch", LAUNCHES, ids=lambda x: x.option)


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("GPROJ_TIER", "triton")


@by_launch
@pytest.mark.parametrize("kwargs,fragment", [
    (dict(window=(8, 0)), "window"),
    (dict(softcap=30.0), "softcap"),
    (dict(varlen=True), "varlen"),
    (dict(correct=False), "correct=False"),
])
def test_uncovered_options_get_a_reason(launch, kwargs, fragment):
    q, k, v, do = qkv()
    reason = launch.predicate(q, k, v, do=do, **kwargs)
    assert reason is not None and fragment in reason


@by_launch
def test_kernel_prefers_tl_where_gluon_is_not_faster(launch, monkeypatch):
    """Where the Gluon kernel could run but was not measured faster (a head dim outside the launch's
    ``configs.GLUON_*_FASTER_HEAD_DIMS``) the plan picks tl and says why; inside it, Gluon; the option "tl" always
    tl. The predicate is stubbed (this machine has no sm_90): the rule under test is the plan's speed preference."""
    monkeypatch.setattr(launch.module, f"{launch.option}_reason", lambda *a, **kw: None)
    monkeypatch.setattr(configs, launch.faster, (128,))
    assert launch.choice(*qkv(d=64)[:3]) == ("tl", f"head_dim=64: the tl {launch.label} kernel is faster there")
    assert launch.choice(*qkv(d=128)[:3]) == ("gluon", None)
    assert launch.choice(*qkv(d=128)[:3], option="tl")[0] == "tl"
    monkeypatch.undo()
    assert set(getattr(configs, launch.faster)) <= set(configs.GLUON_HEAD_DIMS)


@by_launch
def test_explicit_kernel_is_checked(launch, interpreter):
    q, k, v, do = qkv(dtype=torch.float16)
    o, lse = reference_forward(q, k, v)
    with pytest.raises(ValueError, match=f"{launch.option}='gluon'"):
        gproj_backward(do, q, k, v, o.to(q.dtype), lse.float(), **{launch.option: "gluon"})
    with pytest.raises(ValueError, match=f"{launch.option} must be one of"):
        gproj_backward(do, q, k, v, o.to(q.dtype), lse.float(), **{launch.option: "cudnn"})


@by_launch
def test_option_tl_is_in_the_plan_and_counted(launch, interpreter, monkeypatch):
    """The option "tl" (its environment variable or ``enable``'s keyword) is part of the plan the SDPA seam makes
    when the backward runs (options in force then); ``stats()`` counts each launch's kernel with its reason (the
    other launch is tl on this CPU too), ``reset_stats()`` clears them, and the gradients match the fp64 oracle."""
    q, k, v, do = sdpa_fp16_causal()
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    y = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    monkeypatch.setenv(launch.env, "auto")
    with gproj_patch.enable(mode="gproj", **{launch.option: "tl"}):  # the keyword wins over the variable
        gproj_patch.reset_stats()
        y.backward(do)
        s = gproj_patch.stats()
    reasons = s[f"{launch.option}_reasons"]
    assert s[launch.option] == {"tl": 1} and any(f"{launch.option}=tl" in r for r in reasons), s
    assert s[OTHER[launch.option]] == {"tl": 1}, s
    ref = reference_backward(q, k, v, do, causal=True)
    err = max(float((x.grad.double() - r).norm() / r.norm()) for x, r in zip((qq, kk, vv), ref))
    assert err < 5e-3
    gproj_patch.reset_stats()
    assert gproj_patch.stats()[launch.option] == {}


@by_launch
def test_option_is_validated(launch, monkeypatch):
    with pytest.raises(ValueError, match=f"{launch.option} must be one of auto, tl"):
        gproj_patch.enable(**{launch.option: "gluon-always"})
    monkeypatch.setenv(launch.env, "cudnn")
    with pytest.raises(ValueError, match=f"{launch.env} must be one of auto, tl"):
        gproj_patch.enable()
    assert not gproj_patch.is_enabled()
