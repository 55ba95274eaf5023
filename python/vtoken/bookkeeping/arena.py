"""SegmentArena: the token table's storage, one segment per request row.

Three numpy arenas shared by all requests, so that per-step operations over a
whole batch are a handful of vectorized numpy calls with no per-token (or
per-request) Python work:

- ``slots``  int32 [arena]        4 bytes / token
- ``bits``   uint8 [arena / 8]    alive bits, 1/8 byte / token
- ``blocks`` int32 [arena / S]    block lists, 4/S bytes / token (``None`` when
  an engine keeps the block lists itself: :mod:`vtoken.bookkeeping.block_lists`)

A row owns one segment ``[base, base+cap)`` of the arena (base and cap are
multiples of lcm(64, S), so its bits start on a byte and its block list on a
block); a segment that must grow is extended in place when it is last, else
moved to the end, and the arena is compacted when dead segments exceed 1/8 of
it, and always before it would grow. Segments grow by 1/16 and the arena by
1/32, so metadata stays <= 5 bytes per token: 4.375 at S=16 times at most
1.0625 * 1.03125 (4.79), plus one 64-token rounding per request.

Ownership: the arena owns the geometry (``base``, ``cap``, ``ntok``, the
arena's end and garbage) and moves segments; the :class:`vtoken.bookkeeping.table.TokenTable`
owns what the segments hold (it writes ``slots`` / ``bits`` within a row's
``[base, base + ntok)``, and ``blocks`` through
:class:`vtoken.bookkeeping.block_lists.ArenaBlockLists`).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from vtoken import PAD_SLOT, cdiv
from vtoken.errors import InvalidArgumentError
from vtoken.bookkeeping.pool import NULL_BLOCK

_ROW_ARRAYS = ("base", "cap", "ntok", "in_use")


class SegmentArena:
    """Per-row segments of slots, alive bits and block lists. See the module docstring."""

    def __init__(self, block_size: int, *, initial_tokens: int = 1 << 16, initial_rows: int = 64,
                 block_lists: bool = True):
        self.S = int(block_size)
        self.gran = math.lcm(64, self.S)
        cap = self.round(max(initial_tokens, self.gran))
        self.slots = np.full(cap, PAD_SLOT, dtype=np.int32)
        self.bits = np.zeros(cap // 8, dtype=np.uint8)
        self.blocks = np.zeros(cap // self.S, dtype=np.int32) if block_lists else None
        self.end = 0  # first arena position no segment uses
        self.garbage = 0  # arena positions held by dead segments
        self.base = np.zeros(initial_rows, dtype=np.int64)
        self.cap = np.zeros(initial_rows, dtype=np.int64)
        self.ntok = np.zeros(initial_rows, dtype=np.int64)
        self.in_use = np.zeros(initial_rows, dtype=bool)

    # ------------------------------------------------------------------ rows
    def round(self, n: int) -> int:
        return cdiv(int(n), self.gran) * self.gran

    def num_rows(self) -> int:
        return len(self.base)

    def grow_rows(self) -> None:
        """Double the row space (new rows are unused)."""
        for name in _ROW_ARRAYS:
            arr = getattr(self, name)
            setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))

    def open(self, row: int, tokens: int) -> None:
        """Give unused ``row`` an empty segment with room for ``tokens``."""
        self.in_use[row] = True
        self.base[row] = self.end
        self.cap[row] = 0
        self.ntok[row] = 0
        self.ensure_capacity(row, max(tokens, self.gran))

    def close(self, row: int) -> None:
        """Drop ``row``'s segment (it becomes garbage, or is trimmed when last)."""
        cap = int(self.cap[row])
        self.garbage += cap
        if int(self.base[row]) + cap == self.end:
            self.end -= cap
            self.garbage -= cap
            self._clear(self.end, self.end + cap)
        self.in_use[row] = False
        self.ntok[row] = self.cap[row] = 0

    def set_lengths(self, rows: np.ndarray, ntok: np.ndarray) -> None:
        """Record the rows' token counts (the caller ensured capacity)."""
        self.ntok[rows] = ntok

    # ----------------------------------------------------------------- reads
    def alive(self, g: np.ndarray) -> np.ndarray:
        """Alive bits at arena positions ``g`` (bool)."""
        return ((self.bits[g >> 3] >> (g & 7).astype(np.uint8)) & 1).astype(bool)

    def alive_range(self, row: int, t0: int, n: int) -> np.ndarray:
        """Alive bits of ``row``'s tokens ``[t0, t0 + n)`` (bool)."""
        g0 = int(self.base[row]) + t0
        lo = g0 >> 3
        raw = np.unpackbits(self.bits[lo : cdiv(g0 + n, 8)], bitorder="little")
        return raw[g0 - lo * 8 : g0 - lo * 8 + n].astype(bool)

    def num_list_blocks(self, row: int) -> int:
        """Length of ``row``'s block list: ``ceil(ntok / S)``."""
        return cdiv(int(self.ntok[row]), self.S)

    def growth_blocks(self, steps: int) -> int:
        """Blocks the rows in use would open if each appended ``steps`` more tokens (O(rows)).

        The reclamation trigger's projection of the running requests' demand:
        token ``t`` of a row lives in block ``t // S`` of its list, so growing
        from ``n`` to ``n + steps`` tokens opens ``cdiv(n + steps, S) - cdiv(n, S)``.
        """
        n = self.ntok[self.in_use]
        return int((cdiv(n + steps, self.S) - cdiv(n, self.S)).sum())

    def tail_pos(self, rows):
        """Block-list position of the rows' tail blocks (-1 for an empty row)."""
        return cdiv(self.ntok[rows], self.S) - 1

    def check_token_ids(self, row: int, tids: np.ndarray, arg: str = "token_ids") -> None:
        """Raise unless every id in ``tids`` is one of ``row``'s tokens."""
        n = int(self.ntok[row])
        if tids.size and (tids.min() < 0 or tids.max() >= n):
            bad = tids[(tids < 0) | (tids >= n)]
            raise InvalidArgumentError(f"{arg}: expected ids in [0, {n}), got {bad[:8].tolist()}")

    def nbytes(self) -> int:
        arenas = self.slots.nbytes + self.bits.nbytes + (0 if self.blocks is None else self.blocks.nbytes)
        return arenas + sum(getattr(self, n).nbytes for n in _ROW_ARRAYS)

    # ----------------------------------------------------------------- growth
    def ensure_capacity(self, row: int, need: int) -> None:
        """Give ``row`` room for ``need`` tokens (contents preserved, new room clean)."""
        cap = int(self.cap[row])
        if need <= cap:
            return
        new_cap = self.round(max(need, cap + cap // 16))
        base = int(self.base[row])
        last = base + cap == self.end and cap > 0
        # NOTE: before the arena grows, compact with this segment placed last, so
        # that it grows in place: neither dead segments nor a moved segment's old
        # copy may add to the arena, or the slacks compound to ~6.4 bytes/token
        # at S=16 (measured growing 8 interleaved requests to 64K tokens).
        grows = (base if last else self.end) + new_cap > len(self.slots)
        if (grows and (self.garbage or (cap > 0 and not last))) or self.garbage > max(self.end // 8, self.gran):
            self._compact(last_row=row if cap > 0 else None)
            return self.ensure_capacity(row, need)
        if last:
            self._grow_arena(base + new_cap)
            self._clear(base + cap, base + new_cap)
            self.cap[row] = new_cap
            self.end = base + new_cap
            return
        new_base = self.end
        self._grow_arena(new_base + new_cap)
        n = int(self.ntok[row])
        self._copy_segment(base, new_base, n)
        self._clear(new_base + n, new_base + new_cap)
        self.garbage += cap
        self.base[row] = new_base
        self.cap[row] = new_cap
        self.end = new_base + new_cap

    def _grow_arena(self, need: int) -> None:
        size = len(self.slots)
        if need <= size:
            return
        new = self.round(max(need, size + size // 32))
        self.slots = np.concatenate([self.slots, np.full(new - size, PAD_SLOT, dtype=np.int32)])
        self.bits = np.concatenate([self.bits, np.zeros((new - size) // 8, dtype=np.uint8)])
        if self.blocks is not None:
            self.blocks = np.concatenate([self.blocks, np.zeros((new - size) // self.S, dtype=np.int32)])

    def _clear(self, lo: int, hi: int) -> None:
        """Reset arena positions [lo, hi); ``hi`` is a multiple of lcm(8, S).

        NOTE: ``lo`` may be unaligned (the end of a segment's tokens after a
        move), so the byte holding bit ``lo`` keeps its lower bits and the
        block-list entry covering ``lo`` (the segment's tail block) is kept.
        """
        self.slots[lo:hi] = PAD_SLOT
        if lo % 8:
            self.bits[lo // 8] &= np.uint8((1 << (lo % 8)) - 1)
        self.bits[cdiv(lo, 8) : cdiv(hi, 8)] = 0
        if self.blocks is not None:
            self.blocks[cdiv(lo, self.S) : cdiv(hi, self.S)] = NULL_BLOCK

    def _copy_segment(self, src: int, dst: int, n: int) -> None:
        self.slots[dst : dst + n] = self.slots[src : src + n]
        self.bits[dst // 8 : dst // 8 + cdiv(n, 8)] = self.bits[src // 8 : src // 8 + cdiv(n, 8)]
        if self.blocks is not None:
            nb = cdiv(n, self.S)
            self.blocks[dst // self.S : dst // self.S + nb] = self.blocks[src // self.S : src // self.S + nb]

    def _compact(self, last_row: Optional[int] = None) -> None:
        """Slide live segments down over dead ones, in base order; ``last_row`` goes last.

        Putting the segment about to grow last lets it grow in place: moving it
        instead would leave its old copy behind as garbage.
        """
        S = self.S
        rows = np.nonzero(self.in_use)[0]
        rows = rows[np.argsort(self.base[rows], kind="stable")]
        saved = None
        if last_row is not None:
            rows = rows[rows != last_row]
            base, n = int(self.base[last_row]), int(self.ntok[last_row])
            saved = (self.slots[base : base + n].copy(), self.bits[base // 8 : base // 8 + cdiv(n, 8)].copy(),
                     None if self.blocks is None else self.blocks[base // S : base // S + cdiv(n, S)].copy())
        pos = 0
        for row in rows.tolist():
            base, cap, n = int(self.base[row]), int(self.cap[row]), int(self.ntok[row])
            if base != pos:
                self._copy_segment(base, pos, n)
                self._clear(pos + n, pos + cap)
                self.base[row] = pos
            pos += cap
        if saved is not None:
            slots, bits, blocks = saved
            n, cap = len(slots), int(self.cap[last_row])
            self._clear(pos, max(pos + cap, self.end))
            self.slots[pos : pos + n] = slots
            self.bits[pos // 8 : pos // 8 + len(bits)] = bits
            if blocks is not None:
                self.blocks[pos // S : pos // S + len(blocks)] = blocks
            self.base[last_row] = pos
            pos += cap
        self._clear(pos, self.end)
        self.end = pos
        self.garbage = 0
