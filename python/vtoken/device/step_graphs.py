"""StepGraphs: CUDA graphs of the decision loop's device step, one per (padded batch size, entry bucket).

:meth:`vtoken.decisions.loop.DecisionLoop.decide` launches about a hundred
small kernels; eagerly, their launch cost is the host's biggest share of a
step. Captured once per shape, a step is one ``replay()``.

The step's shapes are its padded batch size and its **entry bucket**: the
per-entry passes run over views ``[:bucket]`` of the slot lists (and of the
window votes), the smallest rung of :func:`entry_buckets` that holds the
step's entries (``kv_indptr_host[n]``, known on the host without a sync).
``nnz_max`` is sized for the worst batch; a step's work follows its own
entries instead. A view keeps its buffer's address, so a graph captured over
it replays with whatever the buffer holds.

Rules (the same as the runner's decode graphs):

* the step reads and writes only fixed-address buffers: the slot lists, the
  loop's per-request argument buffer (filled by an async H2D copy before the
  replay), the mirror, the policy state, the key-mass buffer, the ring record;
* a batch of ``n`` requests runs at the next padded size; padding requests
  have empty slot lists (``kv_indptr`` repeats its total) and zero arguments,
  so they evict nothing; entries past the total inside the bucket are padding
  too (request ``num_reqs``), as are those past the bucket, which no pass reads;
* every (size, bucket) pair is captured at warm-up (:meth:`StepGraphs.warmup`,
  before serving: one eager step of each pair first, over empty slot lists and
  zero arguments, loads every kernel and sizes the allocator's pool); serving
  only replays, and a pair that was not captured raises :class:`InvariantViolation`;
* graphs: ``len(sizes) x len(buckets)``, e.g. 9 sizes (``max_reqs`` 256) x 11
  buckets (``nnz_max`` 1M, rungs from 1024 doubling) = 99. The ladder's ratio
  doubles (2, 4, 8, ...) until the product is at most :data:`MAX_GRAPHS`: a
  coarser ladder costs a step at most ``ratio`` x its entries, never a missing graph;
* a mirror re-layout or growth, a ring growth and new slot lists move buffers:
  every graph is dropped (:meth:`invalidate`); the next step runs eagerly,
  then every pair is captured again at once (capture records kernels without
  running them, so the step's state is not touched twice).
"""
from __future__ import annotations

import torch

from vtoken.errors import InvalidArgumentError, InvariantViolation, check_int

MIN_ENTRY_BUCKET = 1024  # below this a step's passes cost their launches, not their elements
MAX_GRAPHS = 128  # sizes x buckets captured per loop (each graph holds the step's ~100-200 kernels)


def padded_batch_sizes(max_reqs: int) -> tuple:
    """The batch sizes graphs are captured at: powers of two below ``max_reqs``, then ``max_reqs``."""
    sizes, b = [], 1
    while b < max_reqs:
        sizes.append(b)
        b *= 2
    return tuple(sizes + [max_reqs])


def entry_buckets(nnz_max: int, min_bucket: int = MIN_ENTRY_BUCKET, ratio: int = 2) -> tuple:
    """The entry counts a step runs at: ``min_bucket`` x ``ratio`` ** k below ``nnz_max``, then ``nnz_max``."""
    check_int("nnz_max", nnz_max, min_value=1)
    check_int("min_bucket", min_bucket, min_value=1)
    check_int("ratio", ratio, min_value=2)
    buckets, b = [], min_bucket
    while b < nnz_max:
        buckets.append(b)
        b *= ratio
    return tuple(buckets + [nnz_max])


