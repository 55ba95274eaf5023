"""TraceRunner: the engine's runner without a model: the real token table, no forward.

An :class:`~vtoken.engine.scheduler.Engine` built with
``runner_factory=TraceRunner.factory(...)`` (or :func:`trace_engine`) runs its
own admission, backpressure, preemption by recompute, eviction and
reclamation over the REAL :class:`~vtoken.bookkeeping.table.TokenTable`, block ledger and
:class:`~vtoken.reclamation.manager.ReclamationManager`; only the model forward is
skipped. Every step does exactly the table calls :class:`ModelRunner` does
(``pre_forward`` hooks, ``table.sync_new_tokens_batch``, ``None`` returned
unchanged when the blocks run out, ``post_forward`` hooks), so the blocks,
admissions and preemptions of a trace run equal a model run's on the same
decisions (tests/test_trace_runner.py replays one victim trace in both).
The reclamation plans are made, launched and committed on the copy engine's
CPU path with no KV tensors: the bookkeeping is real, no bytes move.

What stands in for the forward:

- **Next tokens.** Synthetic and deterministic: the next token of a request
  holding ``n`` tokens after the step is ``n % vocab_size`` (the same in every
  mode). With ``eos_token_id=None`` every request runs to ``max_new_tokens``.
- **Attention scores** (score-based policies, host decisions only). A
  per-request :class:`AttentionSource` made by ``attention(request_id)`` when
  the request is added gives the mass the step's queries put on each listed
  key, e.g. :class:`vtoken.experiments.synthetic_scores.SyntheticScores`.
- **Step composition.** Each forward is recorded as a :class:`Forward`: per
  request, the live tokens attended before the step and the new tokens; a
  modeled clock turns it into time (:meth:`TraceRunner.take_forwards`).

Decisions happen on the host (``EngineConfig(decision="host")``): the device
decision loop reads the attention's key mass on the device, which a trace run
does not have.

Example (vtoken mode, H2O on synthetic scores that are uniform over the listed keys)::

    >>> import numpy as np
    >>> from vtoken.engine.scheduler import EngineConfig
    >>> from vtoken.engine.trace_runner import trace_engine
    >>> class Uniform:
    ...     def scores(self, key_ids, num_new, window=0):
    ...         return np.full(len(key_ids), 1.0 / len(key_ids))
    >>> eng = trace_engine(EngineConfig(mode="vtoken", num_blocks=64, block_size=4, decision="host", policy="h2o",
    ...                                 policy_config={"budget": 0.5, "window": 2, "sink": 1}),
    ...                    vocab_size=100, attention=lambda rid: Uniform())
    >>> out = eng.generate([np.arange(10), np.arange(7)], max_new_tokens=6)
    >>> [r.output for r in out][1], [len(f.new) for f in eng.runner.take_forwards()]
    ([7, 8, 9, 10, 11, 12], [2, 2, 2, 2, 2, 2])
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Protocol, Sequence

import numpy as np
import torch

from vtoken.engine.runner import RunnerConfig, StepHooks, checked_batch, checked_decode, checked_prefill, runner_table
from vtoken.errors import InvalidArgumentError, InvalidTypeError, check_int
from vtoken.bookkeeping.table import TokenTable


class AttentionSource(Protocol):
    """One request's stand-in for the attention (made per request by the runner's ``attention`` callable)."""

    def scores(self, key_ids: np.ndarray, num_new: int, window: int = 0) -> np.ndarray:
        """float ``[len(key_ids)]``: the mass the step's queries give each listed key.

        ``key_ids``: the request's live ids after the step's append, ascending;
        its last ``num_new`` are the step's new tokens, which are also the
        queries (causal among themselves). ``window > 0``: only the last
        ``window`` queries count (SnapKV's observation window).
        """
        ...


@dataclass(frozen=True)
class Forward:
    """What one forward computed, per request in batch order (int64 host arrays)."""

    past: np.ndarray  # live tokens the request held before the step: attended by every new token
    new: np.ndarray  # the step's new tokens: each attends ``past`` and the new ones before it (causal)
    decode: bool


@dataclass
class TraceStepResult:
    """The part of :class:`~vtoken.engine.runner.StepResult` the engine reads, for a trace step.

    Attributes:
        tokens: int64 ``[R]``: each request's synthetic next token.
        kv_indptr: int64 ``[R + 1]``: request r's rows in ``key_scores``.
        slot_mapping: int32 ``[T]``: the slots the new tokens got.
        forward: the step's :class:`Forward`.
        token_ids: each request's live ids (row order of ``key_scores``), when scores are on.
        key_scores: float32 ``[kv_indptr[-1], 1]``, when the runner's ``key_scores`` is ``"sum"``.
        window_scores: per request float32 ``[n_live, 1]`` (zeros for a request with no window),
            for a prefill with a window.
    """

    tokens: np.ndarray
    kv_indptr: np.ndarray
    slot_mapping: np.ndarray
    forward: Forward
    token_ids: Optional[list] = None
    key_scores: Optional[np.ndarray] = None
    window_scores: Optional[list] = None
    window_votes = None  # device votes: never (host decisions only)
    graph: bool = False
    logits = None

    def next_tokens(self) -> np.ndarray:
        return self.tokens.copy()


class TraceRunner:
    """A runner with :class:`~vtoken.engine.runner.ModelRunner`'s engine-facing interface and no model.

    Args:
        config: the :class:`RunnerConfig` (the engine derives it; ``key_scores``
            ``"sum"`` makes every step return the attention source's scores).
        vocab_size: token ids are checked against it (as a model's vocabulary).
        attention: ``request_id -> AttentionSource``, called when a request is
            added; required for ``key_scores="sum"`` and for a prefill window.
        table: an existing :class:`TokenTable` (default: a new one over a
            :class:`BlockPool` of ``config.num_blocks``).
        hooks: :class:`~vtoken.engine.runner.StepHooks` called around every step.
    """

    def __init__(self, config: RunnerConfig, *, vocab_size: int,
                 attention: Optional[Callable[[Hashable], AttentionSource]] = None,
                 table: Optional[TokenTable] = None, hooks: Sequence[StepHooks] = ()):
        if not isinstance(config, RunnerConfig):
            raise InvalidTypeError(f"config: expected a RunnerConfig, got {type(config).__name__}")
        check_int("vocab_size", vocab_size, min_value=1)
        if attention is not None and not callable(attention):
            raise InvalidTypeError(f"attention: expected a callable request_id -> AttentionSource, "
                                   f"got {type(attention).__name__}")
        if config.key_scores == "per_layer":
            raise InvalidArgumentError("key_scores: expected 'none' or 'sum' for a trace runner (no layers), "
                                       "got 'per_layer'")
        if config.key_scores == "sum" and attention is None:
            raise InvalidArgumentError("attention: expected a per-request attention source for a policy that reads "
                                       "attention scores (key_scores='sum'), got None")
        if config.cuda_graph:
            raise InvalidArgumentError("cuda_graph: expected False or None for a trace runner (no model), got True")
        table = runner_table(config, table)
        self.config = config
        self.vocab_size = int(vocab_size)
        self.attention = attention
        self.table = table
        self.hooks = list(hooks)
        self.device = torch.device("cpu")
        # the engine checks prompt ids against model.config.vocab_size
        self.model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=self.vocab_size))
        # no KV tensors, no device copy of the table: the reclaimer runs its bookkeeping only
        self.kv_caches = self.layout = self.mirror = self.slot_lists = None
        self.use_graph = False
        self.warmed_up = False
        self.num_graph_replays = 0
        self.reclaimer = None  # set by the scheduler, as on ModelRunner
        self._sources: dict = {}
        self._forwards: list[Forward] = []

    @classmethod
    def factory(cls, *, vocab_size: int, attention=None, hooks: Sequence[StepHooks] = ()) -> Callable:
        """An ``Engine(runner_factory=...)`` argument: ``RunnerConfig -> TraceRunner``."""
        return functools.partial(cls, vocab_size=vocab_size, attention=attention, hooks=list(hooks))

    # ------------------------------------------------------------- requests
    def add_request(self, req: Hashable, prefix_blocks=None) -> None:
        self.table.add_request(req, prefix_blocks)
        if self.attention is not None:
            self._sources[req] = self.attention(req)

    def evict(self, req: Hashable, token_ids) -> None:
        self.table.evict(req, token_ids)

    def finish(self, req: Hashable) -> np.ndarray:
        """Drop ``req`` and release its blocks, through the reclaimer when one is attached (as ModelRunner)."""
        freed = self.reclaimer.finish_request(req) if self.reclaimer is not None else self.table.finish(req)
        self._sources.pop(req, None)
        return freed

    def warmup(self, score_sink=None) -> None:
        """Before the first step (as :meth:`ModelRunner.warmup`): no model, no graphs to capture."""
        self.warmed_up = True

    def take_forwards(self) -> list:
        """The :class:`Forward` records since the last call, oldest first (a step that got no blocks has none)."""
        out, self._forwards = self._forwards, []
        return out

    # ------------------------------------------------------------------ steps
    def prefill(self, reqs: Sequence[Hashable], token_ids: Sequence, *, all_logits: bool = False,
                window=0, score_sink=None) -> Optional[TraceStepResult]:
        """As :meth:`ModelRunner.prefill`: ``token_ids[i]`` (>= 1 tokens, any count) after what ``reqs[i]`` holds;
        ``window``: an int for every request or one per request. ``None`` when out of blocks (nothing changed)."""
        reqs, toks, window = checked_prefill(reqs, token_ids, window)
        return self._step(reqs, toks, decode=False, window=window if window.any() else None, score_sink=score_sink)

    def decode(self, reqs: Sequence[Hashable], token_ids, *, score_sink=None) -> Optional[TraceStepResult]:
        """As :meth:`ModelRunner.decode`: one token per request. ``None`` when out of blocks (nothing changed)."""
        reqs, toks = checked_decode(reqs, token_ids)
        return self._step(reqs, toks, decode=True, window=None, score_sink=score_sink)

    def _step(self, reqs: list, toks: list, *, decode: bool, window: Optional[np.ndarray],
              score_sink) -> Optional[TraceStepResult]:
        cfg, table = self.config, self.table
        nreq = len(reqs)
        if score_sink is not None:
            raise InvalidArgumentError("score_sink: expected None for a trace runner (no attention on a device: "
                                       "decide on the host, EngineConfig(decision='host')), got a sink")
        counts, ids = checked_batch(reqs, toks, cfg, self.vocab_size)
        # NOTE: no slot-list buffer, so no max_kv_indices check: without shared prefixes, listed keys beyond the
        # pool's slots mean total tokens beyond them too, and the append below returns None.
        past = np.fromiter((table.live_count(r) for r in reqs), dtype=np.int64, count=nreq)
        if window is not None and self.attention is None:
            raise InvalidArgumentError("window: expected a trace runner with an attention source to vote, got None")
        for h in self.hooks:
            h.pre_forward(self)
        slot_mapping = table.sync_new_tokens_batch(reqs, counts)  # None: out of blocks, nothing changed
        if slot_mapping is None:
            return None
        seq_lens = np.fromiter((table.num_tokens(r) for r in reqs), dtype=np.int64, count=nreq)
        kv_indptr = np.zeros(nreq + 1, dtype=np.int64)
        np.cumsum(past + counts, out=kv_indptr[1:])
        forward = Forward(past=past, new=counts, decode=decode)
        result = TraceStepResult(tokens=seq_lens % self.vocab_size, kv_indptr=kv_indptr, slot_mapping=slot_mapping,
                                 forward=forward)
        if cfg.key_scores == "sum" or window is not None:
            live = [table.live_ids(r) for r in reqs]
            if cfg.key_scores == "sum":
                result.token_ids = live
                result.key_scores = np.concatenate([
                    self._sources[r].scores(ids_r, int(n)) for r, ids_r, n in zip(reqs, live, counts)
                ]).astype(np.float32)[:, None]
            if window is not None:
                result.window_scores = [
                    (self._sources[r].scores(ids_r, int(n), int(w)) if w else np.zeros(len(ids_r)))
                    .astype(np.float32)[:, None] for r, ids_r, n, w in zip(reqs, live, counts, window)
                ]
        self._forwards.append(forward)
        for h in self.hooks:
            h.post_forward(self, result)
        return result


def trace_engine(config, *, vocab_size: int, attention=None, policy=None, record_trace: bool = False,
                 engine_class=None):
    """An :class:`~vtoken.engine.scheduler.Engine` over a :class:`TraceRunner` (no model).

    ``config`` must decide on the host (``decision="host"``); ``engine_class``:
    an :class:`Engine` subclass to build instead (its extra keywords can be
    bound with :func:`functools.partial`).
    """
    from vtoken.engine.scheduler import Engine, EngineConfig

    if not isinstance(config, EngineConfig):
        raise InvalidTypeError(f"config: expected an EngineConfig, got {type(config).__name__}")
    if config.decision != "host":
        raise InvalidArgumentError("decision: expected 'host' for a trace engine (the device loop decides from "
                                   f"attention a trace run does not compute), got {config.decision!r}")
    cls = Engine if engine_class is None else engine_class
    return cls(None, config, policy=policy, record_trace=record_trace,
               runner_factory=TraceRunner.factory(vocab_size=vocab_size, attention=attention))
