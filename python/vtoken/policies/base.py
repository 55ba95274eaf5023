"""The eviction-policy contract: view, base class, budgets and registry (traces: :mod:`vtoken.policies.trace`).

A policy sits above the token table (docs/architecture.md §2): it sees the logical
token ids of ONE request (an id is the token's RoPE position and is never
reused), never a block id, and answers one question per step::

    victims = policy.select_victims(view)      # sorted unique int64 token ids
    table.evict(req, victims)                   # the runtime frees storage later

Example (runnable on CPU)::

    >>> import numpy as np
    >>> from vtoken import policies
    >>> p = policies.get("streamingllm", sink=2, window=3)
    >>> view = p.view(request_id=0, step=9, token_ids=np.arange(10))
    >>> p.select_victims(view)                   # keep 0, 1 and 7, 8, 9
    array([2, 3, 4, 5, 6])

What every policy inherits from :class:`EvictionPolicy`:

- **Budget.** ``budget`` is a :class:`Budget`: a ratio of the request's current
  length (``seq_len``, all tokens appended so far, live or not), an absolute cap,
  or both (the smaller wins). When the live count exceeds it, ``select_victims``
  returns exactly enough victims to come back to it (TOVA at decode: one per
  step, its definition), unless protection leaves too few candidates: protection wins.
  ``budget=None`` means "keep only the protected tokens" (``sink + window``).
- **Protection.** The first ``sink`` positions, the last ``window`` positions and
  the tokens of the current step (the newest ``view.num_new``) are never evicted.
  The base class enforces this after every ``choose`` call, for every policy.
- **Ties** go to the older token (smaller id) first, so decisions are a pure
  function of the view: :func:`lowest` sorts stably over candidates in id order.
  NaN ranks after every number and -0.0 equals 0.0; the device path
  (:mod:`vtoken.policies.device`) applies the very same rule.

A new policy is a dataclass with a ``choose(view, candidates, n)`` method; see
``docs/policies.md`` and any of the six policy modules next to this one.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, ClassVar, Hashable

import numpy as np

from vtoken.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    InvariantViolation,
    as_index_array,
    check_int,
    is_int,
)
from vtoken.policies.ids import check_live_ids, is_member
from vtoken.policies.scores import ScoreAccumulator, as_numpy_scores

__all__ = [
    "AT_MODES",
    "Budget",
    "BudgetRaisedWarning",
    "EvictionPolicy",
    "PolicyView",
    "available",
    "check_live_ids",
    "decision_plan",
    "get",
    "is_member",
    "lowest",
    "register",
    "request_seed",
]


#: When a policy decides (``EvictionPolicy.at``): every step, or once at the end of the prompt.
AT_MODES = ("decode", "prefill")


class BudgetRaisedWarning(UserWarning):
    """A budget cap below the protected tokens (``sink + window``) was raised to them."""


# --------------------------------------------------------------------------- request ids


def request_seed(request_id: Hashable) -> int:
    """A process-independent non-negative int for ``request_id`` (``hash(str)`` is salted per process)."""
    if is_int(request_id) and request_id >= 0:
        return int(request_id)
    return zlib.crc32(repr(request_id).encode())


# --------------------------------------------------------------------------- budget


@dataclass(frozen=True)
class Budget:
    """How many tokens a request may keep live.

    ``ratio`` keeps ``floor(ratio * seq_len)`` tokens of the request's current
    length (all tokens appended so far); ``cap`` keeps at most ``cap`` tokens.
    Give one or both; with both, the smaller bound applies.

    >>> Budget(ratio=0.25).resolve(10), Budget(cap=4).resolve(10), Budget(0.5, 4).resolve(100)
    (2, 4, 4)
    """

    ratio: float | None = None
    cap: int | None = None

    def __post_init__(self):
        if self.ratio is None and self.cap is None:
            raise InvalidArgumentError("budget: expected a ratio in (0, 1) and/or a cap >= 1, got neither")
        if self.ratio is not None:
            r = self.ratio
            if isinstance(r, (bool, np.bool_)) or not isinstance(r, (float, int, np.floating, np.integer)):
                raise InvalidTypeError(f"budget.ratio: expected a float in (0, 1), got {r!r}")
            if not (0.0 < float(r) < 1.0):
                raise InvalidArgumentError(f"budget.ratio: expected a float in (0, 1), got {r!r}")
            object.__setattr__(self, "ratio", float(r))
        if self.cap is not None:
            object.__setattr__(self, "cap", check_int("budget.cap", self.cap, min_value=1))

    @classmethod
    def of(cls, value) -> "Budget":
        """Coerce a config value: a float is a ratio, an int a cap, a dict/Budget is taken as is."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"ratio", "cap"})
            if unknown:
                raise InvalidArgumentError(f"budget: expected keys 'ratio' and/or 'cap', got {unknown}")
            return cls(**value)
        if isinstance(value, (float, np.floating)):
            return cls(ratio=float(value))
        if is_int(value):
            return cls(cap=int(value))
        raise InvalidTypeError(
            f"budget: expected a float ratio in (0, 1), an int cap >= 1, a dict or a Budget, got {value!r}"
        )

    def resolve(self, seq_len: int) -> int:
        """The number of live tokens allowed for a request of ``seq_len`` tokens."""
        seq_len = check_int("seq_len", seq_len)
        # NOTE: round before floor so that 0.29 * 100 keeps 29 tokens, not 28 (float error).
        keep = seq_len if self.ratio is None else math.floor(round(self.ratio * seq_len, 9))
        return keep if self.cap is None else min(keep, self.cap)

    def resolve_many(self, seq_lens: np.ndarray) -> np.ndarray:
        """:meth:`resolve` for an int64 array of lengths, vectorized (the device loop's per-step budgets)."""
        seq = np.asarray(seq_lens, dtype=np.int64)
        keep = seq if self.ratio is None else np.floor(np.round(self.ratio * seq, 9)).astype(np.int64)
        return keep if self.cap is None else np.minimum(keep, self.cap)

    def to_json(self) -> dict:
        return {"ratio": self.ratio, "cap": self.cap}


