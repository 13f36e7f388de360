"""FlexAttention block masks as what the GProj backends take: flags, varlen documents, or a dense mask.

A ``BlockMask`` is a block-sparsity structure plus a ``mask_mod(b, h, q_idx, kv_idx) -> bool``. The compiled
(Triton) flex kernel skips whole blocks the structure does not list and does not evaluate ``mask_mod`` on the
blocks it lists as *full*; the eager (math) path evaluates ``mask_mod`` on every element and ignores the
structure. Both compute the same mask only when the structure is consistent with ``mask_mod`` (no True outside
the listed blocks, no False inside a full block) — what ``create_block_mask`` builds. ``analyse`` therefore
evaluates ``mask_mod`` densely, in row chunks (never the whole (Sq, Sk) grid at once), checks that consistency,
and only then recognises the mask exactly:

* every row a contiguous key interval given by causal / sliding-window flags, either alignment
  (``MaskVerdict.causal``, ``causal_align``, ``window``; no mask at all is the unbounded window);
* documents: Sq == Sk, rows grouped into consecutive segments that see exactly their own segment (full or
  causal), possibly different per batch element — varlen ``cu_seqlens`` over the batch packed into one
  sequence;
* otherwise the dense boolean mask for the FP32 tier when it fits ``DENSE_MASK_BUDGET_BYTES`` (kept from the
  evaluation, or — in the compiled path, which keeps only row summaries — rebuilt from rows that are key
  intervals), else a reason.

``evaluate_chunk`` has no host synchronisation, so the flex hook's compiled path runs it inside the graph;
``classify`` reads the row summaries (``Rows``) on the host.

Why a module of its own beside the flex hook (``flex.py``): it answers one question — what a ``BlockMask`` is, as
the backends take it — from the mask alone, whoever intercepted the call; it imports nothing of the hook.

The (b, h) grid evaluated is the call's (B, Hq), reduced to one index when ``mask_mod``'s bytecode never reads
that argument (``reads_argument``), so it is exact for masks that depend on the batch or the head.
"""
from __future__ import annotations

import dis
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

MASK_ROW_CHUNK = 128                 # query rows evaluated at once
INCONSISTENT = "BlockMask block structure disagrees with its mask_mod"
MAX_MASK_EVALUATIONS = 1 << 30       # b·h·Sq·Sk mask_mod evaluations allowed for one analysis
DENSE_MASK_BUDGET_BYTES = 256 << 20  # largest dense bool mask handed to the FP32 tier
_CO_VARARGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


@dataclass(frozen=True, eq=False)
class MaskVerdict:
    """How the backward sees one flex call's mask. ``reason`` set: no exact form (the call passes through)."""
    causal: bool = False
    causal_align: str = "top_left"
    window: Tuple[int, int] = (-1, -1)
    cu_seqlens: Optional[Tensor] = None  # documents: int32 offsets over the batch packed as (1, H, B·S, D)
    max_seqlen: Optional[int] = None
    dense: Optional[Tensor] = None       # (B or 1, Hq or 1, Sq, Sk) bool, True = attend (FP32 tier)
    reason: Optional[str] = None


NO_MASK = MaskVerdict()


@dataclass(frozen=True)
class BlockStructure:
    """The block-sparsity part of a ``BlockMask`` (tensors of shape (B', H', nQb[, nKb]))."""
    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Optional[Tensor]
    full_kv_indices: Optional[Tensor]
    block_size: Tuple[int, int]

    @classmethod
    def of(cls, block_mask) -> "BlockStructure":
        return cls(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                   block_mask.full_kv_indices, tuple(int(s) for s in block_mask.BLOCK_SIZE))


def reads_argument(fn: Callable, index: int) -> bool:
    """False only when provably unused: ``fn``'s own bytecode never loads its ``index``-th positional argument
    (it can then pass it nowhere). Anything unusual (no bytecode, *args, fewer arguments) counts as read."""
    return code_reads_argument(getattr(fn, "__code__", None), index)


def code_reads_argument(code, index: int) -> bool:
    """``reads_argument`` on a code object."""
    if code is None or code.co_flags & _CO_VARARGS or code.co_argcount <= index:
        return True
    name = code.co_varnames[index]
    for ins in dis.get_instructions(code):
        if ins.opname.startswith(("LOAD", "STORE", "DELETE")) and name in _argvals(ins.argval):
            return True
    return False


