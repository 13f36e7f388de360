"""Where a sampled detector call spends its time on the GPU (one device call; prints a table).

Each variant is timed as wall time between two device syncs (what a sampled call costs the training loop),
best of N after warm-up, on the auto_check shape (B=2, H=16, S=4096, D=128, BF16).
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gproj_patch import detector  # noqa: E402


def best(fn, n=30):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e3 * min(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    B, H, S, D = 2, 16, 4096, 128
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.randn(B, H, S, device="cuda")
    idx = torch.linspace(0, S - 1, 256, device="cuda").round().long()
    qs, ks, ls = q.index_select(2, idx), k.index_select(2, idx), lse.index_select(2, idx)
    args_ = (qs, ks, k[:, :, 0, :], ls, D ** -0.5, 1, 2.0 ** -8)
    compiled = torch.compile(detector._statistics, dynamic=False)

    # manual CUDA graph of the eager arithmetic on static inputs
    static = [t.clone() for t in (qs, ks, k[:, :, 0, :], ls)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            detector._statistics(*static, D ** -0.5, 1, 2.0 ** -8)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = detector._statistics(*static, D ** -0.5, 1, 2.0 ** -8)

    def graphed():
        torch.index_select(q, 2, idx, out=static[0])
        torch.index_select(k, 2, idx, out=static[1])
        static[2].copy_(k[:, :, 0, :])
        torch.index_select(lse, 2, idx, out=static[3])
        graph.replay()
        return g_out[-1].tolist()

    rows = {
        "sync round trip (x.item())": lambda: ls[0, 0, 0].item(),
        "index_select q,k,lse only": lambda: (q.index_select(2, idx), k.index_select(2, idx), lse.index_select(2, idx)),
        "eager _statistics + tolist": lambda: detector._statistics(*args_)[-1].tolist(),
        "compiled _statistics + tolist": lambda: compiled(*args_)[-1].tolist(),
        "CUDA graph replay (+ 4 copies) + tolist": graphed,
        "detector.compute(...).summary() (shipped path)": lambda: detector.compute(q, k, lse, None).summary(),
        "eager compute (GPROJ_DETECTOR_GRAPH=0)": None,
    }
    res = {}
    for name, fn in rows.items():
        if fn is None:
            os.environ["GPROJ_DETECTOR_GRAPH"] = "0"
            fn = lambda: detector.compute(q, k, lse, None).summary()  # noqa: E731
        res[name] = best(fn)
        os.environ.pop("GPROJ_DETECTOR_GRAPH", None)
    with open(os.path.join(args.out, "detector_cost.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"detector cost on {torch.cuda.get_device_name()}, torch {torch.__version__}, B,H,S,D = {B},{H},{S},{D}")
    for name, ms in res.items():
        print(f"  {ms:8.3f} ms  {name}")


if __name__ == "__main__":
    main()
