"""TokenTable: per-request logical token -> slot mapping with alive bits.

For every request and every logical token id ``t`` (its RoPE position, never
reused) the table stores the token's current slot (int32 ``block*S+offset``)
and an alive bit. A dead token keeps the slot it died in; that value is
history only and is never dereferenced once its block is freed. Each request
also has a block list (like vLLM's block table): position ``p`` covers logical
tokens ``[p*S, (p+1)*S)`` at allocation time, and a freed position holds the
null block, so ``len(block list) == ceil(num_tokens / S)`` always holds. The
table reads and writes the lists through a block-list store (``block_lists``):
by default its arena's, or the engine's (vLLM's lists), one list per request.

The pieces, one owner each (docs/architecture.md):

- :class:`vtoken.bookkeeping.arena.SegmentArena`: where each request's slots, alive bits
  and block list are stored (numpy arenas, <= 5 bytes per token);
- a block-list store (:mod:`vtoken.bookkeeping.block_lists`): the block lists the
  table reads and writes (by default in the arena);
- this class: request rows, append, evict and the reads;
- :class:`vtoken.bookkeeping.shared_blocks.SharedBlocks`: shared-prefix holders;
- :class:`vtoken.bookkeeping.relocation.RelocationTransitions`: a relocation plan's block
  transitions (the reclaimer's calls, exposed here);
- :class:`vtoken.bookkeeping.ledger.BlockLedger`: per-block counts and states, changed
  only through its methods;
- :class:`vtoken.bookkeeping.journal.DeltaJournal`: every change, for the mirrors;
- :func:`vtoken.bookkeeping.invariants.check_table`: the O(tokens) invariant checks.

Naive-Evict semantics are built in: a non-tail block in which a request has no
live token left is released at once (freed if private, unreferenced if shared).

Every public call validates all of its input before it changes anything, so a
rejected call leaves the table and the ledger bit-identical.
"""
from __future__ import annotations

import operator
from typing import Optional

import numpy as np

from vtoken import cdiv
from vtoken.bookkeeping.arena import SegmentArena
from vtoken.bookkeeping.block_lists import ArenaBlockLists, leaving_blocks
from vtoken.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    as_index_array,
    check_int,
    has_duplicates,
)
from vtoken.bookkeeping.journal import EVICT_ORIGINS, DeltaJournal
from vtoken.bookkeeping.ledger import OWNED, SHARED, BlockLedger
from vtoken.bookkeeping.pool import NULL_BLOCK
from vtoken.bookkeeping.relocation import RelocationTransitions
from vtoken.bookkeeping.request_rows import RequestRows
from vtoken.bookkeeping.shared_blocks import SharedBlocks

_DTYPE = operator.attrgetter("dtype")
_BIT = (1 << np.arange(8)).astype(np.uint8)  # alive-bit masks by offset in the byte: one gather, no casts


def _as_list(arg: str, value) -> list:
    try:
        return list(value)
    except TypeError:
        raise InvalidTypeError(f"{arg}: expected an iterable, got {type(value).__name__}") from None