def _argvals(argval) -> Tuple:
    return argval if isinstance(argval, tuple) else (argval,)


def _vmapped(mask_mod: Callable) -> Callable:
    """mask_mod over index vectors (b, h, q, kv) -> (nb, nh, nq, nk) bool, as flex's math path evaluates it."""
    fn = mask_mod
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=dims, out_dims=0)
    return fn


def _block_map(num: Tensor, idx: Tensor, n_kv_blocks: int) -> Tensor:
    """(B', H', nQb, nKb) bool: the blocks listed by (num, idx)."""
    cols = torch.arange(idx.shape[-1], device=idx.device)
    valid = cols < num[..., None]
    target = torch.where(valid, idx.long(), torch.full_like(idx, n_kv_blocks, dtype=torch.long))
    dense = torch.zeros(*idx.shape[:-1], n_kv_blocks + 1, dtype=torch.bool, device=idx.device)
    dense.scatter_(-1, target, True)
    return dense[..., :n_kv_blocks]


@dataclass
class Rows:
    """Per-row summary of a boolean mask (nb, nh, Sq, Sk): every row is exactly the interval [lo, hi] when
    ``cnt == hi - lo + 1`` (``contiguous``)."""
    lo: Tensor   # (nb, nh, Sq) first visible key, Sk where none
    hi: Tensor   # last visible key, -1 where none
    cnt: Tensor  # number of visible keys

    @property
    def contiguous(self) -> bool:
        return bool(((self.cnt == 0) | (self.cnt == self.hi - self.lo + 1)).all())

    def dense(self, sk: int) -> Tensor:
        """The mask these rows stand for when ``contiguous``: (nb, nh, Sq, Sk) bool."""
        j = torch.arange(sk, device=self.lo.device)
        return (j >= self.lo[..., None]) & (j <= self.hi[..., None])


