"""Eviction on the device: per-token policy state and one segmented selection for the whole batch.

The numpy policies decide one request at a time (``select_victims(view)``)
and stay as the oracles. This module decides for every request of a batch at
once with a fixed number of torch launches, no Python loop over requests and
no device-to-host transfer, on whatever device the inputs live on (CUDA or
CPU tensors alike):

1. :class:`DeviceBatch`: the step's CSR batch (packed entries ``j`` in
   ``kv_indices`` order, with ``kv_pos[j]`` the token's logical id) and the
   per-request ``seq_len``, ``num_new`` and resolved ``budget``.
2. :class:`DevicePolicyState`: the per-token state the policies rank by, in
   persistent buffers indexed by the token's mirror position
   ``mirror_starts[r] + kv_pos[j]``, updated in place from each step's key scores.
3. :func:`select_victims`: each policy's ``device_priority`` hook gives one
   float64 priority per entry; protection, the excess and the ranking are
   shared here. Output: a victim mask over the packed entries ``[nnz_max]``
   and the victim count per request, both fixed-size (CUDA-graph friendly).

Tie-break (identical to :func:`vtoken.policies.base.lowest`): lowest priority
first; among equal priorities the older token (smaller position) first; NaN
ranks after every number; -0.0 equals 0.0. Priorities are mapped to an
order-preserving int64 key before sorting, so the order is exact on every
device (no float comparison inside a radix sort).

Example (CPU tensors; one request of 6 tokens, budget 3, one sink, window 2)::

    >>> import torch
    >>> from vtoken import policies
    >>> p = policies.get("streamingllm", sink=1, window=2, budget=3)
    >>> batch = DeviceBatch(kv_pos=torch.arange(6), kv_indptr=torch.tensor([0, 6]),
    ...                     mirror_starts=torch.tensor([0]), seq_len=torch.tensor([6]),
    ...                     num_new=torch.tensor([1]), budget=torch.tensor([3]), num_reqs=1)
    >>> mask, counts = select_victims(p, DevicePolicyState.for_policy(p, 8, "cpu"), batch)
    >>> mask.nonzero().flatten().tolist(), counts.tolist()
    ([1, 2, 3], [3])
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from vtoken.errors import InvalidArgumentError, InvalidTypeError, check_int

__all__ = ["DeviceBatch", "DevicePolicyState", "order_key", "popcount64", "resolve_budgets", "select_victims",
           "segmented_pool"]

_INT64_MAX = (1 << 63) - 1
_INTS = (torch.int32, torch.int64)


def resolve_budgets(policy, seq_lens) -> np.ndarray:
    """int64 [num_reqs]: ``policy.budget.resolve(seq_len)`` per request, on the host.

    NOTE: budgets are resolved on the host from the host-known ``seq_len`` (the
    scheduler knows every request's length without reading the device): it is
    O(requests), ships with the step's other per-request arguments, and reuses
    ``Budget.resolve``'s round-then-floor exactly (``Budget.resolve_many``, one
    numpy pass), which a float kernel would have to re-derive bit for bit.
    """
    return policy.budget.resolve_many(np.asarray(seq_lens, dtype=np.int64))


# --------------------------------------------------------------------------- batch


def _check(arg: str, t, dtypes, min_len: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{arg}: expected a torch tensor, got {type(t).__name__}")
    if t.dtype not in dtypes or t.dim() != 1:
        raise InvalidTypeError(f"{arg}: expected a 1-D tensor of {[str(d) for d in dtypes]}, got "
                               f"{tuple(t.shape)} {t.dtype}")
    if t.numel() < min_len:
        raise InvalidArgumentError(f"{arg}: expected >= {min_len} entries, got {t.numel()}")
    if t.device != device:
        raise InvalidArgumentError(f"{arg}: expected device {device} (as kv_pos), got {t.device}")


@dataclass(frozen=True, eq=False)
class DeviceBatch:
    """One step's batch on the device, CSR by request in batch order (no field is read on the host).

    Tensors (all on ``kv_pos``'s device):
        kv_pos        int32/int64 [nnz_max]        each packed entry's token id (logical position);
                                                   entries at or past kv_indptr[num_reqs] are padding
        kv_indptr     int32/int64 [>= num_reqs+1]  CSR offsets (packed entries of request r:
                                                   kv_indptr[r]:kv_indptr[r+1]; within them kv_pos increases)
        mirror_starts int64 [>= num_reqs]          each request's mirror segment start
        seq_len       int64 [>= num_reqs]          tokens appended so far (the next id)
        num_new       int64 [>= num_reqs]          the current step's tokens (the newest; protected)
        budget        int64 [>= num_reqs]          resolved live-token budget (:func:`resolve_budgets`)
        step          int64 [>= num_reqs]          optional, Random: the step of the request's decision
        request_seed  int64 [>= num_reqs]          optional, Random: ``fold32(request_seed(request_id))``
        window_step   bool  [>= num_reqs]          optional, SnapKV: True where the window votes this step
    ``num_reqs`` is a host int (the scheduler's batch size). ``nnz_max`` is
    ``kv_pos``'s length: the decision loop passes a view ``[:bucket]`` of its
    slot lists that holds the step's entries, so every per-entry pass is
    O(bucket), and the results equal those over the whole buffer.
    """

    kv_pos: torch.Tensor
    kv_indptr: torch.Tensor
    mirror_starts: torch.Tensor
    seq_len: torch.Tensor
    num_new: torch.Tensor
    budget: torch.Tensor
    num_reqs: int
    step: Optional[torch.Tensor] = None
    request_seed: Optional[torch.Tensor] = None
    window_step: Optional[torch.Tensor] = None

    def __post_init__(self):
        r = check_int("num_reqs", self.num_reqs)
        if not isinstance(self.kv_pos, torch.Tensor):
            raise InvalidTypeError(f"kv_pos: expected a torch tensor, got {type(self.kv_pos).__name__}")
        dev = self.kv_pos.device
        _check("kv_pos", self.kv_pos, _INTS, 0, dev)
        _check("kv_indptr", self.kv_indptr, _INTS, r + 1, dev)
        for name in ("mirror_starts", "seq_len", "num_new", "budget"):
            _check(name, getattr(self, name), (torch.int64,), r, dev)
        for name in ("step", "request_seed"):
            if getattr(self, name) is not None:
                _check(name, getattr(self, name), (torch.int64,), r, dev)
        if self.window_step is not None:
            _check("window_step", self.window_step, (torch.bool,), r, dev)
        # NOTE: derived per-entry tensors are built once per batch: a decision reads each several
        # times (protection, state update, priority), and every rebuild is a device launch.
        object.__setattr__(self, "_memo", {})

    def _cached(self, key, make):
        memo = self._memo
        if key not in memo:
            memo[key] = make()
        return memo[key]

    @property
    def device(self) -> torch.device:
        return self.kv_pos.device

    @property
    def nnz_max(self) -> int:
        return self.kv_pos.numel()

    @functools.cached_property
    def bounds(self) -> tuple:
        """(starts, ends, first): int64 [num_reqs] CSR bounds and kv_indptr[0] as a 0-d tensor."""
        ptr = self.kv_indptr[: self.num_reqs + 1].to(torch.int64)
        return ptr[:-1], ptr[1:], ptr[0]

    @functools.cached_property
    def req(self) -> torch.Tensor:
        """int64 [nnz_max]: each entry's request, ``num_reqs`` for padding."""
        starts, ends, first = self.bounds
        entry = torch.arange(self.nnz_max, device=self.device)
        req = torch.searchsorted(ends, entry, right=True)
        return torch.where(entry < first, self.num_reqs, req)

    @functools.cached_property
    def valid(self) -> torch.Tensor:
        """bool [nnz_max]: the entry is a live token of a request of the batch."""
        return self.req < self.num_reqs

    @functools.cached_property
    def pos(self) -> torch.Tensor:
        return self.kv_pos.to(torch.int64)

    def per_entry(self, per_request: torch.Tensor, fill) -> torch.Tensor:
        """``per_request[req[j]]`` for every entry, ``fill`` for padding (one gather, fixed shape; cached)."""
        key = ("per_entry", id(per_request), type(fill), fill)
        hit = self._memo.get(key)
        if hit is None:
            head = per_request[: self.num_reqs]
            # NOTE: the memo keeps the source tensor alive, so its id cannot be reused by another one.
            hit = self._memo[key] = (per_request, torch.cat([head, head.new_full((1,), fill)])[self.req])
        return hit[1]

    @property
    def live(self) -> torch.Tensor:
        """int64 [num_reqs]: live tokens per request."""
        starts, ends, _ = self.bounds
        return ends - starts

    def recent_start(self, window: int) -> torch.Tensor:
        """int64 [nnz_max]: the request's first protected tail position, as ``EvictionPolicy.recent_start``."""
        return self.per_entry(self.seq_len, 0) - torch.clamp(self.per_entry(self.num_new, 0), min=window)

    def fresh(self) -> torch.Tensor:
        """bool [nnz_max]: the entry is one of the step's new tokens (its first score update)."""
        return self._cached("fresh", lambda: self.valid & (
            self.pos >= self.per_entry(self.seq_len, 0) - self.per_entry(self.num_new, 0)))

    def mirror_pos(self, trash: int) -> torch.Tensor:
        """int64 [nnz_max]: each entry's mirror position; padding goes to ``trash`` (cached)."""
        return self._cached(("mirror_pos", trash),
                            lambda: torch.where(self.valid, self.per_entry(self.mirror_starts, 0) + self.pos, trash))


# --------------------------------------------------------------------------- per-token state


def popcount64(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each int64 (all 64, sign bit included), as int64.

    NOTE: torch has no popcount; this is the SWAR count. ``>>`` is arithmetic on
    int64, but every mask below has its top bit clear, so the sign copies are masked off.
    """
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return x & 0x7F


class DevicePolicyState:
    """The per-token state every policy ranks by, on the device, indexed by mirror position.

    One owner for all policies; only the buffers the policy needs are allocated
    (:meth:`for_policy`). Each is ``[capacity + 1]``: the last slot absorbs the
    writes of padding entries, so updates are fixed-shape scatters.

    Buffers:
        accumulated float64  attention mass summed over every update (H2O)
        last        float64  the latest update's mass (TOVA)
        low_bits    int64    bit i: the token was "low" i updates ago, last ``history`` updates (Scissorhands)
        seen        int32    updates among the last ``history`` that included the token (Scissorhands)
        votes       float64  pooled window votes, written on the SnapKV step

    Updates follow :class:`~vtoken.policies.scores.ScoreAccumulator` exactly: a
    token's first update (the step that appended it, ``kv_pos >= seq_len - num_new``)
    overwrites instead of accumulating, so a mirror position reused by a new
    token needs no reset. The contract is the accumulator's: call :meth:`update`
    once per step with every live token of each request in the batch.

    NOTE: float64, like the accumulator, so that long H2O sums lose nothing and the
    oracle sees the very same numbers. When the mirror re-lays out its segments,
    move this state with the same gather (:meth:`relayout`).
    """

    def __init__(self, capacity: int, device, *, accumulated: bool = False, last: bool = False,
                 history: int = 0, votes: bool = False):
        self.capacity = check_int("capacity", capacity)
        self.history = check_int("history", history, max_value=64)
        self.device = torch.device(device)
        f64 = dict(dtype=torch.float64, device=self.device)
        n = self.capacity + 1
        self.accumulated = torch.zeros(n, **f64) if accumulated else None
        self.last = torch.zeros(n, **f64) if last else None
        self.low_bits = torch.zeros(n, dtype=torch.int64, device=self.device) if history else None
        self.seen = torch.zeros(n, dtype=torch.int32, device=self.device) if history else None
        self.votes = torch.zeros(n, **f64) if votes else None

    @classmethod
    def for_policy(cls, policy, capacity: int, device) -> "DevicePolicyState":
        """The state ``policy`` ranks by (a policy without any gets an empty state)."""
        needs = getattr(policy, "device_state", ())
        history = getattr(policy, "history", 0) if "low" in needs else 0
        if history > 64:
            raise InvalidArgumentError(f"{policy.name}.history: expected <= 64 for the device path "
                                       f"(one 64-bit ring per token), got {history}")
        return cls(capacity, device, accumulated="accumulated" in needs, last="last" in needs,
                   history=history, votes="votes" in needs)

    def _buffers(self) -> dict:
        names = ("accumulated", "last", "low_bits", "seen", "votes")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def relayout(self, source: torch.Tensor) -> None:
        """New position i takes old position ``source[i]`` (int64 [new_capacity], -1: a fresh zero)."""
        if not isinstance(source, torch.Tensor) or source.dtype != torch.int64 or source.dim() != 1:
            raise InvalidTypeError(f"source: expected a 1-D int64 tensor, got {source!r:.60}")
        src = torch.where(source < 0, self.capacity, source).to(self.device)
        for name, buf in self._buffers().items():
            buf[self.capacity] = 0  # the trash slot doubles as the zero source
            setattr(self, name, torch.cat([buf[src], buf[-1:]]))
        self.capacity = source.numel()

    def update(self, batch: DeviceBatch, key_scores: torch.Tensor, entries: Optional[torch.Tensor] = None) -> None:
        """Add one step's scores: ``key_scores`` float [nnz_max, num_kv_heads] or [nnz_max], rows as kv_pos.

        ``entries`` (bool [nnz_max], optional): only these entries take the
        update; the others keep their state (a request mid-prompt).
        """
        if not isinstance(key_scores, torch.Tensor) or not key_scores.dtype.is_floating_point:
            raise InvalidTypeError(f"key_scores: expected a floating-point tensor, got {key_scores!r:.60}")
        if key_scores.dim() not in (1, 2) or key_scores.shape[0] != batch.nnz_max:
            raise InvalidArgumentError(f"key_scores: expected [{batch.nnz_max}] or [{batch.nnz_max}, H] "
                                       f"(rows as kv_pos), got {tuple(key_scores.shape)}")
        if entries is not None and (entries.dtype != torch.bool or tuple(entries.shape) != (batch.nnz_max,)):
            raise InvalidArgumentError(f"entries: expected bool [{batch.nnz_max}], got {entries.dtype} "
                                       f"{tuple(entries.shape)}")
        valid = batch.valid
        row = key_scores.to(torch.float64)
        row = torch.where(valid, row.sum(1) if row.dim() == 2 else row, 0.0)  # padding rows may be garbage
        fresh, mp = batch.fresh(), batch.mirror_pos(self.capacity)

        def put(state: torch.Tensor, new: torch.Tensor) -> None:
            state.index_copy_(0, mp, new if entries is None else torch.where(entries, new, state[mp]))

        if self.accumulated is not None:
            put(self.accumulated, torch.where(fresh, 0.0, self.accumulated[mp]) + row)
        if self.last is not None:
            put(self.last, row)
        if self.history:
            # NOTE: the per-request sum runs in another order than numpy's pairwise sum, so a
            # token whose mean mass is 1/n to the last bit may be classified differently. It is
            # a difference of one scan, not atomic adds: the same bits on every run and every
            # tensor-parallel rank (ranks must decide identically).
            starts, ends, _ = batch.bounds
            scan = torch.cat([row.new_zeros(1), torch.cumsum(row, 0)])
            total = torch.cat([scan[ends] - scan[starts], row.new_zeros(1)])
            live = batch.per_entry(batch.live, 0).to(torch.float64)
            low = (row * live < total[batch.req]).to(torch.int64)  # mean mass below 1 / n_live
            keep = -1 if self.history == 64 else (1 << self.history) - 1
            put(self.low_bits, ((torch.where(fresh, 0, self.low_bits[mp]) << 1) | low) & keep)
            put(self.seen, torch.clamp(torch.where(fresh, 0, self.seen[mp]) + 1, max=self.history))

    def low_fraction(self, mp: torch.Tensor) -> torch.Tensor:
        """float64: low records / updates seen in the window (0 when unseen), as ``ScoreAccumulator``."""
        low = popcount64(self.low_bits[mp]).to(torch.float64)
        seen = self.seen[mp].to(torch.float64)
        return torch.where(seen > 0, low / seen, 0.0)


# --------------------------------------------------------------------------- segmented primitives


def order_key(priority: torch.Tensor) -> torch.Tensor:
    """int64 keys whose order is ``priority``'s (float64): -0.0 == 0.0, NaN after +inf, all NaN equal."""
    bits = (priority.to(torch.float64) + 0.0).view(torch.int64)  # + 0.0 turns -0.0 into 0.0
    key = torch.where(bits < 0, bits ^ _INT64_MAX, bits)  # negatives: flip the magnitude bits
    return torch.where(torch.isnan(priority), _INT64_MAX, key)


def segmented_pool(values: torch.Tensor, member: torch.Tensor, req: torch.Tensor, kernel: int,
                   pooling: str) -> torch.Tensor:
    """Same-length pooling of ``values`` [nnz, H] along each request's run of ``member`` entries.

    A neighbour outside the run (another request, a non-member) counts as zero
    padding (``avgpool``, whose mean divides by ``kernel`` like the public
    SnapKV's) or -inf (``maxpool``). Returns float64 [nnz, H]; ``kernel`` launches.
    """
    pad, fill = kernel // 2, (0.0 if pooling == "avgpool" else float("-inf"))
    nnz = values.shape[0]
    v = torch.where(member[:, None], values.to(torch.float64), fill)
    v = torch.cat([v.new_full((pad, v.shape[1]), fill), v, v.new_full((pad, v.shape[1]), fill)])
    r = torch.cat([req.new_full((pad,), -1), torch.where(member, req, -1), req.new_full((pad,), -1)])
    out = None
    for k in range(kernel):  # the window's elements left to right, as numpy's reduction
        same = (r[k: k + nnz] == req)[:, None]
        x = torch.where(same, v[k: k + nnz], fill)
        out = x if out is None else (out + x if pooling == "avgpool" else torch.maximum(out, x))
    return out / kernel if pooling == "avgpool" else out


def select_victims(policy, state: DevicePolicyState, batch: DeviceBatch) -> tuple:
    """Every request's victims at once: the device twin of ``policy.select_victims(view)``.

    Returns ``(mask, counts)``: bool [nnz_max], True at the packed entries to
    evict, and int64 [num_reqs], the victims per request. Protection, the
    excess and the tie-break are the base class's; the policy contributes only
    ``device_priority(state, batch)`` (float64 [nnz_max], lowest evicted first),
    ``max_victims_per_step``, ``device_active(batch)`` and optionally
    ``device_int_priority`` (an integer priority: one stable sort instead of
    two). Launches: a fixed number, independent of the batch's contents.
    """
    if not isinstance(batch, DeviceBatch):
        raise InvalidTypeError(f"batch: expected a DeviceBatch, got {type(batch).__name__}")
    if not isinstance(state, DevicePolicyState):
        raise InvalidTypeError(f"state: expected a DevicePolicyState, got {type(state).__name__}")
    nreq, req, pos = batch.num_reqs, batch.req, batch.pos
    cand = batch.valid & (pos >= policy.sink) & (pos < batch.recent_start(policy.window))
    # candidates per request: differences of the exclusive prefix count at the CSR bounds
    ccount = torch.cat([cand.new_zeros(1, dtype=torch.int64), torch.cumsum(cand, 0)])
    starts, ends, first = batch.bounds
    n = torch.clamp(torch.minimum(batch.live - batch.budget[:nreq], ccount[ends] - ccount[starts]), min=0)
    if policy.max_victims_per_step is not None:
        n = torch.clamp(n, max=policy.max_victims_per_step)
    active = policy.device_active(batch)
    if active is not None:
        n = torch.where(active[:nreq], n, 0)
    # The order is (request, candidate first, priority, packed order); kv_pos increases within a
    # request, so the packed order keeps the older of equal priorities first.
    segment = req * 2 + (~cand).to(torch.int64)  # <= 2 * num_reqs + 1 (padding: num_reqs, not a candidate)
    segment_bits = (2 * nreq + 1).bit_length()
    as_int = policy.device_int_priority(state, batch)
    if as_int is not None and segment_bits + as_int[1] <= 63:
        # NOTE: one stable sort over one int64 key: the segment above the priority's bits.
        key, bits = as_int
        order = torch.sort(segment if bits == 0 else (segment << bits) | key, stable=True).indices
    else:
        # NOTE: float64 priorities take all 64 bits: a stable sort by priority, then a stable sort by
        # segment, in the narrowest integer type that holds it (a radix sort's passes follow its width).
        by_priority = torch.sort(order_key(policy.device_priority(state, batch)), stable=True).indices
        narrow = torch.int16 if segment_bits < 16 else torch.int32 if segment_bits < 32 else torch.int64
        order = by_priority[torch.sort(segment[by_priority].to(narrow), stable=True).indices]
    # request r's entries occupy sorted slots [starts[r] - first, ends[r] - first), candidates first
    req_sorted = req[order]
    rank = torch.arange(batch.nnz_max, device=batch.device) - (batch.per_entry(starts, 0)[order] - first)
    chosen = cand[order] & (rank < torch.cat([n, n.new_zeros(1)])[req_sorted])
    mask = torch.zeros(batch.nnz_max, dtype=torch.bool, device=batch.device).scatter_(0, order, chosen)
    return mask, n
