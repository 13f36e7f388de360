"""Hook: corrected gradients under context parallelism (PyTorch's ring attention backward, as two ring passes).

``torch.distributed.tensor.experimental`` runs SDPA's fused ops over a sequence-sharded ring: its backward,
``_templated_ring_attention_backward(group, seq_dim, op, grad_out, grad_out_name, query, key, value, out,
logsumexp, is_causal, **kwargs)``, calls the fused backward ``op`` once per KV shard with the merged output and
LSE, accumulates dQ in FP32 and rotates dK/dV back to their owners. Each of those calls rounds dS to BF16 on its
shard: the row's mass leaks into dq along the mean key (docs/math.md §3), and no per-shard projection can remove
it (the shards' true dS sums are not 0, §8). The three ``_scaled_dot_product_ring_{flash,efficient,cudnn}_attention
_backward`` functions look that module global up at call time, so ``install()`` replaces it with
``corrected_ring_backward`` (same signature) and ``uninstall()`` puts the original back by identity.

``corrected_ring_backward`` runs two ring passes with PyTorch's own communication — its rotaters
(``_create_rotater``: the KV rotation, and the all-to-all one that returns dK/dV), its per-step causal behaviour
(``_is_causal_behavior``), its load-balancing halves (``chunk(2)``) and ``_partial_update``, its FP32 dK/dV
accumulation and return path — and ``backends/ring.RingRows`` for the numerics: a row pass over every KV shard
(A, B, ρ, m of the local rows), λ, then a column pass over every KV shard (dk, dv with the rows' λ, back to their
owners); dq = A − λ·B. The KV shards of the column pass are those the row pass received when the rotater is
PyTorch's all-gather one (its gathered buffer holds them all: no second exchange), else a second rotation.

One decision per call, in ``fallback_reason``: a call the corrected ring cannot take (dropout, a bias or mask,
tracing or tensor subclasses, a dtype with nothing to repair, ``_cp_options.convert_to_f32`` off, ...) runs the
original ring function unchanged, its reason passed to ``note`` (the caller's counter) and logged once. The rest
run the GProj kernels (CUDA; CPU fp16 only with ``cpu_kernel``) or else the FP32 form (``RingRows(kernel=False)``),
reported to ``ran``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from ..backends import compat
from ..backends.ring import RingRows, kernel_reason
from ..backends.spec import LOW_PRECISION, normalize_lse
from ..runtime import telemetry
from .restore import restore_by_identity

logger = logging.getLogger("gproj_patch")
#: the fused backward ops PyTorch's ring calls (and the CPU flash one, which it runs the same way): aten names
RING_OPS = ("_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward")
#: the load-balanced ring's halves of a shard (PyTorch's ``ROUND_ROBIN_CYCLE``)
HALVES = 2


def _no_note(reason: str) -> None:
    """The default ``note``: nothing counted."""


def _no_ran(tier: str) -> None:
    """The default ``ran``: nothing counted."""


@dataclass
class InstalledRing:
    """What ``install()`` did, for ``uninstall()`` (hook bookkeeping, not runtime state). One instance,
    ``INSTALLED``, mutated in place and never re-bound."""
    module: Any = None  # PyTorch's ring-attention module (None: not installed)
    original: Optional[Callable] = None  # its ``_templated_ring_attention_backward`` before install()
    note: Callable[[str], None] = _no_note  # called with each fallback's reason
    ran: Callable[[str], None] = _no_ran  # called with "gproj" or "fp32" for each corrected call
    cpu_kernel: Optional[bool] = None  # CPU fp16 rings run the kernels in Triton's interpreter (None: the option)
    pending: Any = None  # the import hook waiting for the ring's module
    # bounded: the distinct fallback reasons logged (a handful of fixed strings and dtype/device names)
    logged: set = field(default_factory=set)


INSTALLED = InstalledRing()


def _count_fallback(reason: str) -> None:
    """``enable()``'s ``note``: a ring left to PyTorch is a pass-through, counted (telemetry logs it at DEBUG)."""
    telemetry.record_pass_through(reason, ("context_parallel",))


def _count_ran(tier: str) -> None:
    telemetry.record_backward(tier)