class BlockMaps:
    """Block-level maps of a ``BlockStructure``: listed (partial or full) and full blocks, (B', H', nQb, nKb)."""

    def __init__(self, blocks: BlockStructure, sk: int):
        self.bq, self.bk = blocks.block_size
        n_kv_blocks = -(-sk // self.bk)
        full = None if blocks.full_kv_num_blocks is None else \
            _block_map(blocks.full_kv_num_blocks, blocks.full_kv_indices, n_kv_blocks)
        listed = _block_map(blocks.kv_num_blocks, blocks.kv_indices, n_kv_blocks)
        self.listed = listed if full is None else listed | full
        self.full = torch.zeros_like(listed) if full is None else full

    def violation(self, m: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
        """0-d bool: the chunk ``m`` (nb, nh, len(rows), len(cols)) has a True outside the listed blocks or a
        False inside a full block (nb, nh broadcast against B', H' of the structure)."""
        nb, nh = m.shape[:2]
        qb, kb = (rows // self.bq)[:, None], (cols // self.bk)[None, :]
        lst = self.listed.expand(nb, nh, *self.listed.shape[2:])[:, :, qb, kb]
        ful = self.full.expand(nb, nh, *self.full.shape[2:])[:, :, qb, kb]
        return (m & ~lst).any() | (ful & ~m).any()


def evaluate_chunk(mask_mod: Callable, maps: BlockMaps, nb: int, nh: int, rows: Tensor, sk: int):
    """(mask chunk (nb, nh, len(rows), Sk) bool, its Rows, violation 0-d bool): traceable (no host syncs)."""
    device = rows.device
    cols = torch.arange(sk, device=device)
    m = _vmapped(mask_mod)(torch.arange(nb, device=device), torch.arange(nh, device=device), rows, cols)
    m = m.to(torch.bool).expand(nb, nh, rows.numel(), sk)
    c = m.sum(-1)
    lo = torch.where(c > 0, m.to(torch.uint8).argmax(-1), sk)
    hi = torch.where(c > 0, sk - 1 - m.flip(-1).to(torch.uint8).argmax(-1), -1)
    return m, Rows(lo, hi, c), maps.violation(m, rows, cols)


def _evaluate(mask_mod, blocks: BlockStructure, nb: int, nh: int, sq: int, sk: int, device,
              keep_dense: bool) -> Tuple[Optional[Rows], Optional[Tensor], Optional[str]]:
    """Row summaries (and the dense mask when asked) of mask_mod on the (nb, nh, Sq, Sk) grid in row chunks,
    or a reason."""
    maps = BlockMaps(blocks, sk)
    lo = torch.empty(nb, nh, sq, dtype=torch.long, device=device)
    hi, cnt = torch.empty_like(lo), torch.empty_like(lo)
    dense = torch.empty(nb, nh, sq, sk, dtype=torch.bool, device=device) if keep_dense else None
    for r0 in range(0, sq, MASK_ROW_CHUNK):
        r1 = min(sq, r0 + MASK_ROW_CHUNK)
        m, rows, bad = evaluate_chunk(mask_mod, maps, nb, nh, torch.arange(r0, r1, device=device), sk)
        if bool(bad):
            return None, None, INCONSISTENT
        lo[:, :, r0:r1], hi[:, :, r0:r1], cnt[:, :, r0:r1] = rows.lo, rows.hi, rows.cnt
        if dense is not None:
            dense[:, :, r0:r1] = m
    return Rows(lo, hi, cnt), dense, None


def _flag_rows(sq: int, sk: int, shift: int, left: int, right: int, device) -> Tuple[Tensor, Tensor]:
    """(lo, hi) per row of the window pattern (left/right < 0: unbounded) with diagonal i + shift."""
    diag = torch.arange(sq, device=device) + shift
    lo = (diag - left).clamp(0, sk) if left >= 0 else torch.zeros_like(diag)
    hi = (diag + right).clamp(-1, sk - 1) if right >= 0 else torch.full_like(diag, sk - 1)
    return lo, hi


def _as_flags(lo: Tensor, hi: Tensor, cnt: Tensor, sq: int, sk: int) -> Optional[MaskVerdict]:
    """One (Sq,) row summary as causal/window flags, or None."""
    live = cnt > 0
    rows = torch.arange(sq, device=lo.device)
    aligns = (("top_left", 0),) if sq == sk else (("top_left", 0), ("bottom_right", sk - sq))
    for align, shift in aligns:
        bounded_r = live & (hi < sk - 1)
        bounded_l = live & (lo > 0)
        right = int((hi - rows - shift)[bounded_r][0]) if bool(bounded_r.any()) else -1
        left = int((rows + shift - lo)[bounded_l][0]) if bool(bounded_l.any()) else -1
        if (bool(bounded_r.any()) and right < 0) or (bool(bounded_l.any()) and left < 0):
            continue  # e.g. strictly-past masks: not a window the kernel takes
        elo, ehi = _flag_rows(sq, sk, shift, left, right, lo.device)
        elive = elo <= ehi
        if torch.equal(elive, live) and torch.equal(elo[live], lo[live]) and torch.equal(ehi[live], hi[live]):
            if right == 0:
                return MaskVerdict(causal=True, causal_align=align, window=(left, -1))
            return MaskVerdict(causal_align=align, window=(left, right))
    return None


def _documents(lo: Tensor, hi: Tensor, cnt: Tensor, s: int) -> Optional[Tuple[list, bool]]:
    """Segment starts and causality of a document mask (every row sees exactly its own segment, all of it or
    causally), or None. Needs Sq == Sk and at least two segments."""
    rows = torch.arange(s, device=lo.device)
    if not bool((cnt > 0).all()):
        return None
    new = torch.ones(s, dtype=torch.bool, device=lo.device)
    new[1:] = lo[1:] != lo[:-1]
    starts = rows[new]
    if starts.numel() < 2 or not torch.equal(lo[new], starts):
        return None
    seg = torch.cumsum(new.long(), 0) - 1
    ends = torch.cat([starts[1:], starts.new_tensor([s])])
    if torch.equal(lo, starts[seg]) and torch.equal(hi, rows):
        return starts.tolist(), True
    if torch.equal(lo, starts[seg]) and torch.equal(hi, ends[seg] - 1):
        return starts.tolist(), False
    return None


def _as_documents(rows: Rows, batch: int, s: int) -> Optional[MaskVerdict]:
    """Documents in every batch element (heads alike), as varlen offsets over the packed batch."""
    offsets, causal_kinds, longest = [], set(), 0
    for b in range(batch):
        bb = b if rows.lo.shape[0] > 1 else 0
        docs = _documents(rows.lo[bb, 0], rows.hi[bb, 0], rows.cnt[bb, 0], s)
        if docs is None:
            return None
        starts, causal = docs
        causal_kinds.add(causal)
        offsets.extend(b * s + x for x in starts)
        longest = max(longest, max(e - a for a, e in zip(starts, starts[1:] + [s])))
    if len(causal_kinds) != 1:
        return None
    cu = torch.tensor(offsets + [batch * s], dtype=torch.int32, device=rows.lo.device)
    return MaskVerdict(causal=causal_kinds.pop(), cu_seqlens=cu, max_seqlen=longest)


def grid(code, block_batch: int, block_heads: int, batch: int, heads: int) -> Tuple[int, int]:
    """(nb, nh): the (b, h) grid to evaluate for a mask_mod with this code object — 1 where it provably ignores
    that index and the block structure (of batch/heads ``block_batch``, ``block_heads``) does not vary along it."""
    nb = batch if code_reads_argument(code, 0) or block_batch > 1 else 1
    nh = heads if code_reads_argument(code, 1) or block_heads > 1 else 1
    return nb, nh


def structure_reason(blocks: BlockStructure, batch: int, heads: int) -> Optional[str]:
    b, h = blocks.kv_num_blocks.shape[:2]
    if b not in (1, batch) or h not in (1, heads):
        return f"BlockMask of batch/heads ({b}, {h}) for a call with ({batch}, {heads})"
    return None


def classify(rows: Rows, dense: Optional[Tensor], batch: int, sq: int, sk: int) -> MaskVerdict:
    """The exact form of a mask from its row summaries: flags, documents, else the dense mask (given, or
    rebuilt from the rows when they are intervals and it fits ``DENSE_MASK_BUDGET_BYTES``), else a reason."""
    contiguous = rows.contiguous
    if contiguous and bool((rows.lo == rows.lo[:, :1]).all() and (rows.hi == rows.hi[:, :1]).all()):
        if bool((rows.lo == rows.lo[:1]).all() and (rows.hi == rows.hi[:1]).all()):
            flags = _as_flags(rows.lo[0, 0], rows.hi[0, 0], rows.cnt[0, 0], sq, sk)
            if flags is not None:
                return flags
        if sq == sk:
            docs = _as_documents(rows, batch, sq)
            if docs is not None:
                return docs
    if dense is None and contiguous and rows.lo.numel() * sk <= DENSE_MASK_BUDGET_BYTES:
        dense = rows.dense(sk)
    if dense is not None:
        return MaskVerdict(dense=dense)
    return MaskVerdict(reason=f"BlockMask is no flag/document pattern and its dense mask exceeds "
                              f"{DENSE_MASK_BUDGET_BYTES >> 20} MiB or has rows that are not key intervals")


def analyse(block_mask_mod: Callable, blocks: BlockStructure, batch: int, heads: int, sq: int, sk: int,
            device) -> MaskVerdict:
    """The exact form of one flex mask for a call with (batch, heads) query shape (module docstring)."""
    reason = structure_reason(blocks, batch, heads)
    if reason is not None:
        return MaskVerdict(reason=reason)
    nb, nh = grid(getattr(block_mask_mod, "__code__", None), *blocks.kv_num_blocks.shape[:2], batch, heads)
    if nb * nh * sq * sk > MAX_MASK_EVALUATIONS:
        return MaskVerdict(reason=f"BlockMask too large to verify ({nb}x{nh}x{sq}x{sk} mask_mod evaluations)")
    keep_dense = nb * nh * sq * sk <= DENSE_MASK_BUDGET_BYTES
    try:
        rows, dense, reason = _evaluate(block_mask_mod, blocks, nb, nh, sq, sk, device, keep_dense)
    except Exception as exc:  # noqa: BLE001 - a mask_mod vmap cannot evaluate: no exact form
        return MaskVerdict(reason=f"mask_mod could not be evaluated densely ({type(exc).__name__})")
    if reason is not None:
        return MaskVerdict(reason=reason)
    return classify(rows, dense, batch, sq, sk)
