"""Compiled Triton launches replayed without Triton's per-call argument binding (the host cost of a launch).

``JITFunction.run`` binds every argument on every call: it specializes each one (a tensor's dtype and 16-byte alignment,
an integer's value 1 or multiple of 16), builds the cache key from that and looks up the compiled kernel — ~60–70
arguments a GProj launch, most of the host time of a backward at small shapes. When the same shape class comes back, all
of that is known: a ``Prepared`` launch keeps the compiled kernel, the grid and every argument in signature order, with
the tensor slots left open; a later call fills the tensors and calls the kernel's launcher directly
(``compat.compiled_launcher``).

Soundness. A ``Prepared`` is only used under a key that fixes everything Triton specializes on: the caller's key
must determine every non-tensor argument (so they are the template's values) and every tensor's dtype, strides
and shape class; ``launch`` adds the 16-byte alignment of every tensor it fills. The first call of a key goes
through ``JITFunction.run`` (compiling if needed) and records what it passed, so a replay passes exactly what
that call would pass again. Launch hooks (a profiler's) force Triton's own path.

This module decides nothing about numerics; it is the launch of the kernels ``triton_launch`` describes.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import torch

from .compat import compiled_launcher, current_cuda_stream, launch_hooks_set

#: bound of ``PREPARED``: distinct (kernel, shape class) pairs kept; the oldest is dropped past it
CAPACITY = 512
#: a tensor's data pointer must be a multiple of this for Triton's pointer specialization ("tt.divisibility")
TRITON_PTR_ALIGN = 16


@dataclass(frozen=True, eq=False)
class Prepared:
    """One compiled launch ready to replay: the kernel (for its register counts), its launcher, the grid, the
    arguments in signature order (slots None) and the slots' (position, parameter name). A slot holds a call's
    tensor, or a call's TMA descriptor (Gluon: the launcher builds the CUtensorMap from it at every launch)."""
    kernel: object
    go: Callable
    grid: Tuple[int, int, int]
    template: tuple
    slots: Tuple[Tuple[int, str], ...]
    # each tensor slot's 16-byte alignment when the kernel was specialized; None for a descriptor slot (Triton
    # does not specialize on a descriptor's base; its TMA alignment is the caller's check,
    # gluon_bwd.bound_descriptor)
    aligned: Tuple[Optional[bool], ...]

    def replay(self, values: Dict[str, Any], stream: int) -> bool:
        """Launch with these slot values; False (nothing launched) when a tensor's alignment differs from the
        template's."""
        args = list(self.template)
        for (pos, name), was_aligned in zip(self.slots, self.aligned):
            x = values[name]
            if was_aligned is not None and (x.data_ptr() % TRITON_PTR_ALIGN == 0) != was_aligned:
                return False
            args[pos] = x
        self.go(self.grid[0], self.grid[1], self.grid[2], stream, args)
        return True


class LaunchCache:
    """A bounded LRU of ``Prepared`` launches, thread-safe (backwards may run on several devices' threads)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._entries: "OrderedDict[Hashable, Prepared]" = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def get(self, key: Hashable) -> Optional[Prepared]:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: Hashable, entry: Prepared) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def launch(self, fn, key: Optional[Hashable], grid: Tuple[int, int, int], device: int,
               slots: Callable[[], Dict[str, Any]], arguments: Callable[[], dict]):
        """Launch ``fn`` (a compiled-mode ``JITFunction``) on ``grid`` on CUDA device ``device``: a replay of the
        ``Prepared`` launch of ``key`` when there is one, else ``fn[grid](**arguments())`` recorded under ``key``.
        ``slots()`` gives the call's own arguments by parameter name (its tensors, or its TMA descriptors),
        ``arguments()`` every keyword argument (slots included; only called on a miss). ``key`` None: Triton's
        own path, nothing recorded. Returns the compiled kernel."""
        replayable = key is not None and not launch_hooks_set()
        if replayable:
            entry = self.get(key)
            if entry is not None and device == torch.cuda.current_device():
                if entry.replay(slots(), current_cuda_stream(device)):
                    self.hits += 1
                    return entry.kernel
        args = arguments()
        kernel = fn[grid](**args)
        if replayable:
            self.misses += 1
            entry = _prepare(fn, kernel, grid, args, frozenset(slots()))
            if entry is not None:
                self.put(key, entry)
        return kernel


def _prepare(fn, kernel, grid, args: dict, slot_names: frozenset) -> Optional[Prepared]:
    """The ``Prepared`` form of a launch just made with ``args``, the arguments ``slot_names`` left open (None
    where it cannot be replayed: a Triton whose launcher is not the checked one, an argument the call left to its
    default, a tensor not on CUDA, a tensor argument outside the slots)."""
    go = compiled_launcher(kernel)
    names = getattr(fn, "arg_names", None)
    if go is None or names is None or any(n not in args for n in names):
        return None
    template, slots, aligned = [], [], []
    for pos, name in enumerate(names):
        value = args[name]
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor and value.device.type != "cuda":
            return None
        if name in slot_names:
            slots.append((pos, name))
            aligned.append(value.data_ptr() % TRITON_PTR_ALIGN == 0 if is_tensor else None)
            template.append(None)
        elif is_tensor:  # a tensor kept in the template would outlive its call: never
            return None
        else:
            template.append(value)
    return Prepared(kernel=kernel, go=go, grid=tuple(int(g) for g in grid), template=tuple(template),
                    slots=tuple(slots), aligned=tuple(aligned))


#: bounded cache (``CAPACITY`` entries, LRU): the prepared launches of the GProj kernels in this process
PREPARED = LaunchCache()
