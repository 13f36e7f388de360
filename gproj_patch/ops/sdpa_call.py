"""One SDPA call as the hooks take it (eager ``ops/sdpa.py`` and compiled ``ops/sdpa_compiled.py`` alike): the
original function the hook replaced, the original forward run with its LSE, the call's ``Problem``, and the
backward's tensors. Imports neither of the two hook modules (they import it: no cycle).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from ..backends.compat import BUILTIN_SDPA, fused_sdpa_lse, saved_tensors_hooks_enabled
from ..backends.spec import default_scale
from ..dispatch.record import CallRecord, Problem
from ..dispatch.router import BackwardTensors
from .masks import mask_as_flags, padding_as_flags

C_SDPA = BUILTIN_SDPA  # the C builtin (compat)


class _Original:
    """The SDPA function the hook replaced (``integrations/sdpa.py`` sets it while installed)."""
    fn: Callable = C_SDPA


def original_sdpa() -> Callable:
    return _Original.fn


def set_original(fn: Optional[Callable]) -> None:
    _Original.fn = C_SDPA if fn is None else fn


detach_pack = torch.Tensor.detach  # the saved-tensor pack hook (a C method: no Python frame per saved tensor)


def identity_unpack(t: Tensor) -> Tensor:
    return t


def inner_saved_tensors_hooks():
    """The pack/unpack hooks of an original forward run inside a hook (``run_original_with_lse``, flex's), or nothing inside ``disable_saved_tensors_hooks``
    (entering hooks raises there; no checkpoint's hooks can be active then either)."""
    if saved_tensors_hooks_enabled():
        return torch.autograd.graph.saved_tensors_hooks(detach_pack, identity_unpack)
    return contextlib.nullcontext()


def run_original_with_lse(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    """(inner output with its graph, lse or None, (qi, ki, vi)): the original SDPA on aliases that require grad.

    Saved-tensor hooks: under activation checkpointing the inner node's saved tensors would be packed by the
    checkpoint, and reading its LSE would re-run the checkpointed block; these hooks keep them. The pack hook
    stores a *detached* alias: storing the tensor itself would put an output inside its own grad_fn, a reference
    cycle through C++ that Python's collector cannot see (every call's tensors would leak)."""
    with torch.enable_grad(), inner_saved_tensors_hooks():
        qi, ki, vi = q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_()
        inner = _Original.fn(qi, ki, vi, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                             enable_gqa=enable_gqa)
    return inner, fused_sdpa_lse(inner.grad_fn), (qi, ki, vi)


def problem_for(q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool, scale: Optional[float]) -> Problem:
    """The call's problem: a mask that is exactly a causal / window pattern becomes flags (at the forward)."""
    mask, causal, align, window = mask_as_flags(attn_mask, q.shape[2], k.shape[2])
    if is_causal:
        causal, align = True, "top_left"
    scale = default_scale(q.shape[-1], scale)
    if mask is None and type(scale) is float:  # (a symbolic scale under tracing is built, not interned)
        return _flags_problem(scale, causal, align, window)
    return Problem(scale=scale, causal=causal, causal_align=align, window=window, attn_mask=mask,
                   padded=mask is not None)


@functools.lru_cache(maxsize=256)
def _flags_problem(scale: float, causal: bool, align: str, window: Tuple[int, int]) -> Problem:
    """The Problem of a call without a mask tensor, one frozen instance per (scale, flags): pure (immutable
    key, immutable value, no tensor), so calls share it instead of building 14 fields each time."""
    return Problem(scale=scale, causal=causal, causal_align=align, window=window)


def backward_tensors(record: CallRecord, do, q, k, v, out, lse):
    """(tensors, record) for the router: a recorded mask that is right padding around causal flags, with zero
    dO on the padded rows, goes to the kernel as flags plus dead rows (exact; the plan was made for that)."""
    problem, dead = record.problem, None
    if problem.padded:
        padded = padding_as_flags(problem.attn_mask, do, q.shape[2], k.shape[2])
        if padded is not None:
            window, dead = padded
            problem = Problem(scale=problem.scale, causal=True, causal_align="top_left", window=window)
            record = CallRecord(problem, record.context, record.plan)
    return BackwardTensors(do, q, k, v, out, lse, dead_rows=dead), record
