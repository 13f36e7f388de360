"""The mask kwargs as one dataclass (the rule on host functions with a dozen loose parameters): the
backends take ``**mask`` and turn it into ``spec.MaskArgs``; the keyword call convention, its refusals and the
results stay what they were with explicit keyword parameters."""
import pytest
import torch

from gproj_patch.backends import spec
from gproj_patch.backends.emulation import EmulationOptions, emulated_backward, emulated_forward
from gproj_patch.backends.fp32_tier import fp32_backward
from gproj_patch.backends.reference import reference_backward
from gproj_patch.backends.spec import MASK_KWARGS, MaskArgs, Varlen


def _former_signature(*, scale=None, causal=False, causal_align="top_left", window=(-1, -1), softcap=0.0,
                      cu_seqlens_q=None, cu_seqlens_k=None):
    """The explicit keyword parameters the backends had before ``**mask`` (Python's own refusals)."""


def _python_refusal(**kwargs) -> str:
    with pytest.raises(TypeError) as info:
        _former_signature(**kwargs)
    return str(info.value).replace("_former_signature", "reference_backward")


def test_mask_args_hold_the_mask_kwargs_and_refuse_others_as_python_does():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    given = dict(scale=0.5, causal=True, causal_align="bottom_right", window=(2, 0), softcap=3.0, cu_seqlens_q=cu,
                 cu_seqlens_k=cu)
    assert set(given) == set(MASK_KWARGS)
    args = MaskArgs.from_kwargs("reference_backward", given)
    assert (args.scale, args.causal, args.causal_align, args.window, args.softcap) == (0.5, True, "bottom_right",
                                                                                      (2, 0), 3.0)
    assert args.varlen.cu_seqlens_q is cu and args.varlen.cu_seqlens_k is cu
    assert args.mask_spec() == spec.MaskSpec(True, "bottom_right", (2, 0), 3.0)
    default = MaskArgs.from_kwargs("reference_backward", {})
    assert default.mask_spec() == spec.MaskSpec() and default.scale is None and default.varlen.cu_seqlens_q is None
    for bad in (dict(casual=True), dict(causal=True, max_seqlen_q=4, foo=1)):  # the first unknown one, in call order
        with pytest.raises(TypeError) as info:
            MaskArgs.from_kwargs("reference_backward", bad)
        assert str(info.value) == _python_refusal(**bad)
    lengths = MaskArgs.from_kwargs("gproj_backward", dict(max_seqlen_q=4, max_seqlen_k=6), max_seqlen=True).varlen
    assert (lengths.max_seqlen_q, lengths.max_seqlen_k) == (4, 6)
    # the public functions refuse with their own name, as their explicit signatures did
    q, k, v, do = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(4))
    for fn in (reference_backward, fp32_backward):
        with pytest.raises(TypeError, match=rf"^{fn.__name__}\(\) got an unexpected keyword argument 'max_seqlen_q'$"):
            fn(q, k, v, do, causal=True, max_seqlen_q=5)


def test_emulation_options_checked_before_the_inputs_and_results_unchanged():
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 40, 16).to(torch.bfloat16) for _ in range(4))
    with pytest.raises(ValueError, match="dk_form"):
        EmulationOptions(dk_form="three_product")
    with pytest.raises(ValueError, match="block"):  # before the inputs: this q is not even a tensor
        emulated_backward("not a tensor", k, v, q, do, None, block_n=0)
    o, lse = emulated_forward(q, k, v, causal=True, scale=0.3, block_n=16)
    stats = {}
    got = emulated_backward(q, k, v, o, do, lse, causal=True, scale=0.3, block_m=16, block_n=16, dk_form="fused",
                            stats=stats)
    want = reference_backward(q, k, v, do, causal=True, scale=0.3)
    for g, w in zip(got, want):  # the GProj emulation at bf16: close to the fp64 oracle
        assert (g.double() - w).norm() / w.norm() < 2e-2
    assert stats["resid"].abs().max() < 1e-4  # the projection's conservation law, measured