# --------------------------------------------------------------------------- view


@dataclass(frozen=True, eq=False)
class PolicyView:
    """Everything a policy may look at for one request at one step (never a block id).

    Parameters
    ----------
    request_id : hashable
        The request (int or str for traces that are saved as JSON).
    step : int
        The runtime's step counter; traces key decisions by ``(request_id, step)``.
    token_ids : int64 array [n_live]
        The live token ids in logical order (strictly increasing). An id is also
        the token's logical (RoPE) position; see :attr:`positions`.
    seq_len : int
        Tokens appended to the request so far (the next id); budget ratios apply to it.
    budget : int
        The live count the policy should come back to.
    num_new : int
        The newest ``num_new`` positions are the current step's tokens; never evicted.
    scores : ScoreAccumulator, optional
        Exact attention scores of this request (H2O, Scissorhands, TOVA).
    window_scores : float array [n_live] or [n_live, H], optional
        Votes of a query window on each live key, aligned with ``token_ids``
        (SnapKV; see :func:`vtoken.policies.scores.window_key_scores`).
    """

    request_id: Hashable
    step: int
    token_ids: np.ndarray
    seq_len: int
    budget: int
    num_new: int = 1
    scores: ScoreAccumulator | None = None
    window_scores: Any = None

    def __post_init__(self):
        ids = check_live_ids("token_ids", self.token_ids)
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "step", check_int("step", self.step))
        min_len = int(ids[-1]) + 1 if ids.size else 0
        object.__setattr__(self, "seq_len", check_int("seq_len", self.seq_len, min_value=min_len))
        object.__setattr__(self, "budget", check_int("budget", self.budget))
        object.__setattr__(self, "num_new", check_int("num_new", self.num_new))
        if self.window_scores is not None:
            ws = as_numpy_scores("window_scores", self.window_scores)
            if ws.ndim == 1:
                ws = ws[:, None]
            if ws.ndim != 2 or ws.shape[0] != ids.size:
                raise InvalidArgumentError(
                    f"window_scores: expected shape [{ids.size}] or [{ids.size}, H] (one row per live token), "
                    f"got {tuple(ws.shape)}"
                )
            object.__setattr__(self, "window_scores", ws)

    @property
    def positions(self) -> np.ndarray:
        """Logical (RoPE) positions of the live tokens: identical to ``token_ids`` by design."""
        return self.token_ids

    @property
    def live_count(self) -> int:
        return int(self.token_ids.size)

    def require_scores(self, who: str) -> ScoreAccumulator:
        """The view's :class:`ScoreAccumulator`, or a clear error naming the policy that needs it."""
        if self.scores is None:
            raise InvalidArgumentError(
                f"view.scores: expected a ScoreAccumulator ({who} ranks tokens by attention; create one per request "
                f"with policy.make_accumulator() and feed it token_attention key scores), got None"
            )
        return self.scores


# --------------------------------------------------------------------------- policy


def decision_plan(at: str, num_new, prompt_done) -> tuple:
    """:meth:`EvictionPolicy.decision_plan` for a policy deciding ``at`` (also a replay's, from its trace's meta)."""
    num_new = np.asarray(num_new, dtype=np.int64)
    prompt_done = np.asarray(prompt_done, dtype=bool)
    if at == "decode":
        return np.ones(num_new.shape, dtype=bool), num_new
    if at != "prefill":
        raise InvalidArgumentError(f"at: expected one of {AT_MODES}, got {at!r}")
    return prompt_done.copy(), np.where(prompt_done, 1, num_new)


