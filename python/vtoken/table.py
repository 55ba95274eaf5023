"""TokenTable: per-request logical token -> slot mapping with alive bits.

For every request and every logical token id ``t`` (its RoPE position, never
reused) the table stores the token's current slot (int32 ``block*S+offset``)
and an alive bit. A dead token keeps the slot it died in; that value is
history only and is never dereferenced once its block is freed. Each request
also has a block list (like vLLM's block table): position ``p`` covers logical
tokens ``[p*S, (p+1)*S)`` at allocation time, and a freed position holds the
null block, so ``len(block list) == ceil(num_tokens / S)`` always holds.

Storage is three numpy arenas shared by all requests, so that per-step
operations over a whole batch are a handful of vectorized numpy calls with no
per-token (or per-request) Python work:

- ``_slots``  int32 [arena]        4 bytes / token
- ``_bits``   uint8 [arena / 8]    alive bits, 1/8 byte / token
- ``_blocks`` int32 [arena / S]    block lists, 4/S bytes / token

A request owns one segment ``[base, base+cap)`` of the arena (base and cap are
multiples of lcm(64, S), so its bits start on a byte and its block list on a
block); a segment that must grow is extended in place when it is last, else
moved to the end, and the arena is compacted when dead segments exceed 1/8 of
it, and always before it would grow. Segments grow by 1/16 and the arena by
1/32, so metadata stays <= 5 bytes per token: 4.375 at S=16 times at most
1.0625 * 1.03125 (4.79), plus one 64-token rounding per request.

Naive-Evict semantics are built in: a non-tail block in which a request has no
live token left is released at once (freed if private, unreferenced if shared).

Every public call validates all of its input before it changes anything, so a
rejected call leaves the table and the ledger bit-identical.
"""
from __future__ import annotations

import math
import operator
from typing import Hashable, Optional

import numpy as np

from vtoken import PAD_SLOT
from vtoken.errors import InvalidArgumentError, InvariantViolation, UnknownRequestError, as_index_array
from vtoken.ledger import DST_INFLIGHT, FREE, OWNED, SHARED, SRC_INFLIGHT, BlockLedger
from vtoken.pool import NULL_BLOCK

PAD = PAD_SLOT
_PRIVATE_STATES = (OWNED, SRC_INFLIGHT)


_DTYPE = operator.attrgetter("dtype")
# NOTE: ufunc.at on an int32 array with a Python-int operand takes numpy's slow
# casting path (227 us vs 3.6 us for 2048 indices, numpy 2.4): always pass _ONE.
_ONE = np.int32(1)
_BIT = (1 << np.arange(8)).astype(np.uint8)  # alive-bit masks by offset in the byte: one gather, no casts


def _has_duplicates(a: np.ndarray) -> bool:
    """Whether ``a`` repeats a value.

    NOTE: np.unique is hash-based in numpy 2.x and several times slower than a
    sort on the small arrays of a decode step; strictly increasing input (the
    common case) costs a single comparison pass.
    """
    if len(a) < 2 or (a[1:] > a[:-1]).all():
        return False
    s = np.sort(a)
    return bool((s[1:] == s[:-1]).any())


