"""Score sources for eviction policies, independent of any engine (docs/policies.md).

Two sources feed the policies:

1. :class:`ScoreAccumulator`, fed with EXACT attention probabilities, e.g. the
   ``key_scores`` that ``vtoken.device.ops.token_attention(..., return_key_scores=True)``
   returns (float32 ``[nnz_max, num_kv_heads]``: row j is the probability mass
   that the request's queries of the step, summed over the queries and over the
   query heads of kv head g's GQA group, gave to the key at ``kv_indices[j]``).
   One accumulator per request keeps, keyed by token id (numpy arrays grown
   amortized, no per-token Python objects):

   - ``accumulated(ids)``: the attention mass a token received, summed over all
     steps (H2O);
   - ``last(ids)``: the mass of the most recent update (TOVA);
   - ``low_fraction(ids)``: over the last ``history`` updates, the fraction of
     updates in which the token's attention was below ``1 / n_live``
     (Scissorhands), kept as running counts over a bounded ring of bit-packed
     per-step "low" masks.

2. :func:`window_key_scores`, which RECOMPUTES the attention of a window of
   queries against the live keys in plain torch and returns per-key scores in
   the same ``[n_live, num_kv_heads]`` format. SnapKV uses it (the last w prompt
   queries vote once, after prefill); an engine whose attention kernel returns
   no probabilities can feed it the step's last query and pass the result to
   ``ScoreAccumulator.update``.

How heads and GQA groups are aggregated (both sources)
------------------------------------------------------
vtoken evicts a token from every head and every layer at once, so a token
gets ONE score per step:

- within a GQA group: the probabilities of the group's query heads are SUMMED
  (that is what a ``key_scores`` column holds);
- across kv heads: the columns are SUMMED (``update`` sums over the last axis;
  to combine layers, sum their key scores, or concatenate them along that axis,
  before calling ``update`` once per step);
- across the queries of one step (a prefill chunk): SUMMED.

So a token's per-step score is the total probability it received from the
``Q = n_queries * num_q_heads`` (query, head) pairs of the step, and the scores
of a step sum to ``Q`` (each pair's probabilities sum to 1). Rankings are those
of the mean over heads, which is the same number divided by ``Q``. The
Scissorhands threshold is taken on that mean: a token is "low" at a step when
``score * n_live < sum(scores)``, i.e. its mean probability is below
``1 / n_live``.

Host transfer: ``update`` converts a torch tensor to numpy once per call
(``accumulate_batch`` once per step for the whole batch). The decision runs on
the CPU, so this is the one device-to-host copy the policy step costs.
"""
from __future__ import annotations

import math
import sys
from collections import deque

import numpy as np

from vtoken.errors import InvalidArgumentError, InvalidTypeError, as_index_array, check_int, check_tensor
from vtoken.policies.ids import check_live_ids

__all__ = ["ScoreAccumulator", "accumulate_batch", "as_numpy_scores", "window_key_scores"]