class StepGraphs:
    """Captured device steps of one decision loop, keyed by (padded batch size, entry bucket).

    ``capture(loop, slot_lists, size, bucket)`` returns an object with
    ``replay()``; the default records ``loop._device_step`` in a
    ``torch.cuda.CUDAGraph`` (a CPU test passes a stand-in). The loop takes
    its bucket from :meth:`bucket` whether graphs are on or not, so the eager
    and the replayed step run the same shapes.
    """

    def __init__(self, max_reqs: int, *, capture=None, min_bucket: int = MIN_ENTRY_BUCKET):
        self.sizes = padded_batch_sizes(max_reqs)
        self.min_bucket = check_int("min_bucket", min_bucket, min_value=1)
        self._ladders: dict = {}  # nnz_max -> its bucket ladder
        self._graphs: dict = {}
        self._pool = None
        self._slot_lists = None
        self._capture_fn = self._capture_cuda if capture is None else capture
        self.warmed_up = False
        self.captures = 0
        self.replays = 0
        self.recaptures = 0  # times every pair was captured again after buffers moved

    def padded(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def buckets(self, nnz_max: int) -> tuple:
        """The entry buckets of slot lists of ``nnz_max`` entries (the ladder keeps the graphs <= MAX_GRAPHS)."""
        ladder = self._ladders.get(nnz_max)
        if ladder is None:
            ratio = 2
            ladder = entry_buckets(nnz_max, self.min_bucket, ratio)
            while len(self.sizes) * len(ladder) > MAX_GRAPHS and len(ladder) > 2:
                ratio *= 2
                ladder = entry_buckets(nnz_max, self.min_bucket, ratio)
            self._ladders[nnz_max] = ladder
        return ladder

    def bucket(self, entries: int, nnz_max: int) -> int:
        """The smallest bucket of ``nnz_max``'s ladder that holds ``entries`` (a host count: no sync)."""
        if not 0 <= entries <= nnz_max:
            raise InvalidArgumentError(f"entries: expected 0 <= entries <= nnz_max={nnz_max}, got {entries}")
        return next(b for b in self.buckets(nnz_max) if b >= entries)

    def invalidate(self) -> None:
        self._graphs.clear()

    def _pairs(self, nnz_max: int) -> list:
        return [(size, bucket) for size in self.sizes for bucket in self.buckets(nnz_max)]

    def warmup(self, loop, slot_lists) -> None:
        """Before serving: one eager step, then a capture, of every (size, bucket) pair over ``slot_lists``.

        NOTE: the eager steps must leave the state as it was: the caller runs
        them over empty slot lists and zero arguments (no entry, no victim).
        """
        for size, bucket in self._pairs(slot_lists.nnz_max):
            loop._device_step(slot_lists, size, bucket)
        self._capture_all(loop, slot_lists)
        self.warmed_up = True

    def run(self, loop, slot_lists, n: int, bucket: int) -> None:
        """Run ``loop``'s device step for ``n`` requests at ``bucket``: a replay of that pair's graph."""
        if not self.warmed_up:
            raise InvalidArgumentError("cuda_graph: expected DecisionLoop.warmup() before the first step "
                                       "(graphs are captured at warm-up, never while serving), got none")
        size = self.padded(n)
        if slot_lists is not self._slot_lists or not self._graphs:
            # Buffers moved since the capture: this step eagerly, then every pair again at once.
            loop._device_step(slot_lists, size, bucket)
            self._capture_all(loop, slot_lists)
            self.recaptures += 1
            return
        graph = self._graphs.get((size, bucket))
        if graph is None:
            raise InvariantViolation(f"decision graph: (padded batch {size}, entry bucket {bucket}) was not "
                                     f"captured at warm-up (captured: {sorted(self._graphs)[:8]}...)")
        graph.replay()
        self.replays += 1

    def _capture_all(self, loop, slot_lists) -> None:
        self._graphs.clear()
        self._slot_lists = slot_lists
        for size, bucket in self._pairs(slot_lists.nnz_max):
            self._graphs[size, bucket] = self._capture_fn(loop, slot_lists, size, bucket)
            self.captures += 1

    def _capture_cuda(self, loop, slot_lists, size: int, bucket: int):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # NOTE: nothing runs during capture (kernels are recorded), so the state is not touched twice.
        with torch.cuda.graph(graph, pool=self._pool):
            loop._device_step(slot_lists, size, bucket)
        return graph