def install(note: Optional[Callable[[str], None]] = None, ran: Optional[Callable[[str], None]] = None, *,
            cpu_kernel: Optional[bool] = None) -> str:
    """Replace PyTorch's ring backward by ``corrected_ring_backward`` (idempotent) — now if its module is imported,
    else right after it is (importing it costs most of a second: a process that never uses context parallelism
    does not pay). ``note(reason)``: each fallback's reason; ``ran(tier)``: each corrected call's tier ("gproj":
    the kernels, "fp32": the FP32 form) — by default the package's counters (``stats()``); ``cpu_kernel``: CPU
    fp16 rings run the kernels through Triton's interpreter (by default the enabled option, read at each call).
    Returns a status line; a ring module that changed is reported in it (``compat.CompatError``), not raised."""
    from ..runtime.import_hooks import call_after_import, imported
    INSTALLED.note, INSTALLED.ran = note or _count_fallback, ran or _count_ran
    INSTALLED.cpu_kernel = cpu_kernel
    if INSTALLED.module is not None or INSTALLED.pending is not None:
        return "installed"
    if not imported(compat.CP_ATTENTION_MODULE):
        INSTALLED.pending = call_after_import(compat.CP_ATTENTION_MODULE, _install_on_import)
        return f"installed (replaces the ring backward when {compat.CP_ATTENTION_MODULE} is imported)"
    return _replace()


def _install_on_import() -> None:
    INSTALLED.pending = None
    status = _replace()
    if not status.startswith("installed"):
        logger.warning("context parallel: %s", status)


def _replace() -> str:
    try:
        module = compat.context_parallel_attention_module()
    except compat.CompatError as exc:
        return f"skipped: {exc}"
    INSTALLED.original = getattr(module, compat.RING_BACKWARD)
    setattr(module, compat.RING_BACKWARD, corrected_ring_backward)
    INSTALLED.module = module
    return "installed"


def uninstall() -> None:
    """Put the original ring backward back where ours still sits (``restore_by_identity``)."""
    if INSTALLED.pending is not None:
        INSTALLED.pending.cancel()
        INSTALLED.pending = None
    module = INSTALLED.module
    if module is None:
        return
    restore_by_identity(vars(module), compat.RING_BACKWARD, corrected_ring_backward, INSTALLED.original,
                        where=f"{module.__name__}.{compat.RING_BACKWARD}")
    INSTALLED.module = INSTALLED.original = None
    INSTALLED.note, INSTALLED.ran = _no_note, _no_ran


def _cpu_kernel() -> bool:
    """Whether CPU fp16 rings run the kernels in Triton's interpreter: ``install``'s argument, else the enabled
    options' (``Config.cpu_kernel``)."""
    if INSTALLED.cpu_kernel is not None:
        return INSTALLED.cpu_kernel
    from ..runtime import config
    cfg = config.active()
    return bool(cfg is not None and cfg.cpu_kernel)


def fallback_reason(op, seq_dim: int, grad_out, query, key, value, out, logsumexp, kwargs: dict) -> Optional[str]:
    """Why the corrected ring cannot take this call (None when it can): the one decision of a call."""
    name = getattr(getattr(op, "overloadpacket", None), "__name__", repr(op))
    if name not in RING_OPS or getattr(op, "_overloadname", None) != "default":
        return f"context parallel: op {name} (not one of SDPA's fused backwards)"
    tensors = (grad_out, query, key, value, out, logsumexp)
    odd = next((t for t in tensors if type(t) is not torch.Tensor), None)
    if odd is not None:
        return f"context parallel: {type(odd).__name__} input (tracing or a tensor subclass)"
    if torch.compiler.is_compiling():
        return "context parallel: traced by torch.compile"
    if seq_dim != 2:
        return f"context parallel: seq_dim={seq_dim}"
    if float(kwargs.get("dropout_p", 0.0) or 0.0) > 0.0:
        return "context parallel: dropout > 0"
    if kwargs.get("attn_bias") is not None or kwargs.get("attn_mask") is not None:
        return "context parallel: attn_bias / attn_mask"
    if query.dtype not in LOW_PRECISION:
        return f"context parallel: dtype={str(query.dtype).replace('torch.', '')} (nothing to repair)"
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return "context parallel: mixed dtypes"
    if query.dim() != 4 or key.dim() != 4 or value.shape[:3] != key.shape[:3] or key.shape[0] != query.shape[0] \
            or key.shape[-1] != query.shape[-1] or query.shape[1] % key.shape[1] != 0:
        return "context parallel: shapes (B, H, S, D) with Hq a multiple of Hkv expected"
    if grad_out.shape != query.shape[:3] + value.shape[3:] or out.shape != grad_out.shape:
        return "context parallel: grad_out / out not shaped like the output"
    if query.device.type not in ("cuda", "cpu"):
        return f"context parallel: device={query.device.type}"
    try:
        normalize_lse(logsumexp, *query.shape[:3])
    except ValueError:
        return f"context parallel: an LSE of shape {tuple(logsumexp.shape)}"
    if not INSTALLED.module._cp_options.convert_to_f32:
        return "context parallel: _cp_options.convert_to_f32=False (the ring accumulates in the input dtype)"
    return None


