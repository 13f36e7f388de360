"""The KV-major launch's own side of the per-call kernel choice on CPU: the predicate's reasons, ``stats()``
counting which kernel ran, the launch's descriptors, arguments and sm_90a builds (what both launches share —
options, explicit argument — is ``test_launch_choice.py``). The Gluon kernel itself runs in
``tests/kernels/test_gluon_gpu.py`` (H200)."""
from __future__ import annotations

import pytest
import torch

import gproj_patch
from gproj_patch.backends import configs, gluon_bwd
from gproj_patch.backends.gluon_bwd import kv_major_reason
from gproj_patch.backends.reference import reference_backward, reference_forward
from gproj_patch.backends.triton_bwd import gproj_backward
from tests.helpers.hopper import gluon_gpu_reason
from tests.helpers.launch_choice import qkv


def test_the_two_product_dk_form_gets_a_reason():
    """The KV-major launch's own option (``test_launch_choice.py`` has the options both launches share)."""
    q, k, v, do = qkv()
    reason = kv_major_reason(q, k, v, do=do, dk_form="two_product")
    assert reason is not None and "two_product" in reason


@pytest.mark.parametrize("shape,dtype,fragment", [
    ((64, 64, 96), torch.bfloat16, "head_dim=96"),
    ((64, 64, 128), torch.float32, "dtype=float32"),
    ((333, 64, 128), torch.bfloat16, "Sq=333"),
    ((64, 64, 128), torch.bfloat16, "device=cpu"),
])
def test_uncovered_inputs_get_a_reason(shape, dtype, fragment):
    q, k, v, do = qkv(*shape, dtype=dtype)
    reason = kv_major_reason(q, k, v, do=do)
    if gluon_bwd.UNAVAILABLE_REASON is not None:  # a Triton without Gluon: that is the reason for everything
        assert reason == gluon_bwd.UNAVAILABLE_REASON
    else:
        assert reason is not None and fragment in reason


def _choice(q, k, v, option="auto"):
    """The plan's KV-major choice for a dense call (``plan.kv_major_choice``, made at the forward)."""
    from gproj_patch.dispatch.plan import ForwardTensors, kv_major_choice
    from gproj_patch.dispatch.record import Problem
    return kv_major_choice(ForwardTensors(q, k, v, None, None), Problem(scale=q.shape[-1] ** -0.5), option)


def test_kv_major_choice_on_this_cpu_names_the_device():
    """The real predicate on this GPU-less machine: tl, because of the device (the speed preference itself is
    ``test_launch_choice.py``'s)."""
    if gluon_bwd.UNAVAILABLE_REASON is None:
        assert _choice(*qkv(d=64)[:3]) == ("tl", "device=cpu")
    else:
        assert _choice(*qkv(d=64)[:3]) == ("tl", gluon_bwd.UNAVAILABLE_REASON)


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("GPROJ_TIER", "triton")


def test_stats_count_the_kv_major_kernel_of_each_kernel_call(interpreter):
    """fp16 on CPU runs the kernel tier under Triton's interpreter: the tl KV-major kernel, counted per call
    with its reason; the gradients still match the fp64 oracle."""
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 40, 32, generator=g).to(torch.float16) for _ in range(4))
    k = k + 16.0
    gproj_patch.enable(mode="gproj")
    try:
        gproj_patch.reset_stats()
        for _ in range(2):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True).backward(do)
        s = gproj_patch.stats()
    finally:
        gproj_patch.disable()
    assert s["gproj"] == 2 and s["kv_major"] == {"tl": 2}, s
    assert sum(s["kv_major_reasons"].values()) == 2
    ref = reference_backward(q, k, v, do, causal=True)
    err = max(float((x.grad.double() - r).norm() / r.norm()) for x, r in zip((qq, kk, vv), ref))
    assert err < 5e-3
    gproj_patch.reset_stats()
    assert gproj_patch.stats()["kv_major"] == {}


