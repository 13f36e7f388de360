"""The named synthetic suite of attention-gradient cases, shared by the audit, tests and benchmarks.

API::

    from gproj_patch.audit.cases import CASES, get_case, select_cases
    case = get_case("key_offset_128")
    inp = case.build(seed=0, dtype=torch.bfloat16, device="cuda", quick=False)
    inp.q, inp.k, inp.v, inp.do          # (B, Hq, Sq, D), (B, Hkv, Sk, D) x2, like q; in `dtype` on `device`
    inp.mask                             # mask kwargs for every backend: scale/causal/causal_align/window/
                                         # softcap/cu_seqlens_q/cu_seqlens_k (only the ones that differ from
                                         # the defaults); pass as **inp.mask
    inp.expected                         # exact facts where the case has them (the witness), else {}
    case.gauge_regime                    # True: the error is a gauge leak GProj must remove (done criterion:
                                         # GProj dq error <= 0.5%); False: not a softmax symmetry (query offset,
                                         # softcap), reported but not held to that bar
    case.key_offset                      # common key offset in units of the key spread σ (for plots); 0 for
                                         # diffuse, None where it does not apply
    case.sweep                           # True for the key-offset sweep (diffuse + key_offset_*), the plot's x axis
    case.smallest_p                      # typical size of the probabilities that carry the true gradient, where
                                         # they are tiny (sink: e^-20), else None
    case.in_range(torch.float16)         # False when those probabilities underflow in that format (below its
                                         # smallest subnormal): a range limit of the format, not a gauge leak
    case.do_layouts                      # () for one backward per key set; ("bhsd", "bshd"): the engine runs the
                                         # backward at these keys once per dO layout, in this order, at a shape
                                         # no other case uses (with_do_layout; run.py)

``CASES`` is a tuple in a fixed order; ``select_cases("key_offset_*,sink*")`` filters by comma-separated names
or fnmatch patterns (ValueError on a pattern that matches nothing). Builders draw everything in fp64 from a
``torch.Generator`` seeded by (seed, case name) on the CPU, then round to ``dtype`` and move to ``device``, so
a case is bitwise reproducible across machines. ``quick=True`` gives smaller shapes (the audit's ``--quick``).

Conventions: keys are N(0, 1) (spread σ = 1) plus, for "key offset Xσ", a common vector X·s with s a random
±1 sign per coordinate (shared by all keys of all heads), so the key RMS is ≈ X·σ. Queries, values and dO are
N(0, 1). Head dim 64 (α = 1/8) unless noted.
"""
from __future__ import annotations

import fnmatch
import math
import zlib
from types import MappingProxyType
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

HEAD_DIM = 64
SINK_MARGIN = 20.0  # logit gap of the sink key: one-hot rows with p_other ≈ e^-20
REPEAT_MARGIN = 10.0  # logit gap of the repeated maxima: sharp rows whose true dq is still well conditioned


@dataclass
class CaseInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    mask: Dict[str, object] = field(default_factory=dict)
    expected: Dict[str, object] = field(default_factory=dict)
    do_layouts: Tuple[str, ...] = ()

    @property
    def shape(self) -> Dict[str, int]:
        B, Hq, Sq, D = self.q.shape
        return {"B": B, "Hq": Hq, "Hkv": self.k.shape[1], "Sq": Sq, "Sk": self.k.shape[2], "D": D}


@dataclass(frozen=True)
class Case:
    name: str
    builder: Callable[["_Draw", bool], Tuple[Dict[str, torch.Tensor], Dict[str, object], Dict[str, object]]]
    gauge_regime: bool
    key_offset: Optional[float]
    description: str
    sweep: bool = False
    smallest_p: Optional[float] = None
    do_layouts: Tuple[str, ...] = ()

    def in_range(self, dtype) -> bool:
        """Whether the probabilities that carry this case's true gradient survive rounding to ``dtype``: False
        when ``smallest_p`` is below the format's smallest subnormal (FP16: 2^-24 ≈ 6.0e-8; BF16: ≈ 9.2e-41)."""
        if self.smallest_p is None:
            return True
        info = torch.finfo(dtype)
        return self.smallest_p >= info.tiny * info.eps

    def build(self, seed: int = 0, dtype=torch.bfloat16, device="cpu", quick: bool = False) -> CaseInputs:
        if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            raise ValueError(f"unsupported dtype {dtype}")
        draw = _Draw(seed, self.name, dtype)
        tensors, mask, expected = self.builder(draw, quick)
        dev = torch.device(device)
        t = {n: x.to(dtype).to(dev) for n, x in tensors.items()}
        mask = {n: (x.to(dev) if isinstance(x, torch.Tensor) else x) for n, x in mask.items()}
        return CaseInputs(t["q"], t["k"], t["v"], t["do"], mask, expected, self.do_layouts)


