"""Prepared launches (backends/launch_cache.py): a compiled GProj launch replayed without Triton's argument binding.

CPU: the key is sound — two backwards with the same ``launch_key`` get the same non-tensor arguments and the same
output strides for both launches, over layouts that differ in strides, shapes, dtypes, masks, sinks and varlen —
and sensitive (each of those changes it); the cache is a bounded LRU. CUDA: a replayed backward is bitwise the
bound one, hits are counted, a tensor whose 16-byte alignment differs from the template's or a launch hook
takes Triton's own path, and the gradients stay within the fp64 suite's bound.
"""
from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from gproj_patch.backends import configs, launch_cache, triton_bwd, triton_launch  # noqa: E402
from gproj_patch.backends.spec import MaskSpec  # noqa: E402
from tests.helpers.hopper import gluon_gpu_reason  # noqa: E402


def _tensors(B=1, H=2, HKV=2, SQ=24, SK=24, D=16, dtype=torch.float16, layout="bhsd", device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(h, s):
        if layout == "bshd":  # a (B, S, H, D) buffer viewed as (B, H, S, D): flash-attn's layout
            return torch.randn(B, s, h, D, generator=g).to(dtype).transpose(1, 2).to(device)
        if layout == "sliced":  # a slice of a wider head dim: non-dense rows
            return torch.randn(B, h, s, D + 8, generator=g).to(dtype)[..., :D].to(device)
        return torch.randn(B, h, s, D, generator=g).to(dtype).to(device)
    q, k, v, do, o = make(H, SQ), make(HKV, SK), make(HKV, SK), make(H, SQ), make(H, SQ)
    lse = torch.randn(B, H, SQ, generator=g).float().to(device)
    return do, q, k, v, o, lse


def _captured_jobs(monkeypatch, calls):
    """The ``Launch`` each call of ``launch_backward`` builds (nothing launched)."""
    jobs = []
    monkeypatch.setattr(triton_bwd, "_launch", lambda km, interpret, job: jobs.append(job) or job.q.new_zeros(job.q.shape[:3], dtype=torch.float32))
    for tensors, kw in calls:
        triton_bwd.launch_backward(*tensors, **kw)
    return jobs


def _scalar_arguments(job):
    """Every non-tensor argument of both launches, and the strides and dtypes of every tensor argument."""
    scratch = triton_launch.allocate_scratch(job)
    out = {}
    for kind in ("dq", "dkdv"):
        args = triton_launch.kernel_arguments(kind, job, scratch, block_d=configs.block_d(job.q.shape[-1]))
        out[kind] = {n: (v.dtype, v.stride(), tuple(v.shape)) if isinstance(v, torch.Tensor) else v
                     for n, v in args.items()}
    return out


CAUSAL = dict(scale=None, mask=MaskSpec(causal=True, causal_align="top_left", window=(-1, -1), softcap=0.0))
DENSE = dict(scale=None, mask=MaskSpec(causal=False, causal_align="top_left", window=(-1, -1), softcap=0.0))


def _variants():
    yield "base", _tensors(), CAUSAL
    yield "other values", _tensors(seed=1), CAUSAL
    yield "bshd", _tensors(layout="bshd"), CAUSAL
    yield "sliced", _tensors(layout="sliced"), CAUSAL
    base, bshd, sliced = _tensors(), _tensors(layout="bshd"), _tensors(layout="sliced")
    for i, name in enumerate(("do", "q", "k", "v", "o")):  # one input laid out otherwise, the rest as "base"
        yield f"{name} alone bshd", base[:i] + (bshd[i],) + base[i + 1:], CAUSAL
    yield "do alone sliced", (sliced[0],) + base[1:], CAUSAL
    yield "lse strided", base[:5] + (torch.randn(1, 24, 2).transpose(1, 2),), CAUSAL
    yield "dense", _tensors(), DENSE
    yield "scale", _tensors(), dict(CAUSAL, scale=0.3)
    yield "window", _tensors(), dict(scale=None, mask=MaskSpec(causal=False, causal_align="top_left",
                                                               window=(4, 2), softcap=0.0))
    yield "bottom_right", _tensors(SQ=16), dict(scale=None, mask=MaskSpec(causal=True, causal_align="bottom_right",
                                                                          window=(-1, -1), softcap=0.0))
    yield "softcap", _tensors(), dict(scale=None, mask=MaskSpec(causal=False, causal_align="top_left",
                                                                window=(-1, -1), softcap=20.0))
    yield "gqa", _tensors(H=4, HKV=2), CAUSAL
    yield "longer", _tensors(SQ=40, SK=40), CAUSAL
    yield "sq!=sk", _tensors(SQ=24, SK=40), CAUSAL
    yield "fp32", _tensors(dtype=torch.float32), CAUSAL
    yield "head dim 32", _tensors(D=32), CAUSAL
    yield "sink", _tensors(), dict(CAUSAL, sink=torch.zeros(2))
    yield "sink fp16", _tensors(), dict(CAUSAL, sink=torch.zeros(2, dtype=torch.float16))
    yield "two_product", _tensors(), dict(CAUSAL, dk_form="two_product")
    yield "uncorrected", _tensors(), dict(CAUSAL, correct=False)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    yield "varlen", _tensors(), dict(CAUSAL, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=14, max_seqlen_k=14)
    yield "varlen other lengths", _tensors(), dict(CAUSAL, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16,
                                                   max_seqlen_k=16)


def test_equal_keys_mean_equal_arguments_and_distinct_variants_distinct_keys(monkeypatch):
    named = list(_variants())
    jobs = _captured_jobs(monkeypatch, [(t, kw) for _, t, kw in named])
    keys = [triton_launch.launch_key(j) for j in jobs]
    args = [_scalar_arguments(j) for j in jobs]
    names = [n for n, _, _ in named]
    for (a, ka, xa), (b, kb, xb) in itertools.combinations(zip(names, keys, args), 2):
        if ka == kb:  # sound: the replayed template is what binding this call would pass
            assert xa == xb, (a, b)
    # sensitive: only the variant with other values (same layout and options as "base") shares a key
    assert keys[0] == keys[1]
    assert len(set(keys)) == len(keys) - 1, [n for n, k in zip(names, keys) if keys.count(k) > 1]


def test_launch_hooks_are_seen_as_set_only_when_one_is_added():
    from triton import knobs
    from gproj_patch.backends.compat import launch_hooks_set
    assert not launch_hooks_set()  # Triton 3.6's empty HookChains
    hook = [].append
    knobs.runtime.launch_exit_hook.add(hook)
    try:
        assert launch_hooks_set()
    finally:
        knobs.runtime.launch_exit_hook.remove(hook)
    assert not launch_hooks_set()


def test_launch_cache_is_a_bounded_lru():
    cache = launch_cache.LaunchCache(capacity=3)
    entries = {i: object() for i in range(5)}
    for i in range(4):
        cache.put(i, entries[i])
    assert len(cache) == 3 and cache.get(0) is None
    assert cache.get(1) is entries[1]  # 1 is now the newest
    cache.put(4, entries[4])
    assert cache.get(2) is None and cache.get(1) is entries[1] and cache.get(4) is entries[4]
    cache.clear()
    assert len(cache) == 0 and cache.hits == cache.misses == 0


def test_prepared_replay_fills_tensor_and_descriptor_slots():
    """A replay puts each call's slot values at their signature positions (a tensor, or an opaque descriptor object
    whose alignment is its builder's check) and refuses, launching nothing, a tensor whose 16-byte alignment
    differs from the template's; the template keeps no tensor."""
    launched = []
    entry = launch_cache.Prepared(kernel="k", go=lambda gx, gy, gz, stream, args: launched.append((gx, stream, args)),
                                  grid=(3, 1, 1), template=(None, 7, None, "CONST"), slots=((0, "desc"), (2, "T")),
                                  aligned=(None, True))
    desc = object()
    buf = torch.empty(64, dtype=torch.float16)
    assert entry.replay({"desc": desc, "T": buf[:8]}, stream=5)
    (gx, stream, args), = launched
    assert (gx, stream, len(args)) == (3, 5, 4) and args[0] is desc and args[1] == 7 and args[3] == "CONST"
    assert args[2].data_ptr() == buf.data_ptr() and entry.template[0] is None and entry.template[2] is None
    assert not entry.replay({"desc": desc, "T": buf[1:9]}, stream=5)  # 2-byte offset: Triton's own path instead
    assert len(launched) == 1


def test_interpreted_launches_are_never_prepared(monkeypatch):
    """CPU tensors run through the interpreter and Triton's binding: nothing is recorded."""
    launch_cache.PREPARED.clear()
    do, q, k, v, o, lse = _tensors()
    triton_bwd.launch_backward(do, q, k, v, o, lse, **CAUSAL)
    assert len(launch_cache.PREPARED) == 0 and launch_cache.PREPARED.misses == 0


# ---- CUDA: replay against binding --------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _moved(x, offset):
    """``x``'s values ``offset`` elements into a larger buffer: its data pointer alignment changes."""
    buf = torch.empty(x.numel() + offset, dtype=x.dtype, device=x.device)
    return buf[offset:].view(x.shape).copy_(x)


def _cuda_call(layout="bhsd", offset=0, seed=0, D=64, do_offset=0, **kw):
    do, q, k, v, o, lse = _tensors(B=2, H=4, HKV=2, SQ=200, SK=200, D=D, dtype=torch.bfloat16, layout=layout,
                                   device="cuda", seed=seed)
    if offset:
        q = _moved(q, offset)
    if do_offset:
        do = _moved(do.contiguous(), do_offset)
    lse = torch.logsumexp((q.float() @ k.float().repeat_interleave(2, 1).transpose(-1, -2)) * D ** -0.5, -1)
    return triton_bwd.launch_backward(do, q, k, v, o, lse, **{**CAUSAL, **kw})


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_replay_is_bitwise_the_bound_launch(D):
    """The Gluon KV-major launch replays too (its TMA descriptors are the slots): bitwise the bound launch, the
    same for other values of the class, and a dO at an odd offset (read from an aligned copy) gives the same
    bits as the aligned one."""
    if gluon_gpu_reason() is not None:
        pytest.skip(gluon_gpu_reason())
    launch_cache.PREPARED.clear()
    bound = _cuda_call(D=D, kv_major="gluon")
    assert launch_cache.PREPARED.misses == 2 and launch_cache.PREPARED.hits == 0
    replayed = _cuda_call(D=D, kv_major="gluon")
    assert launch_cache.PREPARED.hits == 2
    for a, b in zip(bound, replayed):
        assert torch.equal(a, b)
    other = _cuda_call(D=D, kv_major="gluon", seed=3)
    assert launch_cache.PREPARED.hits == 4
    launch_cache.PREPARED.clear()
    fresh = _cuda_call(D=D, kv_major="gluon", seed=3)
    for a, b in zip(other, fresh):
        assert torch.equal(a, b)
    odd = _cuda_call(D=D, kv_major="gluon", do_offset=1)
    for a, b in zip(bound, odd):
        assert torch.equal(a, b)
    tl = _cuda_call(D=D, kv_major="tl")  # the same contract in the same order: bitwise the tl launch
    for a, b in zip(bound, tl):
        assert torch.equal(a, b)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_replay_is_bitwise_the_bound_launch(layout):
    launch_cache.PREPARED.clear()
    bound = _cuda_call(layout)  # miss: Triton's binding, recorded
    assert launch_cache.PREPARED.misses == 2 and launch_cache.PREPARED.hits == 0
    replayed = _cuda_call(layout)  # hit: the prepared launches
    assert launch_cache.PREPARED.hits == 2
    for a, b in zip(bound, replayed):
        assert torch.equal(a, b)
    other = _cuda_call(layout, seed=3)  # other values, same shape class: replayed, and right
    assert launch_cache.PREPARED.hits == 4
    launch_cache.PREPARED.clear()
    fresh = _cuda_call(layout, seed=3)
    for a, b in zip(other, fresh):
        assert torch.equal(a, b)


@pytest.mark.gpu
@cuda
def test_misaligned_tensor_and_launch_hooks_take_tritons_path():
    from triton import knobs
    launch_cache.PREPARED.clear()
    ref = _cuda_call()
    hits = launch_cache.PREPARED.hits
    shifted = _cuda_call(offset=1)  # same key, q no longer 16-byte aligned: binding again, not a replay
    assert launch_cache.PREPARED.hits == hits
    for a, b in zip(ref, shifted):
        assert torch.equal(a, b)
    seen = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)  # Triton 3.6: a HookChain, as a profiler adds to it
    try:
        hooked = _cuda_call()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 2 and launch_cache.PREPARED.hits == hits
    for a, b in zip(ref, hooked):
        assert torch.equal(a, b)


@pytest.mark.gpu
@cuda
def test_replayed_gradients_match_fp64():
    from gproj_patch.backends.reference import reference_backward, reference_forward
    from tests.helpers import adversarial as dc
    inp, kw, _ = dc.make_case("offset128")
    q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
    out, lse = reference_forward(q, k, v, **kw)
    launch_cache.PREPARED.clear()
    for _ in range(2):  # bind, then replay
        grads = triton_bwd.gproj_backward(do, q, k, v, out.to(q.dtype), lse.float(), **kw)
    assert launch_cache.PREPARED.hits >= 2
    ref = reference_backward(q, k, v, do, **kw)
    assert max(dc.rel(a, r) for a, r in zip(grads, ref)) < 5e-3
