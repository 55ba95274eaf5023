"""Hole-filling planner: empty a request's sparsest blocks into the holes of its denser ones.

The read path lists a request's live tokens by logical id (``kv_indices``), so
the physical order inside a block is free: a live token may sit in any slot
of any block its request owns privately. A hole-filling plan moves every live
token of the sparsest blocks (the sources) into the dead slots (the holes) of
the same request's denser blocks (the fill blocks), then frees the emptied
sources. It needs no spare block, so no destination reserve.

Rules (I4 for hole filling, checked by :func:`vtoken.bookkeeping.invariants.check_plan`):

* request-local, and a source is freed only if ALL its live tokens move;
* sources: private (OWNED), not the tail, not in flight, neither full nor empty;
  taken sparsest first (ties: block-list position);
* fill blocks: private (OWNED), not in flight, not a source, and not a block
  a prefix-cache hit may read (``SharedBlocks.hit_readable``: its dead slots
  still hold K/V that a hit would attend);
* a move's destination is a hole: a slot of a fill block that no live token of
  the request holds and, in the tail block, one below the write cursor (the
  tail's slots at or after ``num_tokens % S`` are still to be filled by appends).

Gain. With the candidates sorted by live count, the k sparsest fit into the
others' holes iff ``cum_live[k] <= holes(rest)``, i.e. ``k * S <= H`` where
``H`` counts every hole of the candidates and the tail: the best k is
``floor(H / S)``, the same bound as a fresh-block plan without a reserve, at
``<= S - 1`` moves per freed block (each source holds at most S - 1 tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from vtoken.errors import InvalidArgumentError


@dataclass(frozen=True)
class FillChoice:
    """Sources to empty and the fill blocks whose holes take their tokens."""

    src_blocks: np.ndarray  # int32 [k], sparsest first
    fill_blocks: np.ndarray  # int32 [f], densest first (the fill order)
    fill_limit: np.ndarray  # int32 [f], slots of each fill block that may be filled: S, or the tail's cursor
    num_moves: int  # live tokens in the sources

    @property
    def gain(self) -> int:
        return len(self.src_blocks)


def select_fill(
    blocks: np.ndarray,
    live: np.ndarray,
    fillable: np.ndarray,
    *,
    block_size: int,
    tail_block: int = 0,
    tail_holes: int = 0,
    tail_cursor: int = 0,
    max_src: Optional[int] = None,
    max_moves: Optional[int] = None,
) -> Optional[FillChoice]:
    """Choose one request's sources and fill blocks; ``None`` when nothing can be freed.

    Args:
        blocks: int [n] the request's private non-tail blocks not in flight, in block-list order.
        live: int [n] their live counts.
        fillable: bool [n] whether each may take moved tokens (not prefix-cache readable).
        block_size: S.
        tail_block / tail_holes / tail_cursor: the tail block (0: none usable as a fill block),
            its holes below the cursor, and the cursor (``num_tokens - tail_pos * S``).
        max_src / max_moves: budgets (``None``: no limit).

    Example:
        >>> import numpy as np
        >>> c = select_fill(np.array([5, 6, 7]), np.array([1, 3, 2]), np.ones(3, bool), block_size=4)
        >>> c.src_blocks.tolist(), c.fill_blocks.tolist(), c.num_moves
        ([5], [6], 1)
    """
    S = int(block_size)
    blocks, live, fillable = np.asarray(blocks), np.asarray(live), np.asarray(fillable, dtype=bool)
    if not (blocks.shape == live.shape == fillable.shape and blocks.ndim == 1):
        raise InvalidArgumentError(
            f"live / fillable: expected one entry per block ({blocks.shape}), got {live.shape} / {fillable.shape}"
        )
    keep = (live > 0) & (live < S)  # full blocks have no hole and are never sources
    blocks, live, fillable = blocks[keep], live[keep], fillable[keep]
    n = len(blocks)
    if n == 0:
        return None
    order = np.argsort(live, kind="stable")
    lv = live[order].astype(np.int64)
    holes = np.where(fillable[order], S - lv, 0)
    cum_live = np.cumsum(lv)  # cum_live[k-1]: live tokens of the k sparsest
    # holes_after[k-1]: holes of the candidates after the k sparsest, plus the tail's
    holes_after = np.concatenate([np.cumsum(holes[::-1])[::-1][1:], [0]]) + int(tail_holes)
    ok = cum_live <= holes_after
    if max_src is not None:
        ok[int(max_src):] = False
    if max_moves is not None:
        ok &= cum_live <= max_moves
    # NOTE: cum_live grows and holes_after shrinks with k, so the valid k form a prefix.
    k = int(np.count_nonzero(np.cumprod(ok)))
    if k == 0:
        return None
    m = int(cum_live[k - 1])
    rest = order[k:][::-1]  # densest first: the fewest fill blocks touched
    rest = rest[fillable[rest]]
    fb = blocks[rest].astype(np.int64)
    fl = np.full(len(fb), S, dtype=np.int64)
    fh = (S - live[rest]).astype(np.int64)
    if tail_holes > 0:
        fb = np.append(fb, int(tail_block))
        fl = np.append(fl, int(tail_cursor))
        fh = np.append(fh, int(tail_holes))
    used = int(np.searchsorted(np.cumsum(fh), m)) + 1  # fill blocks needed to hold m tokens
    return FillChoice(
        src_blocks=blocks[order[:k]].astype(np.int32),
        fill_blocks=fb[:used].astype(np.int32),
        fill_limit=fl[:used].astype(np.int32),
        num_moves=m,
    )


def collect_fill_moves(
    token_slots: np.ndarray,
    alive: np.ndarray,
    choice: FillChoice,
    *,
    block_size: int,
    num_blocks: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Moves of ``choice``: the sources' live tokens (ascending id) into the fill blocks' holes, in fill order.

    A hole is a slot below the block's limit that no live token holds (dead
    tokens' stale slots do not count). Returns ``(token_ids, src_slots, dst_slots)``, int32.
    """
    S = int(block_size)
    slots = np.asarray(token_slots, dtype=np.int64)
    blk = np.clip(slots // S, 0, None)
    is_src = np.zeros(int(num_blocks), dtype=bool)
    is_src[choice.src_blocks] = True
    tids = np.flatnonzero(alive & is_src[blk])
    # Occupancy of the fill blocks by the request's live tokens.
    local = np.full(int(num_blocks), -1, dtype=np.int64)
    f = len(choice.fill_blocks)
    local[choice.fill_blocks] = np.arange(f)
    occ = np.zeros((f, S), dtype=bool)
    li = local[blk]
    sel = alive & (li >= 0)
    occ[li[sel], slots[sel] % S] = True
    occ |= np.arange(S)[None, :] >= choice.fill_limit[:, None]
    fr, fo = np.nonzero(~occ)  # row-major: fill order, then offset
    if len(fr) < len(tids):
        raise InvalidArgumentError(
            f"choice: expected holes for {len(tids)} moved tokens, got {len(fr)}: the snapshot is inconsistent"
        )
    dst = choice.fill_blocks[fr[: len(tids)]].astype(np.int64) * S + fo[: len(tids)]
    return tids.astype(np.int32), slots[tids].astype(np.int32), dst.astype(np.int32)
