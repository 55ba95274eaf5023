"""DecisionLoop: eviction decided and applied on the device; the host learns the victims one step late.

Per step, after the forward (docs/architecture.md, "decision loop")::

    loop.drain(table)            # host: apply the records whose copy completed (O(victims), one evict_flat)
    ... forward (attention adds each key's probability mass into loop.token_mass) ...
    loop.decide(reqs, slot_lists, seq_lens=..., num_new=...)   # device: no host sync

:meth:`DecisionLoop.decide` runs a fixed number of torch launches, whatever
the batch holds. Its per-entry passes run over views ``[:bucket]`` of the
slot lists, ``bucket`` the smallest rung of the entry ladder
(:func:`~vtoken.device.step_graphs.entry_buckets`: powers of two from 1024,
then ``nnz_max``) that holds the step's entries, read from the host's
``kv_indptr_host`` (no sync): a step costs O(its entries and victims), not
O(``nnz_max``), and its shapes (padded batch size, bucket) are few enough to
capture every pair as a CUDA graph (:mod:`vtoken.device.step_graphs`):

1. the step's per-request arguments (``seq_len``, ``num_new``, budget, step,
   seed) go to the device in one H2D copy;
2. :class:`~vtoken.policies.device.DevicePolicyState` takes the step's key
   masses from :attr:`token_mass` (indexed by mirror position, written in
   place by ``token_attention``'s ``score_out``) and resets them;
3. the policy's ``select_victims_device`` picks every request's victims;
4. the victims that fit the :class:`~vtoken.decisions.victim_ring.VictimRing` record are
   killed in the device mirror (alive bit 0), so the next attention never
   reads them; the rest stay alive and are picked again next step;
5. the per-block live counts (:class:`~vtoken.decisions.slot_counts.SlotCounts`; a
   shared-prefix block counts a slot while ANY holder keeps it alive, the
   ledger's rule) follow the kills: O(victims) device work, as each mirror
   flush is followed over the positions it writes; under
   ``VTOKEN_DEBUG_INVARIANTS`` each step recounts them from the whole
   mirror and compares. A block that held a
   victim and now counts zero is one of the step's emptied blocks (the frees
   of Naive-Evict; the host frees them when it applies the victims, except a
   request's tail block, which it keeps for the next append);
6. the record (victim counts, victim ids, emptied blocks) is copied to pinned
   host memory asynchronously, behind an event.

:meth:`DecisionLoop.drain` (the next step, on the host) takes the records
whose event completed (it never waits) and applies each with ONE
``TokenTable.evict_flat`` call, skipping requests that finished or were
re-registered since. It returns the applied decisions, keyed by the decision
step's ``(request_id, seq_len)``, for victim traces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from vtoken.errors import (InvalidArgumentError, InvalidTypeError, InvariantViolation, as_index_array, check_int,
                           check_tensor, debug_checks_enabled)
from vtoken.policies.base import request_seed
from vtoken.policies.counter_hash import fold32
from vtoken.policies.device import DeviceBatch, DevicePolicyState
from vtoken.decisions.slot_counts import SlotCounts
from vtoken.device.step_graphs import MIN_ENTRY_BUCKET, StepGraphs
from vtoken.decisions.victim_ring import VictimRing

_NO_BUDGET = np.iinfo(np.int64).max  # a request that must not evict this step (e.g. it just finished)
# Rows of the per-request argument buffer: seq_len, num_new, budget, step, seed, window vote, deferred.
_NUM_ARGS = 7


@dataclass
class StepMeta:
    """What the host needs to apply one step's record (kept on the host beside the copy)."""

    step: int
    reqs: list
    generations: np.ndarray
    seq_lens: np.ndarray
    done: np.ndarray  # bool: the request decided nothing this step (finished, mid-prompt, or not its step)

    @property
    def num_reqs(self) -> int:
        return len(self.reqs)


