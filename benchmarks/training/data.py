"""Training data of ``python -m benchmarks.training``: Python's standard library source, as bytes.

Text that exists offline on every machine with a Python: the ``*.py`` files under
``sysconfig.get_paths()["stdlib"]`` (``site-packages`` / ``dist-packages`` excluded), in sorted path order,
one byte = one token (vocabulary 256). Every ``HELDOUT_EVERY``-th file of that order is held out, whole files,
so held-out text is never a shifted copy of a training window. Files are joined with a NUL byte (absent from
source text) as a document separator. Different Python versions ship different sources: the corpus is
deterministic per machine, its size and file count go into the run's JSON.

Batches: window starts for every step are drawn once from a seeded generator (``train_windows``), so every arm
sees the same windows in the same order; held-out windows are evenly spaced over the held-out text.
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

#: Every HELDOUT_EVERY-th file (in sorted path order) goes to the held-out split (5 %).
HELDOUT_EVERY = 20
DOC_SEPARATOR = b"\x00"
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
VOCAB = 256


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor      # uint8, 1-D
    heldout: torch.Tensor    # uint8, 1-D
    root: str
    files_train: int
    files_heldout: int


def stdlib_sources(root: Optional[Path] = None) -> List[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if p.is_file() and not EXCLUDED_DIRS & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(*, max_bytes: Optional[int] = None, root: Optional[Path] = None) -> Corpus:
    """Read the sources (train part capped at ``max_bytes``; held-out part capped at max_bytes / HELDOUT_EVERY)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_sources(root)
    if not files:
        raise RuntimeError(f"no *.py files under {root}")
    parts = {"train": [], "heldout": []}
    sizes = {"train": 0, "heldout": 0}
    caps = {"train": max_bytes, "heldout": None if max_bytes is None else max(max_bytes // HELDOUT_EVERY, 1)}
    counts = {"train": 0, "heldout": 0}
    for i, path in enumerate(files):
        split = "heldout" if i % HELDOUT_EVERY == 0 else "train"
        if caps[split] is not None and sizes[split] >= caps[split]:
            continue
        data = path.read_bytes() + DOC_SEPARATOR
        parts[split].append(data)
        sizes[split] += len(data)
        counts[split] += 1
    tensors = {k: torch.frombuffer(bytearray(b"".join(v)), dtype=torch.uint8) for k, v in parts.items()}
    if caps["train"] is not None:
        tensors = {k: t[:caps[k]] for k, t in tensors.items()}
    return Corpus(train=tensors["train"], heldout=tensors["heldout"], root=str(root),
                  files_train=counts["train"], files_heldout=counts["heldout"])


def train_windows(*, steps: int, batch: int, seq: int, n_tokens: int, seed: int) -> torch.Tensor:
    """(steps, batch) window starts, uniform over the training text, from one seeded generator."""
    if n_tokens <= seq:
        raise ValueError(f"training text of {n_tokens} bytes is shorter than one window of {seq}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - seq, (steps, batch), generator=g)


def heldout_windows(*, count: int, seq: int, n_tokens: int) -> torch.Tensor:
    """``count`` window starts evenly spaced over the held-out text."""
    if n_tokens <= seq:
        raise ValueError(f"held-out text of {n_tokens} bytes is shorter than one window of {seq}")
    return torch.linspace(0, n_tokens - seq - 1, count).long()


def gather(text: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    """Token ids (len(starts), seq), int64."""
    idx = starts.reshape(-1, 1).to(text.device) + torch.arange(seq, device=text.device).reshape(1, -1)
    return text[idx].long()


def describe(root: Optional[Path] = None, *, max_bytes: Optional[int] = None, list_files: bool = False,
             windows: Optional[dict] = None, seeds: tuple = ()) -> dict:
    """The split of ``root`` (default: this Python's stdlib) as JSON-ready facts: file and byte counts, the
    sha256 of each split's text (equal across machines iff the corpora are), with ``list_files`` the relative
    paths of each split, and for each seed the training windows ``windows`` = dict(steps, batch, seq) draws
    plus the bytes (hex) of the first sequence of the first step."""
    import hashlib
    root = Path(root or sysconfig.get_paths()["stdlib"])
    corpus = load_corpus(max_bytes=max_bytes, root=root)
    out = {"root": str(root), "heldout_every": HELDOUT_EVERY, "files_train": corpus.files_train,
           "files_heldout": corpus.files_heldout, "train_bytes": len(corpus.train),
           "heldout_bytes": len(corpus.heldout),
           "train_sha256": hashlib.sha256(corpus.train.numpy().tobytes()).hexdigest(),
           "heldout_sha256": hashlib.sha256(corpus.heldout.numpy().tobytes()).hexdigest()}
    if list_files:
        names = [p.relative_to(root).as_posix() for p in stdlib_sources(root)]
        out["files"] = names
        out["heldout_files"] = names[::HELDOUT_EVERY]
    for seed in seeds:
        starts = train_windows(n_tokens=len(corpus.train), seed=seed, **windows)
        first = gather(corpus.train, starts[0], windows["seq"])[0]
        out.setdefault("windows", {})[str(seed)] = {"starts": starts.tolist(), "first": bytes(first.tolist()).hex()}
    return out


def main(argv=None) -> int:
    """``python -m benchmarks.training.data``: this machine's corpus split, as JSON (``describe``)."""
    import argparse
    import json
    ap = argparse.ArgumentParser(description="the training corpus split of benchmarks.training, as JSON")
    ap.add_argument("--root", default=None, help="a source tree instead of this Python's stdlib")
    ap.add_argument("--max-bytes", type=int, default=None)
    ap.add_argument("--list", action="store_true", help="also the relative paths of both splits")
    ap.add_argument("--seeds", default="", help="comma-separated seeds: the training windows each one draws")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    seeds = tuple(int(s) for s in args.seeds.split(",") if s)
    print(json.dumps(describe(args.root, max_bytes=args.max_bytes, list_files=args.list, seeds=seeds,
                              windows=dict(steps=args.steps, batch=args.batch, seq=args.seq)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
