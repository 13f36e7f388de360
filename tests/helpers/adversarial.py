"""The adversarial BF16 suite of the GPU kernel tests (tests/kernels/test_triton_gpu.py, test_gluon_gpu.py) and of the
entry points that report on it on the GPU (``python -m benchmarks.kernel``, ``benchmarks.gluon``): named cases with key
offsets to 512σ, sinks, P == 1 rows, causal in both alignments, GQA, varlen with empty sequences, a window, head dims
64-256, strided memory and the four-key witness, all drawn in fp64 from a seeded generator on ``device``.

``make_case(name)`` → (inputs dict, mask kwargs, gauge); ``make_odd(name, seed)`` → (inputs dict, mask kwargs)
for the Gluon kernel's odd shapes; ``rel`` is the error measure the suite reports."""
import torch

from .numerics import rel  # noqa: F401  (the suite's error measure, re-exported)

#: gauge-regime target of the suite (the project's accuracy bar): dq, dk, dv within 0.5% of fp64
TARGET = 5e-3


# ----------------------------------------------------------------------------------------------------------
# adversarial suite (BF16 inputs; fp64 reference on the same rounded inputs)
# ----------------------------------------------------------------------------------------------------------

def _keys(shape, offset, gen, device):
    k = torch.randn(shape, generator=gen, device=device, dtype=torch.float64)
    if offset:
        mu = torch.randn(shape[-1], generator=gen, device=device, dtype=torch.float64)
        k = k + offset * mu
    return k


def _sink_v_do(q, k, sink, gen, dtype):
    """The draws after q and k, in the order every case takes them: a sink direction (when ``sink``: the first
    key pushed along it by ``sink``, every query by 2), then v and dO; all cast to ``dtype``."""
    (B, H, SQ, D), (HKV, SK) = q.shape, k.shape[1:3]
    if sink:
        nu = torch.randn(D, generator=gen, device=q.device, dtype=torch.float64)
        q = q + 2.0 * nu
        k[:, :, 0] += sink * nu
    v = torch.randn(B, HKV, SK, D, generator=gen, device=q.device, dtype=torch.float64)
    do = torch.randn(B, H, SQ, D, generator=gen, device=q.device, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, do))


def make_case(name, device="cuda", dtype=torch.bfloat16, seed=0):
    """(inputs dict, mask kwargs, gauge) for one named case. gauge: the case is in the gauge regime."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, H, HKV, SQ, SK, D = 2, 4, 4, 512, 512, 64
    offset, kw, gauge, sink = 0.0, {}, True, 0.0
    cu = None
    if name == "witness":
        return witness(device, dtype), {}, True
    if name.startswith("offset"):
        offset = float(name[6:])
    elif name == "random":
        pass
    elif name == "sink":  # attention sink (p_sink ~ 0.04..0.9), no offset
        sink = 0.75
    elif name == "sink64":  # sink with p_sink ~ 1 - 1e-5, plus a 64σ key offset (the sink_offset_64 case of gproj_patch/audit/cases.py)
        offset, sink = 64.0, 1.5
    elif name == "massive_sink":  # the sink's OWN key is massive (not a common offset): see _massive_sink
        offset = 8.0
    elif name == "sharp_p1":  # rows with P == 1 (other keys' P <= ~1e-18), plus an offset: beyond fp32
        offset, sink, gauge = 32.0, 3.0, False
        SK = 384
    elif name == "causal_tl":
        SQ, SK, offset, kw = 384, 512, 32.0, dict(causal=True, causal_align="top_left")
    elif name == "causal_br":
        SQ, SK, offset, kw = 512, 384, 32.0, dict(causal=True, causal_align="bottom_right")
    elif name == "gqa":
        H, HKV, offset = 8, 2, 128.0
    elif name == "window":
        SQ = SK = 600
        offset, kw = 32.0, dict(window=(100, 20))
    elif name == "varlen":
        B, H, HKV, offset = 1, 4, 2, 64.0
        lq = [100, 0, 257, 1, 0, 242]
        lk = [100, 37, 300, 0, 0, 242]
        cu = (torch.tensor([0] + list(_cumsum(lq)), dtype=torch.int32, device=device),
              torch.tensor([0] + list(_cumsum(lk)), dtype=torch.int32, device=device))
        SQ, SK = sum(lq), sum(lk)
        kw = dict(causal=True, causal_align="bottom_right", cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    elif name == "d128":
        D, offset, kw = 128, 128.0, dict(causal=True)
    elif name == "d256":
        B, H, HKV, SQ, SK, D, offset = 1, 2, 2, 256, 256, 256, 64.0
    elif name == "d96":
        B, H, HKV, SQ, SK, D, offset = 1, 2, 1, 300, 200, 96, 32.0
    elif name == "strided":
        offset = 128.0
    elif name == "query_offset":  # not a gauge symmetry: reported, not held to the target
        gauge = False
    elif name == "softcap":  # Gemma-style softcap; no exact gauge symmetry, reported
        offset, gauge, kw = 8.0, False, dict(softcap=5.0, causal=True)
    else:
        raise KeyError(name)
    q = torch.randn(B, H, SQ, D, generator=g, device=device, dtype=torch.float64)
    if name == "query_offset":
        q = q + 64.0 * torch.randn(D, generator=g, device=device, dtype=torch.float64)
    k = _keys((B, HKV, SK, D), offset, g, device)
    q, k, v, do = _sink_v_do(q, k, sink, g, dtype)
    if name == "massive_sink":
        q, k = _massive_sink(q, k, g)
    if name == "strided":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, S, H, D) memory
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        v = torch.cat([v, v], dim=-1)[..., :D]  # row stride 2D
    return dict(q=q, k=k, v=v, do=do), kw, gauge


def _massive_sink(q, k, gen, norm=4096.0):
    """Key 0 of every head set to ``norm``·ν̂ (a random unit direction; the other keys have norm ~8σ·√D ≈ 64 at
    D=64), and each query made orthogonal to ν̂ and then given the component along it that puts its sink logit
    α q·k_0 at U(-4, 8): across the rows the sink takes anything from ~0 to ~1 of the probability, with a key
    ~64× the norm of the others. A mean-key centre fails here (docs/math.md §5); the sink is the row's most
    probable key in some rows and not in others. Returned in the inputs' dtype."""
    dtype, (B, H, SQ, D) = q.dtype, q.shape
    nu = torch.randn(D, generator=gen, device=q.device, dtype=torch.float64)
    nu = nu / nu.norm()
    k = k.double()
    k[:, :, 0] = norm * nu
    q = q.double()
    q = q - (q @ nu)[..., None] * nu
    logit = torch.rand(B, H, SQ, generator=gen, device=q.device, dtype=torch.float64) * 12.0 - 4.0
    q = q + (logit * D ** 0.5 / norm)[..., None] * nu
    return q.to(dtype), k.to(dtype)


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t