def _as_array(arg: str, scores) -> np.ndarray:
    """A torch tensor (any device, any float dtype; one host copy) or array-like as a real numpy array."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(scores, torch.Tensor):
        if not scores.dtype.is_floating_point:
            raise InvalidTypeError(f"{arg}: expected a floating-point tensor, got {scores.dtype}")
        scores = scores.detach().to("cpu", torch.float32).numpy()
    arr = np.asarray(scores)
    if arr.dtype.kind not in "fiu":
        raise InvalidTypeError(f"{arg}: expected real-valued scores, got dtype {arr.dtype}")
    return arr


def _check_values(arg: str, arr: np.ndarray, sums: np.ndarray) -> None:
    # NaN and inf survive summation, so checking the sums covers the inputs; a negative entry might not.
    if not np.isfinite(sums).all() or (arr.size and arr.min() < 0):
        raise InvalidArgumentError(f"{arg}: expected finite non-negative attention scores, got NaN, inf or < 0")


def as_numpy_scores(arg: str, scores) -> np.ndarray:
    """A torch tensor or array as a finite, non-negative float64 numpy array."""
    arr = _as_array(arg, scores).astype(np.float64, copy=False)
    _check_values(arg, arr, arr)
    return arr


def _row_scores(arg: str, scores, n: int) -> np.ndarray:
    """Per-token score [n] in float64: a 1-D input as is, a 2-D input summed over its last axis (kv heads)."""
    arr = _as_array(arg, scores)
    if arr.ndim not in (1, 2):
        raise InvalidTypeError(f"{arg}: expected shape [n_live] or [n_live, num_kv_heads], got {tuple(arr.shape)}")
    if arr.shape[0] != n:
        raise InvalidArgumentError(f"{arg}: expected {n} rows (one per live token), got {arr.shape[0]}")
    s = arr.astype(np.float64) if arr.ndim == 1 else arr.sum(axis=1, dtype=np.float64)
    _check_values(arg, arr, s)
    return s


class ScoreAccumulator:
    """Per-request attention scores keyed by token id; see the module docstring.

    Parameters
    ----------
    history : int
        Number of most recent updates whose "low attention" records are kept
        (Scissorhands' history window). 0 keeps none.

    Contract: call :meth:`update` once per step with ALL the request's live
    token ids (the same ids, in the same order, as its ``kv_indptr`` rows).
    The "seen" count of :meth:`low_fraction` relies on it: a live token has
    been present in every update since its first one (ids are never reused and
    never come back to life).

    Memory: 20 bytes per token id plus ``history * seq_len / 8`` bytes of ring.

    >>> import numpy as np
    >>> acc = ScoreAccumulator(history=2)
    >>> acc.update(np.arange(3), np.array([[0.5, 0.25], [0.25, 0.5], [0.25, 0.25]]))
    >>> acc.accumulated([0, 2]), acc.low_fraction([0, 1, 2])
    (array([0.75, 0.5 ]), array([0., 0., 1.]))
    """

    _MIN_CAPACITY = 64

    def __init__(self, history: int = 0):
        self.history = check_int("history", history)
        self.steps = 0
        self._acc = np.zeros(0, dtype=np.float64)  # [capacity] summed mass per token id
        self._low = np.zeros(0, dtype=np.int32)  # [capacity] low records inside the ring
        self._first = np.zeros(0, dtype=np.int64)  # [capacity] index of the first update that saw the id
        self._last_ids = np.zeros(0, dtype=np.int64)  # [n_live at the last update]
        self._last_vals = np.zeros(0, dtype=np.float64)  # [n_live at the last update]
        self._ring: deque = deque()  # (packed low mask over ids [0, len), len) per update
        self._deferred = np.zeros(0, dtype=np.float64)  # [ids] prompt-chunk masses held for the next update

    @property
    def capacity(self) -> int:
        return int(self._acc.size)

    @property
    def nbytes(self) -> int:
        ring = sum(m.nbytes for m, _ in self._ring)
        return self._acc.nbytes + self._low.nbytes + self._first.nbytes + self._last_ids.nbytes + \
            self._last_vals.nbytes + self._deferred.nbytes + ring

    def _grow(self, size: int) -> None:
        if size <= self._acc.size:
            return
        cap = max(self._MIN_CAPACITY, self._acc.size * 2, size)  # amortized doubling
        old = self._acc.size
        self._acc = np.concatenate([self._acc, np.zeros(cap - old, np.float64)])
        self._low = np.concatenate([self._low, np.zeros(cap - old, np.int32)])
        self._first = np.concatenate([self._first, np.full(cap - old, -1, np.int64)])

    def update(self, token_ids, key_scores) -> None:
        """Add one step's scores.

        Parameters
        ----------
        token_ids : int array [n_live]
            The request's live token ids in logical order (strictly increasing).
        key_scores : float tensor/array [n_live, num_kv_heads] or [n_live]
            The step's probability mass per live key (torch on any device, or numpy);
            summed over the last axis. Invalid input raises and changes nothing.
        """
        ids = check_live_ids("token_ids", token_ids)
        s = _row_scores("key_scores", key_scores, ids.size)
        if self._deferred.size:
            s = s + self._gather(self._deferred, ids, 0.0)
            self._deferred = np.zeros(0, dtype=np.float64)
        if ids.size == 0:
            self.steps += 1
            return
        self._grow(int(ids[-1]) + 1)
        self._acc[ids] += s
        fresh = ids[self._first[ids] < 0]
        self._first[fresh] = self.steps
        self._last_ids, self._last_vals = ids.copy(), s.copy()
        if self.history:
            span = int(ids[-1]) + 1
            low = np.zeros(span, dtype=bool)
            low[ids[s * ids.size < s.sum()]] = True  # mean probability below 1 / n_live
            if len(self._ring) == self.history:
                old, old_span = self._ring.popleft()
                self._low[:old_span] -= np.unpackbits(old, count=old_span).view(bool)
            self._ring.append((np.packbits(low), span))
            self._low[:span] += low
        self.steps += 1

    def defer(self, token_ids, key_scores) -> None:
        """Hold a step's scores for the next :meth:`update`, which adds them into its own (no update here).

        A chunked prefill defers every chunk of a prompt but the last, so the
        prompt is ONE update whatever the chunking, as an unchunked prefill
        gives (the device loop's ``DecisionLoop.decide(defer=...)``). Arguments
        as :meth:`update`; the ids stay live until that update (nothing is
        evicted inside a prompt).
        """
        ids = check_live_ids("token_ids", token_ids)
        s = _row_scores("key_scores", key_scores, ids.size)
        if ids.size == 0:
            return
        if self._deferred.size <= ids[-1]:
            self._deferred = np.concatenate([self._deferred, np.zeros(int(ids[-1]) + 1 - self._deferred.size)])
        self._deferred[ids] += s

    def _ids(self, token_ids) -> np.ndarray:
        ids = as_index_array("token_ids", token_ids)
        if ids.size and (ids.min() < 0):
            raise InvalidArgumentError(f"token_ids: expected non-negative ids, got {int(ids.min())}")
        return ids

    def _gather(self, arr: np.ndarray, ids: np.ndarray, fill) -> np.ndarray:
        out = np.full(ids.shape, fill, dtype=arr.dtype)
        inside = ids < arr.size
        out[inside] = arr[ids[inside]]
        return out

    def accumulated(self, token_ids) -> np.ndarray:
        """float64 [n]: attention mass summed over all updates (0 for ids never seen)."""
        return self._gather(self._acc, self._ids(token_ids), 0.0)

    def last(self, token_ids) -> np.ndarray:
        """float64 [n]: the mass of the latest update (0 for ids not in it)."""
        ids = self._ids(token_ids)
        pos = np.minimum(np.searchsorted(self._last_ids, ids), max(self._last_ids.size - 1, 0))
        hit = (self._last_ids[pos] == ids) if self._last_ids.size else np.zeros(ids.shape, bool)
        return np.where(hit, self._last_vals[pos] if self._last_vals.size else 0.0, 0.0)

    def low_counts(self, token_ids) -> np.ndarray:
        """int [n]: updates among the last ``history`` where the token's attention was low."""
        return self._gather(self._low, self._ids(token_ids), 0).astype(np.int64)

    def seen_counts(self, token_ids) -> np.ndarray:
        """int [n]: updates among the last ``history`` that included the token."""
        first = self._gather(self._first, self._ids(token_ids), -1)
        return np.where(first < 0, 0, np.minimum(self.history, self.steps - first))

    def low_fraction(self, token_ids) -> np.ndarray:
        """float64 [n]: ``low_counts / seen_counts`` (0 for tokens never seen)."""
        low, seen = self.low_counts(token_ids), self.seen_counts(token_ids)
        return np.divide(low, seen, out=np.zeros(low.shape, np.float64), where=seen > 0)


def accumulate_batch(accumulators, token_ids, key_scores, kv_indptr, defer=None) -> None:
    """Feed one step of a batch: request r gets rows ``kv_indptr[r]:kv_indptr[r+1]``.

    Parameters
    ----------
    accumulators : sequence of ScoreAccumulator or None
        One per request in batch order; None skips a request (no exact-score policy).
    token_ids : sequence of int arrays
        Each request's live ids, in the order of its rows.
    key_scores : float tensor [nnz_max, num_kv_heads]
        From ``token_attention(..., return_key_scores=True)``; copied to the host once.
    kv_indptr : int tensor/array [>= num_reqs + 1]
    defer : bool array [num_reqs], optional
        Requests in the middle of their prompt: their rows are held for their
        next update (:meth:`ScoreAccumulator.defer`) instead of making one.
    """
    if len(token_ids) != len(accumulators):
        raise InvalidArgumentError(
            f"token_ids: expected one array per accumulator ({len(accumulators)}), got {len(token_ids)}"
        )
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(kv_indptr, torch.Tensor):
        kv_indptr = kv_indptr.detach().cpu().numpy()
    indptr = as_index_array("kv_indptr", kv_indptr)
    rows = as_numpy_scores("key_scores", key_scores)
    if indptr.size < len(accumulators) + 1:
        raise InvalidArgumentError(f"kv_indptr: expected >= {len(accumulators) + 1} entries, got {indptr.size}")
    bounds = indptr[: len(accumulators) + 1]
    if np.any(np.diff(bounds) < 0) or bounds[0] < 0 or bounds[-1] > rows.shape[0]:
        raise InvalidArgumentError(
            f"kv_indptr: expected non-decreasing offsets within [0, {rows.shape[0]}], got {bounds.tolist()[:8]}"
        )
    defer = np.zeros(len(accumulators), dtype=bool) if defer is None else np.asarray(defer)
    if defer.dtype != np.bool_ or defer.shape != (len(accumulators),):
        raise InvalidArgumentError(f"defer: expected {len(accumulators)} bools, got {defer.dtype} {defer.shape}")
    for r, (acc, ids) in enumerate(zip(accumulators, token_ids)):
        if acc is not None:
            (acc.defer if defer[r] else acc.update)(ids, rows[bounds[r]: bounds[r + 1]])


def window_key_scores(queries, keys, *, key_ids=None, query_ids=None, scale: float | None = None,
                      group_heads: bool = True, validate: bool = True):
    """Recompute the attention of a query window on the live keys; scores per key and kv head.

    Parameters
    ----------
    queries : float tensor [w, num_q_heads, head_dim]
        The window's queries (after RoPE), e.g. the last w prompt tokens.
    keys : float tensor [n_live, num_kv_heads, head_dim]
        The request's live keys in logical order (gathered by the caller).
    key_ids : int tensor/array [n_live], optional
        Positions of the keys (default ``0..n_live-1``).
    query_ids : int tensor/array [w], optional
        Positions of the queries (default: the last w key positions, i.e. the
        window is the newest w tokens). Query i sees key j iff
        ``key_ids[j] <= query_ids[i]`` (causal).
    scale : float, optional
        Softmax scale, default ``1 / sqrt(head_dim)``.
    group_heads : bool
        True (default): sum each GQA group's query heads, like ``key_scores``.
        False: one column per query head (SnapKV pools per head).
    validate : bool
        True (default): check that every query sees at least one key, which
        reads the device (a host sync on a GPU). False skips it, for callers
        that guarantee it (the runner: a window query always sees its own token).

    Returns
    -------
    float32 tensor [n_live, num_kv_heads] (or [n_live, num_q_heads] with
    ``group_heads=False``) on the queries' device: row j holds the probability
    mass the window's queries gave key j, summed over the queries (and over the
    query heads of each GQA group; query head h belongs to kv head
    ``h // (num_q_heads // num_kv_heads)``).

    >>> import torch
    >>> s = window_key_scores(torch.randn(2, 4, 8), torch.randn(5, 2, 8))
    >>> tuple(s.shape), round(float(s.sum()), 4)    # 2 queries x 4 heads
    ((5, 2), 8.0)
    """
    import torch

    check_tensor("queries", queries, ndim=3)
    check_tensor("keys", keys, ndim=3)
    w, hq, d = queries.shape
    n, hkv, dk = keys.shape
    if d != dk:
        raise InvalidTypeError(f"keys: expected head_dim {d} (as queries), got {dk}")
    if hkv == 0 or hq % hkv:
        raise InvalidArgumentError(f"queries: expected num_q_heads a multiple of num_kv_heads ({hkv}), got {hq}")
    if keys.device != queries.device:
        raise InvalidArgumentError(f"keys: expected device {queries.device}, got {keys.device}")
    dev = queries.device

    def _pos(arg, v, default):
        if v is None:
            return default
        t = v if isinstance(v, torch.Tensor) else torch.as_tensor(as_index_array(arg, v))
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise InvalidTypeError(f"{arg}: expected a 1-D integer array, got {tuple(t.shape)} {t.dtype}")
        return t.to(torch.int64) if t.device == dev else t.to(dev, torch.int64)  # already there: no copy

    kpos = _pos("key_ids", key_ids, torch.arange(n, device=dev))
    if kpos.numel() != n:
        raise InvalidArgumentError(f"key_ids: expected {n} ids (one per key), got {kpos.numel()}")
    if query_ids is None and w > n:
        raise InvalidArgumentError(f"queries: expected at most {n} queries when query_ids is omitted, got {w}")
    qpos = _pos("query_ids", query_ids, kpos[n - w:])
    if qpos.numel() != w:
        raise InvalidArgumentError(f"query_ids: expected {w} ids (one per query), got {qpos.numel()}")
    future = kpos[None, :] > qpos[:, None]  # [w, n]
    if validate and w and n and bool(future.all(dim=1).any()):
        raise InvalidArgumentError("query_ids: expected every query to see at least one key, got one before all keys")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    g = hq // hkv
    q = queries.to(torch.float32).reshape(w, hkv, g, d)
    out = torch.empty(n, hkv, g, dtype=torch.float32, device=dev)
    # NOTE: one kv head at a time bounds the temporary to g*w*n floats.
    for h in range(hkv):
        logits = torch.einsum("wgd,nd->gwn", q[:, h], keys[:, h].to(torch.float32)) * scale
        logits.masked_fill_(future, float("-inf"))
        out[:, h] = torch.softmax(logits, dim=-1).sum(dim=1).T
    return out.sum(dim=2) if group_heads else out.reshape(n, hq)
