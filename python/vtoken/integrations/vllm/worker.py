"""The worker side of the vtoken connector: token-table mirror, slot lists, relocation copies, scores.

One :class:`WorkerSide` per worker process (one per tensor-parallel rank),
created by the connector's ``WORKER`` role and published with
:func:`set_current` so the attention backend of the same process finds it.

Per step:

- ``handle_preemptions`` (first call of ``execute_model``): apply the step's
  table events up to its moves (:mod:`vtoken.journal`, shipped in the
  connector metadata) to the device mirror (:class:`vtoken.buffers.
  DeviceMirror`, with no host table of its own), then
  ``CopyEngine.before_forward``: the compute stream waits on the last
  relocation event (I3; no host wait);
- the attention metadata builder calls :meth:`WorkerSide.build_slot_lists`:
  ``ops.build_slot_lists`` rebuilds ``kv_indices`` / ``kv_indptr`` /
  ``slot_mapping`` in fixed-address buffers from the device mirror;
- the attention backend adds each layer's ``token_attention`` key scores into
  one per-step buffer (:meth:`WorkerSide.add_key_scores`);
- ``wait_for_save`` (after the forward): ONE ``compact_kv`` launch on the
  relocation stream covers every move of the step (old slots to new, both in
  the move events), then the mirror applies the moves;
- ``build_connector_worker_meta``: the step's per-request scores go back to
  the scheduler (the only device-to-host copy; only when the policy needs it).
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np
import torch

from vtoken import invariants
from vtoken.buffers import DeviceMirror, SlotListBuffers
from vtoken.copy_engine import CopyEngine
from vtoken.errors import InvalidArgumentError, InvariantViolation
from vtoken.integrations.vllm.meta import VTokenConnectorMetadata, VTokenWorkerMetadata
from vtoken.layout import KVLayout

KV_LAYOUT_NAME = "vllm_fused"  # vLLM 0.32's per-layer view [num_blocks, H, block_size, 2*D] (docs/vllm.md)

_CURRENT: Optional["WorkerSide"] = None
_LOCK = threading.Lock()


def set_current(worker: Optional["WorkerSide"]) -> None:
    global _CURRENT
    with _LOCK:
        _CURRENT = worker


def current() -> Optional["WorkerSide"]:
    """The :class:`WorkerSide` of this process, or None before the connector exists (profiling)."""
    return _CURRENT


class WorkerSide:
    """See the module docstring.

    Args:
        max_reqs: the batch size bound (``max_num_seqs``).
        max_tokens: tokens per step bound (``max_num_batched_tokens``).
        max_moves: relocation moves per step bound (``reclaim.max_moves_per_step``).
        force_sync: the host waits on every relocation copy (ablation).
        checking: run the debug checks (slot mapping vs vLLM's, I1 around copies).
    """

    def __init__(self, *, max_reqs: int, max_tokens: int, max_moves: int, force_sync: bool = False,
                 checking: bool = False):
        self.max_reqs, self.max_tokens, self.max_moves = int(max_reqs), int(max_tokens), int(max_moves)
        self.force_sync = bool(force_sync)
        self.checking = bool(checking)
        self.mirror: Optional[DeviceMirror] = None
        self.buffers: Optional[SlotListBuffers] = None
        self.copy_engine: Optional[CopyEngine] = None
        self.kv_caches: list = []
        self.layout: Optional[KVLayout] = None
        self.device = torch.device("cpu")
        self._meta: Optional[VTokenConnectorMetadata] = None
        self._moves: list = []  # this step's move events, applied after the forward
        self._scores: Optional[torch.Tensor] = None
        self._batch: list = []
        self._batch_step = -1
        self.stats = {"steps": 0, "moves": 0, "copies": 0, "event_waits": 0, "slot_lists_built": 0,
                      "slot_list_grows": 0}

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
        nnz_max = self.layout.num_blocks * self.layout.block_size  # every live token holds its own slot
        self.mirror = DeviceMirror(None, self.device)  # fed with the scheduler table's events
        self.buffers = SlotListBuffers(max_reqs=self.max_reqs, nnz_max=nnz_max, max_tokens=self.max_tokens,
                                       device=self.device)
        self._scores = torch.zeros(nnz_max, dtype=torch.float32, device=self.device)
        self.copy_engine = CopyEngine(caches, self.layout, max_moves=self.max_moves, force_sync=self.force_sync)

    @property
    def ready(self) -> bool:
        return self.mirror is not None

    # --------------------------------------------------------- before forward
    def begin_step(self, meta: VTokenConnectorMetadata) -> None:
        """Apply the step's events up to its moves and fence the last copy (I3)."""
        if not self.ready:
            raise InvariantViolation("worker: metadata arrived before register_kv_caches")
        before_moves, self._moves = meta.split_moves()
        self.mirror.apply(before_moves)
        if self.copy_engine.before_forward(step=meta.step):
            self.stats["event_waits"] += 1
        self._meta = meta
        self.stats["steps"] += 1

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
        if self._meta is not None and self._meta.want_scores:
            self._scores[:total].zero_()
        self._batch = list(req_ids)
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
        nnz_max = max(need, self.buffers.nnz_max * 3 // 2)
        self.buffers = SlotListBuffers(max_reqs=self.max_reqs, nnz_max=nnz_max, max_tokens=self.max_tokens,
                                       device=self.device)
        self._scores = torch.zeros(nnz_max, dtype=torch.float32, device=self.device)
        self.stats["slot_list_grows"] += 1

    @property
    def want_scores(self) -> bool:
        return self._meta is not None and self._meta.want_scores

    def add_key_scores(self, key_scores: torch.Tensor) -> None:
        """Add one layer's ``token_attention`` key scores (float32 ``[nnz_max, num_kv_heads]``)."""
        self._scores[: key_scores.shape[0]] += key_scores.sum(dim=1)

    # ---------------------------------------------------------- after forward
    def end_step(self) -> None:
        """Launch the step's relocation copy (one ``compact_kv``) and update the mirror."""
        meta, moves = self._meta, self._moves
        if meta is None or not moves:
            return
        before = self._capture(moves) if self.checking else None
        src = np.concatenate([ev[3] for ev in moves])
        dst = np.concatenate([ev[4] for ev in moves])
        self.copy_engine.launch(src, dst, step=meta.step)
        self.mirror.apply(moves)
        self._moves = []
        self.stats["moves"] += len(src)
        self.stats["copies"] += 1
        if before is not None:
            self._check_i1(before)

    def worker_meta(self) -> VTokenWorkerMetadata:
        """The step's per-request scores (empty unless the policy needs them)."""
        meta = self._meta
        step = meta.step if meta is not None else -1
        scores = {}
        if meta is not None and meta.want_scores and self._batch_step == step and self._batch:
            indptr = self.buffers.kv_indptr_host
            total = int(indptr[len(self._batch)])
            host = self._scores[:total].cpu().numpy()
            for i, req in enumerate(self._batch):
                scores[req] = host[indptr[i] : indptr[i + 1]].copy()
        return VTokenWorkerMetadata(step=step, scores=scores)

    def clear(self) -> None:
        self._meta = None

    # ---------------------------------------------------------------- checks
    def _capture(self, moves: list) -> dict:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # debug only: the forward wrote the rows
        out = {}
        for ev in moves:
            req = self.mirror.request_of_row(ev[1])
            slots, mask = self.mirror.host_copy(req)
            ids = np.flatnonzero(mask)
            slots = slots[mask]
            rows = [invariants.gather_token_rows(c, self.layout, slots).cpu() for c in self.kv_caches]
            out[req] = (ids, rows)
        return out

    def _check_i1(self, before: dict) -> None:
        for t in list(self.copy_engine._pending):
            t.event.synchronize()
        for req, (ids, rows) in before.items():
            slots = self.mirror.host_copy(req)[0][ids]
            after = [invariants.gather_token_rows(c, self.layout, slots).cpu() for c in self.kv_caches]
            if invariants.fingerprint_rows(ids, rows) != invariants.fingerprint_rows(ids, after):
                raise InvariantViolation(f"I1: live K/V bytes of request {req!r} changed across a relocation")