@dataclass(frozen=True)
class AppliedRecord:
    """One step's decisions, as the host received them: CSR over the requests it decided for."""

    reqs: list
    seq_lens: np.ndarray  # each request's length when the device decided (the trace key)
    counts: np.ndarray  # victims per request (0 included: a decision to keep everything)
    token_ids: np.ndarray  # int64, CSR by request
    decided_step: int
    applied_step: int
    applied: np.ndarray  # bool per request: evicted on the host (False: finished or re-registered since, or no table)

    @property
    def num_victims(self) -> int:
        return int(self.token_ids.size)

    def decisions(self):
        """``(request_id, seq_len, token_ids)`` per request (for victim traces)."""
        off = np.concatenate([[0], np.cumsum(self.counts)])
        for k, req in enumerate(self.reqs):
            yield req, int(self.seq_lens[k]), self.token_ids[off[k]: off[k + 1]]


def _csr_rows(values: np.ndarray, counts: np.ndarray, rows: np.ndarray) -> tuple:
    """``(values, counts)`` of the CSR rows ``rows`` (ascending) of ``(values, counts)``."""
    if rows.size == counts.size:
        return values, counts
    ends = np.cumsum(counts)
    parts = [values[ends[i] - counts[i]: ends[i]] for i in rows]
    return (np.concatenate(parts) if parts else values[:0]), counts[rows]


