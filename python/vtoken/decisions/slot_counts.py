"""SlotCounts: live slots per KV block, derived from a device mirror and kept up to date in O(writes).

A slot is live while ANY mirror position holding it is alive (the ledger's
rule for shared-prefix blocks). The counts start from one recount of the
mirror; after that every change comes from its writer with the positions
written: the decision loop's kills (:meth:`SlotCounts.shift` with -1 per
victim) and each mirror flush (the mirror shows its watchers the positions it
writes, before and after: ``DeltaShipper.add_write_watcher``). A re-layout
moves positions with their slot and alive bit together, so it changes no
count. Per step this is device work over the step's victims, not over the
mirror or every slot; :meth:`SlotCounts.check` (debug, syncs) compares with
a recount of the whole mirror.

NOTE: the device kills counted are the owner's (one decision loop per
mirror); another object's ``kill_on_device`` on the same mirror would go
uncounted until the debug check reports the drift.

Example (CPU)::

    >>> from vtoken.device.buffers import DeviceMirror
    >>> from vtoken.bookkeeping.ledger import BlockLedger
    >>> from vtoken.bookkeeping.pool import BlockPool
    >>> from vtoken.bookkeeping.table import TokenTable
    >>> t = TokenTable(BlockLedger(BlockPool(8), 4))
    >>> m = DeviceMirror(t, "cpu")
    >>> c = SlotCounts(m, num_blocks=8, block_size=4)
    >>> t.add_request("a"); _ = t.sync_new_tokens("a", 6); m.sync(); _ = m.flush()
    >>> c.block_live[:3].tolist()
    [0, 4, 2]
"""
from __future__ import annotations

import torch

from vtoken.device import ops
from vtoken.errors import InvariantViolation, check_int


class SlotCounts:
    """Alive holders per slot and live slots per block of ``mirror``'s tokens (see module docstring).

    Tensors (device, fixed addresses, updated in place):
        block_live   int32 [num_blocks + 1]  live slots per block (+ a trash entry)
        waste_ratio  float32 []              F over every block, as ``ops.block_live_counts``
    """

    def __init__(self, mirror, num_blocks: int, block_size: int):
        self.mirror = mirror
        self.num_blocks = check_int("num_blocks", num_blocks, min_value=1)
        self.block_size = check_int("block_size", block_size, min_value=1)
        self.device = mirror.device
        self.num_slots = num_blocks * block_size  # also the trash slot's index: "counts for nothing"
        self._slot_ids = torch.arange(self.num_slots, dtype=torch.int32, device=self.device)
        self._refs, self.block_live, self._live_slots, self.waste_ratio = self._recount()
        # Scratch for "one entry per distinct slot" (any writer wins; read only where just written).
        self._pick = torch.zeros(self.num_slots + 1, dtype=torch.int64, device=self.device)
        self._before = None  # between a flush's two calls: what its positions counted for
        mirror.deltas.add_write_watcher(self)

    def counted_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """int64: the slot each mirror position counts for (alive, in range), else the trash slot."""
        slots = self.mirror.slots[positions].to(torch.int64)
        held = (self.mirror.alive[positions] != 0) & (slots >= 0) & (slots < self.num_slots)
        return torch.where(held, slots, self.num_slots)

    def shift(self, slots: torch.Tensor, delta: torch.Tensor) -> None:
        """Add ``delta`` (int32) to the holders of ``slots`` (int64; the trash slot: none); the block
        counts and F follow. O(len(slots)) device work, fixed shape, no host read."""
        had = self._refs[slots] > 0
        self._refs.index_add_(0, slots, delta)
        has = self._refs[slots] > 0
        # A slot listed twice (shared-prefix holders) changes its block's count once.
        entry = torch.arange(slots.numel(), device=self.device)
        self._pick.index_copy_(0, slots, entry)
        once = (self._pick[slots] == entry) & (slots < self.num_slots)
        change = torch.where(once, has.to(torch.int32) - had.to(torch.int32), 0)
        self.block_live.index_add_(0, slots // self.block_size, change)  # the trash slot: the trash block
        self._live_slots += change.sum()
        # F over every block (ops.block_live_counts without an allocation mask): float64, rounded once.
        self.waste_ratio.copy_(1.0 - self._live_slots.to(torch.float64) / float(self.num_slots))

    def before_mirror_writes(self, positions: torch.Tensor) -> None:
        """The mirror is about to write ``positions`` (a flush): remember what they count for now."""
        self._before = self.counted_slots(positions)

    def after_mirror_writes(self, positions: torch.Tensor) -> None:
        """The mirror wrote ``positions``: their counts move from the old slots to the new ones."""
        old, new = self._before, self.counted_slots(positions)
        self._before = None
        ones = torch.ones_like(old, dtype=torch.int32)
        self.shift(torch.cat([old, new]), torch.cat([-ones, ones]))

    def _recount(self) -> tuple:
        """``(refs, block_live, live_slots, waste_ratio)`` from the whole mirror: O(mirror + slots)."""
        n = self.num_slots
        slots = self.mirror.slots.to(torch.int64)
        held = (self.mirror.alive != 0) & (slots >= 0) & (slots < n)
        refs = torch.zeros(n + 1, dtype=torch.int32, device=self.device)
        refs.index_add_(0, torch.where(held, slots, n), torch.ones_like(slots, dtype=torch.int32))
        counts, waste = ops.block_live_counts(self._slot_ids, (refs[:n] > 0).to(torch.int8), self.num_blocks,
                                              self.block_size)
        block_live = torch.zeros(self.num_blocks + 1, dtype=torch.int32, device=self.device)
        block_live[: self.num_blocks] = counts
        return refs, block_live, (refs[:n] > 0).sum(), waste.clone()

    def check(self) -> None:
        """Debug (syncs): the maintained counts equal a recount of the whole mirror."""
        refs, block_live, live_slots, waste = self._recount()
        n, nb = self.num_slots, self.num_blocks
        for name, have, want in (("slot holders", self._refs[:n], refs[:n]),
                                 ("block live counts", self.block_live[:nb], block_live[:nb]),
                                 ("live slots", self._live_slots, live_slots), ("waste ratio", self.waste_ratio, waste)):
            if not torch.equal(have, want):
                raise InvariantViolation(f"slot counts: the maintained {name} drifted from the mirror's recount")