def witness(device="cuda", dtype=torch.bfloat16):
    """The four-key witness (docs/math.md §4): uniform attention over 4 identical keys of first coordinate K0,
    g = (1 + eps, -1, -eps, 0) with low(1 + eps) = 1. Exact dq is 0; an uncorrected kernel returns
    -α·K0·eps in dq[..., 0]: -24 in BF16 (eps = 3/1024, K0 = 65536), -0.75 in FP16 (eps = 3/8192, K0 = 16384)."""
    D = 64
    eps, k0 = (3.0 / 1024, 65536.0) if dtype == torch.bfloat16 else (3.0 / 8192, 16384.0)
    q = torch.zeros(1, 1, 1, D, device=device, dtype=dtype)
    k = torch.zeros(1, 1, 4, D, device=device, dtype=dtype)
    k[..., 0] = k0
    v = torch.zeros(1, 1, 4, D, device=device, dtype=dtype)
    v[0, 0, 0, 0], v[0, 0, 0, 1] = 4.0, 4.0 * eps
    v[0, 0, 1, 0] = -4.0
    v[0, 0, 2, 1] = -4.0 * eps
    do = torch.zeros(1, 1, 1, D, device=device, dtype=dtype)
    do[..., 0], do[..., 1] = 1.0, 1.0
    return dict(q=q, k=k, v=v, do=do)


SUITE = ["random", "offset8", "offset32", "offset128", "offset512", "sink", "sink64", "massive_sink", "sharp_p1",
         "causal_tl", "causal_br", "gqa", "window", "varlen", "d96", "d128", "d256", "strided", "query_offset", "softcap",
         "witness"]



# ----------------------------------------------------------------------------------------------------------
# the Gluon kernel's cases: the suite above (D=64 unless named) and odd shapes of its own
# ----------------------------------------------------------------------------------------------------------

SUITE_CASES = ["random", "offset128", "offset512", "sink", "sink64", "sharp_p1", "causal_tl", "causal_br", "gqa",
               "d128", "strided", "query_offset", "witness"]