needs_gluon = pytest.mark.skipif(gluon_bwd.UNAVAILABLE_REASON is not None, reason="no Gluon in this Triton")


def _job(sq=96, sk=160, h=4, hkv=2, d=128, dtype=torch.bfloat16, q=None):
    """A causal bottom-right ``Launch`` on CPU tensors (host work only) and its fp32 (B·H, Sq) scratch."""
    from gproj_patch.backends.triton_launch import Launch
    q = torch.empty(1, h, sq, d, dtype=dtype) if q is None else q
    k = torch.empty(1, hkv, sk, d, dtype=dtype)
    f = torch.empty(q.shape[0] * q.shape[1], q.shape[2])
    job = Launch(do=q.clone(), q=q, k=k, v=k.clone(), o=q, lse=f, dq=q, dk=k.clone(), dv=k.clone(), sink=None,
                 cu_q=q, cu_k=q, varlen=False, n_problems=1, max_q=sq, max_k=sk, window=(-1, 0), bottom_right=True,
                 alpha=0.125, softcap=0.0, correct=True, fused=True, cfg_dq=(64, 64, 4, 2), cfg_dkdv=(32, 64, 4, 2))
    return job, f


def _public(x, shape, strides, block, layout):
    """The descriptor Gluon's public constructor builds (its checks run)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor(x, list(shape), list(strides), list(block), layout)


@needs_gluon
def test_launch_descriptors_are_what_the_public_constructor_builds():
    """Per call only the tensors are bound into the shape class's cached templates: each descriptor equals, field
    by field, the one Triton's constructor builds over the same tensor (strides of size-1 dims made aligned;
    the scratch as (B·H, Sq) rows, a box ending at its head), and Triton specializes it to the same type."""
    from triton.experimental.gluon import language as gl
    from triton.runtime.jit import mangle_type
    job, f = _job()
    lse2, delta, lam = f, f.clone(), f.clone()
    args = gluon_bwd.dkdv_arguments(job, delta, lse2, lam, configs.GLUON_KV_CONFIGS[128])
    tile = gl.NVMMASharedLayout.get_default_for([1, 1, 64, 128], gl.bfloat16)
    rows = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    q, k = job.q, job.k
    expect = dict(
        q_desc=_public(q, q.shape, (q.stride(1) * 4,) + q.stride()[1:], (1, 1, 64, 128), tile),  # B = 1
        k_desc=_public(k, k.shape, (k.stride(1) * 2,) + k.stride()[1:], (1, 1, 64, 128), tile),
        v_desc=_public(job.v, k.shape, (k.stride(1) * 2,) + k.stride()[1:], (1, 1, 64, 128), tile),
        do_desc=_public(job.do, q.shape, (q.stride(1) * 4,) + q.stride()[1:], (1, 1, 64, 128), tile),
        lse2_desc=_public(lse2, (4, 96), (96, 1), (1, 64), rows),
        delta_desc=_public(delta, (4, 96), (96, 1), (1, 64), rows),
        lam_desc=_public(lam, (4, 96), (96, 1), (1, 64), rows))
    for name, want in expect.items():
        got = args[name]
        assert type(got) is type(want) and got.base is want.base, name
        assert [list(getattr(got, n)) if n in ("shape", "strides", "block_shape") else getattr(got, n)
                for n in gluon_bwd.DESCRIPTOR_FIELDS[1:]] == \
            [list(getattr(want, n)) if n in ("shape", "strides", "block_shape") else getattr(want, n)
             for n in gluon_bwd.DESCRIPTOR_FIELDS[1:]], name
        assert mangle_type(got) == mangle_type(want), name


@needs_gluon
def test_shape_class_cache_is_bounded_and_keeps_no_tensor():
    """The second call of a shape class reuses its templates (a cache hit, the same layout objects); the cache
    has a bound; and it keeps no tensor of a call alive (the templates' bases are zero-size stand-ins)."""
    import gc
    import weakref
    gluon_bwd._launch_class.cache_clear()
    job, f = _job(sq=48)
    a = gluon_bwd.dkdv_arguments(job, f, f, f, configs.GLUON_KV_CONFIGS[128])
    job2, f2 = _job(sq=48)
    b = gluon_bwd.dkdv_arguments(job2, f2, f2, f2, configs.GLUON_KV_CONFIGS[128])
    info = gluon_bwd._launch_class.cache_info()
    assert (info.hits, info.misses, info.maxsize) == (1, 1, gluon_bwd.LAUNCH_CLASS_CACHE_SIZE)
    assert a["q_desc"].layout is b["q_desc"].layout and a["q_desc"].base is not b["q_desc"].base
    ref = weakref.ref(job2.q)
    del job2, f2, b
    gc.collect()
    assert ref() is None


@needs_gluon
def test_launch_arguments_copy_an_unaligned_base_and_refuse_a_bad_scratch():
    """An input whose base is off TMA's 16-byte grid (a dO handed to backward at an odd offset: the plan never saw
    it) is read from an aligned copy with the same values and strides, not refused in the backward; a scratch
    that is not the contiguous (B·H, Sq) buffer is refused with a reason, not launched."""
    base = torch.randn(1 * 4 * 96 * 128 + 1).to(torch.bfloat16)
    q = base[1:].view(1, 4, 96, 128)  # 2-byte offset
    job, f = _job(q=q)
    args = gluon_bwd.dkdv_arguments(job, f, f, f, configs.GLUON_KV_CONFIGS[128])
    copy = args["q_desc"].base
    assert q.data_ptr() % 16 != 0 and copy.data_ptr() % 16 == 0
    assert copy.stride() == q.stride() and torch.equal(copy, q)
    assert args["k_desc"].base is job.k  # aligned inputs are bound as they are
    job, f = _job()
    with pytest.raises(ValueError, match="scratch"):
        gluon_bwd.dkdv_arguments(job, f.t(), f, f, configs.GLUON_KV_CONFIGS[128])
    with pytest.raises(ValueError, match="scratch"):
        gluon_bwd.dkdv_arguments(job, f[:, :64], f, f, configs.GLUON_KV_CONFIGS[128])


def test_paired_release_needs_two_pairs_of_slots():
    """``release_pairs`` hands two slots back at once: a ring of 2 or 3 slots would deadlock (the producer would
    wait for the pair whose tile it is about to load), so the config refuses it."""
    for stages in (2, 3, 5):
        with pytest.raises(ValueError, match="release_pairs"):
            configs.KernelConfig(64, stages, release_pairs=True)
    assert configs.KernelConfig(64, 4, release_pairs=True).num_stages == 4
    assert not any(c.release_pairs for c in configs.GLUON_KV_CONFIGS.values())  # default unchanged until timed


@pytest.mark.skipif(gluon_bwd.UNAVAILABLE_REASON is not None, reason="no Gluon in this Triton")
@pytest.mark.parametrize("head_dim", sorted(configs.GLUON_KV_CONFIGS))
def test_default_configs_compile_for_sm90a_without_spills(head_dim):
    """The shipped Gluon configs compile for sm_90a on this (GPU-less) machine with Triton's own ptxas and spill nothing
    (``python -m benchmarks.ptx --gluon`` tables the same): a kernel edit that breaks compilation or starts spilling
    fails here, in CI, before any GPU run."""
    from tests.helpers.kernel_build import gluon_compile_report
    cfg = configs.GLUON_KV_CONFIGS[head_dim]
    for causal in (True, False):
        (row,) = gluon_compile_report(head_dims=(head_dim,), block_ms=(cfg.block_m,), stages=(cfg.num_stages,),
                                      retire_tiles=(cfg.retire_tiles,), causal=causal)
        assert "error" not in row and bool(row.get("retire_tiles")) == cfg.retire_tiles, row
        assert row["stack"] == 0 and row["regs"] == gluon_bwd.MAXNREG, row
        assert not row["serialized"], row  # ptxas kept every wgmma async (C7512 otherwise)
    assert row["smem"] <= gluon_bwd.SMEM_LIMIT_BYTES, row


@needs_gluon
@pytest.mark.parametrize("head_dim", sorted(configs.GLUON_KV_CONFIGS))
def test_paired_release_variant_compiles_for_sm90a_without_spills(head_dim):
    """The paired slot release at the default's tile rows (4 slots) compiles for sm_90a without spills and
    within shared memory (the variant ``python -m benchmarks.gluon`` times against the default)."""
    from tests.helpers.kernel_build import gluon_compile_report
    cfg = configs.GLUON_KV_CONFIGS[head_dim]
    (row,) = gluon_compile_report(head_dims=(head_dim,), block_ms=(cfg.block_m,), stages=(4,), release_pairs=(True,),
                                  retire_tiles=(cfg.retire_tiles,))
    assert "error" not in row and row.get("release_pairs"), row
    assert row["stack"] == 0 and row["regs"] == gluon_bwd.MAXNREG, row
    assert row["smem"] <= gluon_bwd.SMEM_LIMIT_BYTES, row


#: the default's tile rows and ring, each tile's products retired within it (``KernelConfig.retire_tiles``)
RETIRED = {d: configs.KernelConfig(c.block_m, c.num_stages, retire_tiles=True)
           for d, c in configs.GLUON_KV_CONFIGS.items()}


@needs_gluon
@pytest.mark.parametrize("causal", [True, False])
def test_retired_tiles_keep_wgmma_async_at_d128_without_spills(causal):
    """At D=128 with the default's 64-row tiles, ptxas serializes every wgmma of the default build (a
    ``WARPGROUP.DEPBAR`` after each ``HGMMA``, info C7512, which Triton 3.6 does not show; recorded here:
    when it stops, the reason for ``retire_tiles`` is gone). The retired-tiles build keeps them async, spills
    nothing and fits in shared memory, for causal and full calls."""
    from tests.helpers.kernel_build import gluon_compile_report
    cfg = configs.GLUON_KV_CONFIGS[128]
    default, retired = gluon_compile_report(head_dims=(128,), block_ms=(cfg.block_m,), stages=(cfg.num_stages,),
                                            retire_tiles=(False, True), causal=causal)
    assert "error" not in default and default["serialized"], default
    assert "error" not in retired and retired.get("retire_tiles"), retired
    assert not retired["serialized"], retired
    assert retired["stack"] == 0 and retired["regs"] == gluon_bwd.MAXNREG, retired
    assert retired["smem"] <= gluon_bwd.SMEM_LIMIT_BYTES, retired


def _retire_case(name, seed=19):
    """(q, k, v, do, o, lse, mask kwargs) on the GPU: an adversarial case, or "no_query_blocks_d128" (causal
    top-left GQA with Sk > Sq: key blocks no query sees, where the retired build streams one zero tile)."""
    from tests.helpers import adversarial as adv
    if name == "no_query_blocks_d128":
        g = torch.Generator(device="cuda").manual_seed(seed)
        mk = lambda h, s: torch.randn(1, h, s, 128, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
        inp, kw = dict(q=mk(4, 100), k=mk(2, 420) + 8.0, v=mk(2, 420), do=mk(4, 100)), dict(causal=True)
    elif name in adv.ODD_CASES:
        inp, kw = adv.make_odd(name, seed)
    else:
        inp, kw, _ = adv.make_case(name, seed=seed)
    out, lse = reference_forward(inp["q"], inp["k"], inp["v"], **kw)
    return inp["q"], inp["k"], inp["v"], inp["do"], out.to(inp["q"].dtype), lse.float(), kw


@pytest.mark.gpu
@pytest.mark.skipif(gluon_gpu_reason() is not None, reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("name", ["d128", "causal_br", "odd_br_mqa_d128", "fp16_d128_dense", "gqa", "offset512",
                                  "no_query_blocks_d128"])
def test_retired_tiles_are_bitwise_the_default_and_tl(name, monkeypatch):
    """Same products in the same order: the retired-tiles build's dq, dk, dv are bitwise the default build's
    and the tl KV-major launch's (outputs poisoned with NaN first: a key block left unwritten would show)."""
    from gproj_patch.backends import triton_bwd
    from gproj_patch.backends.gluon_entry import gluon_backward
    monkeypatch.setattr(triton_bwd, "_POISON_OUTPUTS", True)
    q, k, v, do, o, lse, kw = _retire_case(name)
    a = gluon_backward(do, q, k, v, o, lse, **kw)
    b = gluon_backward(do, q, k, v, o, lse, _gluon_config=RETIRED[q.shape[-1]], **kw)
    tl = gproj_backward(do, q, k, v, o, lse, kv_major="tl", **kw)
    assert all(bool(torch.isfinite(x).all()) for x in b), name
    assert all(torch.equal(x, y) for x, y in zip(a, b)), name
    assert all(torch.equal(x, y) for x, y in zip(tl, b)), name


@pytest.mark.skipif(gluon_bwd.UNAVAILABLE_REASON is not None, reason="no Gluon in this Triton")
def test_dkdv_arguments_name_every_kernel_parameter_and_refuse_what_it_cannot_run():
    """The launch's keyword arguments are exactly the kernel's parameters (num_warps aside), the causal shift
    follows the alignment, and a job the kernel does not cover (a window) is refused rather than run."""
    import dataclasses
    import inspect
    from gproj_patch.backends import gluon_kernels
    from gproj_patch.backends.triton_launch import Launch
    q = torch.empty(1, 4, 96, 128, dtype=torch.bfloat16)
    k = torch.empty(1, 2, 160, 128, dtype=torch.bfloat16)
    f = torch.empty(4, 96)
    job = Launch(do=q, q=q, k=k, v=k, o=q, lse=f, dq=q, dk=k, dv=k, sink=None, cu_q=q, cu_k=q, varlen=False,
                 n_problems=1, max_q=96, max_k=160, window=(-1, 0), bottom_right=True, alpha=0.125, softcap=0.0,
                 correct=True, fused=True, cfg_dq=(64, 64, 4, 2), cfg_dkdv=(32, 64, 4, 2))
    args = gluon_bwd.dkdv_arguments(job, f, f, f, configs.GLUON_KV_CONFIGS[128])
    params = set(inspect.signature(gluon_kernels._dkdv_kernel.fn).parameters) - {"num_warps"}
    assert set(args) == params
    assert args["CAUSAL"] and args["shift"] == 160 - 96 and args["GROUP"] == 2
    assert not gluon_bwd.dkdv_arguments(dataclasses.replace(job, bottom_right=False), f, f, f,
                                        configs.GLUON_KV_CONFIGS[128])["shift"]
    with pytest.raises(ValueError, match="window"):
        gluon_bwd.dkdv_arguments(dataclasses.replace(job, window=(16, 0)), f, f, f, configs.GLUON_KV_CONFIGS[128])


def test_unavailable_gluon_sends_every_call_to_tl(monkeypatch, interpreter):
    """When the Gluon kernel cannot run in this process (an unchecked Triton release, no Gluon), the choice is
    the tl kernel with that reason, and asking for Gluon explicitly is a clear error."""
    monkeypatch.setattr(gluon_bwd, "UNAVAILABLE_REASON", "triton 9.9.0: the Gluon kernel was checked against 3.6")
    q, k, v, do = qkv(dtype=torch.float16)  # fp16 on CPU: the tl kernel's own predicate accepts it here
    assert _choice(q, k, v) == ("tl", "triton 9.9.0: the Gluon kernel was checked against 3.6")
    from gproj_patch.backends.gluon_entry import gluon_supported_reason
    assert "triton 9.9.0" in gluon_supported_reason(q, k, v, do=do)
    o, lse = reference_forward(q, k, v)
    with pytest.raises(ValueError, match="triton 9.9.0"):
        gproj_backward(do, q, k, v, o.to(q.dtype), lse.float(), kv_major="gluon")
