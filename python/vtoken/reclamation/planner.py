"""Relocation planner: which live tokens of a request move where (docs/reclamation.md).

Pure numpy functions over a consistent snapshot of one request. They allocate
nothing and mutate nothing: :class:`vtoken.reclamation.manager.ReclamationManager` takes
the snapshot, reserves the destination blocks from the headroom, and turns the
result into an in-flight relocation.

Rules (I4, checked by :func:`vtoken.bookkeeping.invariants.check_plan`):

* request-local: every source, destination and token belongs to one request;
* sources are the request's private blocks (ledger state OWNED, so ref == 1),
  never its tail block, never a block already in flight, and never a full
  block (a full block can only be moved, never emptied into fewer blocks);
* sources are taken sparsest first (ties: block-list position), up to
  ``max_src``; of that sorted list the planner keeps the shortest prefix with
  the largest gain ``k - ceil(T_live(k) / S)`` that also fits the move and
  destination budgets;
* profitability gate: ``len(src) > ceil(T_live / S)`` (gain >= 1);
* destinations are filled completely, in logical order: the j-th moved token
  (ascending token id) goes to ``dst_blocks[j // S] * S + j % S``, so only the
  last destination may be partial, and it is filled from offset 0.

Cost: one stable argsort of the candidates' live counts, one cumsum, and an
O(request tokens) pass to collect the moved tokens. Planning 1,000 source
blocks is well under the 2 ms goal (``bench/bench_planner.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional

import numpy as np

from vtoken import cdiv
from vtoken.errors import InvalidArgumentError

_NEG = np.int64(-(1 << 62))


@dataclass(frozen=True)
class SourceChoice:
    """The planner's decision before destinations exist: sources and their live total."""

    src_blocks: np.ndarray  # int32 [k], sparsest first
    num_moves: int  # T_live: live tokens in the sources
    num_dst: int  # ceil(T_live / S)

    @property
    def gain(self) -> int:
        """Blocks freed net of destinations: ``len(src) - num_dst``."""
        return len(self.src_blocks) - self.num_dst


@dataclass(frozen=True, eq=False)
class Plan:
    """One request's relocation: every live token of ``src_blocks`` moves into ``dst_blocks``.

    Arrays (all int32, numpy):
        token_ids  [M]  logical ids of the moved tokens, ascending
        src_slots  [M]  their current slots (in ``src_blocks``)
        dst_slots  [M]  their new slots: ``dst_blocks[j // S] * S + j % S``
        src_blocks [k]  the sources, sparsest first; all are freed on commit
        dst_blocks [d]  the destinations, in fill order; ``d = ceil(M / S) < k``
        fill_blocks [f] a hole-filling plan's destinations (:mod:`vtoken.reclamation.hole_planner`): blocks
                        the request already owns, whose holes take the moves; then
                        ``dst_blocks`` is empty and the moves need no logical order

    """

    request: Hashable
    token_ids: np.ndarray
    src_slots: np.ndarray
    dst_slots: np.ndarray
    src_blocks: np.ndarray
    dst_blocks: np.ndarray
    block_size: int
    fill_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def fills_holes(self) -> bool:
        """A hole-filling plan (no fresh destination)."""
        return len(self.fill_blocks) > 0

    @property
    def num_moves(self) -> int:
        return len(self.token_ids)

    @property
    def gain(self) -> int:
        return len(self.src_blocks) - len(self.dst_blocks)


