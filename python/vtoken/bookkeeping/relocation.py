"""RelocationTransitions: the token table's side of a relocation plan (the reclaimer's calls).

A plan moves the live tokens of a request's sparse private blocks into fewer
fresh blocks. Its block transitions, each validated before anything changes:

- :meth:`begin_relocation`: sources OWNED -> SRC_INFLIGHT (never released by
  Naive-Evict while in flight);
- :meth:`apply_moves` (the commit): tokens take their new slots, emptied
  sources are released and destinations take their block-list positions;
- :meth:`end_relocation` / :meth:`release_destinations` (abort, or leftovers
  after a partial commit).

The transitions own no state: they change the table's arena, block lists and
ledger through the table, and record moves in its journal.
"""
from __future__ import annotations

import numpy as np

from vtoken import cdiv
from vtoken.errors import InvalidArgumentError, as_index_array, has_duplicates
from vtoken.bookkeeping.ledger import DST_INFLIGHT, OWNED, SHARED, SRC_INFLIGHT, STATE_NAMES
from vtoken.bookkeeping.pool import NULL_BLOCK

_PRIVATE_STATES = (OWNED, SRC_INFLIGHT)


class RelocationTransitions:
    """Relocation transitions of one :class:`vtoken.bookkeeping.table.TokenTable`."""

    def __init__(self, table):
        self.table = table

    def apply_moves(self, req, token_ids, new_slots) -> np.ndarray:
        """Move live tokens of ``req`` to ``new_slots`` (the reclaimer's commit).

        Validated: the tokens are live, unique, not in shared blocks; the new
        slots are unique, lie in blocks the request owns (OWNED, or
        DST_INFLIGHT reserved for it) and hold no live token of the request.
        Destination blocks not yet in the block list take the positions of the
        source blocks this call empties, first positions first. Returns the
        ids of the blocks released.
        """
        t = self.table
        row = t.row_of(req)
        led, S = t.ledger, t.S
        tids = as_index_array("token_ids", token_ids)
        dst = as_index_array("new_slots", new_slots)
        if len(tids) != len(dst):
            raise InvalidArgumentError(f"new_slots: expected {len(tids)} slots (one per token), got {len(dst)}")
        if tids.size == 0:
            return np.zeros(0, dtype=np.int32)
        t.arena.check_token_ids(row, tids)
        if has_duplicates(tids):
            raise InvalidArgumentError("token_ids: expected unique ids, got duplicates")
        g = int(t.arena.base[row]) + tids
        alive = t.arena.alive(g)
        if not alive.all():
            raise InvalidArgumentError(f"token_ids: expected live tokens, got dead ids {tids[~alive][:8].tolist()}")
        nslots = led.num_blocks * S
        if dst.min() < S or dst.max() >= nslots:
            raise InvalidArgumentError(f"new_slots: expected slots in [{S}, {nslots}), got out-of-range values")
        if has_duplicates(dst):
            raise InvalidArgumentError("new_slots: expected unique slots, got duplicates")
        src_blocks = t.arena.slots[g] // S
        if (led.state[src_blocks] == SHARED).any():
            raise InvalidArgumentError("token_ids: expected tokens in private blocks, got tokens in shared blocks")
        dst_blocks = dst // S
        # SRC_INFLIGHT destinations: the fill blocks of a hole-filling plan (vtoken.reclamation.hole_planner).
        ok = np.isin(led.state[dst_blocks], (OWNED, DST_INFLIGHT, SRC_INFLIGHT)) & (led.owner[dst_blocks] == row)
        if not ok.all():
            raise InvalidArgumentError(
                f"new_slots: expected slots in blocks owned by request {req!r}, got foreign blocks "
                f"{np.unique(dst_blocks[~ok])[:8].tolist()}"
            )
        n = int(t.arena.ntok[row])
        base = int(t.arena.base[row])
        # NOTE: the tail's offsets past the last token are reserved for future
        # appends (sync_new_tokens writes token t at offset t % S), so they are
        # never free destinations.
        tail_pos = cdiv(n, S) - 1
        future = (dst_blocks == t.tail_block(req)) & (dst % S >= n - tail_pos * S)
        if future.any():
            raise InvalidArgumentError(
                f"new_slots: expected empty slots, got tail-block slots reserved for future tokens "
                f"{dst[future][:8].tolist()}"
            )
        # NOTE: a DST_INFLIGHT block never holds a live token (only this call
        # moves tokens into it, and that makes it OWNED), so only slots in OWNED
        # blocks need the O(live tokens) occupancy check: a reclaimer commit,
        # whose destinations are all fresh, skips it.
        in_owned = np.isin(led.state[dst_blocks], _PRIVATE_STATES)
        if in_owned.any():
            row_live = t.arena.slots[base : base + n][t.arena.alive_range(row, 0, n)]
            occupied = np.isin(dst[in_owned], row_live)
            if occupied.any():
                raise InvalidArgumentError(
                    f"new_slots: expected empty slots, got occupied slots {dst[in_owned][occupied][:8].tolist()}"
                )
        # Which sources end up empty, and are there positions for new destinations?
        involved = np.union1d(src_blocks, dst_blocks)
        delta = np.zeros(len(involved), dtype=np.int64)
        np.subtract.at(delta, np.searchsorted(involved, src_blocks), 1)
        np.add.at(delta, np.searchsorted(involved, dst_blocks), 1)
        live_after = led.live[involved] + delta
        tail = int(t.arena.tail_pos(row))
        emptied = involved[
            (live_after == 0) & np.isin(led.state[involved], _PRIVATE_STATES) & (led.pos[involved] != tail)
        ]
        new_dst = np.unique(dst_blocks[led.state[dst_blocks] == DST_INFLIGHT])
        if len(new_dst) > len(emptied):
            raise InvalidArgumentError(
                f"new_slots: expected at most {len(emptied)} new destination blocks (one per emptied source), "
                f"got {len(new_dst)}"
            )
        # --- validated: mutate -------------------------------------------
        led.remove_live(src_blocks)
        led.add_live(dst_blocks)
        t.shared.moved_into[dst_blocks] = True
        t.journal.emit("move", row, tids.copy(), t.arena.slots[g], dst.astype(np.int32))
        t.arena.slots[g] = dst.astype(np.int32)
        positions = np.sort(led.pos[emptied])
        ids = emptied.astype(np.int64)
        led.release(ids)
        t.lists.write(np.full(len(positions), row, dtype=np.int64), positions, NULL_BLOCK)
        if len(new_dst):
            # Destinations in logical order of their first token take the first positions.
            k = np.minimum(np.searchsorted(new_dst, dst_blocks), len(new_dst) - 1)
            hit = new_dst[k] == dst_blocks
            first_use = np.full(len(new_dst), np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(first_use, k[hit], tids[hit])
            new_dst = new_dst[np.argsort(first_use, kind="stable")]
            p = positions[: len(new_dst)]
            t.lists.write(np.full(len(p), row, dtype=np.int64), p, new_dst)
            led.place(new_dst, p)
            led.set_state(new_dst.astype(np.int64), OWNED)
        return ids.astype(np.int32)

    def relocation_candidates(self, req) -> tuple[np.ndarray, np.ndarray]:
        """Blocks of ``req`` a plan may use as sources, in block-list order.

        Private (OWNED: ref == 1, not in flight), not the tail, not released.
        Returns ``(blocks int32 [n], live int32 [n])``.
        """
        t = self.table
        row = t.row_of(req)
        led = t.ledger
        blist = t.lists.row(row, t.arena.num_list_blocks(row))[:-1]
        b = blist[blist != NULL_BLOCK]
        b = b[led.state[b] == OWNED]
        return b.astype(np.int32), led.live[b].astype(np.int32)

    def fill_candidates(self, req):
        """What a hole-filling plan of ``req`` may use (:func:`vtoken.reclamation.hole_planner.select_fill`).

        Returns ``(blocks int32 [n], live int32 [n], fillable bool [n], tail_block, tail_holes,
        tail_cursor)``: the sources' candidates (:meth:`relocation_candidates`), which of them
        may take moved tokens (not prefix-cache readable), and the tail block as a fill block
        (``tail_block`` 0 when it is not private or has no hole below its write cursor).
        """
        t = self.table
        row = t.row_of(req)
        led, S = t.ledger, t.S
        blocks, live = self.relocation_candidates(req)
        fillable = ~t.shared.hit_readable[blocks]
        n = int(t.arena.ntok[row])
        tail = t.tail_block(req)
        cursor = n - (cdiv(n, S) - 1) * S if n else 0
        holes = cursor - int(led.live[tail]) if tail != NULL_BLOCK else 0
        if tail == NULL_BLOCK or led.state[tail] != OWNED or t.shared.hit_readable[tail] or holes <= 0:
            return blocks, live, fillable, 0, 0, 0
        return blocks, live, fillable, tail, holes, cursor

    def _blocks_of(self, arg: str, blocks, req, state: int) -> np.ndarray:
        """``blocks`` as unique int64 ids of blocks in ``state`` that ``req`` owns, or raise naming ``arg``."""
        t = self.table
        row = t.row_of(req)
        led = t.ledger
        b = as_index_array(arg, blocks)
        if b.size == 0:
            return b
        if b.min() < 1 or b.max() >= led.num_blocks:
            raise InvalidArgumentError(f"{arg}: expected ids in [1, {led.num_blocks}), got out-of-range ids")
        if len(np.unique(b)) != len(b):
            raise InvalidArgumentError(f"{arg}: expected unique ids, got duplicates")
        ok = (led.state[b] == state) & (led.owner[b] == row)
        if not ok.all():
            raise InvalidArgumentError(
                f"{arg}: expected {STATE_NAMES[state]} blocks of request {req!r}, got {b[~ok][:8].tolist()}"
            )
        return b

    def begin_relocation(self, req, src_blocks) -> None:
        """Mark ``src_blocks`` of ``req`` SRC_INFLIGHT (sources of a launched plan).

        Validated: unique, OWNED by ``req`` and not its tail. While in flight a
        source is never released by Naive-Evict, even if it empties.
        """
        t = self.table
        led = t.ledger
        b = self._blocks_of("src_blocks", src_blocks, req, OWNED)
        if b.size == 0:
            return
        tail = t.tail_block(req)
        if (b == tail).any():
            raise InvalidArgumentError(f"src_blocks: expected non-tail blocks, got the tail block {tail}")
        led.set_state(b, SRC_INFLIGHT)

    def begin_fill(self, req, fill_blocks) -> None:
        """Mark the fill blocks of ``req``'s hole-filling plan SRC_INFLIGHT (the tail included).

        NOTE: a fill block that empties while the copy into its holes is in
        flight (evictions; or the tail, once appends move past it) must not be
        released: SRC_INFLIGHT blocks never are. :meth:`end_relocation` returns
        them to OWNED (releasing an empty non-tail one then).
        """
        b = self._blocks_of("fill_blocks", fill_blocks, req, OWNED)
        if b.size:
            self.table.ledger.set_state(b, SRC_INFLIGHT)

    def end_relocation(self, req, src_blocks) -> np.ndarray:
        """Return ``req``'s still-in-flight ``src_blocks`` to OWNED (abort, or after a commit).

        Blocks a commit already freed are skipped. A returned source left with
        no live token (every token in it died while it was in flight) is
        released now, as Naive-Evict would have done. Returns the released ids.
        """
        t = self.table
        row = t.row_of(req)
        led = t.ledger
        b = as_index_array("src_blocks", src_blocks)
        if b.size and (b.min() < 1 or b.max() >= led.num_blocks):
            raise InvalidArgumentError(f"src_blocks: expected ids in [1, {led.num_blocks}), got out-of-range ids")
        b = np.unique(b)
        b = b[(led.state[b] == SRC_INFLIGHT) & (led.owner[b] == row)]
        if b.size == 0:
            return np.zeros(0, dtype=np.int32)
        led.set_state(b, OWNED)
        empty = b[led.live[b] == 0]
        if empty.size:
            t._release_if_empty(np.full(len(empty), row, dtype=np.int64), empty)
        return empty.astype(np.int32)

    def release_destinations(self, req, dst_blocks) -> None:
        """Free ``req``'s DST_INFLIGHT blocks that a commit did not place (abort, unused)."""
        b = self._blocks_of("dst_blocks", dst_blocks, req, DST_INFLIGHT)
        if b.size:
            self.table.ledger.release(b)