def corrected_ring_backward(group, seq_dim, op, grad_out, grad_out_name, query, key, value, out, logsumexp,
                            is_causal, **kwargs):
    """PyTorch's ``_templated_ring_attention_backward`` with GProj's row λ: the same signature and results
    (dq, dk, dv in the inputs' dtype, then the op's further outputs, None here: no bias gradient)."""
    if INSTALLED.module is None:
        raise RuntimeError("corrected_ring_backward called while the context-parallel hook is not installed")
    reason = fallback_reason(op, seq_dim, grad_out, query, key, value, out, logsumexp, kwargs)
    if reason is not None:
        INSTALLED.note(reason)
        if reason not in INSTALLED.logged:
            INSTALLED.logged.add(reason)
            logger.warning("%s -> PyTorch's ring backward, uncorrected (logged once per reason)", reason)
        return INSTALLED.original(group, seq_dim, op, grad_out, grad_out_name, query, key, value, out, logsumexp,
                                  is_causal, **kwargs)
    kernel = kernel_reason(query, key, value, cpu_kernel=_cpu_kernel()) is None
    dq_major, kv_major = pass_launches(query, key, value) if kernel else ("tl", "tl")
    rows = RingRows(grad_out, query, out, logsumexp, scale=kwargs.get("scale"), kernel=kernel, dq_major=dq_major,
                    kv_major=kv_major)
    dq, dk, dv = _two_passes(INSTALLED.module, group, rows, key, value, bool(is_causal))
    INSTALLED.ran("gproj" if kernel else "fp32")
    extra = (None,) * (len(op._schema.returns) - 3)  # the efficient op's bias gradient: none without a bias
    return (dq.to(query.dtype), dk, dv) + extra


def pass_launches(query, key, value) -> Tuple[str, str]:
    """The (row pass, column pass) launches, as a GProj backward's plan picks its dQ-major and KV-major ones:
    Gluon where it takes the call and was measured faster (``configs.gluon_measured_faster``), else tl
    (``RingRows`` falls back to tl on a step Gluon does not take)."""
    from ..backends import gluon_bwd, gluon_dq
    from ..backends.configs import gluon_measured_faster
    d = query.shape[-1]
    # the row pass's Gluon dQ-major launch (PARTIAL mode) is slower than tl under GQA (BENCHMARKS.md, the ring)
    dq = (gluon_dq.dq_major_reason(query, key, value) is None and gluon_measured_faster("dq_major", d)
          and key.shape[1] == query.shape[1])
    kv = gluon_bwd.kv_major_reason(query, key, value) is None and gluon_measured_faster("kv_major", d)
    return "gluon" if dq else "tl", "gluon" if kv else "tl"


def ring_step(cp, rank: int, size: int, i: int, is_causal: bool) -> Optional[Tuple[bool, bool, bool]]:
    """Step i of PyTorch's ring on ``rank`` (its ``_is_causal_behavior`` and load-balancing branches): None when
    the step is skipped, else (second half of the queries only, first half of the keys only, causal)."""
    behavior = cp._is_causal_behavior(rank=rank, world_size=size, i=i, is_causal=is_causal)
    if behavior == cp._CausalBehavior.SKIP:
        return None
    balanced = cp._cp_options.enable_load_balance
    if i == 0 or not balanced or not is_causal:
        return False, False, bool(behavior.value)
    if i <= rank:
        return False, True, bool(behavior.value)
    return True, False, bool(behavior.value)