def select_sources(
    blocks: np.ndarray,
    live: np.ndarray,
    *,
    block_size: int,
    max_src: Optional[int] = None,
    max_moves: Optional[int] = None,
    max_dst: Optional[int] = None,
) -> Optional[SourceChoice]:
    """Choose the source blocks of one request; ``None`` when no choice passes the gate.

    Args:
        blocks: int [n] candidate blocks (private, non-tail, not in flight), in
            block-list order (the tie-break among equal live counts).
        live: int [n] live tokens of each candidate.
        block_size: S.
        max_src: at most this many sources (``None``: no limit).
        max_moves: at most this many moved tokens (``None``: no limit).
        max_dst: at most this many destinations (the headroom left; ``None``: no limit).

    The gain of the k sparsest candidates is ``k - ceil(cum_live[k] / S)``; the
    choice is the smallest k with the largest gain within the budgets, and it
    is returned only if that gain is at least 1 (``len(src) > N_dst``).

    Example:
        >>> import numpy as np
        >>> c = select_sources(np.array([3, 1, 2]), np.array([5, 2, 4]), block_size=8)
        >>> c.src_blocks.tolist(), c.num_moves, c.num_dst
        ([1, 2], 6, 1)
    """
    S = int(block_size)
    blocks = np.asarray(blocks)
    live = np.asarray(live)
    if blocks.shape != live.shape or blocks.ndim != 1:
        raise InvalidArgumentError(
            f"live: expected one count per candidate block ({blocks.shape}), got shape {live.shape}"
        )
    # Full (and, defensively, empty) blocks can never raise the gain.
    keep = (live > 0) & (live < S)
    if not keep.all():
        blocks, live = blocks[keep], live[keep]
    n = len(blocks)
    if n < 2:
        return None
    order = np.argsort(live, kind="stable")
    if max_src is not None and n > max_src:
        order = order[:max_src]
    cum = np.cumsum(live[order], dtype=np.int64)
    k = np.arange(1, len(order) + 1, dtype=np.int64)
    ndst = cdiv(cum, S)
    gain = k - ndst
    ok = np.ones(len(order), dtype=bool)
    if max_moves is not None:
        ok &= cum <= max_moves
    if max_dst is not None:
        ok &= ndst <= max_dst
    if not ok.any():
        return None
    gain = np.where(ok, gain, _NEG)
    best = int(np.argmax(gain))  # first index of the max: the fewest moves for that gain
    if gain[best] < 1:
        return None
    return SourceChoice(
        src_blocks=blocks[order[: best + 1]].astype(np.int32),
        num_moves=int(cum[best]),
        num_dst=int(ndst[best]),
    )


def collect_moves(
    token_slots: np.ndarray,
    alive: np.ndarray,
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
    *,
    block_size: int,
    num_blocks: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Moves that empty ``src_blocks`` into ``dst_blocks``, filled completely in logical order.

    Args:
        token_slots: int32 [n] every token's slot (dead ones: the slot they died in).
        alive: bool [n] alive bits.
        src_blocks / dst_blocks: int block ids.
        block_size: S. num_blocks: the ledger's block count (bounds the lookup).

    Returns ``(token_ids, src_slots, dst_slots)``, int32 each.
    """
    S = int(block_size)
    mark = np.zeros(int(num_blocks), dtype=bool)
    mark[src_blocks] = True
    # NOTE: a dead token keeps a stale slot that may point into a block the
    # request owns again today, so the alive mask must gate the lookup.
    blk = token_slots // S
    sel = alive & mark[np.clip(blk, 0, None)]
    tids = np.flatnonzero(sel)
    m = len(tids)
    if m > len(dst_blocks) * S:
        raise InvalidArgumentError(
            f"dst_blocks: expected room for {m} moved tokens, got {len(dst_blocks)} blocks of {S}"
        )
    j = np.arange(m, dtype=np.int64)
    dst = np.asarray(dst_blocks, dtype=np.int64)[j // S] * S + j % S
    return tids.astype(np.int32), token_slots[tids].astype(np.int32), dst.astype(np.int32)


def make_plan(
    request: Hashable,
    token_slots: np.ndarray,
    alive: np.ndarray,
    choice: SourceChoice,
    dst_blocks: np.ndarray,
    *,
    block_size: int,
    num_blocks: int,
) -> Plan:
    """Build the :class:`Plan` of ``choice`` with its reserved ``dst_blocks``."""
    dst_blocks = np.asarray(dst_blocks, dtype=np.int32)
    if len(dst_blocks) != choice.num_dst:
        raise InvalidArgumentError(f"dst_blocks: expected {choice.num_dst} blocks, got {len(dst_blocks)}")
    tids, src, dst = collect_moves(
        token_slots, alive, choice.src_blocks, dst_blocks, block_size=block_size, num_blocks=num_blocks
    )
    if len(tids) != choice.num_moves:
        raise InvalidArgumentError(
            f"token_slots: expected {choice.num_moves} live tokens in the sources (the snapshot's counts), "
            f"got {len(tids)}: the snapshot is inconsistent"
        )
    return Plan(request, tids, src, dst, choice.src_blocks, dst_blocks, int(block_size))


def per_request_gain(
    owner: np.ndarray, live: np.ndarray, num_rows: int, *, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Upper bound of the blocks each request could free: ``count - ceil(live / S)``.

    ``owner`` / ``live``: the candidate blocks' owner rows and live counts (any
    order). Returns ``(gain[int64 num_rows], candidates[int64 num_rows])``.
    Vectorized over every block of the pool (two bincounts).
    """
    S = int(block_size)
    cnt = np.bincount(owner, minlength=num_rows).astype(np.int64)
    tot = np.bincount(owner, weights=live, minlength=num_rows).astype(np.int64)
    return cnt - cdiv(tot, S), cnt