#: name -> (B, H, HKV, SQ, SK, D, key offset σ, sink strength, dtype, mask kwargs)
ODD_CASES = {
    "odd_br_mqa_d128": (1, 3, 1, 332, 517, 128, 128.0, 0.0, torch.bfloat16, dict(causal=True,
                                                                             causal_align="bottom_right")),
    "odd_tl_d64_sq_gt_sk": (2, 2, 2, 700, 130, 64, 512.0, 0.0, torch.bfloat16, dict(causal=True)),
    "empty_rows_br": (1, 2, 1, 400, 250, 64, 32.0, 0.0, torch.bfloat16, dict(causal=True,
                                                                         causal_align="bottom_right")),
    "fp16_d128_dense": (2, 4, 2, 300, 301, 128, 128.0, 0.0, torch.float16, {}),
    "sink64_d128_causal": (1, 4, 2, 256, 257, 128, 64.0, 1.5, torch.bfloat16, dict(causal=True)),
}
#: reported, not held to the gauge target (not a gauge symmetry, or beyond fp32: see BENCHMARKS.md)
NOT_GAUGE = ("sharp_p1", "query_offset", "sink64_d128_causal")  # the last: dk 0.63% on the H200 (seed 11)
#: inputs the predicate must turn down (the tl kernel runs them)
UNCOVERED = ["window", "varlen", "d96", "d256", "softcap"]


#: odd shapes only the Gluon dQ-major launch takes (Sq not a multiple of 4: its KV-major launch is then tl's)
DQ_ODD_CASES = {
    "odd_sq333_gqa_d128": (1, 4, 2, 333, 333, 128, 128.0, 0.0, torch.bfloat16, dict(causal=True)),
    "odd_sq65_sk1000_d64_sink": (2, 2, 1, 65, 1000, 64, 64.0, 1.5, torch.bfloat16,
                                 dict(causal=True, causal_align="bottom_right")),
}


def make_odd(name, seed, device="cuda"):
    """One of ODD_CASES (or DQ_ODD_CASES) drawn with ``seed``: (inputs dict, mask kwargs)."""
    B, H, HKV, SQ, SK, D, offset, sink, dtype, kw = {**ODD_CASES, **DQ_ODD_CASES}[name]
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, SQ, D, generator=g, device=device, dtype=torch.float64)
    k = _keys((B, HKV, SK, D), offset, g, device)
    q, k, v, do = _sink_v_do(q, k, sink, g, dtype)
    return dict(q=q, k=k, v=v, do=do), kw


def witness_rows4():
    """The four-key witness (``witness``) at D=128 with its query row repeated to Sq=4 (the
    Gluon kernel's Sq alignment): every row's exact dq is 0."""
    inp = {n: torch.nn.functional.pad(x, (0, 64)) for n, x in witness().items()}
    inp["q"], inp["do"] = inp["q"].repeat(1, 1, 4, 1), inp["do"].repeat(1, 1, 4, 1)
    return inp


# ----------------------------------------------------------------------------------------------------------
# a head whose forward rows are not finite, next to heads that are (the Gluon kernel's ragged last tile)
# ----------------------------------------------------------------------------------------------------------

#: (B, H, Sq, Sk) of ``foreign_nonfinite``: MHA, Sq a multiple of 4 (the Gluon predicate) but of no query tile
#: (32, 64, 128), so every head's last tile has rows past Sq
FOREIGN_SHAPE = (2, 2, 100, 160)
#: the (batch, head) ``poison_head`` makes non-finite: head (0, 0)'s ragged last tile borders its first rows
POISONED_HEAD = (0, 1)


def foreign_nonfinite(head_dim, seed, device="cuda", causal=True):
    """(inputs dict, mask kwargs): BF16 MHA inputs of ``FOREIGN_SHAPE`` (keys offset by 32σ) for
    ``poison_head``. MHA: a head's dq, dk, dv depend on its own rows only, so every other head's exact
    gradients are those of the clean inputs."""
    B, H, SQ, SK = FOREIGN_SHAPE
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, SQ, head_dim, generator=g, device=device, dtype=torch.float64)
    k = _keys((B, H, SK, head_dim), 32.0, g, device)
    q, k, v, do = _sink_v_do(q, k, 0.0, g, torch.bfloat16)
    return dict(q=q, k=k, v=v, do=do), (dict(causal=True, causal_align="bottom_right") if causal else {})


def poison_head(o, lse):
    """Copies of the forward's output and LSE with head ``POISONED_HEAD`` not finite (O := inf, so its D is
    not finite; LSE := NaN): what the backward's per-row scratch then holds there."""
    o, lse = o.clone(), lse.clone()
    o[POISONED_HEAD] = float("inf")
    lse[POISONED_HEAD] = float("nan")
    return o, lse


def outside_poisoned(x):
    """``x`` (B, H, ...) without head ``POISONED_HEAD``: the heads whose gradients must stay exact."""
    keep = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    keep[POISONED_HEAD] = False
    return x[keep]
