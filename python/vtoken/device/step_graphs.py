"""StepGraphs: CUDA graphs of the decision loop's device step, one per padded batch size.

:meth:`vtoken.decisions.loop.DecisionLoop.decide` launches about a hundred
small kernels; eagerly, their launch cost is the host's biggest share of a
step. Captured once per padded batch size, a step is one ``replay()``.

Rules (the same as the runner's decode graphs):

* the step reads and writes only fixed-address buffers: the slot lists, the
  loop's per-request argument buffer (filled by an async H2D copy before the
  replay), the mirror, the policy state, the key-mass buffer, the ring record;
* a batch of ``n`` requests runs at the next padded size; padding requests
  have empty slot lists (``kv_indptr`` repeats its total) and zero arguments,
  so they evict nothing;
* every padded size is captured at warm-up (:meth:`StepGraphs.warmup`, before
  serving: one eager step of each size first, over empty slot lists and zero
  arguments, loads every kernel and sizes the allocator's pool); serving only
  replays, and a size that was not captured raises :class:`InvariantViolation`;
* a mirror re-layout or growth and a ring growth move buffers: every graph is
  dropped (:meth:`invalidate`); the next step runs eagerly, then every size is
  captured again at once (capture records kernels without running them, so
  the step's state is not touched twice).
"""
from __future__ import annotations

import torch

from vtoken.errors import InvalidArgumentError, InvariantViolation


def padded_batch_sizes(max_reqs: int) -> tuple:
    """The batch sizes graphs are captured at: powers of two below ``max_reqs``, then ``max_reqs``."""
    sizes, b = [], 1
    while b < max_reqs:
        sizes.append(b)
        b *= 2
    return tuple(sizes + [max_reqs])


class StepGraphs:
    """Captured device steps of one decision loop, keyed by padded batch size.

    ``capture(loop, slot_lists, size)`` returns an object with ``replay()``;
    the default records ``loop._device_step`` in a ``torch.cuda.CUDAGraph``
    (a CPU test passes a stand-in).
    """

    def __init__(self, max_reqs: int, *, capture=None):
        self.sizes = padded_batch_sizes(max_reqs)
        self._graphs: dict = {}
        self._pool = None
        self._slot_lists = None
        self._capture_fn = self._capture_cuda if capture is None else capture
        self.warmed_up = False
        self.captures = 0
        self.replays = 0
        self.recaptures = 0  # times every size was captured again after buffers moved

    def padded(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def invalidate(self) -> None:
        self._graphs.clear()

    def warmup(self, loop, slot_lists) -> None:
        """Before serving: one eager step, then a capture, of every padded size over ``slot_lists``.

        NOTE: the eager steps must leave the state as it was: the caller runs
        them over empty slot lists and zero arguments (no entry, no victim).
        """
        for size in self.sizes:
            loop._device_step(slot_lists, size)
        self._capture_all(loop, slot_lists)
        self.warmed_up = True

    def run(self, loop, slot_lists, n: int) -> None:
        """Run ``loop``'s device step for ``n`` requests: a replay of its padded size's graph."""
        if not self.warmed_up:
            raise InvalidArgumentError("cuda_graph: expected DecisionLoop.warmup() before the first step "
                                       "(graphs are captured at warm-up, never while serving), got none")
        size = self.padded(n)
        if slot_lists is not self._slot_lists or not self._graphs:
            # Buffers moved since the capture: this step eagerly, then every size again at once.
            loop._device_step(slot_lists, size)
            self._capture_all(loop, slot_lists)
            self.recaptures += 1
            return
        graph = self._graphs.get(size)
        if graph is None:
            raise InvariantViolation(f"decision graph: padded batch {size} was not captured at warm-up "
                                     f"(captured: {sorted(self._graphs)})")
        graph.replay()
        self.replays += 1

    def _capture_all(self, loop, slot_lists) -> None:
        self._graphs.clear()
        self._slot_lists = slot_lists
        for size in self.sizes:
            self._graphs[size] = self._capture_fn(loop, slot_lists, size)
            self.captures += 1

    def _capture_cuda(self, loop, slot_lists, size: int):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # NOTE: nothing runs during capture (kernels are recorded), so the state is not touched twice.
        with torch.cuda.graph(graph, pool=self._pool):
            loop._device_step(slot_lists, size)
        return graph
