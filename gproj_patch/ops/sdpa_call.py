"""Saved-tensor hooks for an original forward run inside a hook (``ops/sdpa.py``'s ``_Attention``, flex's):
the inner graph keeps its own saved tensors even under an activation checkpoint's hooks.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..backends.compat import saved_tensors_hooks_enabled

detach_pack = torch.Tensor.detach  # the saved-tensor pack hook (a C method: no Python frame per saved tensor)


def identity_unpack(t: Tensor) -> Tensor:
    return t


def inner_saved_tensors_hooks():
    """The pack/unpack hooks of an original forward run inside a hook, or nothing inside
    ``disable_saved_tensors_hooks`` (entering hooks raises there; no checkpoint's hooks can be active then either).

    Under activation checkpointing the inner node's saved tensors would be packed by the checkpoint, and reading
    them would re-run the checkpointed block; these hooks keep them. The pack hook stores a *detached* alias:
    storing the tensor itself would put an output inside its own grad_fn, a reference cycle through C++ that
    Python's collector cannot see (every call's tensors would leak)."""
    if saved_tensors_hooks_enabled():
        return torch.autograd.graph.saved_tensors_hooks(detach_pack, identity_unpack)
    return contextlib.nullcontext()
