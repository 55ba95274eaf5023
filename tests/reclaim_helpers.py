"""Shared builders of the reclamation tests: a small runtime with real KV tensors."""
from __future__ import annotations

import numpy as np
import torch

from vtoken.layout import KVLayout, kv_cache_shape
from vtoken.bookkeeping.ledger import BlockLedger
from vtoken.bookkeeping.pool import BlockPool
from vtoken.reclamation.manager import ReclaimConfig, ReclamationManager
from vtoken.bookkeeping.table import TokenTable

from table_helpers import assert_same  # noqa: F401  (re-exported for test_reclaim)


class Runtime:
    """Table + ledger + pool + KV caches (+ optional mirror) + manager, CPU."""

    def __init__(self, *, num_blocks=96, block_size=8, layout="nhd", num_layers=2, heads=2, head_dim=16,
                 dtype=torch.float32, config=None, mirror=False, mirror_min_slack=8, seed=0, **cfg):
        self.S = block_size
        self.pool = BlockPool(num_blocks)
        self.ledger = BlockLedger(self.pool, block_size)
        self.table = TokenTable(self.ledger, initial_tokens=256)
        g = torch.Generator().manual_seed(seed)
        shape = kv_cache_shape(layout, num_blocks, block_size, heads, head_dim)
        self.caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(num_layers)]
        self.layout = KVLayout.from_tensor(self.caches[0], layout)
        self.mirror = None
        if mirror:
            from vtoken.device.buffers import DeviceMirror

            self.mirror = DeviceMirror(self.table, "cpu", initial_tokens=1024, min_slack=mirror_min_slack)
        if config is None:
            base = dict(low_watermark=1.0, headroom_blocks=6, check_interval=1, max_src_per_plan=16,
                        max_moves_per_step=256)
            base.update(cfg)
            config = ReclaimConfig(**base)
        self.mgr = ReclamationManager(self.table, config, kv_caches=self.caches, layout=self.layout,
                                      mirror=self.mirror)
        self.rng = np.random.default_rng(seed)

    def add(self, req, prefix_blocks=None):
        self.table.add_request(req, prefix_blocks)

    def append(self, reqs, counts):
        """Append tokens and write distinct K/V values into their slots (like a forward would)."""
        slots = self.table.sync_new_tokens_batch(reqs, counts)
        if slots is not None and len(slots):
            write_kv(self.caches, self.layout, slots, self.rng)
        return slots

    def evict(self, req, token_ids):
        self.table.evict(req, token_ids)

    def step(self, *, evict_frac=0.3, append=4, protect=4):
        """One decode-like step: append to every request, evict a random fraction of old tokens."""
        reqs = self.table.requests()
        if not reqs:
            return
        self.mgr.before_forward()
        self.append(reqs, [append] * len(reqs))
        for r in reqs:
            live = self.table.live_ids(r)
            old = live[:-protect] if len(live) > protect else live[:0]
            k = int(len(old) * evict_frac * self.rng.random())
            if k:
                self.evict(r, self.rng.choice(old, size=k, replace=False))
        plans = self.mgr.maybe_plan()
        self.mgr.launch(plans)
        return self.mgr.commit()


def write_kv(caches, layout: KVLayout, slots, rng) -> None:
    """Give each slot's K/V rows fresh random values in every layer (addressed by strides)."""
    s = torch.as_tensor(np.asarray(slots, dtype=np.int64))
    S = layout.block_size
    base = (s // S) * layout.stride_block + (s % S) * layout.stride_offset
    kv = torch.arange(layout.num_kv) * layout.stride_kv
    h = torch.arange(layout.num_heads) * layout.stride_head
    d = torch.arange(layout.head_dim)
    idx = base[:, None, None, None] + kv[None, :, None, None] + h[None, None, :, None] + d
    for c in caches:
        assert c.is_contiguous(), "test caches are contiguous"
        flat = c.view(-1)
        vals = torch.from_numpy(rng.standard_normal(idx.numel()).astype(np.float32)).to(c.dtype)
        flat[idx.reshape(-1)] = vals