def step_operands(rows: RingRows, key, value, step) -> Tuple[slice, torch.Tensor, torch.Tensor, bool]:
    """(query rows, key shard, value shard, causal) of a ring step (``ring_step``), as PyTorch's ring cuts them
    (``chunk(2)`` along the sequence)."""
    tail, head, causal = step
    seq = rows.q.shape[2]
    q_rows = slice(-(-seq // HALVES), seq) if tail else slice(None)  # chunk(2)[1]: after the first ⌈S/2⌉ rows
    if head:
        key, value = key.chunk(HALVES, dim=2)[0], value.chunk(HALVES, dim=2)[0]
    return q_rows, key, value, causal


def _two_passes(cp, group, rows: RingRows, key, value, is_causal: bool):
    """The two ring passes of one call (PyTorch's rotation and dK/dV return path): (dq fp32, dk, dv)."""
    if not is_causal and cp._cp_options.enable_load_balance:
        raise RuntimeError("Load balancing requires `is_causal=True`.")  # PyTorch's ring refuses it alike
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    key, value = key.contiguous(), value.contiguous()
    kv_rotater = cp._create_rotater(group, 2)
    shards = []
    for i, (k, v) in enumerate(_rotation(kv_rotater, key, value, size)):  # row pass
        shards.append((k, v))
        step = ring_step(cp, rank, size, i, is_causal)
        if step is not None:
            q_rows, ks, vs, causal = step_operands(rows, k, v, step)
            rows.row_step(ks, vs, causal=causal, rows=q_rows)
    rows.finish()
    if not isinstance(kv_rotater, cp._AllGatherRotater):  # a second rotation (all-gather: the buffer holds all)
        shards = _rotation(cp._create_rotater(group, 2), key, value, size)
    dkv_rotater = cp._create_rotater(group, 2, method=cp._RotateMethod.ALL_TO_ALL)
    grad_key = torch.zeros_like(key, dtype=torch.float32)
    grad_value = torch.zeros_like(value, dtype=torch.float32)
    for i, (k, v) in enumerate(shards):  # column pass, and PyTorch's dK/dV return path
        step = ring_step(cp, rank, size, i, is_causal)
        if step is not None:
            q_rows, ks, vs, causal = step_operands(rows, k, v, step)
            grad_key_, grad_value_ = rows.column_step(ks, vs, causal=causal, rows=q_rows)
        else:
            grad_key_ = torch.zeros_like(key, dtype=torch.float32)
            grad_value_ = torch.zeros_like(value, dtype=torch.float32)
        if i == 0:
            grad_key += grad_key_
            grad_value += grad_value_
        else:
            next_grad_kv = dkv_rotater.next_buffer()  # the partial sums from rank − 1
            grad_key = next_grad_kv[:grad_key.numel()].reshape(grad_key.shape)
            grad_value = next_grad_kv[grad_key.numel():grad_key.numel() + grad_value.numel()].reshape(
                grad_value.shape)
            if i <= rank and cp._cp_options.enable_load_balance:
                grad_key = cp._partial_update(grad_key, grad_key_, dim=2, n_chunks=HALVES, idx=0, add=True)
                grad_value = cp._partial_update(grad_value, grad_value_, dim=2, n_chunks=HALVES, idx=0, add=True)
            else:
                grad_key += grad_key_
                grad_value += grad_value_
        dkv_rotater.exchange_buffers(torch.cat([grad_key.flatten(), grad_value.flatten()]))
    next_grad_kv = dkv_rotater.next_buffer().to(key.dtype)
    dk = next_grad_kv[:grad_key.numel()].reshape(grad_key.shape)
    dv = next_grad_kv[grad_key.numel():].reshape(grad_value.shape)
    return rows.dq(), dk, dv


def _rotation(rotater, key, value, size: int):
    """Yield the (key, value) shard of each ring step, rotated as PyTorch's ring rotates them: step i > 0 waits
    for rank − i's, every step but the last sends its own on before the step's work (which overlaps it)."""
    for i in range(size):
        if i > 0:
            buffer = rotater.next_buffer()
            key = buffer[:key.numel()].reshape(key.shape)
            value = buffer[key.numel():key.numel() + value.numel()].reshape(value.shape)
        if i != size - 1:
            rotater.exchange_buffers(torch.cat([key.flatten(), value.flatten()]))
        yield key, value
