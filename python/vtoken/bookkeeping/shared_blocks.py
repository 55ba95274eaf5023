"""SharedBlocks: the token table's shared-prefix holders.

A prefix block is shared, not copied: every request that starts from it holds
one reference and lists it at the same block-list position. Its live count in
the ledger is the union over its holders (an offset counts while any holder
still has that token alive). This module owns the rules for taking a prefix
block (it must be full and unmodified), the union counts, and what happens
when a holder lets go.

It also owns ``moved_into``: blocks that received moved tokens since the
table allocated them. NOTE: a move may land on a dead token's slot,
overwriting K/V that a shared prefix would still need, while the slot table
looks unmodified; such blocks are never accepted as prefix blocks.
"""
from __future__ import annotations

import numpy as np

from vtoken.errors import InvalidArgumentError
from vtoken.bookkeeping.ledger import OWNED, SHARED


class SharedBlocks:
    """Shared-prefix bookkeeping over a table's arena and ledger."""

    def __init__(self, arena, ledger):
        self.arena = arena
        self.ledger = ledger
        self.S = ledger.block_size
        self.moved_into = np.zeros(ledger.num_blocks, dtype=bool)
        # NOTE: blocks a prefix-cache hit outside the table may read (vLLM: blocks with a hash),
        # set by the integration. A hit attends every offset, dead ones included, so such a
        # block is never a hole-filling destination (vtoken.reclamation.hole_planner).
        self.hit_readable = np.zeros(ledger.num_blocks, dtype=bool)

    def check_prefix(self, prefix: np.ndarray) -> None:
        """Raise unless ``prefix`` lists full, unmodified, allocated blocks at positions 0, 1, ..."""
        led, arena, S = self.ledger, self.arena, self.S
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
                g0 = int(arena.base[r0]) + i * S
                pristine = not self.moved_into[b] and int(arena.ntok[r0]) >= (i + 1) * S and np.array_equal(
                    arena.slots[g0 : g0 + S], b * S + np.arange(S, dtype=np.int32)
                )
                if not pristine:
                    raise InvalidArgumentError(
                        f"prefix_blocks: expected full, unmodified prefix blocks, got block {b} "
                        "that is partial or was a relocation destination"
                    )
        if len(np.unique(prefix)) != len(prefix):
            raise InvalidArgumentError(f"prefix_blocks: expected unique ids, got {prefix.tolist()}")

    def attach(self, row: int, prefix: np.ndarray) -> None:
        """``row`` holds the (checked) ``prefix`` blocks: one more reference each, every offset alive."""
        led = self.ledger
        led.allocator.incref(prefix)
        for b in prefix.tolist():
            if led.state[b] == OWNED:
                led.share(b, {int(led.owner[b]), row})
            else:
                led.add_holder(b, row)
            led.set_live(b, self.S)  # the new holder has every offset alive

    def union_live(self, block: int) -> int:
        """Offsets of shared ``block`` that any holder still has alive."""
        p = int(self.ledger.pos[block])
        acc = np.zeros(self.S, dtype=bool)
        for h in self.ledger.holders[block]:
            acc |= self.arena.alive_range(h, p * self.S, self.S)
        return int(acc.sum())

    def refresh(self, block: int) -> None:
        """Recount shared ``block``'s union of live offsets into the ledger."""
        self.ledger.set_live(block, self.union_live(block))

    def holder_keeps_nothing(self, row: int, block: int) -> bool:
        """Whether ``row`` holds shared ``block`` and has no token alive in it."""
        led, S = self.ledger, self.S
        if led.state[block] != SHARED or row not in led.holders[block]:
            return False
        return not self.arena.alive_range(row, int(led.pos[block]) * S, S).any()

    def drop(self, row: int, block: int) -> bool:
        """``row`` lets go of shared ``block``; True if the block is left OWNED and empty.

        With one holder left the block becomes that holder's private block,
        whose live count is its own alive offsets: when none is left and the
        block is not the holder's tail, the caller releases it.
        """
        led = self.ledger
        led.unshare(block, row)
        if led.state[block] == SHARED:
            self.refresh(block)
            return False
        last, p = int(led.owner[block]), int(led.pos[block])
        n = int(self.arena.alive_range(last, p * self.S, self.S).sum())
        led.set_live(block, n)
        return n == 0 and p != int(self.arena.tail_pos(last))