def lowest(candidates: np.ndarray, priority, n: int) -> np.ndarray:
    """The ``n`` candidates with the lowest ``priority``; ties go to the older (smaller id) token.

    ``candidates`` is sorted ascending, so among equal priorities the first
    positions are the oldest tokens. NaN ranks last (never chosen before a number).
    O(len) with a partition instead of a full sort: a steady decode step evicts
    one token out of thousands.
    """
    priority = np.asarray(priority, dtype=np.float64)
    if priority.shape != candidates.shape:
        raise InvariantViolation(f"priority: expected shape {candidates.shape}, got {priority.shape}")
    if n >= candidates.size:
        return candidates
    if n <= 0:
        return candidates[:0]
    if np.isnan(priority).any():  # rare (scores are validated finite): a stable sort ranks NaN after inf
        return candidates[np.argsort(priority, kind="stable")[:n]]
    kth = np.partition(priority, n - 1)[n - 1]
    below = np.flatnonzero(priority < kth)
    ties = np.flatnonzero(priority == kth)[: n - below.size]  # the oldest of the tied tokens
    return candidates[np.concatenate([below, ties])]


@dataclass
class EvictionPolicy:
    """Base class: budget, protection and validation; subclasses implement :meth:`choose`.

    Fields (every policy): ``budget`` (see :class:`Budget`; a float is a ratio,
    an int a cap, ``None`` keeps only the protected tokens), ``window`` (protected
    most recent positions), ``sink`` (protected first positions, 4 by default:
    StreamingLLM's attention sinks; position 0 carries most of every head's
    attention, and evicting it wrecks the text) and ``at`` (when the policy
    decides: ``"decode"``, every step, or ``"prefill"``, once when the prompt
    is complete; see :meth:`decision_plan`). A cap below ``sink + window`` is
    raised to it with a :class:`BudgetRaisedWarning`.
    """

    name: ClassVar[str] = ""
    #: Where the policy's scores come from (docs/policies.md): "exact" (a
    #: ScoreAccumulator in ``view.scores``), "window" (``view.window_scores``) or "none".
    score_source: ClassVar[str] = "none"
    #: Device path (:mod:`vtoken.policies.device`): the per-token state the
    #: policy ranks by ("accumulated", "last", "low", "votes") and a cap on the
    #: victims of one step (TOVA: 1), both beside the policy's ``device_priority``.
    device_state: ClassVar[tuple] = ()
    max_victims_per_step: ClassVar[int | None] = None
    #: The ``at`` values the policy has a definition for (SnapKV: prefill only).
    at_modes: ClassVar[tuple] = AT_MODES

    budget: Any = 0.5
    window: int = 32
    sink: int = 4
    at: str = "decode"

    def __post_init__(self):
        self.window = check_int(f"{self.name}.window", self.window)
        self.sink = check_int(f"{self.name}.sink", self.sink)
        if self.at not in self.at_modes:
            raise InvalidArgumentError(f"{self.name}.at: expected one of {self.at_modes}, got {self.at!r}")
        protected = self.sink + self.window
        if self.budget is None:
            if protected == 0:
                raise InvalidArgumentError(f"{self.name}.budget: expected a budget when sink + window == 0, got None")
            self.budget = Budget(cap=protected)
        self.budget = Budget.of(self.budget)
        if self.budget.cap is not None and self.budget.cap < protected:
            # Protection wins anyway (a request never drops below its protected tokens); saying so
            # once beats a config that silently means something else than it reads.
            warnings.warn(f"{self.name}.budget: cap {self.budget.cap} < sink + window = {protected}; "
                          f"raised to {protected}", BudgetRaisedWarning, stacklevel=3)
            self.budget = Budget(self.budget.ratio, protected)

    def decision_plan(self, num_new, prompt_done) -> tuple:
        """Which requests of a step decide, and the tail each protects (``at``; numpy, one entry per request).

        ``num_new``: the step's new tokens per request; ``prompt_done``: bool,
        the step completes the request's prompt. ``at="decode"``: every
        request decides, its new tokens protected. ``at="prefill"``: only the
        requests whose prompt completes decide, once, protecting the last
        token rather than the whole prompt (the window protects the rest);
        decode steps evict nothing. Returns ``(decides bool, num_new int64)``.
        """
        return decision_plan(self.at, num_new, prompt_done)

    # -- to implement ---------------------------------------------------------
    def choose(self, view: PolicyView, candidates: np.ndarray, n: int) -> np.ndarray:
        """Return at most ``n`` victims among ``candidates`` (sorted unprotected live ids), ``1 <= n <= len``."""
        raise NotImplementedError(f"{type(self).__name__}.choose")

    def device_priority(self, state, batch):
        """float64 [nnz_max]: one priority per packed entry of ``batch``, lowest evicted first (device path)."""
        raise NotImplementedError(f"{type(self).__name__}.device_priority")

    def device_int_priority(self, state, batch):
        """The priority as ``(key, bits)``, int64 ``key`` in ``[0, 2**bits)`` ordered exactly as
        :meth:`device_priority` (ties included), so that the selection sorts once; ``(None, 0)``: the
        packed order (within a request, older first). None: float priorities only (two sorts)."""
        return None

    def device_active(self, batch):
        """bool [>= num_reqs] where the policy may evict this step, or None for every request."""
        return None

    # -- provided -------------------------------------------------------------
    def select_victims_device(self, state, batch):
        """Every request of a device batch at once: ``(mask [nnz_max] bool, counts [num_reqs] int64)``.

        The device twin of :meth:`select_victims` (same victims, same tie-break);
        see :func:`vtoken.policies.device.select_victims`.
        """
        from vtoken.policies.device import select_victims  # torch only where the device path is used

        return select_victims(self, state, batch)

    def view(self, request_id: Hashable, step: int, token_ids, *, seq_len: int | None = None, num_new: int = 1,
             scores: ScoreAccumulator | None = None, window_scores=None) -> PolicyView:
        """Build the :class:`PolicyView` for one request, resolving this policy's budget.

        ``seq_len`` defaults to ``token_ids[-1] + 1`` (nothing evicted at the tail).
        """
        ids = check_live_ids("token_ids", token_ids)
        if seq_len is None:
            seq_len = int(ids[-1]) + 1 if ids.size else 0
        return PolicyView(request_id, step, ids, seq_len, self.budget.resolve(seq_len), num_new, scores, window_scores)

    def make_accumulator(self) -> ScoreAccumulator | None:
        """A fresh per-request score accumulator when the policy ranks by exact scores, else None."""
        if self.score_source != "exact":
            return None
        return ScoreAccumulator(history=getattr(self, "history", 0))

    def recent_start(self, view: PolicyView) -> int:
        """First position of the protected tail (recent window and current step)."""
        return view.seq_len - max(self.window, view.num_new)

    def candidates(self, view: PolicyView) -> np.ndarray:
        """The unprotected live ids (sorted): a slice, since the protected ids are a prefix and a suffix."""
        ids = view.token_ids
        lo, hi = np.searchsorted(ids, [self.sink, max(self.recent_start(view), self.sink)])
        return ids[lo:hi]

    def select_victims(self, view: PolicyView) -> np.ndarray:
        """Token ids to evict now: sorted unique int64, never protected, never more than the excess."""
        if not isinstance(view, PolicyView):
            raise InvalidTypeError(f"view: expected a PolicyView, got {type(view).__name__}")
        excess = view.live_count - view.budget
        if excess <= 0:
            return np.zeros(0, dtype=np.int64)
        candidates = self.candidates(view)
        if candidates.size == 0:
            return np.zeros(0, dtype=np.int64)
        n = min(excess, int(candidates.size))
        victims = np.unique(as_index_array(f"{self.name}.choose", self.choose(view, candidates, n)))
        # NOTE: this check is what makes rule 4 ("never evict the current step or a
        # protected token") hold for every policy, including user-written ones.
        ok = is_member(candidates, victims)
        if victims.size > n or not ok.all():
            raise InvariantViolation(
                f"{self.name}.choose: expected at most {n} ids among the unprotected live tokens, got "
                f"{victims.size} ids, {int((~ok).sum())} protected or not live: {victims[~ok][:8].tolist()}"
            )
        return victims

    def config(self) -> dict:
        """JSON-ready config (``get(p.name, **p.config())`` rebuilds the policy)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["budget"] = self.budget.to_json()
        return out


# --------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type] = {}


def register(name: str):
    """Class decorator: make a policy available as ``vtoken.policies.get(name)``."""

    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise InvalidArgumentError(f"policy name: expected a new name, got {name!r} (already registered)")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_REGISTRY)


def get(name: str, **cfg) -> EvictionPolicy:
    """Build the policy registered as ``name`` with config ``cfg`` (every key has a default).

    >>> get("h2o", budget=0.25, window=8).budget
    Budget(ratio=0.25, cap=None)
    """
    if not isinstance(name, str):
        raise InvalidTypeError(f"policy: expected a name (str), got {type(name).__name__}")
    cls = _REGISTRY.get(name.lower())
    if cls is None:
        raise InvalidArgumentError(f"policy: expected one of {available()}, got {name!r}")
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(cfg) - set(fields))
    if unknown:
        raise InvalidArgumentError(f"{cls.name}: expected config keys among {fields}, got unknown {unknown}")
    return cls(**cfg)