def _cdiv(a, b):
    return -(-a // b)


class TokenTable:
    """Token tables of every request over one :class:`BlockLedger`.

    Example:
        >>> from vtoken.pool import BlockPool
        >>> from vtoken.ledger import BlockLedger
        >>> table = TokenTable(BlockLedger(BlockPool(64), block_size=16))
        >>> table.add_request("a")
        >>> table.sync_new_tokens("a", 40).tolist()[:3]
        [16, 17, 18]
        >>> table.evict("a", [0, 1, 2]); table.live_count("a")
        37
    """

    def __init__(self, ledger: BlockLedger, *, initial_tokens: int = 1 << 16):
        self.ledger = ledger
        self.S = ledger.block_size
        self._gran = math.lcm(64, self.S)
        cap = self._round(max(initial_tokens, self._gran))
        self._slots = np.full(cap, PAD, dtype=np.int32)
        self._bits = np.zeros(cap // 8, dtype=np.uint8)
        self._blocks = np.zeros(cap // self.S, dtype=np.int32)
        self._end = 0  # first arena position no segment uses
        self._garbage = 0  # arena positions held by dead segments
        nrows = 64
        self._base = np.zeros(nrows, dtype=np.int64)
        self._cap = np.zeros(nrows, dtype=np.int64)
        self._ntok = np.zeros(nrows, dtype=np.int64)
        self._nlive = np.zeros(nrows, dtype=np.int64)
        self._in_use = np.zeros(nrows, dtype=bool)
        self._rows: dict[Hashable, int] = {}
        self._row_req: list = [None] * nrows
        self._free_rows: list[int] = list(range(nrows - 1, -1, -1))
        # NOTE: a row and an id can both be reused (finish, then add_request of the
        # same id); the registration number tells a holder of an old (req, row)
        # pair, such as a relocation plan, that it is stale.
        self._registrations = 0
        self._generation: dict[Hashable, int] = {}
        # NOTE: blocks that received moved tokens since the table allocated them.
        # A move may land on a dead token's slot, overwriting K/V that a shared
        # prefix would still need, while the slot table looks unmodified; such
        # blocks are never accepted as prefix blocks.
        self._moved_into = np.zeros(ledger.num_blocks, dtype=bool)

    # ------------------------------------------------------------------ rows
    def _round(self, n: int) -> int:
        return _cdiv(int(n), self._gran) * self._gran

    def row_of(self, req) -> int:
        """The internal row index of ``req`` (stable while the request lives)."""
        try:
            return self._rows[req]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"req: expected a registered request, got {req!r}") from None

    def rows_of(self, reqs) -> np.ndarray:
        """Rows of ``reqs`` (int64), one C-level lookup pass; unknown ids raise UnknownRequestError."""
        reqs = list(reqs)
        if len(reqs) < 2:
            return np.array([self.row_of(r) for r in reqs], dtype=np.int64)
        try:
            return np.array(operator.itemgetter(*reqs)(self._rows), dtype=np.int64)
        except (KeyError, TypeError):
            for r in reqs:
                self.row_of(r)  # raises, naming the first unknown request
            raise

    def generation(self, req) -> int:
        """A number unique to this registration of ``req`` (a re-registered id gets a new one)."""
        self.row_of(req)
        return self._generation[req]

    def request_of(self, row: int):
        return self._row_req[row]

    def __contains__(self, req) -> bool:
        try:
            return req in self._rows
        except TypeError:
            return False

    def requests(self) -> list:
        return list(self._rows)

    def _new_row(self) -> int:
        if not self._free_rows:
            n = len(self._base)
            for name in ("_base", "_cap", "_ntok", "_nlive", "_in_use"):
                arr = getattr(self, name)
                setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))
            self._row_req.extend([None] * n)
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    # ----------------------------------------------------------------- arena
    def _ensure_capacity(self, row: int, need: int) -> None:
        """Give ``row`` room for ``need`` tokens (contents preserved, new room clean)."""
        cap = int(self._cap[row])
        if need <= cap:
            return
        new_cap = self._round(max(need, cap + cap // 16))
        base = int(self._base[row])
        last = base + cap == self._end and cap > 0
        # NOTE: before the arena grows, compact with this segment placed last, so
        # that it grows in place: neither dead segments nor a moved segment's old
        # copy may add to the arena, or the slacks compound to ~6.4 bytes/token
        # at S=16 (measured growing 8 interleaved requests to 64K tokens).
        grows = (base if last else self._end) + new_cap > len(self._slots)
        if (grows and (self._garbage or (cap > 0 and not last))) or self._garbage > max(self._end // 8, self._gran):
            self._compact(last_row=row if cap > 0 else None)
            return self._ensure_capacity(row, need)
        if last:
            self._grow_arena(base + new_cap)
            self._clear(base + cap, base + new_cap)
            self._cap[row] = new_cap
            self._end = base + new_cap
            return
        new_base = self._end
        self._grow_arena(new_base + new_cap)
        n = int(self._ntok[row])
        self._copy_segment(base, new_base, n)
        self._clear(new_base + n, new_base + new_cap)
        self._garbage += cap
        self._base[row] = new_base
        self._cap[row] = new_cap
        self._end = new_base + new_cap

    def _grow_arena(self, need: int) -> None:
        size = len(self._slots)
        if need <= size:
            return
        new = self._round(max(need, size + size // 32))
        self._slots = np.concatenate([self._slots, np.full(new - size, PAD, dtype=np.int32)])
        self._bits = np.concatenate([self._bits, np.zeros((new - size) // 8, dtype=np.uint8)])
        self._blocks = np.concatenate([self._blocks, np.zeros((new - size) // self.S, dtype=np.int32)])

    def _clear(self, lo: int, hi: int) -> None:
        """Reset arena positions [lo, hi); ``hi`` is a multiple of lcm(8, S).

        NOTE: ``lo`` may be unaligned (the end of a segment's tokens after a
        move), so the byte holding bit ``lo`` keeps its lower bits and the
        block-list entry covering ``lo`` (the segment's tail block) is kept.
        """
        self._slots[lo:hi] = PAD
        if lo % 8:
            self._bits[lo // 8] &= np.uint8((1 << (lo % 8)) - 1)
        self._bits[_cdiv(lo, 8) : _cdiv(hi, 8)] = 0
        self._blocks[_cdiv(lo, self.S) : _cdiv(hi, self.S)] = NULL_BLOCK

    def _copy_segment(self, src: int, dst: int, n: int) -> None:
        self._slots[dst : dst + n] = self._slots[src : src + n]
        self._bits[dst // 8 : dst // 8 + _cdiv(n, 8)] = self._bits[src // 8 : src // 8 + _cdiv(n, 8)]
        nb = _cdiv(n, self.S)
        self._blocks[dst // self.S : dst // self.S + nb] = self._blocks[src // self.S : src // self.S + nb]

    def _compact(self, last_row: Optional[int] = None) -> None:
        """Slide live segments down over dead ones, in base order; ``last_row`` goes last.

        Putting the segment about to grow last lets it grow in place: moving it
        instead would leave its old copy behind as garbage.
        """
        rows = np.nonzero(self._in_use)[0]
        rows = rows[np.argsort(self._base[rows], kind="stable")]
        saved = None
        if last_row is not None:
            rows = rows[rows != last_row]
            base, n = int(self._base[last_row]), int(self._ntok[last_row])
            saved = (self._slots[base : base + n].copy(), self._bits[base // 8 : base // 8 + _cdiv(n, 8)].copy(),
                     self._blocks[base // self.S : base // self.S + _cdiv(n, self.S)].copy())
        pos = 0
        for row in rows.tolist():
            base, cap, n = int(self._base[row]), int(self._cap[row]), int(self._ntok[row])
            if base != pos:
                self._copy_segment(base, pos, n)
                self._clear(pos + n, pos + cap)
                self._base[row] = pos
            pos += cap
        if saved is not None:
            slots, bits, blocks = saved
            n, cap = len(slots), int(self._cap[last_row])
            self._clear(pos, max(pos + cap, self._end))
            self._slots[pos : pos + n] = slots
            self._bits[pos // 8 : pos // 8 + len(bits)] = bits
            self._blocks[pos // self.S : pos // self.S + len(blocks)] = blocks
            self._base[last_row] = pos
            pos += cap
        self._clear(pos, self._end)
        self._end = pos
        self._garbage = 0

    # --------------------------------------------------------------- helpers
    def _alive(self, g: np.ndarray) -> np.ndarray:
        return ((self._bits[g >> 3] >> (g & 7).astype(np.uint8)) & 1).astype(bool)

    def _alive_range(self, row: int, t0: int, n: int) -> np.ndarray:
        g0 = int(self._base[row]) + t0
        lo = g0 >> 3
        raw = np.unpackbits(self._bits[lo : _cdiv(g0 + n, 8)], bitorder="little")
        return raw[g0 - lo * 8 : g0 - lo * 8 + n].astype(bool)

    def _block_list_view(self, row: int) -> np.ndarray:
        b0 = int(self._base[row]) // self.S
        return self._blocks[b0 : b0 + _cdiv(int(self._ntok[row]), self.S)]

    def _tail_pos(self, rows):
        return _cdiv(self._ntok[rows], self.S) - 1

    def _check_tokens(self, row: int, tids: np.ndarray, arg: str = "token_ids") -> None:
        n = int(self._ntok[row])
        if tids.size and (tids.min() < 0 or tids.max() >= n):
            bad = tids[(tids < 0) | (tids >= n)]
            raise InvalidArgumentError(f"{arg}: expected ids in [0, {n}), got {bad[:8].tolist()}")

    def _union_live(self, block: int) -> int:
        """Offsets of shared ``block`` that any holder still has alive."""
        p = int(self.ledger.pos[block])
        acc = np.zeros(self.S, dtype=bool)
        for h in self.ledger.holders[block]:
            acc |= self._alive_range(h, p * self.S, self.S)
        return int(acc.sum())

    def _refresh_shared(self, block: int) -> None:
        led = self.ledger
        new = self._union_live(block)
        led.total_live += new - int(led.live[block])
        led.live[block] = new

    # ------------------------------------------------------------ public API
    def add_request(self, req, prefix_blocks=None) -> None:
        """Register ``req``, optionally starting from shared prefix blocks.

        ``prefix_blocks`` (ints, may be empty) are full blocks holding the
        request's logical tokens ``0 .. k*S-1`` in order: block ``i`` must sit
        at position ``i`` of the block list of the request(s) already holding
        it, unmodified (never a relocation destination). They are shared, not
        copied: each gets one more reference.
        """
        try:
            hash(req)
        except TypeError:
            raise InvalidArgumentError(f"req: expected a hashable request id, got {type(req).__name__}") from None
        if req in self._rows:
            raise InvalidArgumentError(f"req: expected a new request id, got already registered {req!r}")
        led, S = self.ledger, self.S
        prefix = as_index_array("prefix_blocks", prefix_blocks if prefix_blocks is not None else [])
        for i, b in enumerate(prefix.tolist()):
            if not (0 < b < led.num_blocks) or led.state[b] not in (OWNED, SHARED):
                raise InvalidArgumentError(
                    f"prefix_blocks: expected allocated OWNED/SHARED blocks, got block {b} "
                    f"in state {int(led.state[b]) if 0 <= b < led.num_blocks else 'out of range'}"
                )
            if led.pos[b] != i:
                raise InvalidArgumentError(
                    f"prefix_blocks: expected block {b} at list position {i} of its holders, got {int(led.pos[b])}"
                )
            if led.state[b] == OWNED:
                r0 = int(led.owner[b])
                g0 = int(self._base[r0]) + i * S
                pristine = not self._moved_into[b] and int(self._ntok[r0]) >= (i + 1) * S and np.array_equal(
                    self._slots[g0 : g0 + S], b * S + np.arange(S, dtype=np.int32)
                )
                if not pristine:
                    raise InvalidArgumentError(
                        f"prefix_blocks: expected full, unmodified prefix blocks, got block {b} "
                        "that is partial or was a relocation destination"
                    )
        if len(np.unique(prefix)) != len(prefix):
            raise InvalidArgumentError(f"prefix_blocks: expected unique ids, got {prefix.tolist()}")

        row = self._new_row()
        self._rows[req] = row
        self._registrations += 1
        self._generation[req] = self._registrations
        self._row_req[row] = req
        self._in_use[row] = True
        self._base[row] = self._end
        self._cap[row] = 0
        self._ntok[row] = 0
        self._nlive[row] = 0
        n = len(prefix) * S
        self._ensure_capacity(row, max(n, self._gran))
        if n:
            base = int(self._base[row])
            self._slots[base : base + n] = (prefix[:, None] * S + np.arange(S)).reshape(-1)
            self._bits[base // 8 : base // 8 + n // 8] = 0xFF
            if n % 8:
                self._bits[base // 8 + n // 8] = (1 << (n % 8)) - 1
            self._blocks[base // S : base // S + len(prefix)] = prefix
            self._ntok[row] = n
            self._nlive[row] = n
            led.allocator.incref(prefix)
            for b in prefix.tolist():
                if led.state[b] == OWNED:
                    led.share(b, {int(led.owner[b]), row})
                else:
                    led.holders[b].add(row)
                led.total_live += S - int(led.live[b])  # the new holder has every offset alive
                led.live[b] = S

    def sync_new_tokens(self, req, n: int) -> Optional[np.ndarray]:
        """Assign slots to ``n`` appended tokens of ``req``; None if blocks ran out.

        Returns the new tokens' slots (int32, logical order): the slot mapping
        for their K/V writes. On ``None`` nothing changed.
        """
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise InvalidArgumentError(f"n: expected an int >= 0, got {n!r}")
        return self.sync_new_tokens_batch([req], [n])

    def sync_new_tokens_batch(self, reqs, counts) -> Optional[np.ndarray]:
        """Batched :meth:`sync_new_tokens`: slots of every new token, request after request."""
        rows = self.rows_of(list(reqs))
        counts = as_index_array("counts", counts)
        if len(counts) != len(rows):
            raise InvalidArgumentError(f"counts: expected {len(rows)} entries (one per request), got {len(counts)}")
        if counts.size and counts.min() < 0:
            raise InvalidArgumentError(f"counts: expected values >= 0, got {counts[counts < 0][:8].tolist()}")
        if _has_duplicates(rows):
            raise InvalidArgumentError("reqs: expected unique requests, got duplicates")
        return self._append(rows, counts)

    def _append(self, rows: np.ndarray, counts: np.ndarray) -> Optional[np.ndarray]:
        led, S = self.ledger, self.S
        if rows.size == 0 or int(counts.min()) == 0:
            keep = counts > 0
            rows, counts = rows[keep], counts[keep]
            if rows.size == 0:
                return np.zeros(0, dtype=np.int32)
        old_n = self._ntok[rows]
        # The decode step appends one token per request: fewer, cheaper numpy passes.
        one_each = int(counts.max()) == 1
        if one_each:
            new_n = old_n + 1
            opens = old_n % S == 0  # the token opens a new block
            total_new_blocks = int(np.count_nonzero(opens))
        else:
            new_n = old_n + counts
            need = _cdiv(new_n, S) - _cdiv(old_n, S)
            opens = need > 0
            total_new_blocks = int(need.sum())
        if total_new_blocks > led.admission_free:
            return None
        grow = np.flatnonzero(new_n > self._cap[rows])
        for i in grow.tolist():  # rare: amortized by 1/8 growth
            self._ensure_capacity(int(rows[i]), int(new_n[i]))
        base = self._base[rows]
        if total_new_blocks:
            if one_each:
                blk_rows, first = rows[opens], old_n[opens] // S
            else:
                blk_rows = np.repeat(rows, need)
                first = np.repeat(_cdiv(old_n, S) - np.cumsum(need) + need, need) + np.arange(total_new_blocks)
            ids = led.allocate(total_new_blocks, blk_rows, first)
            assert ids is not None  # admission_free was checked above
            self._moved_into[ids] = False
            self._blocks[self._base[blk_rows] // S + first] = ids
        if one_each:
            tids = old_n
            g = base + tids
        else:  # flat (row, token id) pairs for every new token
            tok_rows = np.repeat(np.arange(len(rows)), counts)
            starts = np.cumsum(counts) - counts
            tids = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts) + np.repeat(old_n, counts)
            g = base[tok_rows] + tids
        blocks = self._blocks[g // S]
        slots = blocks * S + (tids % S).astype(np.int32)
        self._slots[g] = slots
        if one_each:  # NOTE: segments are 64-token aligned, so one token per row never shares a byte
            self._bits[g >> 3] |= (1 << (g & 7)).astype(np.uint8)
        else:
            np.bitwise_or.at(self._bits, g >> 3, (1 << (g & 7)).astype(np.uint8))
        np.add.at(led.live, blocks, _ONE)
        led.total_live += len(g)
        self._nlive[rows] += counts
        self._ntok[rows] = new_n
        # A previous tail that became a non-tail with no live token is released now.
        was_full = opens & (old_n > 0) & (old_n % S == 0)
        if was_full.any():
            r = rows[was_full]
            prev = self._blocks[self._base[r] // S + _cdiv(old_n[was_full], S) - 1]
            self._release_if_empty(r, prev)
        return slots

    def evict(self, req, token_ids) -> None:
        """Mark ``token_ids`` of ``req`` dead (batched). Errors leave state unchanged."""
        tids = as_index_array("token_ids", token_ids)
        row = self.row_of(req)
        self._evict(np.full(len(tids), row, dtype=np.int64), tids, runs=True)

    def evict_batch(self, reqs, token_ids_per_req) -> None:
        """Evict across requests in one vectorized pass."""
        reqs = list(reqs)
        if len(reqs) != len(token_ids_per_req):
            raise InvalidArgumentError(
                f"token_ids_per_req: expected {len(reqs)} arrays (one per request), got {len(token_ids_per_req)}"
            )
        rows = self.rows_of(reqs)
        parts = list(token_ids_per_req)
        tids = None
        try:  # fast path: 1-D integer numpy arrays, validated in C-level passes
            kinds = {d.kind for d in set(map(_DTYPE, parts))}
            if kinds <= {"i", "u"} and parts:
                tids = np.concatenate(parts)
        except (AttributeError, ValueError, TypeError):
            tids = None
        if tids is None or tids.ndim != 1 or tids.dtype.kind not in "iu":  # else per array, naming the bad one
            parts = [as_index_array(f"token_ids_per_req[{i}]", t) for i, t in enumerate(parts)]
            tids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        lens = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        self._evict(np.repeat(rows, lens), tids.astype(np.int64, copy=False), runs=not _has_duplicates(rows))

    def evict_flat(self, reqs, token_ids, counts) -> None:
        """Evict across requests from one flat id array (the decode-step form).

        ``token_ids`` (int [sum(counts)]) holds ``counts[i]`` ids of ``reqs[i]``
        after those of ``reqs[:i]`` (CSR order, as a batched policy's top-k
        produces them). Same checks as :meth:`evict`, with O(1) Python work
        per call instead of O(len(reqs)).

        Example:
            >>> table.evict_flat(["a", "b"], np.array([0, 5, 1]), np.array([2, 1]))  # doctest: +SKIP
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
        if _has_duplicates(rows):
            self._evict(np.repeat(rows, counts), tids)
        else:
            self._evict(np.repeat(rows, counts), tids, runs=True, run_rows=rows, run_counts=counts)

    def _evict(self, rows: np.ndarray, tids: np.ndarray, runs: bool = False,
               run_rows: Optional[np.ndarray] = None, run_counts: Optional[np.ndarray] = None) -> None:
        """Evict (rows[i], tids[i]) pairs; ``runs``: each row's pairs are one contiguous run.

        NOTE: with ``runs`` and ids ascending within each run (what np.nonzero or
        a sorted top-k gives), uniqueness is one comparison pass and the alive
        bits of a byte are grouped, so no sort and no ufunc.at on the bits;
        anything else takes one sort (33 us for 2048 ids on this 2-core VM).
        """
        if tids.size == 0:
            return
        led, S = self.ledger, self.S
        ntok = self._ntok[rows]
        bad = (tids < 0) | (tids >= ntok)
        if bad.any():
            raise InvalidArgumentError(
                f"token_ids: expected ids in [0, num_tokens), got {tids[bad][:8].tolist()} "
                f"(num_tokens {ntok[bad][:8].tolist()})"
            )
        g = self._base[rows] + tids
        grouped = runs and bool(((tids[1:] > tids[:-1]) | (rows[1:] != rows[:-1])).all())
        if not grouped and _has_duplicates(g):
            sg = np.sort(g)
            raise InvalidArgumentError(
                f"token_ids: expected unique ids, got duplicates of {tids[np.isin(g, sg[1:][sg[1:] == sg[:-1]])][:8].tolist()}"
            )
        byte, bit = g >> 3, _BIT[g & 7]
        alive = (self._bits[byte] & bit) != 0
        if not alive.all():
            raise InvalidArgumentError(f"token_ids: expected live tokens, got already-evicted ids {tids[~alive][:8].tolist()}")
        # --- validated: mutate -------------------------------------------
        mask = ~bit
        if grouped:  # equal bytes are adjacent (segments are byte-aligned): combine their masks
            same = byte[1:] == byte[:-1]
            if same.any():
                first = np.flatnonzero(np.concatenate(([True], ~same)))
                byte, mask = byte[first], np.bitwise_and.reduceat(mask, first)
            self._bits[byte] &= mask
        else:
            np.bitwise_and.at(self._bits, byte, mask)
        if run_rows is not None:  # unique rows with their counts: no scatter-add needed
            self._nlive[run_rows] -= run_counts
        else:
            np.subtract.at(self._nlive, rows, 1)
        blocks = self._slots[g].astype(np.int64) // S
        shared = led.state[blocks] == SHARED
        if shared.any():
            sh_pairs = np.unique(np.stack([rows[shared], blocks[shared]]), axis=1)
            for b in np.unique(sh_pairs[1]).tolist():
                self._refresh_shared(b)
            blocks = blocks[~shared]
        np.subtract.at(led.live, blocks, _ONE)
        led.total_live -= len(blocks)
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
        candidate = (blocks != NULL_BLOCK) & (led.pos[blocks] != self._tail_pos(rows))
        state = led.state[blocks]
        private = candidate & (state == OWNED) & (led.owner[blocks] == rows) & (led.live[blocks] == 0)
        shared = candidate & (state == SHARED)
        # Shared pairs are rare (prefix blocks): per pair, with the holder's own alive bits.
        for row, b in zip(rows[shared].tolist(), blocks[shared].tolist()):
            p = int(led.pos[b])
            if led.state[b] == SHARED and row in led.holders[b] and not self._alive_range(row, p * S, S).any():
                self._blocks[int(self._base[row]) // S + p] = NULL_BLOCK
                led.unshare(b, row)
                self._refresh_after_unshare(b)
        if private.any():
            ids = blocks[private]
            self._blocks[self._base[rows[private]] // S + led.pos[ids]] = NULL_BLOCK
            led.release(ids)

    def _refresh_after_unshare(self, block: int) -> None:
        if self.ledger.state[block] == SHARED:
            self._refresh_shared(block)
        else:
            self._refresh_owned(block)

    def _refresh_owned(self, block: int) -> None:
        """A block that just went from SHARED to OWNED: live = the last holder's count."""
        led = self.ledger
        row, p = int(led.owner[block]), int(led.pos[block])
        new = int(self._alive_range(row, p * self.S, self.S).sum())
        led.total_live += new - int(led.live[block])
        led.live[block] = new
        if new == 0 and p != int(self._tail_pos(row)):
            self._release_if_empty(np.array([row]), np.array([block]))

    def apply_moves(self, req, token_ids, new_slots) -> np.ndarray:
        """Move live tokens of ``req`` to ``new_slots`` (the reclaimer's commit).

        Validated: the tokens are live, unique, not in shared blocks; the new
        slots are unique, lie in blocks the request owns (OWNED, or
        DST_INFLIGHT reserved for it) and hold no live token of the request.
        Destination blocks not yet in the block list take the positions of the
        source blocks this call empties, first positions first. Returns the
        ids of the blocks released.
        """
        row = self.row_of(req)
        led, S = self.ledger, self.S
        tids = as_index_array("token_ids", token_ids)
        dst = as_index_array("new_slots", new_slots)
        if len(tids) != len(dst):
            raise InvalidArgumentError(f"new_slots: expected {len(tids)} slots (one per token), got {len(dst)}")
        if tids.size == 0:
            return np.zeros(0, dtype=np.int32)
        self._check_tokens(row, tids)
        if _has_duplicates(tids):
            raise InvalidArgumentError("token_ids: expected unique ids, got duplicates")
        g = int(self._base[row]) + tids
        alive = self._alive(g)
        if not alive.all():
            raise InvalidArgumentError(f"token_ids: expected live tokens, got dead ids {tids[~alive][:8].tolist()}")
        nslots = led.num_blocks * S
        if dst.min() < S or dst.max() >= nslots:
            raise InvalidArgumentError(f"new_slots: expected slots in [{S}, {nslots}), got out-of-range values")
        if _has_duplicates(dst):
            raise InvalidArgumentError("new_slots: expected unique slots, got duplicates")
        src_blocks = self._slots[g] // S
        if (led.state[src_blocks] == SHARED).any():
            raise InvalidArgumentError("token_ids: expected tokens in private blocks, got tokens in shared blocks")
        dst_blocks = dst // S
        ok = np.isin(led.state[dst_blocks], (OWNED, DST_INFLIGHT)) & (led.owner[dst_blocks] == row)
        if not ok.all():
            raise InvalidArgumentError(
                f"new_slots: expected slots in blocks owned by request {req!r}, got foreign blocks "
                f"{np.unique(dst_blocks[~ok])[:8].tolist()}"
            )
        n = int(self._ntok[row])
        base = int(self._base[row])
        # NOTE: the tail's offsets past the last token are reserved for future
        # appends (sync_new_tokens writes token t at offset t % S), so they are
        # never free destinations.
        tail_pos = _cdiv(n, S) - 1
        future = (dst_blocks == self._blocks[base // S + tail_pos]) & (dst % S >= n - tail_pos * S)
        if future.any():
            raise InvalidArgumentError(
                f"new_slots: expected empty slots, got tail-block slots reserved for future tokens "
                f"{dst[future][:8].tolist()}"
            )
        # NOTE: a DST_INFLIGHT block never holds a live token (only this call
        # moves tokens into it, and that makes it OWNED), so only slots in OWNED
        # blocks need the O(live tokens) occupancy check: a reclaimer commit,
        # whose destinations are all fresh, skips it.
        in_owned = led.state[dst_blocks] == OWNED
        if in_owned.any():
            row_live = self._slots[base : base + n][self._alive_range(row, 0, n)]
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
        tail = int(self._tail_pos(row))
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
        np.subtract.at(led.live, src_blocks, _ONE)
        np.add.at(led.live, dst_blocks, _ONE)
        self._moved_into[dst_blocks] = True
        self._slots[g] = dst.astype(np.int32)
        positions = np.sort(led.pos[emptied])
        ids = emptied.astype(np.int64)
        led.release(ids)
        self._blocks[base // S + positions] = NULL_BLOCK
        if len(new_dst):
            # Destinations in logical order of their first token take the first positions.
            k = np.minimum(np.searchsorted(new_dst, dst_blocks), len(new_dst) - 1)
            hit = new_dst[k] == dst_blocks
            first_use = np.full(len(new_dst), np.iinfo(np.int64).max, dtype=np.int64)
            np.minimum.at(first_use, k[hit], tids[hit])
            new_dst = new_dst[np.argsort(first_use, kind="stable")]
            p = positions[: len(new_dst)]
            self._blocks[base // S + p] = new_dst
            led.pos[new_dst] = p
            led._set_state(new_dst.astype(np.int64), OWNED)
        return ids.astype(np.int32)

    # ------------------------------------------- relocation (the reclaimer's)
    def relocation_candidates(self, req) -> tuple[np.ndarray, np.ndarray]:
        """Blocks of ``req`` a plan may use as sources, in block-list order.

        Private (OWNED: ref == 1, not in flight), not the tail, not released.
        Returns ``(blocks int32 [n], live int32 [n])``.
        """
        row = self.row_of(req)
        led = self.ledger
        blist = self._block_list_view(row)[:-1]
        b = blist[blist != NULL_BLOCK]
        b = b[led.state[b] == OWNED]
        return b.astype(np.int32), led.live[b].astype(np.int32)

    def tail_block_ids(self) -> np.ndarray:
        """The tail block of every registered request that has one (int64)."""
        rows = np.flatnonzero(self._in_use & (self._ntok > 0))
        tails = self._blocks[self._base[rows] // self.S + self._tail_pos(rows)]
        return tails[tails != NULL_BLOCK].astype(np.int64)

    def is_alive(self, req, token_ids) -> np.ndarray:
        """Alive bits of ``token_ids`` of ``req`` (bool, validated ids)."""
        row = self.row_of(req)
        tids = as_index_array("token_ids", token_ids)
        self._check_tokens(row, tids)
        return self._alive(int(self._base[row]) + tids)

    def begin_relocation(self, req, src_blocks) -> None:
        """Mark ``src_blocks`` of ``req`` SRC_INFLIGHT (sources of a launched plan).

        Validated: unique, OWNED by ``req`` and not its tail. While in flight a
        source is never released by Naive-Evict, even if it empties.
        """
        row = self.row_of(req)
        led = self.ledger
        b = as_index_array("src_blocks", src_blocks)
        if b.size == 0:
            return
        if b.min() < 1 or b.max() >= led.num_blocks:
            raise InvalidArgumentError(f"src_blocks: expected ids in [1, {led.num_blocks}), got out-of-range ids")
        if len(np.unique(b)) != len(b):
            raise InvalidArgumentError("src_blocks: expected unique ids, got duplicates")
        ok = (led.state[b] == OWNED) & (led.owner[b] == row)
        if not ok.all():
            raise InvalidArgumentError(
                f"src_blocks: expected OWNED blocks of request {req!r}, got {b[~ok][:8].tolist()}"
            )
        tail = self.tail_block(req)
        if (b == tail).any():
            raise InvalidArgumentError(f"src_blocks: expected non-tail blocks, got the tail block {tail}")
        led._set_state(b, SRC_INFLIGHT)

    def end_relocation(self, req, src_blocks) -> np.ndarray:
        """Return ``req``'s still-in-flight ``src_blocks`` to OWNED (abort, or after a commit).

        Blocks a commit already freed are skipped. A returned source left with
        no live token (every token in it died while it was in flight) is
        released now, as Naive-Evict would have done. Returns the released ids.
        """
        row = self.row_of(req)
        led = self.ledger
        b = as_index_array("src_blocks", src_blocks)
        if b.size and (b.min() < 1 or b.max() >= led.num_blocks):
            raise InvalidArgumentError(f"src_blocks: expected ids in [1, {led.num_blocks}), got out-of-range ids")
        b = np.unique(b)
        b = b[(led.state[b] == SRC_INFLIGHT) & (led.owner[b] == row)]
        if b.size == 0:
            return np.zeros(0, dtype=np.int32)
        led._set_state(b, OWNED)
        empty = b[led.live[b] == 0]
        if empty.size:
            self._release_if_empty(np.full(len(empty), row, dtype=np.int64), empty)
        return empty.astype(np.int32)

    def release_destinations(self, req, dst_blocks) -> None:
        """Free ``req``'s DST_INFLIGHT blocks that a commit did not place (abort, unused)."""
        row = self.row_of(req)
        led = self.ledger
        b = as_index_array("dst_blocks", dst_blocks)
        if b.size == 0:
            return
        if b.min() < 1 or b.max() >= led.num_blocks:
            raise InvalidArgumentError(f"dst_blocks: expected ids in [1, {led.num_blocks}), got out-of-range ids")
        if len(np.unique(b)) != len(b):
            raise InvalidArgumentError("dst_blocks: expected unique ids, got duplicates")
        ok = (led.state[b] == DST_INFLIGHT) & (led.owner[b] == row)
        if not ok.all():
            raise InvalidArgumentError(
                f"dst_blocks: expected DST_INFLIGHT blocks of request {req!r}, got {b[~ok][:8].tolist()}"
            )
        led.release(b)

    def finish(self, req) -> np.ndarray:
        """Drop ``req``: free every block it owns, unreference shared ones. Returns the freed ids."""
        row = self.row_of(req)
        led = self.ledger
        blist = self._block_list_view(row)
        held = blist[blist != NULL_BLOCK].astype(np.int64)
        private = held[led.state[held] != SHARED]
        if led.count(DST_INFLIGHT):
            inflight = np.nonzero((led.state == DST_INFLIGHT) & (led.owner == row))[0]
            private = np.concatenate([private, inflight])
        for b in held[led.state[held] == SHARED].tolist():
            led.unshare(b, row)
            self._refresh_after_unshare(b)
        led.release(private)
        self._garbage += int(self._cap[row])
        if int(self._base[row]) + int(self._cap[row]) == self._end:
            self._end -= int(self._cap[row])
            self._garbage -= int(self._cap[row])
            self._clear(self._end, self._end + int(self._cap[row]))
        self._in_use[row] = False
        self._ntok[row] = self._nlive[row] = self._cap[row] = 0
        del self._rows[req]
        del self._generation[req]
        self._row_req[row] = None
        self._free_rows.append(row)
        return private.astype(np.int32)

    # ------------------------------------------------------------------ reads
    def num_tokens(self, req) -> int:
        return int(self._ntok[self.row_of(req)])

    def live_count(self, req) -> int:
        return int(self._nlive[self.row_of(req)])

    def live_mask(self, req) -> np.ndarray:
        row = self.row_of(req)
        return self._alive_range(row, 0, int(self._ntok[row]))

    def live_ids(self, req) -> np.ndarray:
        """Live logical token ids of ``req``, ascending (int64)."""
        return np.nonzero(self.live_mask(req))[0]

    def live_slots(self, req) -> np.ndarray:
        """Slots of the live tokens of ``req`` in logical order (int32)."""
        row = self.row_of(req)
        base, n = int(self._base[row]), int(self._ntok[row])
        return self._slots[base : base + n][self._alive_range(row, 0, n)].copy()

    def slots(self, req) -> np.ndarray:
        """Every token's slot (dead ones: the slot they died in), a copy."""
        row = self.row_of(req)
        base, n = int(self._base[row]), int(self._ntok[row])
        return self._slots[base : base + n].copy()

    def block_list(self, req) -> np.ndarray:
        """The request's block list (null block at released positions), a copy."""
        return self._block_list_view(self.row_of(req)).copy()

    def held_blocks(self, req) -> int:
        """Blocks the request still references (private and shared)."""
        return int(np.count_nonzero(self._block_list_view(self.row_of(req))))

    def tail_block(self, req) -> int:
        blist = self._block_list_view(self.row_of(req))
        return int(blist[-1]) if len(blist) else NULL_BLOCK

    def nbytes(self) -> int:
        """Bytes of table metadata: the arenas (slack included) plus per-request rows."""
        arenas = self._slots.nbytes + self._bits.nbytes + self._blocks.nbytes
        rows = sum(getattr(self, n).nbytes for n in ("_base", "_cap", "_ntok", "_nlive", "_in_use"))
        return arenas + rows

    def total_tokens(self) -> int:
        return int(self._ntok[self._in_use].sum())

    # ------------------------------------------------------------- checking
    def snapshot(self) -> dict:
        """A deep copy of all state, for bit-identical comparisons in tests."""
        snap = {"ledger": self.ledger.snapshot(), "rows": dict(self._rows), "end": self._end, "garbage": self._garbage}
        for name in ("_base", "_cap", "_ntok", "_nlive", "_in_use"):
            snap[name] = getattr(self, name).copy()
        snap["per_request"] = {
            req: (self.slots(req), self.live_mask(req), self.block_list(req)) for req in self._rows
        }
        snap["moved_into"] = self._moved_into.copy()
        snap["ref"] = None
        alloc = self.ledger.allocator
        if hasattr(alloc, "ref_count"):
            snap["ref"] = alloc.ref_count(np.arange(1, alloc.num_blocks))
        return snap

    def check_invariants(self) -> None:
        """Conservation, I2 (unique mapping) and live counts vs a recount. O(tokens + blocks)."""
        led, S = self.ledger, self.S
        led.check_conservation()
        recount = np.zeros(led.num_blocks, dtype=np.int64)
        private_slots = []
        list_refs = np.zeros(led.num_blocks, dtype=np.int64)
        for req, row in self._rows.items():
            n = int(self._ntok[row])
            mask = self._alive_range(row, 0, n)
            if int(mask.sum()) != int(self._nlive[row]):
                raise InvariantViolation(f"request {req!r}: live count {int(self._nlive[row])} != recount {int(mask.sum())}")
            base = int(self._base[row])
            live_slots = self._slots[base : base + n][mask].astype(np.int64)
            tids = np.nonzero(mask)[0]
            if live_slots.size and (live_slots < S).any():
                raise InvariantViolation(f"request {req!r}: a live token has no slot")
            blocks = live_slots // S
            st = led.state[blocks]
            mine = np.isin(st, (OWNED, SRC_INFLIGHT)) & (led.owner[blocks] == row)
            sh = st == SHARED
            if not (mine | sh).all():
                raise InvariantViolation(f"request {req!r}: live tokens in blocks it does not own: {np.unique(blocks[~(mine | sh)])[:8].tolist()}")
            for b in np.unique(blocks[sh]).tolist():
                if row not in led.holders[b]:
                    raise InvariantViolation(f"request {req!r}: token in shared block {b} it does not hold")
            exp = (led.pos[blocks[sh]].astype(np.int64) * S + (live_slots[sh] % S))
            if not np.array_equal(exp, tids[sh]):
                raise InvariantViolation(f"request {req!r}: shared-block token at the wrong position")
            np.add.at(recount, blocks[mine], 1)
            private_slots.append(live_slots[mine])
            blist = self._block_list_view(row)
            held = blist[blist != NULL_BLOCK]
            np.add.at(list_refs, held, 1)
            for p, b in zip(np.nonzero(blist != NULL_BLOCK)[0].tolist(), held.tolist()):
                if led.pos[b] != p or not (led.owner[b] == row or (led.state[b] == SHARED and row in led.holders[b])):
                    raise InvariantViolation(f"request {req!r}: block {b} at list position {p} is not recorded there")
        allp = np.concatenate(private_slots) if private_slots else np.zeros(0, np.int64)
        if _has_duplicates(allp):
            raise InvariantViolation("I2: a slot is held by two live tokens")
        for b in led.holders:
            recount[b] = self._union_live(b)
        allocated = led.state != FREE
        allocated[NULL_BLOCK] = False
        if not np.array_equal(recount[allocated], led.live[allocated].astype(np.int64)):
            bad = np.nonzero(allocated & (recount != led.live))[0]
            raise InvariantViolation(f"ledger live counts differ from a recount at blocks {bad[:8].tolist()}")
        in_list = np.isin(led.state, (OWNED, SHARED, SRC_INFLIGHT))
        in_list[NULL_BLOCK] = False
        expected_refs = np.where(led.state == SHARED, 0, 1)
        for b, h in led.holders.items():
            expected_refs[b] = len(h)
        if not np.array_equal(list_refs[in_list], expected_refs[in_list]):
            bad = np.nonzero(in_list & (list_refs != expected_refs))[0]
            raise InvariantViolation(f"blocks not listed exactly once per holder: {bad[:8].tolist()}")
        if (list_refs[~in_list] != 0).any():
            raise InvariantViolation("a free or in-flight destination block appears in a block list")