class DecisionLoop:
    """Device-side eviction for one :class:`~vtoken.device.buffers.DeviceMirror` (see module docstring).

    Args:
        policy: an :class:`~vtoken.policies.base.EvictionPolicy` with a device path.
        mirror: the device mirror the runner builds its slot lists from.
        num_blocks / block_size: the KV cache's geometry (slot = block * block_size + offset).
        max_reqs: most requests per step.
        table: the host :class:`~vtoken.bookkeeping.table.TokenTable` the victims go to (default: the mirror's;
            None when the mirror has none either: :meth:`drain` then only returns the decisions).
        victim_capacity: victims one step's record holds, default ``max(8 * max_reqs, 1024)``
            (it grows between steps when a step wanted more).
        block_capacity: emptied blocks one record holds, default ``max(2 * max_reqs, 256)``.
        cuda_graph: replay the device half of :meth:`decide` from CUDA graphs (CUDA only; one graph
            per (padded batch size, entry bucket), every pair captured by :meth:`warmup` before the first
            step, all captured again after a mirror re-layout or a ring growth). Default off: it has not
            run on a GPU yet.
        min_entry_bucket: the entry ladder's first rung (default 1024; tests use small ones).
    """

    def __init__(self, policy, mirror, *, num_blocks: int, block_size: int, max_reqs: int, table=None,
                 victim_capacity: Optional[int] = None, block_capacity: Optional[int] = None,
                 cuda_graph: bool = False, min_entry_bucket: int = MIN_ENTRY_BUCKET):
        if not hasattr(policy, "select_victims_device"):
            raise InvalidTypeError(f"policy: expected an EvictionPolicy with a device path, got {type(policy).__name__}")
        self.policy = policy
        self.mirror = mirror
        # None: the victims go elsewhere (a vLLM worker ships them to the scheduler's table): drain()
        # returns them without evicting on the host.
        self.table = mirror.table if table is None else table
        self.device = mirror.device
        self.num_blocks = check_int("num_blocks", num_blocks, min_value=1)
        self.block_size = check_int("block_size", block_size, min_value=1)
        self.max_reqs = check_int("max_reqs", max_reqs, min_value=1)
        # Decode evicts about one token per request per step; a prefill over budget evicts more, and
        # whatever does not fit is deferred a step (and the ring grows), never lost.
        victim_capacity = max(8 * max_reqs, 1024) if victim_capacity is None else victim_capacity
        block_capacity = max(2 * max_reqs, 256) if block_capacity is None else block_capacity
        self.ring = VictimRing(max_reqs, victim_capacity, block_capacity, self.device)
        if cuda_graph and self.device.type != "cuda":
            raise InvalidArgumentError(f"cuda_graph: expected a CUDA mirror for graph capture, got device {self.device}")
        self.cuda_graph = bool(cuda_graph)
        self._graphs = StepGraphs(max_reqs, min_bucket=min_entry_bucket)
        self._args = torch.zeros(_NUM_ARGS, max_reqs, dtype=torch.int64, device=self.device)  # fixed per-request args
        cap = mirror.slots.numel()
        self.state = DevicePolicyState.for_policy(policy, cap, self.device)
        self.scored = policy.score_source == "exact"
        # Per-step key mass by mirror position (+1 trash); token_attention adds into it, decide() resets it.
        self.token_mass = torch.zeros(cap + 1, dtype=torch.float32, device=self.device) if self.scored else None
        mirror.add_layout_listener(self._follow_layout)
        self.counts = SlotCounts(mirror, self.num_blocks, self.block_size)
        # The counts' tensors, updated in place (a captured graph writes the same ones).
        self.block_live, self.waste_ratio = self.counts.block_live, self.counts.waste_ratio
        self._block_pick = torch.zeros(self.num_blocks + 1, dtype=torch.int64, device=self.device)  # see _apply
        self._keyed = hasattr(policy, "seed")  # Random draws from (seed, step, request, token)
        self._seed_cache: dict = {}
        self.steps = 0
        self.num_deferred = 0
        self.num_applied = 0

    # ------------------------------------------------------------------ layout
    def _follow_layout(self, source: torch.Tensor, size: int) -> None:
        self._graphs.invalidate()  # captured over the old buffers
        old_capacity = self.state.capacity
        self.state.relayout(source)
        if self.token_mass is None:
            return
        # Between steps token_mass holds only the deferred prompts' masses; they move with their
        # tokens. It keeps its address unless the arena grew, so graphs captured over it stay valid.
        src = torch.where(source < 0, old_capacity, source).to(self.device)
        self.token_mass[old_capacity] = 0  # the trash slot doubles as the zero source
        moved = self.token_mass[src]
        if self.token_mass.numel() != size + 1:
            self.token_mass = torch.zeros(size + 1, dtype=torch.float32, device=self.device)
        self.token_mass[:size].copy_(moved)
        self.token_mass[size] = 0

    def warmup(self, slot_lists) -> None:
        """Capture the device step of every (padded batch size, entry bucket) over ``slot_lists`` (graphs on).

        Call before the first :meth:`decide`. Each pair first runs once eagerly
        over no entry and zero arguments (the lists' ``kv_indptr`` and the
        argument buffer are zeroed meanwhile, then restored): no victim, no
        state change.
        """
        if not self.cuda_graph:
            return
        saved = [t.clone() for t in (self._args, slot_lists.kv_indptr)]
        self._args.zero_()
        slot_lists.kv_indptr.zero_()
        self._graphs.warmup(self, slot_lists)
        for t, v in zip((self._args, slot_lists.kv_indptr), saved):
            t.copy_(v)

    # ------------------------------------------------------------------ device side
    def _stage(self, n: int, seq_lens, num_new, reqs, skip, window, defer) -> None:
        """The step's per-request arguments into the fixed device buffer ``_args`` (one async H2D copy)."""
        budget = np.where(skip | defer, _NO_BUDGET, self.policy.budget.resolve_many(seq_lens))
        seeds = self._seeds(reqs) if self._keyed else 0
        host = np.zeros((_NUM_ARGS, self.max_reqs), dtype=np.int64)  # zeros past n: padding requests evict nothing
        host[0, :n], host[1, :n], host[2, :n], host[3, :n], host[4, :n] = seq_lens, num_new, budget, seq_lens, seeds
        host[5, :n], host[6, :n] = window, defer
        self._args.copy_(self.mirror.deltas.to_device(host.reshape(-1)).view(_NUM_ARGS, -1), non_blocking=True)

    def entry_bucket(self, slot_lists, num_reqs: int) -> int:
        """The entries the device step of ``num_reqs`` requests runs over: the bucket of their host count."""
        return self._graphs.bucket(int(slot_lists.kv_indptr_host[num_reqs]), slot_lists.nnz_max)

    def _batch(self, slot_lists, num_reqs: int, bucket: int) -> DeviceBatch:
        """The step's batch over the first ``bucket`` entries (views: fixed addresses, for the graphs)."""
        args = self._args
        return DeviceBatch(
            kv_pos=slot_lists.kv_pos[:bucket], kv_indptr=slot_lists.kv_indptr, mirror_starts=slot_lists.mirror_starts,
            seq_len=args[0], num_new=args[1], budget=args[2], num_reqs=num_reqs, step=args[3],
            request_seed=args[4], window_step=args[5] != 0,
        )

    def add_entry_mass(self, slot_lists, num_reqs: int, mass: torch.Tensor) -> None:
        """Add per-entry key masses (float ``[>= nnz_max]``, rows as the built slot lists) into :attr:`token_mass`.

        For an attention that returns its key scores per slot-list entry
        rather than adding them in place (``score_out``); padding rows are
        ignored, and rows past the step's entry bucket are not read. No host sync.
        """
        if self.token_mass is None:
            raise InvalidArgumentError(f"mass: expected none for policy {self.policy.name!r} (it reads no scores), "
                                       "got a tensor")
        nnz = slot_lists.nnz_max
        check_tensor("mass", mass, ndim=1, device=self.device)
        if mass.shape[0] < nnz or not mass.dtype.is_floating_point:
            raise InvalidArgumentError(f"mass: expected float [>= {nnz}] (rows as the slot lists), "
                                       f"got {mass.dtype} {tuple(mass.shape)}")
        bucket = self.entry_bucket(slot_lists, num_reqs)
        batch = self._batch(slot_lists, num_reqs, bucket)
        mp = batch.mirror_pos(self.state.capacity)
        self.token_mass.index_add_(0, mp, torch.where(batch.valid, mass[:bucket].to(torch.float32), 0.0))

    def decide(self, reqs: Sequence, slot_lists, *, seq_lens, num_new, done=None, defer=None, prompt_done=None,
               window_scores: Optional[torch.Tensor] = None) -> None:
        """Decide, kill and ship this step's victims for the batch ``reqs`` (as built into ``slot_lists``).

        ``seq_lens`` / ``num_new``: host int arrays per request (tokens so far,
        tokens new this step; the policy's protected tail). ``done``: bool per
        request that must not evict (finished this step). ``defer``: bool per
        request in the middle of its prompt: it evicts nothing, and its key
        masses stay in :attr:`token_mass`, so the step that completes the
        prompt (with ``num_new`` = the whole prompt) gives the policy ONE
        update for it, whatever the chunking. ``prompt_done``: bool per
        request whose prompt this step completes; a policy with
        ``at="prefill"`` decides only for those (``EvictionPolicy.decision_plan``).
        ``window_scores``: float
        ``[nnz_max, H]`` window votes, rows as ``kv_pos`` (SnapKV's prefill;
        its requests decide this step). No host sync.
        """
        reqs, seq_lens, num_new, done, defer, prompt_done = self._check_step(
            reqs, slot_lists, seq_lens, num_new, done, defer, prompt_done, window_scores)
        n = len(reqs)
        bucket = self.entry_bucket(slot_lists, n)
        decides, num_new = self.policy.decision_plan(num_new, prompt_done)
        skip = done | ~decides  # finished, or not deciding this step: evicts nothing
        # A one-time decision (SnapKV's window, any at="prefill" compression) has no later step to take
        # what a full record defers: its record holds every possible victim.
        if window_scores is not None or (self.policy.at == "prefill" and not skip.all()):
            if self.ring.grow(min_victims=int(slot_lists.kv_indptr_host[n])):
                self._graphs.invalidate()
        self._stage(n, seq_lens, num_new, reqs, skip, np.full(n, window_scores is not None, dtype=np.int64), defer)
        self.mirror.flush()  # pending host deltas land first (never inside a captured graph)
        if self.cuda_graph and window_scores is None:
            self._graphs.run(self, slot_lists, n, bucket)
        else:
            self._device_step(slot_lists, n, bucket, window_scores)
        meta = StepMeta(self.steps, reqs, self._generations(reqs), seq_lens.copy(), skip | defer)
        self.ring.ship(meta)
        if debug_checks_enabled():
            self.counts.check()
        if self.table is not None and debug_checks_enabled():  # who held each block when the device decided
            self._owners_at_decide = (self.steps, self.table.ledger.owner.copy())
        self.steps += 1

    def _generations(self, reqs) -> np.ndarray:
        # Without a host table nothing is skipped at drain (the receiver keeps its own registrations).
        return np.zeros(len(reqs), np.int64) if self.table is None else self.table.registry.generations_of(reqs)

    def _check_step(self, reqs, slot_lists, seq_lens, num_new, done, defer, prompt_done, window_scores) -> tuple:
        """Every argument of :meth:`decide`, checked before anything changes (typed errors naming it)."""
        reqs = list(reqs)
        n = len(reqs)
        if n > self.max_reqs:
            raise InvalidArgumentError(f"reqs: expected at most max_reqs={self.max_reqs} requests, got {n}")
        if reqs != list(getattr(slot_lists, "reqs", ())):
            raise InvalidArgumentError(f"reqs: expected the batch the slot lists were built for "
                                       f"({list(getattr(slot_lists, 'reqs', ()))[:4]}...), got {reqs[:4]}...")
        seq_lens = as_index_array("seq_lens", seq_lens)
        num_new = as_index_array("num_new", num_new)
        if seq_lens.shape != (n,) or num_new.shape != (n,):
            raise InvalidArgumentError(f"seq_lens/num_new: expected {n} entries each, got {seq_lens.shape} and {num_new.shape}")
        if n and (num_new.min() < 0 or (num_new > seq_lens).any()):
            raise InvalidArgumentError("num_new: expected 0 <= num_new <= seq_lens per request")
        done = np.zeros(n, dtype=bool) if done is None else np.asarray(done)
        if done.dtype != np.bool_ or done.shape != (n,):
            raise InvalidArgumentError(f"done: expected {n} bools, got {done.dtype} {done.shape}")
        if prompt_done is None and self.policy.at == "prefill":
            raise InvalidArgumentError(f"prompt_done: expected flags (policy {self.policy.name!r} decides when a "
                                       "prompt completes), got None")
        defer, prompt_done = (np.zeros(n, dtype=bool) if a is None else np.asarray(a) for a in (defer, prompt_done))
        for name, flags in (("defer", defer), ("prompt_done", prompt_done)):
            if flags.dtype != np.bool_ or flags.shape != (n,):
                raise InvalidArgumentError(f"{name}: expected {n} bools, got {flags.dtype} {flags.shape}")
        if window_scores is not None:
            if self.policy.score_source != "window":
                raise InvalidArgumentError(f"window_scores: expected None for policy {self.policy.name!r} "
                                           "(only a window-vote policy takes them), got a tensor")
            check_tensor("window_scores", window_scores, ndim=2, device=self.device)
            if window_scores.shape[0] != slot_lists.nnz_max or not window_scores.dtype.is_floating_point:
                raise InvalidArgumentError(f"window_scores: expected float [{slot_lists.nnz_max}, H] (rows as kv_pos), "
                                           f"got {window_scores.dtype} {tuple(window_scores.shape)}")
        if self.table is not None and n:
            self._check_against_table(reqs, seq_lens)
        return reqs, seq_lens, num_new, done, defer, prompt_done

    def _check_against_table(self, reqs: list, seq_lens: np.ndarray) -> None:
        """Every request still registered, and ``seq_lens`` its token count on the host table (host only).

        NOTE: a victim past a request's real length, or one of a request gone since the build, would make
        its record fail at every later ``drain``; a ``seq_lens`` too long would move the protected tail
        onto older tokens. The host's own counts decide, so this costs no device sync."""
        gone = [r for r, g in zip(reqs, self.table.registry.generations_of(reqs)) if g < 0]
        if gone:
            raise InvalidArgumentError(f"reqs: expected requests registered now (as when the slot lists were "
                                       f"built), got {gone[0]!r}, finished since")
        have = self.table.arena.ntok[self.table.rows_of(reqs)]
        bad = np.flatnonzero(have != seq_lens)
        if bad.size:
            i = int(bad[0])
            raise InvalidArgumentError(f"seq_lens: expected each request's token count on the host table, got "
                                       f"{int(seq_lens[i])} for {reqs[i]!r}, which holds {int(have[i])}")

    def _device_step(self, slot_lists, num_reqs: int, bucket: int, window_scores=None) -> None:
        """Everything on the device over the first ``bucket`` entries (fixed shapes, no host read): capturable.

        ``bucket`` must hold the step's entries (:meth:`entry_bucket`); the
        entries past them inside it are padding, the ones past it are not read.
        """
        batch = self._batch(slot_lists, num_reqs, bucket)
        mp = batch.mirror_pos(self.state.capacity)
        if self.scored:
            mass = self.token_mass[mp]
            # A deferred request's masses stay where attention added them (summed over its prompt chunks).
            taken = batch.per_entry(self._args[6], 0) == 0
            self.token_mass.index_copy_(0, mp, torch.where(taken, 0.0, mass))
            self.state.update(batch, mass, entries=taken)
        if window_scores is not None:
            self.policy.record_votes_device(self.state, batch, window_scores[:bucket])
        mask, _ = self.policy.select_victims_device(self.state, batch)
        self._apply(batch, mask, mp)

    def _apply(self, batch: DeviceBatch, mask: torch.Tensor, mp: torch.Tensor) -> None:
        """Trim to the record, kill in the mirror, update the block counts, write the record (device only)."""
        ring, rec = self.ring, self.ring.record
        dest = torch.cumsum(mask, 0) - 1
        kept = mask & (dest < ring.victim_capacity)
        counts = torch.zeros(batch.num_reqs + 1, dtype=torch.int32, device=self.device)
        counts.index_add_(0, batch.req, kept.to(torch.int32))
        ring.counts.zero_()
        ring.counts[: batch.num_reqs] = counts[: batch.num_reqs]
        rec.scatter_(0, torch.where(kept, ring.victims_offset + dest, ring.trash), batch.kv_pos.to(torch.int32))
        # The kept victims' mirror positions, packed as in the record: the kills, the counts and the
        # emptied blocks below are work over the record's victim capacity, not over nnz_max or the mirror.
        cap = ring.victim_capacity
        packed = torch.full((cap + 1,), -1, dtype=torch.int64, device=self.device)
        packed.scatter_(0, torch.where(kept, dest, cap), mp)
        is_victim = packed[:cap] >= 0
        positions = torch.where(is_victim, packed[:cap], 0)  # a non-victim writes "no change" at position 0
        # The slot each kill takes from the counts: the mirror's, where the bit is still set (victims
        # are distinct positions, so each kill counts once).
        gone = torch.where(is_victim, self.counts.counted_slots(positions), self.counts.num_slots)
        self.mirror.kill_on_device(positions, is_victim)
        self.counts.shift(gone, torch.full_like(gone, -1, dtype=torch.int32))
        # Emptied this step: a block that held a victim (so it was live before) and holds nothing now,
        # listed once (one of its victims, whichever the scatter keeps, stands for it).
        block = gone // self.block_size  # the trash slot maps to the trash block
        entry = torch.arange(cap, device=self.device)
        self._block_pick.index_copy_(0, block, entry)
        emptied = (self._block_pick[block] == entry) & (block < self.num_blocks) & (self.block_live[block] == 0)
        bdest = torch.cumsum(emptied, 0) - 1
        rec.scatter_(0, torch.where(emptied & (bdest < ring.block_capacity), ring.blocks_offset + bdest, ring.trash),
                     block.to(torch.int32))
        nv, ne = kept.sum(), emptied.sum()
        header = torch.stack([nv, mask.sum() - nv, torch.clamp(ne, max=ring.block_capacity),
                              torch.clamp(ne - ring.block_capacity, min=0)])
        ring.header.copy_(header)

    def _seeds(self, reqs) -> np.ndarray:
        """``fold32(request_seed(r))`` per request (Random's per-request key), memoized by request id."""
        cache = self._seed_cache
        if len(cache) > 8 * self.max_reqs:
            cache.clear()
        for r in reqs:
            if r not in cache:
                cache[r] = fold32(request_seed(r))
        return np.fromiter((cache[r] for r in reqs), dtype=np.int64, count=len(reqs))

    # ------------------------------------------------------------------ host side
    def drain(self) -> list[AppliedRecord]:
        """Apply every record whose copy completed, oldest first (never waits); returns what they decided.

        One ``evict_flat`` per record, O(victims). A request that finished or
        was re-registered since the decision is not evicted on the host (its
        blocks are gone, or its tokens are new) but its decision is still
        returned: the device did keep those victims out of attention. A
        record leaves the ring only once applied. Between steps the ring
        grows if a step wanted more victims than a record holds.
        """
        applied = []
        rec = self.ring.next_ready()
        while rec is not None:
            applied.append(self._apply_record(rec))
            check = self._emptied_check(rec, applied[-1])  # read before release: the record's buffer is reused
            self.ring.release()
            if check is not None:  # NOTE: after release: a failed check must not leave the record to re-apply
                self._check_emptied(check)
            rec = self.ring.next_ready()
        if self.ring.grow():
            self._graphs.invalidate()  # the record moved
        return applied

    def drain_all(self) -> list[AppliedRecord]:
        """:meth:`drain`, waiting for every copy in flight (end of a run, tests): syncs."""
        self.ring.wait_all()
        return self.drain()

    def _apply_record(self, rec) -> AppliedRecord:
        """Evict a record's victims on the host (one ``evict_flat``); its decisions, every request decided for."""
        meta = rec.meta
        self.num_deferred += rec.deferred
        decided = np.flatnonzero(~meta.done)
        tids, dcounts = _csr_rows(rec.token_ids, rec.counts.astype(np.int64), decided)
        reqs = [meta.reqs[i] for i in decided]
        keep = (self._generations(meta.reqs) == meta.generations)[decided]
        live = np.flatnonzero(keep)  # finished / re-registered since: nothing to evict on the host
        live_ids, live_counts = _csr_rows(tids, dcounts, live)
        if self.table is None:
            return AppliedRecord(reqs, meta.seq_lens[decided], dcounts, tids.astype(np.int64), meta.step, self.steps,
                                 np.zeros(len(reqs), dtype=bool))
        if live_counts.any():
            # origin "device": _device_step killed these in the mirror already; the mirror ships nothing back
            self.table.evict_flat([reqs[i] for i in live], live_ids, live_counts, origin="device")
        self.num_applied += int(live_counts.sum())
        return AppliedRecord(reqs, meta.seq_lens[decided], dcounts, tids.astype(np.int64), meta.step, self.steps, keep)

    def check_mirror(self) -> None:
        """I2 for this loop's mirror against the host table, the device kills not yet drained excepted (syncs)."""
        self.mirror.check_against_table(self.table, pending_kills=self.pending_victims())

    def pending_victims(self) -> dict:
        """{request: token ids} killed on the device and not yet applied on the host (debug checks: syncs)."""
        pending: dict = {}
        for rec in self.ring.peek():
            current = self._generations(rec.meta.reqs)
            counts = rec.counts.astype(np.int64)
            for i, req in enumerate(rec.meta.reqs):
                if current[i] == rec.meta.generations[i] and counts[i]:
                    ids = _csr_rows(rec.token_ids, counts, np.array([i]))[0].astype(np.int64)
                    pending[req] = np.concatenate([pending.get(req, ids[:0]), ids])
        return pending

    def _emptied_check(self, rec, applied: AppliedRecord) -> Optional[np.ndarray]:
        """Debug: the blocks of ``rec`` the device saw emptied that the host must agree on, or None.

        Only one step late (later appends may have refilled a kept tail block), and only blocks still held by
        the same request since the decision: a block freed (its request finished) and handed to another
        request in between holds that request's live tokens rightly."""
        meta = rec.meta
        if (self.table is None or not debug_checks_enabled() or rec.emptied_overflow != 0
                or meta.step != self.steps - 1 or getattr(self, "_owners_at_decide", (None,))[0] != meta.step):
            return None
        emptied = rec.emptied_blocks.astype(np.int64)
        kept = [r for r, k in zip(applied.reqs, applied.applied) if k]
        rows = self.table.rows_of(kept) if kept else np.zeros(0, np.int64)
        owner = self.table.ledger.owner[emptied]
        same = (owner == self._owners_at_decide[1][emptied]) & np.isin(owner, rows)
        return emptied[same]

    def _check_emptied(self, emptied: np.ndarray) -> None:
        """Debug: every block the device saw emptied is free on the host or a request's kept tail block."""
        if emptied.size == 0:
            return
        led = self.table.ledger
        held = led.live[emptied] > 0
        if held.any():
            raise InvariantViolation(f"decision loop: blocks {emptied[held][:8].tolist()} emptied on the device "
                                     "hold live tokens on the host")
