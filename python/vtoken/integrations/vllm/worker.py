"""The worker side of the vtoken connector: token-table mirror, slot lists, relocation copies, decisions.

One :class:`WorkerSide` per worker process (one per tensor-parallel rank),
created by the connector's ``WORKER`` role and bound, at ``register_kv_caches``,
to the attention layers whose KV caches it registered
(:func:`vtoken.integrations.vllm.attention.bind_worker`): their metadata
builder hands it to the forward in each step's attention metadata.

Per step:

- ``handle_preemptions`` (first call of ``execute_model``): apply the step's
  table events (:mod:`vtoken.bookkeeping.journal`, shipped in the connector metadata; the
  moves of relocations whose copy an earlier step ran) to the device mirror
  (:class:`vtoken.device.buffers.DeviceMirror`, with no host table of its own), then
  ``CopyEngine.before_forward``: the compute stream waits on the last
  relocation event (I3; no host wait);
- ``start_load_kv`` (before the forward: the scheduler side marks every step
  ``has_sync_kv_loads``), :meth:`WorkerSide.prepare_step`:
  ``ops.build_slot_lists`` rebuilds ``kv_indices`` / ``kv_indptr`` /
  ``slot_mapping`` in fixed-address buffers from the device mirror, for the
  batch in the runner's row order, and the attention metadata vLLM built
  for the step is pointed at them (Model Runner V2 builds it before it
  hands the connector the step's events, the V1 runner after);
- the attention backend plans ``token_attention`` once per step
  (:meth:`WorkerSide.plan_attention`: validation, tiling, workspaces carved
  from one buffer preallocated at ``register_kv_caches``) and runs the plan
  per layer, which adds each listed key's mass in place into one per-step
  score buffer (``score_out``; nothing per layer is allocated or zeroed);
- ``wait_for_save`` (after the forward): the eviction decision runs on the
  device (:class:`vtoken.decisions.loop.DecisionLoop`: the step's key masses,
  summed over tensor-parallel ranks on the device, the device policy, the
  victims killed in the mirror so the next attention never reads them; a
  request mid-prompt evicts nothing), then ONE ``compact_kv`` launch on the
  relocation stream copies the step's planned moves (``copy_src`` to
  ``copy_dst``); the mirror is not touched: the scheduler commits the plans
  only once every worker reported the copy, and the commit's move events
  re-point the mirror at a later step;
- ``build_connector_worker_meta``: the copy's outcome and the decisions whose
  records reached the host (never waited for) go back to the scheduler,
  O(victims) bytes, which applies them to its table (block frees, relocation
  planning) a step or more late. No per-token score leaves the device.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np
import torch

from vtoken.device import kv_fingerprint, ops
from vtoken.device.buffers import DeviceMirror, SlotListBuffers
from vtoken.device.copy_engine import CopyEngine
from vtoken.decisions.loop import DecisionLoop
from vtoken.errors import InvalidArgumentError, InvariantViolation
from vtoken.integrations.vllm.meta import StepDecisions, VTokenConnectorMetadata, VTokenWorkerMetadata
from vtoken.integrations.vllm.workspace import AttentionWorkspace
from vtoken.layout import KVLayout

logger = logging.getLogger(__name__)

KV_LAYOUT_NAME = "vllm_fused"  # vLLM 0.32's per-layer view [num_blocks, H, block_size, 2*D] (docs/vllm.md)

class WorkerSide:
    """See the module docstring.

    Args:
        max_reqs: the batch size bound (``max_num_seqs``).
        max_tokens: tokens per step bound (``max_num_batched_tokens``).
        max_moves: relocation moves per step bound (``reclaim.max_moves_per_step``).
        policy: the eviction policy (with a device path), or None (native mode: no decisions).
        reduce_scores: sums a float tensor over the tensor-parallel ranks in place (None: one rank).
        fixed_slot_lists: fix the slot lists at min(this bound, the physical slots) entries and never
            move them (full CUDA graphs replay captured addresses; the connector passes
            ``max_num_seqs x max_model_len`` and refuses prefix caching, so no batch lists more
            keys than there are slots); None: sized by physical slots, grown when needed.
        attention: the shapes that size the attention workspace, preallocated with the slot
            lists; None: each step's plan allocates its own.
        force_sync: the host waits on every relocation copy (ablation).
        checking: run the debug checks (slot mapping vs vLLM's, I1 around copies).
    """

    def __init__(self, *, max_reqs: int, max_tokens: int, max_moves: int, policy=None,
                 reduce_scores: Optional[Callable[[torch.Tensor], None]] = None, force_sync: bool = False,
                 checking: bool = False, fixed_slot_lists: Optional[int] = None,
                 attention: Optional[AttentionWorkspace] = None):
        self.max_reqs, self.max_tokens, self.max_moves = int(max_reqs), int(max_tokens), int(max_moves)
        self.policy = policy
        self.reduce_scores = reduce_scores
        self.fixed_slot_lists = None if fixed_slot_lists is None else int(fixed_slot_lists)
        self.force_sync = bool(force_sync)
        self.checking = bool(checking)
        self.attention = attention
        self._workspace: Optional[torch.Tensor] = None  # float32, the attention plans' workspace
        self._workspace_entries = 0  # listed keys the workspace's decode logits hold
        self._entry_pos: Optional[torch.Tensor] = None  # int32 arange: score_out[0 + j] is entry j's
        self._zero_starts: Optional[torch.Tensor] = None
        self.mirror: Optional[DeviceMirror] = None
        self.buffers: Optional[SlotListBuffers] = None
        self.copy_engine: Optional[CopyEngine] = None
        self.loop: Optional[DecisionLoop] = None
        self.kv_caches: list = []
        self.layout: Optional[KVLayout] = None
        self.device = torch.device("cpu")
        self._meta: Optional[VTokenConnectorMetadata] = None
        self._copies: dict = {}  # step -> its relocation copy was launched (True) or failed (False)
        self._failure: Optional[Exception] = None  # a debug check that failed before this step's collective
        self._scores: Optional[torch.Tensor] = None
        self._batch: list = []
        self._query_lens = np.zeros(0, dtype=np.int64)
        self._batch_step = -1
        self._prompt_tokens: dict = {}  # request -> tokens to compute before it may evict
        self._decided_steps: dict = {}  # the loop's step -> the scheduler step it decided at
        self._pending_attention: list = []  # this step's attention metadata, filled by prepare_step
        self.stats = {"steps": 0, "moves": 0, "copies": 0, "event_waits": 0, "slot_lists_built": 0,
                      "slot_list_grows": 0, "decisions": 0, "victims": 0, "worker_meta_bytes": 0,
                      "attention_plans": 0, "failed_copies": 0}

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict) -> None:
        seen, caches = set(), []
        for name, t in kv_caches.items():
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(f"kv_caches[{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
            if t.data_ptr() in seen:  # KV sharing across layers: copy each tensor once
                continue
            seen.add(t.data_ptr())
            caches.append(t)
        if not caches:
            raise InvalidArgumentError("kv_caches: expected at least one KV cache tensor, got none")
        self.layout = KVLayout.from_tensor(caches[0], KV_LAYOUT_NAME)
        for t in caches[1:]:
            if KVLayout.from_tensor(t, KV_LAYOUT_NAME) != self.layout or t.dtype != caches[0].dtype:
                raise InvalidArgumentError("kv_caches: expected every layer with the same shape, strides and dtype")
        self.kv_caches = caches
        self.device = caches[0].device
        nnz_max = self.layout.num_blocks * self.layout.block_size  # physical slots: what can be resident
        if self.fixed_slot_lists is not None:
            nnz_max = self.fixed_slot_lists = min(self.fixed_slot_lists, nnz_max)
        self.mirror = DeviceMirror(None, self.device)  # fed with the scheduler table's events
        self._allocate_lists(nnz_max)
        self._zero_starts = torch.zeros(self.max_reqs, dtype=torch.int64, device=self.device)
        if self.attention is not None:
            # NOTE: sized once, by the resident slots; lists grown past them (shared prefixes) plan their
            # decode steps on the varlen path, which needs no [num_q_heads, entries] logits (plan_attention).
            self._workspace_entries = nnz_max
            self._workspace = torch.empty(self.attention.attention_numel(nnz_max, self.device),
                                          dtype=torch.float32, device=self.device)
        self.copy_engine = CopyEngine(caches, self.layout, max_moves=self.max_moves, force_sync=self.force_sync)
        if self.policy is not None:
            self.loop = DecisionLoop(self.policy, self.mirror, num_blocks=self.layout.num_blocks,
                                     block_size=self.layout.block_size, max_reqs=self.max_reqs, table=None)

    @property
    def ready(self) -> bool:
        return self.mirror is not None

    # --------------------------------------------------------- before forward
    def begin_step(self, meta: VTokenConnectorMetadata) -> None:
        """Apply the step's events and fence the last copy (I3)."""
        if not self.ready:
            raise InvariantViolation("worker: metadata arrived before register_kv_caches")
        for ev in meta.events:
            if ev[0] == "finish":
                self._prompt_tokens.pop(self.mirror.request_of_row(ev[1]), None)
        self._prompt_tokens.update(meta.prompt_tokens)
        self.mirror.apply(meta.events)
        if self.copy_engine.before_forward(step=meta.step):
            self.stats["event_waits"] += 1
        self._meta = meta
        self.stats["steps"] += 1

    def expect_attention(self, meta) -> None:
        """The attention metadata builder built ``meta`` for this step: :meth:`prepare_step` fills it.

        With fixed slot lists it points at the buffers at once: a dummy run (warm-up, CUDA-graph
        capture), which runs with the connector off, then attends over them as they are.
        """
        self.attach_fixed_slot_lists(meta)
        if len(self._pending_attention) >= 8:  # V2 dummy runs build with the connector off: keep the newest
            del self._pending_attention[0]
        self._pending_attention.append(meta)

    def attach_fixed_slot_lists(self, meta) -> None:
        """With fixed slot lists, point ``meta`` at the buffers as they are (a dummy or captured batch too)."""
        if self.fixed_slot_lists is not None:
            meta.kv_indices = self.buffers.kv_indices
            meta.kv_indptr = self.buffers.kv_indptr[: meta.num_reqs + 1]
            meta.want_scores = self.want_scores

    def prepare_step(self, request_ids=None) -> None:
        """Before the forward: rebuild the slot lists for the batch and point the step's attention metadata at them.

        ``request_ids``: the batch's requests in row order (Model Runner V2
        passes them to ``start_load_kv``); None takes the order the V1 runner
        published to the builder. Called after ``handle_preemptions`` on both
        runners, so the mirror holds the step's events.
        """
        if not self._pending_attention:
            return
        meta = self._pending_attention[-1]
        req_ids = list(request_ids) if request_ids is not None else meta.req_ids
        if req_ids is None:
            # Model Runner V2 with no forward this step (it names no requests): what is pending
            # was built by its dummy runs (warm-up, capture), which run with the connector off.
            self._pending_attention = []
            return
        n = min(len(req_ids), meta.num_reqs)
        bufs = self.build_slot_lists(req_ids[:n], meta.query_lens[:n],
                                     None if meta.seq_lens is None else meta.seq_lens[:n])
        if self.checking and meta.slot_mapping is not None and meta.slot_mapping.device.type == "cpu":
            t = int(meta.query_lens[:n].sum())
            if not torch.equal(bufs.slot_mapping[:t].to(torch.int64), meta.slot_mapping[:t].to(torch.int64)):
                self._fail(InvariantViolation("worker mirror: vtoken's slot mapping differs from vLLM's"))
        # NOTE: a view of the fixed-address buffer cut at this batch's live total (known on the
        # host: an upper bound), so key scores are [total, H] rather than [nnz_max, H].
        total = max(int(bufs.kv_indptr_host[n]), 1)
        for m in self._pending_attention:  # one per KV cache group (vtoken runs with one)
            # Whole buffers with fixed slot lists: a replayed graph reads the addresses and shapes it captured.
            m.kv_indices = bufs.kv_indices if self.fixed_slot_lists is not None else bufs.kv_indices[:total]
            m.kv_indptr = bufs.kv_indptr[: m.num_reqs + 1]  # rows past n repeat the total: empty
            m.want_scores = self.want_scores
        self._pending_attention = []

    def build_slot_lists(self, req_ids: list, query_lens: np.ndarray, seq_lens: Optional[np.ndarray] = None):
        """Rebuild the batch's ``kv_indices`` / ``kv_indptr`` / ``slot_mapping`` (fixed addresses).

        ``req_ids`` in batch order, ``query_lens`` the tokens each computes this
        step. Returns the :class:`SlotListBuffers`.
        """
        if seq_lens is not None:
            n = np.fromiter((self.mirror.num_tokens(r) for r in req_ids), dtype=np.int64, count=len(req_ids))
            if not np.array_equal(n, np.asarray(seq_lens[: len(req_ids)], dtype=np.int64)):
                raise InvariantViolation(
                    f"worker mirror: token counts {n.tolist()[:8]} differ from vLLM's seq_lens "
                    f"{np.asarray(seq_lens[: len(req_ids)]).tolist()[:8]}"
                )
        self._ensure_capacity(req_ids)
        self.mirror.build(self.buffers, req_ids, query_lens)
        total = int(self.buffers.kv_indptr_host[len(req_ids)])
        if self.want_scores:
            self._scores[:total].zero_()
        self._batch = list(req_ids)
        self._query_lens = np.asarray(query_lens, dtype=np.int64)[: len(req_ids)].copy()
        self._batch_step = self._meta.step if self._meta is not None else -1
        self.stats["slot_lists_built"] += 1
        return self.buffers

    def _ensure_capacity(self, req_ids: list) -> None:
        """Grow the slot lists and the score buffer when the batch lists more keys than they hold.

        NOTE: a shared prefix slot is listed once per holder, so the logical entries
        (live tokens summed over the batch) can exceed the physical slots many times
        over (100 requests over one 2K-token system prompt list 200K entries). Sized
        by physical slots at start, the buffers grow by 1.5x past the need, between
        steps (they are rebuilt every step; this backend is not captured in graphs).
        """
        need = sum(self.mirror.live_count(r) for r in req_ids)
        if need <= self.buffers.nnz_max:
            return
        if self.fixed_slot_lists is not None:  # no prefix caching: no slot is listed twice
            raise InvariantViolation(f"worker: the batch lists {need} keys, past the fixed slot lists' "
                                     f"{self.buffers.nnz_max} (the KV cache's slots)")
        self._allocate_lists(max(need, self.buffers.nnz_max * 3 // 2))
        self.stats["slot_list_grows"] += 1

    def _allocate_lists(self, nnz_max: int) -> None:
        """The slot lists, the per-entry score buffer and its destinations for ``nnz_max`` entries."""
        self.buffers = SlotListBuffers(max_reqs=self.max_reqs, nnz_max=nnz_max, max_tokens=self.max_tokens,
                                       device=self.device)
        self._scores = torch.zeros(nnz_max, dtype=torch.float32, device=self.device)
        self._entry_pos = torch.arange(nnz_max, dtype=torch.int32, device=self.device)

    @property
    def want_scores(self) -> bool:
        """The attention should add its key scores (the policy reads exact attention mass)."""
        return self.loop is not None and self.loop.scored

    def plan_attention(self, meta, *, num_q_heads: int, dtype: torch.dtype, scale: float):
        """The step's :class:`vtoken.device.ops.TokenAttentionStep` over ``meta``'s slot lists (planned once, kept on ``meta``).

        Every layer of the step runs it. With scores, each run adds its keys' mass into the
        per-entry score buffer: ``score_out[0 + j]`` is entry ``j``'s (``mirror_starts`` zeros,
        ``kv_pos`` the entry index), which :meth:`end_step` reduces over ranks and hands the loop.
        """
        key = (num_q_heads, dtype, scale)
        if meta.plan is not None and meta.plan_key == key:
            return meta.plan
        nnz = meta.kv_indices.numel()
        scored = meta.want_scores
        # Uniform decode takes the decode path (no q_indptr): its launch depends only on shapes, so a full
        # CUDA graph captured over the fixed-address slot lists replays correctly. NOTE: past the
        # workspace's entries (grown lists) it takes the varlen path, whose scores need no logits.
        decode = meta.uniform_decode and not (scored and self._workspace is not None
                                              and nnz > self._workspace_entries)
        meta.plan = ops.plan_token_attention(
            self.layout, meta.kv_indices, meta.kv_indptr, None if decode else meta.q_indptr,
            num_q_heads=num_q_heads, dtype=dtype, num_q_tokens=meta.num_actual_tokens, scale=scale, scores=scored,
            mirror_starts=self._zero_starts if scored else None, kv_pos=self._entry_pos[:nnz] if scored else None,
            workspace=self._workspace,
        )
        meta.plan_key = key
        self.stats["attention_plans"] += 1
        return meta.plan

    @property
    def score_out(self) -> torch.Tensor:
        """float32 ``[nnz_max]``: this step's key masses per slot-list entry (the attention adds in place)."""
        return self._scores

    # ---------------------------------------------------------- after forward
    def end_step(self) -> None:
        """Decide the step's evictions on the device, then launch its relocation copy (reported, not applied)."""
        meta = self._meta
        if meta is None:
            self._raise_failure()
            return
        if self.loop is not None and self._batch and self._batch_step == meta.step:
            self._decide(meta.step)
        self._raise_failure()  # a step with no collective: nothing to agree on
        if meta.copy_src.size and meta.step not in self._copies:
            self._copies[meta.step] = self._copy(meta.copy_src, meta.copy_dst, meta.step)

    def _copy(self, src: np.ndarray, dst: np.ndarray, step: int) -> bool:
        """Launch the step's relocation copy; False when it failed (the scheduler then rolls its plans back)."""
        # NOTE: a failure is reported, not raised: the scheduler commits nothing before every
        # worker reports the copy launched, and no mirror reads a destination before that
        # commit, so rolling the plans back leaves every request as it was (the sources were
        # never freed) and the engine keeps serving. The catch decides nothing about the device.
        try:
            self.copy_engine.launch(src, dst, step=step)
        except Exception:
            logger.exception("vtoken: the relocation copy of step %d failed; the scheduler rolls it back", step)
            if self.device.type == "cuda":
                # A partial copy left on the relocation stream must not land after the freed
                # destinations' next writer: drain it (failure path only).
                torch.cuda.synchronize(self.device)
            self.stats["failed_copies"] += 1
            return False
        self.stats["moves"] += len(src)
        self.stats["copies"] += 1
        if self.checking:
            self._check_copy(src, dst)
        return True

    def _decide(self, step: int) -> None:
        """The device decision over the batch just attended (no host sync)."""
        reqs, n, bufs = self._batch, len(self._batch), self.buffers
        if self.loop.scored:  # first: nothing that may raise on one rank comes before the collective
            self._sum_masses(int(bufs.kv_indptr_host[n]))
        seq = bufs.num_tokens_host[:n].copy()  # as the slot lists were built (the mirror has not changed since)
        prompt = np.fromiter((self._prompt_tokens.get(r, 0) for r in reqs), dtype=np.int64, count=n)
        qlen = self._query_lens
        defer = seq < prompt  # mid-prompt: no eviction, its masses wait for the prompt's last chunk
        # The step that completes the prompt sees the whole prompt as new, as an unchunked prefill would.
        prompt_done = ~defer & (seq - qlen < prompt)
        num_new = np.where(prompt_done, np.minimum(prompt, seq), qlen)
        if self.loop.scored:
            self.loop.add_entry_mass(bufs, n, self._scores)
        self._decided_steps[self.loop.steps] = step
        self.loop.decide(reqs, bufs, seq_lens=seq, num_new=num_new, defer=defer, prompt_done=prompt_done)

    def _sum_masses(self, total: int) -> None:
        """Sum the step's key masses over the tensor-parallel ranks in place; raise a failure all ranks agree on.

        NOTE: every rank must reach this all-reduce once per scored step, or the
        others hang in it. So nothing before it in the step raises on one rank
        alone: a debug check that fails earlier (:meth:`_fail`) is kept, and in
        checking mode a failure flag travels summed with the masses, so every
        rank raises after the collective: the failing rank its own error, the
        others an :class:`InvariantViolation` naming the step. Reading the flag
        syncs with the device, as every debug check does; without checking no
        failure is deferred (nothing to agree on) and nothing is read.
        """
        if self.reduce_scores is None:
            self._raise_failure()
            return
        if not self.checking:  # the same branch on every rank: checking is one setting for all
            self.reduce_scores(self._scores[:total])  # identical masses, hence identical decisions, on every rank
            self._raise_failure()
            return
        flag = torch.full((1,), float(self._failure is not None), dtype=self._scores.dtype, device=self.device)
        both = torch.cat([self._scores[:total], flag])
        self.reduce_scores(both)
        self._scores[:total].copy_(both[:total])
        self._raise_failure()
        if float(both[total]) > 0:
            step = self._meta.step if self._meta is not None else -1
            raise InvariantViolation(f"worker: a debug check failed on another tensor-parallel rank at step {step}")

    def _fail(self, error: Exception) -> None:
        """A debug check failed: raise now with one rank, else after this step's masses collective (:meth:`_sum_masses`)."""
        if self.reduce_scores is None:
            raise error
        if self._failure is None:
            self._failure = error

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def worker_meta(self) -> VTokenWorkerMetadata:
        """The decisions whose records reached the host since the last report (never waits)."""
        meta = self._meta
        out = VTokenWorkerMetadata(step=meta.step if meta is not None else -1, copies=self._copies)
        self._copies = {}
        if self.loop is None:
            return out
        for rec in self.loop.drain():
            step = self._decided_steps.pop(rec.decided_step)
            keep = np.flatnonzero(rec.counts > 0)
            if keep.size == 0:
                continue
            # Leaving out the rows with no victim leaves the CSR values as they are.
            tids = rec.token_ids.astype(np.int32)
            counts = rec.counts.astype(np.int32)
            out.decisions.append(StepDecisions(step, tuple(rec.reqs[i] for i in keep),
                                               rec.seq_lens[keep].astype(np.int32), counts[keep], tids))
            self.stats["decisions"] += int(keep.size)
            self.stats["victims"] += int(tids.size)
        self.stats["worker_meta_bytes"] += out.nbytes
        return out

    def clear(self) -> None:
        self._meta = None
        self._pending_attention = []

    # ---------------------------------------------------------------- checks
    def _check_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """I1 for the copy: every layer's K/V rows at ``dst`` equal those at ``src`` (debug; syncs)."""
        self.copy_engine.synchronize()
        for c in self.kv_caches:
            a = kv_fingerprint.gather_token_rows(c, self.layout, src)
            b = kv_fingerprint.gather_token_rows(c, self.layout, dst)
            if not torch.equal(a, b):
                raise InvariantViolation("I1: a relocation copy's destination rows differ from its source rows")
