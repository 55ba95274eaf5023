"""The scheduler side of the vtoken connector: mirror, reclamation, the workers' decisions.

One :class:`SchedulerSide` lives in vLLM's engine-core process next to the
``KVCacheManager``. Its token table keeps no block lists of its own: it reads
and writes vLLM's (``req_to_blocks``, through
:class:`vtoken.integrations.vllm.block_lists.VLLMBlockLists`). Per step (vLLM
calls in this order):

1. ``schedule()`` allocates blocks; :meth:`SchedulerSide.note_admission`
   records the tokens of each request admitted (``update_state_after_alloc``).
2. :meth:`SchedulerSide.build_meta` (``build_connector_meta``, the last call of
   ``schedule()``): forget preempted requests, mirror the step's new tokens and
   the blocks vLLM gave them into the token table (the adapter hands the table
   exactly those blocks), report the waiting demand (the prompt vLLM could
   not admit this schedule, :meth:`SchedulerSide.note_waiting_head`), run
   the reclamation manager (plan, bookkeeping
   launch; the plans stay in flight, sources and destinations held), stop
   vLLM hashing the blocks of requests whose prompt is complete, and ship the
   deltas and the plans' copies to the workers.
3. The workers run the forward, decide the step's evictions on the device
   (the victims are dead there at once), copy the planned K/V and report the
   copy and the decisions whose records reached their host.
4. :meth:`SchedulerSide.request_finished` (before vLLM frees a finished
   request's blocks) and :meth:`SchedulerSide.update_output` (after it): the
   table evicts the reported victims, a step or more after the decision
   (Naive-Evict releases fully dead blocks at once: their positions in
   vLLM's list become the null block); then the step's plans are committed
   if every worker reports their copy done (the table switches to the
   destinations, the sources go back to vLLM's pool, their positions in
   vLLM's list become the null block, destinations take the first source
   positions, and the destinations' hashes are dropped), else rolled back
   (the destinations go back, nothing else changed). Nothing here depends on which step's output arrives when, so
   vLLM's async scheduler (step N+1 scheduled before step N's output) is
   handled like the synchronous one.

Nothing here touches a tensor.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
import numpy as np

from vtoken import cdiv
from vtoken.errors import InvalidArgumentError, InvariantViolation
from vtoken.integrations.vllm.allocator import VLLMBlockAllocator, drop_hashes
from vtoken.integrations.vllm.config import VLLM_HEADROOM_SHARE, VTokenVLLMConfig
from vtoken.integrations.vllm.meta import VTokenConnectorMetadata
from vtoken.integrations.vllm.block_lists import VLLMBlockLists, block_ids
from vtoken.bookkeeping.ledger import OWNED, SHARED, BlockLedger
from vtoken.bookkeeping.pool import NULL_BLOCK
from vtoken.bookkeeping.table import TokenTable

logger = logging.getLogger(__name__)

# vLLM's per-request count of hashed blocks, set past any length once a request
# may evict: its cache_blocks (allocate_slots, and the async scheduler's output
# path) then hashes nothing more for it, within the same schedule too.
NEVER_HASH_MORE = 1 << 62


@dataclass
class _Req:
    """Scheduler-side state of one request."""

    admitted_step: int = 0  # decisions of earlier steps were about an earlier registration
    prompt_tokens: int = 0  # tokens vLLM knew at admission: the prompt (plus outputs, when resumed)
    hashing_frozen: bool = False  # its prompt is computed: vLLM hashes none of its blocks from now on


class SchedulerSide:
    """See the module docstring. ``bind`` must be called before anything else."""

    def __init__(self, config: VTokenVLLMConfig):
        self.config = config
        self.reclaim_config = config.make_reclaim_config()
        self.step = 0
        self._reqs: dict = {}
        self._admitting: dict = {}  # request id -> tokens known when vLLM allocated it this schedule
        self._waiting_head: tuple | None = None  # (request id, blocks) vLLM tried to admit this schedule
        self._decided_through = -1  # the workers' decisions of steps up to this one were applied
        self._recent_decisions: dict = {}  # step -> the decisions applied for it (to compare a late rank's)
        self._unconfirmed: dict = {}  # step -> its launched plans, held until the workers report their copy
        self.bound = False
        self.stats = {
            "steps": 0, "evicted_tokens": 0, "relocations": 0, "plans": 0, "reclaimed_blocks": 0,
            "naive_released_blocks": 0, "hashes_dropped": 0,
            "peak_blocks_in_use": 0, "sum_blocks_in_use": 0, "peak_blocks_held": 0, "sum_blocks_held": 0,
            "decisions_applied": 0, "stale_decisions": 0, "worker_meta_bytes": 0,
            "copies_confirmed": 0, "copies_failed": 0, "plans_rolled_back": 0,
            "mirror_us": 0.0, "apply_us": 0.0, "reclaim_us": 0.0,
        }

    # ------------------------------------------------------------------ setup
    def bind(self, kv_cache_manager) -> None:
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

        managers = kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1 or type(managers[0]) is not FullAttentionManager:
            raise InvalidArgumentError(
                "kv_cache_manager: expected one full-attention KV cache group (vtoken supports decoder models "
                f"with full attention), got {[type(m).__name__ for m in managers]}"
            )
        self.kvm = kv_cache_manager
        self.stm = managers[0]
        self.pool = kv_cache_manager.block_pool
        self.S = int(self.stm.block_size)
        from vtoken.reclamation.manager import ReclamationManager

        usable = int(self.pool.num_gpu_blocks) - 1
        if self.reclaim_config.headroom_blocks is None:
            # NOTE: here the headroom is a physical stash taken out of vLLM's free queue once, at bind; it
            # cannot follow the running count as the embedded engine's automatic one does, so an explicit
            # None keeps the connector's fixed share too.
            self.reclaim_config = dataclasses.replace(self.reclaim_config, headroom_blocks=VLLM_HEADROOM_SHARE)
        _, headroom = self.reclaim_config.resolve(usable)
        self.alloc = VLLMBlockAllocator(self.pool, headroom=headroom if self.config.mode == "vtoken" else 0)
        self.ledger = BlockLedger(self.alloc, self.S)
        # vLLM's lists are the table's: one list per request (the table's rows name the requests)
        lists = VLLMBlockLists(self.stm, self.pool, request_of=lambda row: self.table.registry.request_of(row))
        self.table = TokenTable(self.ledger, block_lists=lists)
        self.manager = ReclamationManager(self.table, self.reclaim_config)
        self._reader = self.table.journal.subscribe()  # what the workers learn each step
        self._sync_reserve()
        self._vllm_reset_prefix_cache = kv_cache_manager.reset_prefix_cache
        kv_cache_manager.reset_prefix_cache = self._reset_prefix_cache
        self.bound = True

    def _reset_prefix_cache(self) -> bool:
        """vLLM's ``KVCacheManager.reset_prefix_cache`` with vtoken's stash handed back first, taken again after.

        NOTE: vLLM resets its prefix cache (after an RLHF weight update,
        ``POST /reset_prefix_cache``) only when no block but the null block is
        in use, and the stash holds blocks out of its free queue: without this
        every reset failed (and ``reset_running_requests=True`` raised).
        Relocation destinations in flight (async scheduling) stay in use, so a
        reset then fails as it does for vLLM's own in-use blocks.
        """
        self.alloc.release_stash()
        self._sync_reserve()
        try:
            return self._vllm_reset_prefix_cache()
        finally:
            self.alloc.top_up()
            self._sync_reserve()

    def _sync_reserve(self) -> None:
        # NOTE: the ledger's reserve must equal the blocks physically stashed:
        # mirroring a vLLM allocation must never fail on a soft reserve that
        # vLLM's own admission did not respect.
        self.ledger.set_reserve(self.alloc.held)

    # -------------------------------------------------------------- admission
    def note_admission(self, rid, num_tokens: int) -> None:
        """vLLM allocated blocks for a waiting request (new or resumed) knowing ``num_tokens`` of its tokens."""
        self._admitting[rid] = int(num_tokens)

    def note_waiting_head(self, rid, num_tokens: int, num_computed: int) -> None:
        """vLLM considers admitting waiting request ``rid`` (``num_tokens``, ``num_computed`` of them cached).

        NOTE: vLLM admits first come, first served and stops at the first
        request whose whole prompt (plus its watermark) does not fit the free
        blocks, so the last request it considers in a schedule and does not
        admit is the one more free blocks would let in next: its blocks are
        the waiting demand the trigger sees (:meth:`_waiting_demand`). Without
        it, reclamation freed blocks only for the running requests' growth
        and never enough to admit another prompt.
        """
        blocks = cdiv(int(num_tokens), self.S) - int(num_computed) // self.S
        self._waiting_head = (rid, blocks + int(self.kvm.watermark_blocks))

    def _waiting_demand(self) -> int:
        """Blocks owed beyond the running requests' growth: the waiting head's prompt and the rest of partial prompts."""
        owed = 0
        for rid, st in self._reqs.items():
            if not st.hashing_frozen and rid in self.table:  # its prompt is still being computed (chunked)
                owed += max(0, cdiv(st.prompt_tokens, self.S) - cdiv(self.table.num_tokens(rid), self.S))
        head, self._waiting_head = self._waiting_head, None
        if head is not None and head[0] not in self.table:  # not admitted in the end
            owed += head[1]
        return owed

    # -------------------------------------------------------------- per step
    def build_meta(self, so) -> VTokenConnectorMetadata:
        """Mirror the scheduled step ``so`` (a vLLM ``SchedulerOutput``); return the worker deltas."""
        t0 = time.perf_counter()
        for rid in sorted(so.preempted_req_ids or ()):
            if rid in self.table:
                # vLLM freed every block of the request already (_preempt_request), its list with them.
                self._forget(rid)
        computed = {d.req_id: d.num_computed_tokens for d in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        for rid, c in zip(cached.req_ids, cached.num_computed_tokens):
            computed[rid] = c
        # NOTE: vLLM allocates in scheduling order (running, then new requests), and a
        # prefix-cache hit may name blocks allocated earlier in the SAME step (two
        # identical prompts admitted together). Mirroring in that order, flushing the
        # batch before each admission with hits, registers those blocks first.
        batch: list = []  # (rid, n, new block ids)
        prompt_tokens: dict = {}  # of the requests admitted this step, for the workers
        for rid, n in so.num_scheduled_tokens.items():
            if rid not in self.table:
                if computed[rid] > 0:
                    self._mirror_batch(batch)
                    batch = []
                self._admit(rid, computed[rid])  # the journal carries its prefix-cache hits' slots
                prompt_tokens[rid] = self._reqs[rid].prompt_tokens
            st = self._reqs[rid]
            have = self.table.num_tokens(rid)
            if have != computed[rid]:
                raise InvariantViolation(
                    f"mirror: request {rid!r} has {have} tokens in vtoken's table, vLLM computed {computed[rid]}"
                )
            vids = block_ids(self.stm, rid)
            lo, hi = cdiv(have, self.S), cdiv(have + n, self.S)
            if len(vids) < hi:
                raise InvariantViolation(f"mirror: vLLM holds {len(vids)} blocks for {rid!r}, {hi} needed")
            batch.append((rid, int(n), vids[lo:hi]))
            if not st.hashing_frozen and have + n >= st.prompt_tokens:
                self._freeze_hashing(rid, st)
        self._mirror_batch(batch)
        t1 = time.perf_counter()
        self.manager.note_waiting(self._waiting_demand())
        copy_src, copy_dst = self._reclaim()
        t2 = time.perf_counter()
        self._admitting.clear()
        meta = VTokenConnectorMetadata(step=self.step, events=self.table.journal.take(self._reader),
                                       prompt_tokens=prompt_tokens, copy_src=copy_src, copy_dst=copy_dst)
        # The workers build the step's slot lists in start_load_kv, which both runners call
        # before the forward only for steps with synchronous loads.
        so.has_sync_kv_loads = True
        self.stats["relocations"] += meta.num_moves
        self._sample_usage()
        if self.config.checking:
            self.check()
        self.stats["mirror_us"] += (t1 - t0) * 1e6
        self.stats["reclaim_us"] += (t2 - t1) * 1e6
        self.stats["steps"] += 1
        self.step += 1
        return meta

    def _mirror_batch(self, batch: list) -> None:
        """Append the step's tokens of ``batch`` [(rid, n, vLLM's new block ids)] to the table."""
        if not batch:
            return
        reqs = [b[0] for b in batch]
        counts = [b[1] for b in batch]
        with self.alloc.mirroring(np.concatenate([b[2] for b in batch]).tolist()):
            slots = self.table.sync_new_tokens_batch(reqs, counts)
        if slots is None:
            raise InvariantViolation("mirror: the table could not take the blocks vLLM allocated")

    def _admit(self, rid, num_computed: int) -> None:
        """Register a request (new or resumed); ``num_computed`` tokens are prefix-cache hits."""
        led, S = self.ledger, self.S
        vids = block_ids(self.stm, rid)
        full = num_computed // S
        hits = vids[: cdiv(num_computed, S)]
        # Hits that live requests hold, unchanged at the same position, are shared.
        j = 0
        while j < full and led.state[hits[j]] in (OWNED, SHARED) and led.pos[hits[j]] == j:
            j += 1
        rest = hits[j:]
        foreign = rest[np.isin(led.state[rest], (OWNED, SHARED))] if rest.size else rest
        if foreign.size:
            # NOTE: unreachable while every mid-request free drops the block's hash
            # (allocator.free) and tainted blocks lose theirs; kept as a loud check.
            raise InvariantViolation(
                f"mirror: prefix-cache hit of {rid!r} reuses blocks {foreign[:8].tolist()} held by other requests "
                "after a block that is not; vtoken cannot share them (disable prefix caching)"
            )
        with self.alloc.mirroring(()):
            self.table.add_request(rid, prefix_blocks=hits[:j])
        if rid not in self._admitting:
            raise InvariantViolation(f"mirror: request {rid!r} was scheduled without an allocation for it this step")
        self._reqs[rid] = _Req(admitted_step=self.step, prompt_tokens=self._admitting.pop(rid))
        if rest.size:
            # Freed-but-cached blocks vLLM touched back: now owned by this request.
            with self.alloc.mirroring(rest.tolist()):
                if self.table.sync_new_tokens(rid, num_computed - j * S) is None:
                    raise InvariantViolation(f"mirror: could not register the cached blocks of {rid!r}")

    def _reclaim(self) -> tuple[np.ndarray, np.ndarray]:
        """Plan and launch this step's relocations; return the slots the workers copy (src, dst)."""
        mgr = self.manager
        plans = mgr.maybe_plan()
        mgr.launch(plans)  # bookkeeping only here: the workers copy after their forward
        # NOTE: nothing is committed before the workers report the copy (update_output):
        # the sources stay listed in vLLM and in the table, so a failed copy costs nothing
        # but the plan, and no block a copy reads can be handed out before it ran.
        mgr.commit(hold=True)
        self.alloc.top_up()
        self._sync_reserve()
        if not plans:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        self.stats["plans"] += len(plans)
        self._unconfirmed[self.step] = plans
        return (np.concatenate([p.src_slots for p in plans]).astype(np.int32),
                np.concatenate([p.dst_slots for p in plans]).astype(np.int32))

    def _settle_copies(self, through: int, copies: dict) -> None:
        """Commit the plans of every step up to ``through`` whose copy all workers report done; roll back the rest.

        ``copies``: the workers' aggregated ``{step: ok}``. vLLM hands the
        scheduler each step's output once, in step order, and every worker
        reports its copy of step N in step N's output; a plan of a step up to
        ``through`` with no report was never copied (a rollback is always
        safe: no worker reads a destination before the commit's moves).
        """
        for step in sorted(s for s in self._unconfirmed if s <= through):
            plans = self._unconfirmed.pop(step)
            if copies.get(step) is True:
                freed = self.manager.confirm(plans)
                self.stats["copies_confirmed"] += 1
                self.stats["reclaimed_blocks"] += int(len(freed))
                for p in plans:
                    if p.request in self.table:
                        # A destination's bytes (a fill block's holes too) no longer match any prefix: no hash.
                        dst = np.concatenate([p.dst_blocks, p.fill_blocks])
                        self.stats["hashes_dropped"] += drop_hashes(self.pool, dst.tolist())
            else:
                self.stats["copies_failed"] += 1
                self.stats["plans_rolled_back"] += self.manager.abort(plans)
                logger.warning("vtoken: the relocation copy of step %d %s; its %d plans were rolled back", step,
                               "failed on a worker" if step in copies else "was not reported", len(plans))
        self.alloc.top_up()
        self._sync_reserve()

    def _sample_usage(self) -> None:
        in_use = int(self.pool.num_gpu_blocks) - 1 - int(self.pool.get_num_free_blocks())
        held = in_use - self.alloc.held
        s = self.stats
        s["peak_blocks_in_use"] = max(s["peak_blocks_in_use"], in_use)
        s["sum_blocks_in_use"] += in_use
        s["peak_blocks_held"] = max(s["peak_blocks_held"], held)
        s["sum_blocks_held"] += held

    def _freeze_hashing(self, rid, st: _Req) -> None:
        """``rid``'s prompt is computed this step: from now on the workers may evict from it.

        NOTE: a block computed after a request's first eviction holds K/V (from
        layer 1 on) that differ from what its hash promises another request.
        The workers kill victims right after a forward and the scheduler learns
        them a step or more later (later still under async scheduling), while
        vLLM hashes a block in the ``allocate_slots`` of the schedule that
        fills it, before a later admission of the same schedule looks it up.
        So, in the modes that evict, a request's blocks stop being hashed once
        its prompt is computed: vLLM's count of its hashed blocks is set past
        any length. Its prompt blocks, filled before, keep their hashes.
        """
        st.hashing_frozen = True
        if self._hashing_stops_after_prompts:
            self.stm.num_cached_block[rid] = NEVER_HASH_MORE

    @property
    def _hashing_stops_after_prompts(self) -> bool:
        return self.config.evicts and self.config.drop_tainted_hashes and self.pool.enable_caching

    # ---------------------------------------------------------- after the step
    def update_output(self, worker_meta) -> None:
        """Evict the victims the workers decided (and have reported), once each, in step order; settle the copies."""
        t0 = time.perf_counter()
        # NOTE: vLLM's reset_prefix_cache(reset_running_requests=True) preempts between steps, outside
        # schedule(): those lists are gone before build_meta hears of it, and their decisions may be in
        # this output. Forget them now: the decisions are then stale, not written to a missing list.
        for rid in [r for r in self._reqs if r in self.table and r not in self.stm.req_to_blocks]:
            self._forget(rid)
        decisions = getattr(worker_meta, "decisions", None) or ()
        if decisions:
            self.stats["worker_meta_bytes"] += worker_meta.nbytes
        for dec in decisions:
            if dec.step <= self._decided_through:
                # Reported before by another tensor-parallel rank: it must have decided the same.
                seen = self._recent_decisions.get(dec.step)
                if seen is not None and not seen.same_as(dec):
                    raise InvariantViolation(f"worker decisions: tensor-parallel ranks decided step {dec.step} "
                                             "differently")
                continue
            for rid, _, victims in dec.rows():
                st = self._reqs.get(rid)
                if st is None or rid not in self.table or st.admitted_step > dec.step:
                    self.stats["stale_decisions"] += 1  # finished, or preempted and re-admitted since
                    continue
                held = self.table.held_blocks(rid)
                self.table.evict(rid, victims, origin="device")  # the workers killed them in their mirrors
                self.stats["naive_released_blocks"] += held - self.table.held_blocks(rid)
                self.stats["evicted_tokens"] += int(victims.size)
                self.stats["decisions_applied"] += 1
            self._decided_through = dec.step
            self._recent_decisions[dec.step] = dec
            if len(self._recent_decisions) > 64:  # a late rank reports within a few steps
                del self._recent_decisions[next(iter(self._recent_decisions))]
        # After the evictions: a plan commits only its survivors.
        if worker_meta is not None and self._unconfirmed:
            self._settle_copies(worker_meta.step, worker_meta.copies)
        self.stats["apply_us"] += (time.perf_counter() - t0) * 1e6
        if self.config.checking:
            self.check()

    def request_finished(self, rid) -> None:
        """vLLM is about to free the request's blocks: drop it from the table without freeing them."""
        if rid in self.table:
            self._forget(rid)

    def _forget(self, rid) -> None:
        """Drop ``rid`` from the table; vLLM frees (or freed) the blocks its list holds, not vtoken.

        NOTE: which blocks those are comes from the ledger, not from vLLM's list:
        a preempted request's list is gone before build_meta hears of it, and so
        is that of one preempted and aborted before the next build_meta.
        """
        row = self.table.row_of(rid)
        vllm_frees = set(self.ledger.listed_blocks(row).tolist())
        self.table.lists.release(row)  # a plan rolled back as it leaves must not null vLLM's entries
        with self.alloc.detached(vllm_frees):
            self.manager.finish_request(rid)
        self._reqs.pop(rid, None)

    def shutdown(self) -> None:
        if self.bound:
            for plans in self._unconfirmed.values():  # their destinations go back to vLLM's pool
                self.manager.abort(plans)
            self._unconfirmed = {}
            self.alloc.release_stash()
            self._sync_reserve()

    # ---------------------------------------------------------------- checks
    def check(self) -> None:
        """Table/ledger invariants over vLLM's block lists; no listed block is free (O(blocks))."""
        self.table.check_invariants()  # every listed block recorded by the ledger at its position, once per holder
        for rid, st in self._reqs.items():
            if rid not in self.table:
                continue
            tl = self.table.block_list(rid)  # vLLM's list, the table's part of it
            live = tl[tl != NULL_BLOCK]
            refs = self.alloc.ref_count(live) if live.size else np.zeros(0)
            if (refs < 1).any():
                raise InvariantViolation(f"block lists: request {rid!r} lists freed blocks {live[refs < 1][:8].tolist()}")
            if st.hashing_frozen and self._hashing_stops_after_prompts:
                hashed = [b.block_id for b in self.stm.req_to_blocks.get(rid, ())[st.prompt_tokens // self.S:]
                          if not b.is_null and b.block_hash is not None]
                if hashed:
                    raise InvariantViolation(
                        f"prefix cache: blocks {hashed[:8]} of {rid!r}, filled after its prompt, carry a hash"
                    )

    def summary(self) -> dict:
        """Counters plus the current pool state (for tests and logs)."""
        out = dict(self.stats)
        if self.bound:
            out.update(
                num_gpu_blocks=int(self.pool.num_gpu_blocks),
                free_blocks=int(self.pool.get_num_free_blocks()),
                headroom_held=self.alloc.held,
                freed_hashes_dropped=self.alloc.hashes_dropped,
                requests=len(self._reqs),
                waste_ratio=float(self.ledger.waste_ratio),
            )
        return out
