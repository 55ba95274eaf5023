"""StepGraphs: CUDA graphs of the decision loop's device step, one per padded batch size.

:meth:`vtoken.decision_loop.DecisionLoop.decide` launches about a hundred
small kernels; eagerly, their launch cost is the host's biggest share of a
step. Captured once per padded batch size, a step is one ``replay()``.

Rules (the same as the runner's decode graphs):

* the step reads and writes only fixed-address buffers: the slot lists, the
  loop's per-request argument buffer (filled by an async H2D copy before the
  replay), the mirror, the policy state, the key-mass buffer, the ring record;
* a batch of ``n`` requests runs at the next padded size; padding requests
  have empty slot lists (``kv_indptr`` repeats its total) and zero arguments,
  so they evict nothing;
* the first step of a size runs eagerly (it loads every kernel and sizes the
  allocator's pool); the second captures, then replays;
* a mirror re-layout or growth and a ring growth move buffers: every graph is
  dropped (:meth:`invalidate`) and recaptured.
"""
from __future__ import annotations

import torch


def padded_batch_sizes(max_reqs: int) -> tuple:
    """The batch sizes graphs are captured at: powers of two below ``max_reqs``, then ``max_reqs``."""
    sizes, b = [], 1
    while b < max_reqs:
        sizes.append(b)
        b *= 2
    return tuple(sizes + [max_reqs])


class StepGraphs:
    """Captured device steps of one decision loop, keyed by padded batch size."""

    def __init__(self, max_reqs: int):
        self.sizes = padded_batch_sizes(max_reqs)
        self._graphs: dict = {}
        self._warm: set = set()
        self._pool = None
        self._slot_lists = None
        self.captures = 0
        self.replays = 0

    def padded(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def invalidate(self) -> None:
        self._graphs.clear()
        self._warm.clear()

    def run(self, loop, slot_lists, n: int) -> None:
        """Run ``loop``'s device step for ``n`` requests: eager the first time at this size, then a replay."""
        if slot_lists is not self._slot_lists:  # graphs read the buffers they were captured over
            self.invalidate()
            self._slot_lists = slot_lists
        size = self.padded(n)
        graph = self._graphs.get(size)
        if graph is None:
            if size not in self._warm:
                self._warm.add(size)
                loop._device_step(slot_lists, size)
                return
            graph = self._capture(loop, slot_lists, size)
        graph.replay()
        self.replays += 1

    def _capture(self, loop, slot_lists, size: int):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # NOTE: nothing runs during capture (kernels are recorded), so the state is not touched twice.
        with torch.cuda.graph(graph, pool=self._pool):
            loop._device_step(slot_lists, size)
        self._graphs[size] = graph
        self.captures += 1
        return graph
