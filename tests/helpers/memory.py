"""Memory and tier checks shared by the tests that run many forward+backward calls.

``flat`` checks that nothing of a call outlives its backward; ``tier_ran`` says which backward those
calls got, so that a flat-memory or bit-for-bit result cannot come from a path that silently skipped the
correction."""
import gc

import torch

import gproj_patch
from gproj_patch.runtime.config import TIERS

#: forward+backward calls per flat-memory check
CALLS = 6


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage the garbage collector can reach (meta and storage-less tensors —
    nested, fake — not counted)."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):
            continue
        try:
            if not obj.is_meta:
                storage = obj.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        except Exception:  # noqa: BLE001 - tensors without storage (nested, fake) are not counted
            continue
    return total


def flat(step, calls: int = CALLS) -> list:
    """Run ``step`` ``calls`` times; the live bytes after the last call must not exceed those after the second
    (the first call may create caches: kernels, interned contexts). Returns the sizes measured."""
    sizes = []
    for _ in range(calls):
        step()
        sizes.append(live_tensor_bytes())
    assert sizes[-1] <= sizes[1], sizes
    return sizes


def assert_tier_ran(tier: str, calls: int = 1) -> dict:
    """Only ``tier`` ran: ``gproj_patch.stats()`` counts at least ``calls`` backwards on ``tier`` ("gproj",
    "fp32" or "original") and none on the other two. Returns the stats."""
    stats = gproj_patch.stats()
    assert stats[tier] >= calls, (tier, calls, stats)
    assert all(stats[t] == 0 for t in TIERS if t != tier), (tier, stats)
    return stats
