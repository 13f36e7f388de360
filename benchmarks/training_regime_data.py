"""Training data of ``benchmarks/training_regime.py``: Python's standard library source, as bytes.

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
