"""The dq of a BF16 fused backward with four choices of the correction's centre, modelled on CPU (docs/math.md §5,
"A relaxed centre for dq"): P, dP and D in fp32 from fp64 scores and the saved BF16 output, t = low(dS),
r = low(P), then

    none     α Σ t k                      (a fused backward, uncorrected)
    mass     α (Σ t k − λ Σ r k)          (GProj: the exact centre Σ r k / m)
    argmax   α (Σ t k − λ m k_j*)         (the row's most probable key: the relaxation, measured and not shipped)
    meankey  α (Σ t k − ρ k̄)              (the mean key of the head: not gauge-safe for a massive sink key)

and prints each one's relative dq error against the fp64 reference on the unmasked cases of the GPU suite
(``tests/helpers/adversarial.py``, drawn on the CPU). No kernel runs; the H200 numbers of the kernel's argmax
centre are in BENCHMARKS.md.

    python -m benchmarks.centre_model [--json] [CASE ...]     (--json: {case: {centre: error}} instead of the table)
"""
import argparse
import json

import torch

from gproj_patch.backends.reference import reference_backward, reference_forward
from tests.helpers import adversarial

CASES = ["random", "offset8", "offset32", "offset128", "offset512", "sink", "sink64", "massive_sink", "sharp_p1",
         "gqa", "d96", "d256", "strided"]
CENTRES = ("none", "mass", "argmax", "meankey")


def dq_errors(name: str) -> dict:
    """{centre: relative dq error against fp64} for one unmasked case of the suite."""
    inp, kw, _ = adversarial.make_case(name, device="cpu")
    if kw:
        raise ValueError(f"{name}: the model covers unmasked cases only")
    q, k, v, do = (inp[x] for x in ("q", "k", "v", "do"))
    o, _ = reference_forward(q, k, v)
    ref = reference_backward(q, k, v, do)[0].double()
    group = q.shape[1] // k.shape[1]
    q64, do64 = q.double(), do.double()
    k64, v64 = (x.double().repeat_interleave(group, 1) for x in (k, v))
    alpha = q.shape[-1] ** -0.5
    p = torch.softmax((q64 @ k64.transpose(-1, -2)) * alpha, -1).float()  # P (fp32)
    dp = (do64 @ v64.transpose(-1, -2)).float()  # dP = dO·Vᵀ (fp32)
    delta = (do64 * o.to(q.dtype).double()).sum(-1).float()  # D from the saved low-precision output
    t = (p * (dp - delta[..., None])).to(q.dtype).double()  # t = low(dS)
    r = p.to(q.dtype).double()  # r = low(P)
    rho, m = t.sum(-1), r.sum(-1)
    lam = rho / m
    acc = t @ k64
    j_star = p.argmax(-1)  # first of ties
    k_star = torch.gather(k64, 2, j_star[..., None].expand(*j_star.shape, k64.shape[-1]))
    dq = {"none": acc, "mass": acc - lam[..., None] * (r @ k64), "argmax": acc - (lam * m)[..., None] * k_star,
          "meankey": acc - rho[..., None] * k64.mean(2, keepdim=True)}
    return {c: float((alpha * dq[c] - ref).norm() / ref.norm()) for c in CENTRES}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", metavar="CASE", help=f"cases (default all: {', '.join(CASES)})")
    ap.add_argument("--json", action="store_true", help="{case: {centre: error}} instead of the table")
    args = ap.parse_args(argv)
    names = args.cases or CASES
    if args.json:
        print(json.dumps({name: dq_errors(name) for name in names}))
        return
    print(f"{'case':14s}" + "".join(f"{c:>10s}" for c in CENTRES))
    for name in names:
        errs = dq_errors(name)
        print(f"{name:14s}" + "".join(f"{100 * errs[c]:9.3f}%" for c in CENTRES))


if __name__ == "__main__":
    main()