class TokenTable:
    """Token tables of every request over one :class:`BlockLedger`.

    Example:
        >>> from vtoken.bookkeeping.pool import BlockPool
        >>> from vtoken.bookkeeping.ledger import BlockLedger
        >>> table = TokenTable(BlockLedger(BlockPool(64), block_size=16))
        >>> table.add_request("a")
        >>> table.sync_new_tokens("a", 40).tolist()[:3]
        [16, 17, 18]
        >>> table.evict("a", [0, 1, 2]); table.live_count("a")
        37
    """

    def __init__(self, ledger: BlockLedger, *, initial_tokens: int = 1 << 16, block_lists=None):
        if not isinstance(ledger, BlockLedger):
            raise InvalidTypeError(f"ledger: expected a BlockLedger, got {type(ledger).__name__}")
        self.ledger = ledger
        self.S = ledger.block_size
        nrows = 64
        self.arena = SegmentArena(self.S, initial_tokens=initial_tokens, initial_rows=nrows, block_lists=block_lists is None)
        self.lists = ArenaBlockLists(self.arena) if block_lists is None else block_lists
        self.shared = SharedBlocks(self.arena, ledger)
        self.relocation = RelocationTransitions(self)
        self.journal = DeltaJournal()
        self._nlive = np.zeros(nrows, dtype=np.int64)
        self.registry = RequestRows(nrows)

    # ------------------------------------------------------------------ rows
    def row_of(self, req) -> int:
        """The internal row index of ``req`` (stable while the request lives)."""
        return self.registry.row_of(req)

    def rows_of(self, reqs) -> np.ndarray:
        return self.registry.rows_of(reqs)

    def generation(self, req) -> int:
        return self.registry.generation(req)

    def request_of(self, row: int):
        return self.registry.request_of(row)

    def __contains__(self, req) -> bool:
        return req in self.registry

    def requests(self) -> list:
        return self.registry.requests()

    # ------------------------------------------------------------ public API
    def add_request(self, req, prefix_blocks=None) -> None:
        """Register ``req``, optionally starting from shared prefix blocks.

        ``prefix_blocks`` (ints, may be empty) are full blocks holding the
        request's logical tokens ``0 .. k*S-1`` in order: block ``i`` must sit
        at position ``i`` of the block list of the request(s) already holding
        it, unmodified (never a relocation destination). They are shared, not
        copied: each gets one more reference.
        """
        self.registry.check_new(req)
        S = self.S
        prefix = as_index_array("prefix_blocks", prefix_blocks if prefix_blocks is not None else [])
        self.shared.check_prefix(prefix)
        row = self.registry.add(req)
        if row >= self.arena.num_rows():
            self.arena.grow_rows()
            self._nlive = np.concatenate([self._nlive, np.zeros_like(self._nlive)])
        self._nlive[row] = 0
        n = len(prefix) * S
        self.arena.open(row, n)
        self.lists.open(row, req)
        self.journal.emit("add", row, req)
        if n:
            arena = self.arena
            base = int(arena.base[row])
            slots = (prefix[:, None] * S + np.arange(S)).reshape(-1).astype(np.int32)
            arena.slots[base : base + n] = slots
            arena.bits[base // 8 : base // 8 + n // 8] = 0xFF
            if n % 8:
                arena.bits[base // 8 + n // 8] = (1 << (n % 8)) - 1
            self.lists.claim(np.full(len(prefix), row, dtype=np.int64), np.arange(len(prefix)), prefix)
            arena.set_lengths(row, n)
            self._nlive[row] = n
            self.shared.attach(row, prefix)
            self.journal.emit("append", np.array([row], dtype=np.int64), np.array([n], dtype=np.int64), slots)

    def sync_new_tokens(self, req, n: int) -> Optional[np.ndarray]:
        """Assign slots to ``n`` appended tokens of ``req``; None if blocks ran out.

        Returns the new tokens' slots (int32, logical order): the slot mapping
        for their K/V writes. On ``None`` nothing changed.
        """
        check_int("n", n, min_value=0)
        return self.sync_new_tokens_batch([req], [n])

    def sync_new_tokens_batch(self, reqs, counts) -> Optional[np.ndarray]:
        """Batched :meth:`sync_new_tokens`: slots of every new token, request after request."""
        rows = self.rows_of(list(reqs))
        counts = as_index_array("counts", counts)
        if len(counts) != len(rows):
            raise InvalidArgumentError(f"counts: expected {len(rows)} entries (one per request), got {len(counts)}")
        if counts.size and counts.min() < 0:
            raise InvalidArgumentError(f"counts: expected values >= 0, got {counts[counts < 0][:8].tolist()}")
        if has_duplicates(rows):
            raise InvalidArgumentError("reqs: expected unique requests, got duplicates")
        return self._append(rows, counts)

    def _append(self, rows: np.ndarray, counts: np.ndarray) -> Optional[np.ndarray]:
        led, S = self.ledger, self.S
        if rows.size == 0 or int(counts.min()) == 0:
            keep = counts > 0
            rows, counts = rows[keep], counts[keep]
            if rows.size == 0:
                return np.zeros(0, dtype=np.int32)
        old_n = self.arena.ntok[rows]
        # The decode step appends one token per request: fewer, cheaper numpy passes.
        one_each = int(counts.max()) == 1
        if one_each:
            new_n = old_n + 1
            opens = old_n % S == 0  # the token opens a new block
            total_new_blocks = int(np.count_nonzero(opens))
        else:
            new_n = old_n + counts
            need = cdiv(new_n, S) - cdiv(old_n, S)
            opens = need > 0
            total_new_blocks = int(need.sum())
        if total_new_blocks > led.admission_free:
            return None
        grow = np.flatnonzero(new_n > self.arena.cap[rows])
        for i in grow.tolist():  # rare: amortized by 1/16 growth
            self.arena.ensure_capacity(int(rows[i]), int(new_n[i]))
        base = self.arena.base[rows]
        if total_new_blocks:
            if one_each:
                blk_rows, first = rows[opens], old_n[opens] // S
            else:
                blk_rows = np.repeat(rows, need)
                first = np.repeat(cdiv(old_n, S) - np.cumsum(need) + need, need) + np.arange(total_new_blocks)
            ids = led.allocate(total_new_blocks, blk_rows, first)
            assert ids is not None  # admission_free was checked above
            self.shared.moved_into[ids] = False
            self.lists.claim(blk_rows, first, ids)
        if one_each:
            tids = old_n
            g = base + tids
            blocks = self.lists.read(rows, tids // S)
        else:  # flat (row, token id) pairs for every new token
            tok_rows = np.repeat(np.arange(len(rows)), counts)
            starts = np.cumsum(counts) - counts
            tids = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts) + np.repeat(old_n, counts)
            g = base[tok_rows] + tids
            blocks = self.lists.read(rows[tok_rows], tids // S)
        slots = blocks * S + (tids % S).astype(np.int32)
        self.arena.slots[g] = slots
        if one_each:  # NOTE: segments are 64-token aligned, so one token per row never shares a byte
            self.arena.bits[g >> 3] |= (1 << (g & 7)).astype(np.uint8)
        else:
            np.bitwise_or.at(self.arena.bits, g >> 3, (1 << (g & 7)).astype(np.uint8))
        led.add_live(blocks)
        self._nlive[rows] += counts
        self.arena.set_lengths(rows, new_n)
        self.journal.emit("append", rows.copy(), counts.copy(), slots.copy())  # the caller keeps its arrays
        # A previous tail that became a non-tail with no live token is released now.
        was_full = opens & (old_n > 0) & (old_n % S == 0)
        if was_full.any():
            r = rows[was_full]
            prev = self.lists.read(r, cdiv(old_n[was_full], S) - 1)
            self._release_if_empty(r, prev)
        return slots

    def evict(self, req, token_ids, *, origin: str = "host") -> None:
        """Mark ``token_ids`` of ``req`` dead (batched; ``origin``: see :meth:`evict_flat`). Errors change nothing."""
        tids = as_index_array("token_ids", token_ids)
        row = self.row_of(req)
        self._evict(np.full(len(tids), row, dtype=np.int64), tids, runs=True, origin=origin)

    def evict_batch(self, reqs, token_ids_per_req) -> None:
        """Evict across requests in one vectorized pass."""
        reqs = _as_list("reqs", reqs)
        parts = _as_list("token_ids_per_req", token_ids_per_req)  # any iterable, generators included
        if len(reqs) != len(parts):
            raise InvalidArgumentError(
                f"token_ids_per_req: expected {len(reqs)} arrays (one per request), got {len(parts)}"
            )
        rows = self.rows_of(reqs)
        tids = None
        try:  # fast path: 1-D integer numpy arrays, validated in C-level passes
            kinds = {d.kind for d in set(map(_DTYPE, parts))}
            if kinds <= {"i"} and parts:  # NOTE: unsigned ids go the slow way, which names values >= 2**63
                tids = np.concatenate(parts)
        except (AttributeError, ValueError, TypeError):
            tids = None
        if tids is None or tids.ndim != 1 or tids.dtype.kind not in "iu":  # else per array, naming the bad one
            parts = [as_index_array(f"token_ids_per_req[{i}]", t) for i, t in enumerate(parts)]
            tids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        lens = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        self._evict(np.repeat(rows, lens), tids.astype(np.int64, copy=False), runs=not has_duplicates(rows))

    def evict_flat(self, reqs, token_ids, counts, *, origin: str = "host") -> None:
        """Evict across requests from one flat id array (the decode-step form).

        ``token_ids`` (int [sum(counts)]) holds ``counts[i]`` ids of ``reqs[i]`` after those of ``reqs[:i]``
        (CSR order, as a batched policy's top-k produces them): ``evict_flat(["a", "b"], [0, 5, 1], [2, 1])``.
        Same checks as :meth:`evict`, with O(1) Python work per call instead of O(len(reqs)).
        ``origin="device"``: a device decision loop already cleared these alive bits in its mirror, so
        the journal's event tells mirrors not to ship them back.
        """
        rows = self.rows_of(reqs)
        tids = as_index_array("token_ids", token_ids)
        counts = as_index_array("counts", counts)
        if len(counts) != len(rows):
            raise InvalidArgumentError(f"counts: expected {len(rows)} entries (one per request), got {len(counts)}")
        if counts.size and counts.min() < 0:
            raise InvalidArgumentError(f"counts: expected values >= 0, got {counts[counts < 0][:8].tolist()}")
        if int(counts.sum()) != len(tids):
            raise InvalidArgumentError(f"token_ids: expected sum(counts) = {int(counts.sum())} ids, got {len(tids)}")
        if has_duplicates(rows):
            self._evict(np.repeat(rows, counts), tids, origin=origin)
        else:
            self._evict(np.repeat(rows, counts), tids, runs=True, run_rows=rows, run_counts=counts, origin=origin)

    def _evict(self, rows: np.ndarray, tids: np.ndarray, runs: bool = False, run_rows: Optional[np.ndarray] = None,
               run_counts: Optional[np.ndarray] = None, origin: str = "host") -> None:
        """Evict (rows[i], tids[i]) pairs; ``runs``: each row's pairs are one contiguous run.

        NOTE: with ``runs`` and ids ascending within each run (what np.nonzero or
        a sorted top-k gives), uniqueness is one comparison pass and the alive
        bits of a byte are grouped, so no sort and no ufunc.at on the bits;
        anything else takes one sort (33 us for 2048 ids on this 2-core VM).
        """
        if origin not in EVICT_ORIGINS:
            raise InvalidArgumentError(f"origin: expected one of {EVICT_ORIGINS}, got {origin!r}")
        if tids.size == 0:
            return
        led, S = self.ledger, self.S
        ntok = self.arena.ntok[rows]
        bad = (tids < 0) | (tids >= ntok)
        if bad.any():
            raise InvalidArgumentError(
                f"token_ids: expected ids in [0, num_tokens), got {tids[bad][:8].tolist()} "
                f"(num_tokens {ntok[bad][:8].tolist()})"
            )
        g = self.arena.base[rows] + tids
        grouped = runs and bool(((tids[1:] > tids[:-1]) | (rows[1:] != rows[:-1])).all())
        if not grouped and has_duplicates(g):
            sg = np.sort(g)
            raise InvalidArgumentError(
                f"token_ids: expected unique ids, got duplicates of {tids[np.isin(g, sg[1:][sg[1:] == sg[:-1]])][:8].tolist()}"
            )
        byte, bit = g >> 3, _BIT[g & 7]
        alive = (self.arena.bits[byte] & bit) != 0
        if not alive.all():
            raise InvalidArgumentError(f"token_ids: expected live tokens, got already-evicted ids {tids[~alive][:8].tolist()}")
        # --- validated: mutate -------------------------------------------
        self.journal.emit("evict", rows.copy(), tids.copy(), origin)
        mask = ~bit
        if grouped:  # equal bytes are adjacent (segments are byte-aligned): combine their masks
            same = byte[1:] == byte[:-1]
            if same.any():
                first = np.flatnonzero(np.concatenate(([True], ~same)))
                byte, mask = byte[first], np.bitwise_and.reduceat(mask, first)
            self.arena.bits[byte] &= mask
        else:
            np.bitwise_and.at(self.arena.bits, byte, mask)
        if run_rows is not None:  # unique rows with their counts: no scatter-add needed
            self._nlive[run_rows] -= run_counts
        else:
            np.subtract.at(self._nlive, rows, 1)
        blocks = self.arena.slots[g].astype(np.int64) // S
        shared = led.state[blocks] == SHARED
        if shared.any():
            sh_pairs = np.unique(np.stack([rows[shared], blocks[shared]]), axis=1)
            for b in np.unique(sh_pairs[1]).tolist():
                self.shared.refresh(b)
            blocks = blocks[~shared]
        led.remove_live(blocks)
        emptied = blocks[led.live[blocks] == 0]
        if emptied.size:
            emptied = np.unique(emptied)
            self._release_if_empty(led.owner[emptied].astype(np.int64), emptied)
        if shared.any():  # a holder with nothing left in a shared block drops its reference
            self._release_if_empty(sh_pairs[0], sh_pairs[1])


    def _release_if_empty(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """Release each (row, block) pair where the row keeps nothing alive and the block is not its tail."""
        led, S = self.ledger, self.S
        rows = np.asarray(rows, dtype=np.int64)
        blocks = np.asarray(blocks, dtype=np.int64)
        candidate = (blocks != NULL_BLOCK) & (led.pos[blocks] != self.arena.tail_pos(rows))
        state = led.state[blocks]
        private = candidate & (state == OWNED) & (led.owner[blocks] == rows) & (led.live[blocks] == 0)
        shared = candidate & (state == SHARED)
        # Shared pairs are rare (prefix blocks): per pair, with the holder's own alive bits.
        for row, b in zip(rows[shared].tolist(), blocks[shared].tolist()):
            if self.shared.holder_keeps_nothing(row, b):
                self.lists.write(np.array([row]), np.array([int(led.pos[b])]), NULL_BLOCK)
                self._drop_shared(row, b)
        if private.any():
            ids = blocks[private]
            self.lists.write(rows[private], led.pos[ids], NULL_BLOCK)
            led.release(ids)

    def _drop_shared(self, row: int, block: int) -> None:
        """``row`` lets go of shared ``block``; a last holder left with nothing in it releases it too."""
        if self.shared.drop(row, block):
            self._release_if_empty(np.array([int(self.ledger.owner[block])]), np.array([block]))

    # ------------------------------------------------------------ blocks
    def tail_block_ids(self) -> np.ndarray:
        """The tail block of every registered request that has one (int64)."""
        rows = np.flatnonzero(self.arena.in_use & (self.arena.ntok > 0))
        tails = self.lists.read(rows, self.arena.tail_pos(rows))
        return tails[tails != NULL_BLOCK].astype(np.int64)

    def is_alive(self, req, token_ids) -> np.ndarray:
        """Alive bits of ``token_ids`` of ``req`` (bool, validated ids)."""
        row = self.row_of(req)
        tids = as_index_array("token_ids", token_ids)
        self.arena.check_token_ids(row, tids)
        return self.arena.alive(int(self.arena.base[row]) + tids)

    def finish(self, req) -> np.ndarray:
        """Drop ``req``: free every block it owns, unreference shared ones. Returns the freed ids."""
        row = self.row_of(req)
        led = self.ledger
        listed, inflight, shared = leaving_blocks(self.lists, led, row, self.arena.num_list_blocks(row))
        private = np.concatenate([listed, inflight])
        for b in shared:
            self._drop_shared(row, b)
        led.release(private)
        self.lists.close(row)
        self.arena.close(row)
        self._nlive[row] = 0
        self.journal.emit("finish", row)
        self.registry.remove(req)
        return private.astype(np.int32)


    # ------------------------------------------------------------------ reads
    def num_tokens(self, req) -> int:
        return int(self.arena.ntok[self.row_of(req)])

    def live_count(self, req) -> int:
        return int(self._nlive[self.row_of(req)])

    def live_mask(self, req) -> np.ndarray:
        row = self.row_of(req)
        return self.arena.alive_range(row, 0, int(self.arena.ntok[row]))

    def live_ids(self, req) -> np.ndarray:
        """Live logical token ids of ``req``, ascending (int64)."""
        return np.nonzero(self.live_mask(req))[0]

    def live_slots(self, req) -> np.ndarray:
        """Slots of the live tokens of ``req`` in logical order (int32)."""
        row = self.row_of(req)
        base, n = int(self.arena.base[row]), int(self.arena.ntok[row])
        return self.arena.slots[base : base + n][self.arena.alive_range(row, 0, n)].copy()

    def slots(self, req) -> np.ndarray:
        """Every token's slot (dead ones: the slot they died in), a copy."""
        row = self.row_of(req)
        base, n = int(self.arena.base[row]), int(self.arena.ntok[row])
        return self.arena.slots[base : base + n].copy()

    def block_list(self, req) -> np.ndarray:
        """The request's block list (null block at released positions), a copy."""
        row = self.row_of(req)
        return np.array(self.lists.row(row, self.arena.num_list_blocks(row)), dtype=np.int32)

    def held_blocks(self, req) -> int:
        """Blocks the request still references (private and shared)."""
        return int(np.count_nonzero(self.block_list(req)))

    def tail_block(self, req) -> int:
        rows = np.array([self.row_of(req)])
        return int(self.lists.read(rows, self.arena.tail_pos(rows))[0]) if self.arena.ntok[rows[0]] else NULL_BLOCK

    def nbytes(self) -> int:
        """Bytes of table metadata: the arenas (slack included) plus per-request rows."""
        return self.arena.nbytes() + self._nlive.nbytes

    def total_tokens(self) -> int:
        return int(self.arena.ntok[self.arena.in_use].sum())


    # ------------------------------------------------------------- checking
    def snapshot(self) -> dict:
        """A deep copy of all state, for bit-identical comparisons: :func:`vtoken.bookkeeping.invariants.table_snapshot`."""
        from vtoken.bookkeeping.invariants import table_snapshot

        return table_snapshot(self)

    def check_invariants(self) -> None:
        """Conservation, I2 (unique mapping) and live counts vs a recount: :func:`vtoken.bookkeeping.invariants.check_table`."""
        from vtoken.bookkeeping.invariants import check_table

        check_table(self)
