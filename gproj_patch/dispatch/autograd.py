"""What autograd asks of a hooked call beyond one reverse-mode backward, answered as the unpatched call would.

* ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, ``vmap``, ``jvp``) and forward-mode AD (dual tensors):
  the hooks' ``autograd.Function``s define neither ``setup_context`` nor ``jvp``, so such a call is passed to the
  original untouched (``transform_reason``) — it then works, or raises, exactly as without the patch.
* ``create_graph=True``: the corrected backward is not differentiable. torch's ``once_differentiable`` marks the
  gradients only when dO requires grad, so a gradient penalty (``autograd.grad(out, q, create_graph=True)`` with
  a plain dO, then ``penalty.backward()``) silently lost its second-order term. ``once_differentiable`` here also
  counts the forward's inputs (``ctx.needs_input_grad``): the gradients then require grad through a node that
  raises ``SECOND_ORDER_ERROR`` when a backward reaches it; a ``create_graph`` backward that is never
  differentiated again is unaffected.
* activation checkpointing around a hook that runs the original forward itself (SDPA without the seam, flex):
  the inner graph's saved tensors must not be packed by the checkpoint's hooks (reading them would re-run the
  checkpointed block), so that forward runs under ``inner_saved_tensors_hooks``. It lives here, beside the other
  answers to what autograd does around a hooked call, because every hook with such a forward needs it.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from torch import Tensor

from ..backends import compat

SECOND_ORDER_ERROR = ("gproj_patch: the corrected attention backward is not differentiable (a double backward "
                      "through create_graph=True reached it); run this attention with gproj_patch.disable() "
                      "for higher-order gradients")


def has_backward(*tensors) -> bool:
    """Grad mode is on and one of ``tensors`` (None skipped) requires grad: the call will have a backward to
    correct. Every hook asks this before its own terms (its mode, the inputs' dtype)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def transform_reason(*tensors) -> Optional[str]:
    """Why a call made under a ``torch.func`` transform or with dual tensors keeps the original (None: neither).
    Eager calls only (under ``torch.compile`` the compiled paths take these transforms through custom ops)."""
    if compat.functorch_transform_active():
        return "a torch.func transform (grad, vmap, jvp, ...) is active"
    if compat.forward_ad_active() and any(
            t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        return "forward-mode AD (dual tensors)"
    return None


def once_differentiable(backward):
    """``torch.autograd.function.once_differentiable`` counting the forward's inputs as well as the incoming
    gradients (module docstring). Outside ``create_graph`` (grad mode off in the backward) it only calls
    ``backward``."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not (any(ctx.needs_input_grad) or any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads)):
            return outputs
        return compat.delayed_error(SECOND_ORDER_ERROR, outputs)
    return wrapper


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
    if compat.saved_tensors_hooks_enabled():
        return torch.autograd.graph.saved_tensors_hooks(detach_pack, identity_unpack)
    return contextlib.nullcontext()
