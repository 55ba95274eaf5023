"""Block fragmentation under token-level eviction (the paper's Figure 1), on the real table.

Each of ``requests`` requests gets ``context`` tokens through
:meth:`TokenTable.sync_new_tokens_batch`, then an eviction pattern marks
``evict_ratio`` of its tokens dead through :meth:`TokenTable.evict_flat`.
Naive-Evict is built into the table, so a block is freed only once every token
in it is dead; the :class:`BlockLedger` then reports what a paged engine keeps.

Patterns (what a policy's victims look like in logical order):

- ``random``: each token dies independently with probability ``evict_ratio``
  (H2O/TOVA-like scattered victims). A block's live count is then
  Binomial(S, 1 - evict_ratio): at 0.5 and S = 16 about 60% of the blocks are
  at most half full, and almost none can be freed.
- ``strided``: victims evenly spaced (``round(evict_ratio * L)`` of them, a
  random phase per request): every block keeps the same share of live tokens,
  the worst case for block freeing.
- ``window``: StreamingLLM-like: the first 4 tokens (attention sinks) and the
  most recent tokens stay, a contiguous middle span dies. Whole blocks free
  up; only the two boundary blocks are partial.

With ``policy`` set, a real eviction policy chooses the victims instead of a
pattern: each request's prompt runs through the embedded engine's model and
the policy decides once at its end (see
:mod:`vtoken.experiments.policy_victims`).

Example:
    >>> from vtoken.experiments.fragmentation import FragmentationConfig, run_fragmentation
    >>> r = run_fragmentation(FragmentationConfig(pattern="window", requests=2, context=256))
    >>> r.retained_blocks_per_request, r.ideal_blocks_per_request  # 7 of 16 blocks freed
    (9.0, 8.0)
    >>> round(r.waste_ratio, 4)  # 1 - 128 live / (9 blocks * 16)
    0.1111
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from vtoken import cdiv
from vtoken.errors import InvalidArgumentError, check_int
from vtoken.experiments.common import check_memory, check_pool
from vtoken.bookkeeping.ledger import BlockLedger
from vtoken.bookkeeping.pool import BlockPool
from vtoken.bookkeeping.table import TokenTable

PATTERNS = ("random", "strided", "window")
WINDOW_SINKS = 4  # StreamingLLM's attention sinks, kept by the window pattern


def host_bytes(requests: int, context: int, block_size: int) -> float:
    """Estimated peak host memory of :func:`run_fragmentation` (without ``policy``).

    NOTE: tracemalloc peaks at evict ratio 1.0 (the largest), S from 1 to 64, requests x context
    from 1 x 65536 to 4096 x 16: 76-168 bytes per token, the most at S = 1 (per-block arrays), and
    about 600 bytes more per request when requests are short; hence 112 + 64 / S bytes per token
    plus 1 KiB per request.
    """
    return requests * (context * (112 + 64 / block_size) + 1024)


@dataclass
class FragmentationConfig:
    pattern: str = "random"
    evict_ratio: float = 0.5
    requests: int = 64
    context: int = 4096
    block_size: int = 16
    seed: int = 0
    policy: Optional[str] = None  # a registered policy chooses the victims (``pattern`` is then unused)
    window: Optional[int] = None  # the policy's recent window (None: its default, at most 32)
    sink: Optional[int] = None  # the policy's attention sinks (None: its default, 4)

    def __post_init__(self):
        if self.policy is not None:
            from vtoken.experiments.policy_victims import make_policy

            make_policy(self.policy, self.evict_ratio, self.window, self.sink)  # validates the policy and its budget
        if self.pattern not in PATTERNS:
            raise InvalidArgumentError(f"pattern: expected one of {list(PATTERNS)}, got {self.pattern!r}")
        if not 0.0 <= float(self.evict_ratio) <= 1.0:
            raise InvalidArgumentError(f"evict_ratio: expected a value in [0, 1], got {self.evict_ratio}")
        for name in ("requests", "context", "block_size"):
            check_int(name, getattr(self, name), min_value=1)
        check_int("seed", self.seed)
        blocks = cdiv(self.context, self.block_size)  # the pool's int32 slots: one request first, then all
        check_pool("context", self.context, blocks + 1, self.block_size)
        check_pool("requests", self.requests, self.requests * blocks + 1, self.block_size)

    def check_memory(self) -> None:
        """Refuse a run this machine cannot hold, naming ``context`` if one request alone is too much."""
        victims, what = 0, "token table"
        if self.policy is not None:
            from vtoken.experiments.policy_victims import peak_bytes

            victims, what = peak_bytes(self.context), "token table and policy prefill"  # one request at a time
        for arg, n in (("context", 1), ("requests", self.requests)):
            check_memory(arg, getattr(self, arg), host_bytes(n, self.context, self.block_size) + victims, what)


@dataclass
class FragmentationResult:
    """What the ledger reports after eviction (per-request values are means)."""

    waste_ratio: float  # F = 1 - live / (allocated * S)
    frac_blocks_le_25pct: float  # allocated blocks with live <= S/4
    frac_blocks_le_50pct: float  # allocated blocks with live <= S/2
    retained_blocks_per_request: float  # blocks a paged engine keeps (Naive-Evict)
    ideal_blocks_per_request: float  # ceil(live / S): the live tokens packed
    table_bytes_per_token: float  # TokenTable.nbytes() / tokens

    def to_dict(self) -> dict:
        return asdict(self)


def victims(pattern: str, evict_ratio: float, context: int, rng: np.random.Generator) -> np.ndarray:
    """Logical ids (ascending int64) one request evicts under ``pattern``."""
    L = context
    if pattern == "random":
        return np.flatnonzero(rng.random(L) < evict_ratio)
    k = min(L, round(evict_ratio * L))
    if pattern == "strided":
        if k == 0:
            return np.zeros(0, dtype=np.int64)
        # k evenly spaced ids with a random phase: id = floor((i + phase) * L / k).
        return np.floor((np.arange(k) + rng.random()) * (L / k)).astype(np.int64)
    # window: sinks first, then the k oldest non-sink tokens; a tiny context loses sinks too.
    start = min(WINDOW_SINKS, L - k)
    return np.arange(start, start + k, dtype=np.int64)


def run_fragmentation(cfg: FragmentationConfig, *, progress=None) -> FragmentationResult:
    """Prefill every request, evict by ``cfg.pattern`` (or ``cfg.policy``), and read the ledger."""
    cfg.check_memory()
    S, R, L = cfg.block_size, cfg.requests, cfg.context
    ledger = BlockLedger(BlockPool(R * math.ceil(L / S) + 1), S)
    table = TokenTable(ledger, initial_tokens=R * L)
    reqs = list(range(R))
    for r in reqs:
        table.add_request(r)
    table.sync_new_tokens_batch(reqs, np.full(R, L, dtype=np.int64))
    if cfg.policy is not None:
        from vtoken.experiments.policy_victims import policy_victims

        per = policy_victims(cfg.policy, requests=R, context=L, evict_ratio=float(cfg.evict_ratio), seed=cfg.seed,
                             window=cfg.window, sink=cfg.sink, progress=progress)
    else:
        rng = np.random.default_rng(cfg.seed)
        per = [victims(cfg.pattern, float(cfg.evict_ratio), L, rng) for _ in reqs]
    table.evict_flat(reqs, np.concatenate(per), [len(v) for v in per])
    live = np.array([table.live_count(r) for r in reqs], dtype=np.int64)
    return FragmentationResult(
        waste_ratio=ledger.waste_ratio,
        frac_blocks_le_25pct=ledger.frac_blocks_at_most(0.25),
        frac_blocks_le_50pct=ledger.frac_blocks_at_most(0.5),
        retained_blocks_per_request=ledger.num_allocated / R,
        ideal_blocks_per_request=float(np.mean(cdiv(live, S))),
        table_bytes_per_token=table.nbytes() / table.total_tokens(),
    )


def format_result(cfg: FragmentationConfig, res: FragmentationResult) -> str:
    return "\n".join([
        f"vtoken fragmentation: {'policy=' + cfg.policy if cfg.policy else 'pattern=' + cfg.pattern} evict_ratio={cfg.evict_ratio:g} requests={cfg.requests} "
        f"context={cfg.context} block_size={cfg.block_size} seed={cfg.seed}",
        f"  waste ratio F                     {res.waste_ratio:.4f}",
        f"  blocks at <= 25% utilization      {100 * res.frac_blocks_le_25pct:.1f}%",
        f"  blocks at <= 50% utilization      {100 * res.frac_blocks_le_50pct:.1f}%",
        f"  retained blocks per request       {res.retained_blocks_per_request:.1f}  (Naive-Evict)",
        f"  ideal packed blocks per request   {res.ideal_blocks_per_request:.1f}  (ceil(live / S))",
        f"  token table metadata              {res.table_bytes_per_token:.3f} bytes/token",
    ])