class _Draw:
    """Seeded fp64 random draws for one case."""

    def __init__(self, seed: int, name: str, dtype):
        self.gen = torch.Generator().manual_seed((int(seed) * 1000003 + zlib.crc32(name.encode())) % (1 << 62))
        self.dtype = dtype

    def normal(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

    def signs(self, n: int) -> torch.Tensor:
        return torch.where(torch.rand(n, generator=self.gen, dtype=torch.float64) < 0.5, -1.0, 1.0)

    def unit(self, n: int) -> torch.Tensor:
        e = self.normal(n)
        return e / e.norm()


def _sizes(quick: bool):
    return (1, 2, 128) if quick else (1, 4, 512)  # B, H, S


def _standard(d: _Draw, B, Hq, Hkv, Sq, Sk, key_offset=0.0, query_offset=0.0, D=HEAD_DIM):
    q = d.normal(B, Hq, Sq, D)
    k = d.normal(B, Hkv, Sk, D)
    v = d.normal(B, Hkv, Sk, D)
    do = d.normal(B, Hq, Sq, D)
    if key_offset:
        k = k + key_offset * d.signs(D)
    if query_offset:
        q = q + query_offset * d.signs(D)
    return {"q": q, "k": k, "v": v, "do": do}


def _dense(key_offset=0.0, query_offset=0.0, **mask):
    def build(d: _Draw, quick: bool):
        B, H, S = _sizes(quick)
        return _standard(d, B, H, H, S, S, key_offset, query_offset), dict(mask), {}
    return build


def _sink(d: _Draw, quick: bool):
    """One sink key that every query prefers by ~SINK_MARGIN logits, all keys offset by 64σ.

    The sink direction e is removed from the other keys' noise so the margin is the same for every row; the
    true dq is then ~e^-20 small while the keys are large — plain FP32 attention fails here (docs/math.md).
    In FP16 the e^-20 probabilities and score gradients underflow (below 2^-24), so FP16 kernels, GProj
    included, lose the true dq here (a range limit, not a gauge leak: ≈ 2 % dq error in the emulation).
    """
    B, H, S = _sizes(quick)
    t = _standard(d, B, H, H, S, S, key_offset=0.0)
    e = d.unit(HEAD_DIM)
    k = t["k"] - (t["k"] @ e)[..., None] * e
    k = k + 64.0 * d.signs(HEAD_DIM)
    k[:, :, 0] += 8.0 * e
    t["k"] = k
    t["q"] = t["q"] + SINK_MARGIN * e  # α · SINK_MARGIN · 8 = SINK_MARGIN logits (α = 1/8)
    return t, {}, {}


def _repeated_max(d: _Draw, quick: bool):
    """Seed 002: four identical dominant keys, so each row's maximum is repeated and FA's P̃ = exp(S − m) == 1
    exactly on all four; the other keys are ~REPEAT_MARGIN logits lower (a few % of the mass), keys offset 32σ.

    Sharper rows (a 20-logit gap) make dq ill-conditioned: the four O(1) score gradients cancel to ~e^-20 and
    even exact-input FP32 matmul accumulation cannot resolve that, with or without projection."""
    B, H, S = _sizes(quick)
    t = _standard(d, B, H, H, S, S)
    e = d.unit(HEAD_DIM)
    k = t["k"] - (t["k"] @ e)[..., None] * e
    k = k + 32.0 * d.signs(HEAD_DIM)
    k[:, :, 1:4] = k[:, :, 0:1]
    k[:, :, 0:4] += 8.0 * e
    t["k"] = k
    t["q"] = t["q"] + REPEAT_MARGIN * e
    return t, {}, {}


def _causal(align: str, sq: Tuple[int, int], sk: Tuple[int, int]):
    def build(d: _Draw, quick: bool):
        B, H, _ = _sizes(quick)
        Sq, Sk = sq[quick], sk[quick]
        return (_standard(d, B, H, H, Sq, Sk, key_offset=32.0),
                {"causal": True, "causal_align": align}, {})
    return build


def _shaped(Sq: Tuple[int, int], Sk: Tuple[int, int], H: Tuple[int, int] = (4, 2), Hkv=None, **mask):
    def build(d: _Draw, quick: bool):
        hq = H[quick]
        hkv = hq if Hkv is None else Hkv[quick]
        return _standard(d, 1, hq, hkv, Sq[quick], Sk[quick], key_offset=32.0), dict(mask), {}
    return build


def _varlen(d: _Draw, quick: bool):
    """Packed batch (B = 1, cu_seqlens) with sequences of (q, k) lengths (50, 70), (1, 1), (0, 0), (80, 60),
    bottom-right causal (flash-attn's): the last sequence's first 20 queries see no key (zero gradients)."""
    lq = [50, 1, 0, 80] if not quick else [20, 1, 0, 30]
    lk = [70, 1, 0, 60] if not quick else [28, 1, 0, 24]
    cq = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    ck = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
    H = 2
    t = _standard(d, 1, H, H, int(cq[-1]), int(ck[-1]), key_offset=32.0)
    return t, {"causal": True, "causal_align": "bottom_right", "cu_seqlens_q": cq, "cu_seqlens_k": ck}, {}


#: dO's memory layouts a case can ask for: "bhsd", contiguous (B, H, S, D); "bshd", the same values as a
#: (B, H, S, D) view of a contiguous (B, S, H, D) tensor — the gradient of an ``out.transpose(1, 2)`` that a model
#: reshapes to (B, S, H·D), the layout most training code hands the attention backward
DO_LAYOUTS = ("bhsd", "bshd")


def with_do_layout(inp: CaseInputs, layout: str) -> CaseInputs:
    """``inp`` with dO in ``layout`` (``DO_LAYOUTS``): the same values, other strides."""
    if layout == "bhsd":
        do = inp.do.contiguous()
    elif layout == "bshd":
        do = inp.do.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        raise ValueError(f"dO layout {layout!r}: expected one of {', '.join(DO_LAYOUTS)}")
    return replace(inp, do=do)


def _layout_pair(S: Tuple[int, int]):
    """Diffuse inputs at sequence length S (full, quick), a length no other case uses: a backend that caches
    per-shape state (cuDNN's execution plans) meets this shape first in these cases, in the dO layout they
    name first, whatever ran before."""
    def build(d: _Draw, quick: bool):
        B, H, _ = _sizes(quick)
        return _standard(d, B, H, H, S[quick], S[quick]), {}, {}
    return build


def witness_parameters(dtype) -> Dict[str, float]:
    """ε (BF16/FP16 rounds 1 + ε to 1) and the common key coordinate K0 of the four-key witness."""
    if dtype == torch.float16:
        return {"eps": 3.0 / 8192.0, "key0": 16384.0}
    return {"eps": 3.0 / 1024.0, "key0": 65536.0}


def _witness(d: _Draw, quick: bool):
    """The four-key witness (docs/math.md; seed 000 §3.4): uniform attention over 4 keys (q = 0),
    g = (1+ε, −1, −ε, 0), keys share first coordinate K0, D = 64 (α = 1/8). Every input and the saved output
    O = (−ε, ε, 0, …) are exactly representable; the exact dq[..., 0] is 0 and an uncorrected kernel returns
    α·K0·(−ε) (−24 in BF16)."""
    p = witness_parameters(d.dtype)
    eps, key0 = p["eps"], p["key0"]
    D = HEAD_DIM
    q = torch.zeros(1, 1, 1, D, dtype=torch.float64)
    k = torch.zeros(1, 1, 4, D, dtype=torch.float64)
    k[..., 0] = key0
    k[0, 0, 1, 1] = 1.0  # exact dq = (0, −α, 0, …): nonzero, and GProj's residual error (ε/4 relative) is small
    v = torch.zeros(1, 1, 4, D, dtype=torch.float64)
    v[0, 0, 0, :2] = torch.tensor([4.0, 4.0 * eps])
    v[0, 0, 1, 0] = -4.0
    v[0, 0, 2, 0] = -4.0 * eps
    do = torch.zeros(1, 1, 1, D, dtype=torch.float64)
    do[..., :2] = 1.0
    alpha = D ** -0.5
    expected = {"dq_index": (0, 0, 0, 0), "dq_exact": 0.0, "dq_uncorrected": alpha * key0 * (-eps),
                "dq_exact_coord1": -alpha, "saved_output": [-eps, eps],
                "g": [1.0 + eps, -1.0, -eps, 0.0]}
    return {"q": q, "k": k, "v": v, "do": do}, {}, expected


def _case(name, builder, gauge, offset, desc, sweep=False, smallest_p=None, do_layouts=()) -> Case:
    return Case(name, builder, gauge, offset, desc, sweep, smallest_p, tuple(do_layouts))


CASES: Tuple[Case, ...] = (
    _case("diffuse", _dense(), True, 0.0, "random q, k, v, dO; no offset", sweep=True),
    *(_case(f"key_offset_{x}", _dense(key_offset=float(x)), True, float(x),
            f"common key offset {x}σ (key RMS ≫ spread)", sweep=True) for x in (8, 32, 128, 512)),
    _case("sink_offset_64", _sink, True, 64.0, "one-hot rows on a sink key, keys offset 64σ",
          smallest_p=math.exp(-SINK_MARGIN)),
    _case("repeated_max", _repeated_max, True, 32.0,
          "four identical dominant keys: repeated row maxima, P̃ == 1 exactly (seed 002), offset 32σ",
          smallest_p=math.exp(-REPEAT_MARGIN)),
    _case("query_offset_32", _dense(query_offset=32.0), False, None,
          "large common query offset 32σ: not a softmax symmetry (dk legitimately carries it)"),
    _case("causal_top_left", _causal("top_left", (96, 48), (160, 80)), True, 32.0,
          "causal, top-left (SDPA) alignment, Sq < Sk, offset 32σ"),
    _case("causal_bottom_right", _causal("bottom_right", (160, 80), (96, 48)), True, 32.0,
          "causal, bottom-right (flash-attn) alignment, Sq > Sk (first Sq−Sk rows see no key), offset 32σ"),
    _case("window", _shaped((256, 128), (256, 128), causal=True, window=(48, 0)), True, 32.0,
          "sliding window (48, 0) with causal, offset 32σ"),
    _case("singleton_keys", _shaped((64, 32), (1, 1)), True, 32.0, "Sk = 1: P == 1, exact dq = dk = 0"),
    _case("odd_lengths", _shaped((77, 37), (93, 53)), True, 32.0, "odd lengths Sq = 77, Sk = 93, offset 32σ"),
    _case("long", _shaped((2000, 640), (2000, 640), H=(1, 1)), True, 32.0, "long sequence S = 2000, offset 32σ"),
    _case("gqa", _shaped((256, 128), (256, 128), H=(8, 4), Hkv=(2, 1)), True, 32.0,
          "GQA 8 query heads on 2 KV heads (quick: MQA 4 on 1), offset 32σ"),
    _case("varlen", _varlen, True, 32.0, "varlen pack with a length-1 and a length-0 sequence, causal bottom-right"),
    _case("softcap", _shaped((256, 128), (256, 128), softcap=30.0), False, 8.0,
          "softcap 30 with a key offset 8σ (tanh breaks the gauge symmetry)"),
    _case("witness", _witness, True, None, "the four-key witness (docs/math.md): exact dq coordinate 0"),
    _case("do_layout_bhsd_bshd", _layout_pair((448, 112)), True, 0.0,
          "two backwards at one new shape: dO contiguous (B, H, S, D), then the same dO as a (B, S, H, D) view",
          do_layouts=("bhsd", "bshd")),
    _case("do_layout_bshd_bhsd", _layout_pair((416, 104)), True, 0.0,
          "two backwards at one new shape: dO as a (B, S, H, D) view, then the same dO contiguous (B, H, S, D)",
          do_layouts=("bshd", "bhsd")),
)

_BY_NAME = MappingProxyType({c.name: c for c in CASES})


def get_case(name: str) -> Case:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown case {name!r}; known: {', '.join(_BY_NAME)}") from None


def select_cases(spec: Optional[str]) -> List[Case]:
    """Cases matching comma-separated names or fnmatch patterns, in the order asked (all when ``spec`` is empty)."""
    if not spec:
        return list(CASES)
    chosen: List[Case] = []
    for pat in (p.strip() for p in spec.split(",")):
        if not pat:
            continue
        hits = [c for c in CASES if fnmatch.fnmatchcase(c.name, pat)]
        if not hits:
            raise ValueError(f"no case matches {pat!r}; known: {', '.join(_BY_NAME)}")
        chosen += [c for c in hits if c not in chosen]
    return chosen
