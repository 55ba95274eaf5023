"""The embedded engine's scheduler: continuous batching over a block budget, in three modes.

One :class:`Engine` step is ONE forward (docs/architecture.md §6, §7):

1. **Admission and batch composition** (:mod:`vtoken.engine.batch_plan`).
   ``ReclamationManager.admission_budget()`` gives the free blocks minus the
   headroom reserve and the backpressure flag. Under backpressure
   (reclamation pending and free blocks at or below the low watermark)
   nothing new is admitted. Otherwise waiting requests are admitted FIFO
   while their prompt's blocks fit the budget and the running set stays
   within ``max_num_reqs``. By default a step is either the whole-prompt
   prefill of the requests it admits (within ``max_num_tokens``; prefill
   first, as vLLM's default scheduler) or a decode of every running request.
   With ``chunked_prefill=True``, ``max_num_tokens`` is a per-step token
   budget shared by decode tokens, prompt chunks and new admissions, and one
   step may mix them (vLLM's chunked prefill).
2. **Forward.** ``before_forward()`` (the compute stream waits on the last
   relocation), then the runner's prefill (any mix of chunks and decode
   tokens) or, for a pure decode step, its decode (CUDA graph on GPU). When
   the step cannot get a block for every request, the most recently admitted
   request is shed: one admitted in this very step goes back to the queue's
   head; a running one is preempted BY RECOMPUTE: its blocks are released and
   it goes back to the front of the queue with every token it has (prompt +
   output) as its new prompt; the step retries without it.
3. **Sampling and eviction.** Greedy tokens (a request in the middle of its
   prompt samples nothing). In ``naive`` and ``vtoken`` modes the policy then
   decides for each unfinished request whose prompt is complete. With
   ``decision="device"`` (the default) a :class:`~vtoken.decisions.loop.DecisionLoop`
   decides for the whole batch on the device (the attention added every key's
   mass into its per-token buffer; SnapKV's window votes stay on the device),
   kills the victims in the device mirror at once and ships them to the host,
   which applies them at the START of the next step with one ``evict_flat``
   (one step late: the host never waits on the device). With
   ``decision="host"`` (the numpy baseline and oracle) each request's scores
   come back to the host and the numpy policy decides per request.
4. **Reclamation** (``vtoken`` only does anything): plan, one copy launch,
   commit; finished requests are released first.

Victim traces. Decisions are keyed by ``(request_id, seq_len)``, the
request's own step, so a trace recorded in one mode replays in another even
if admission interleaves requests differently. Use ``record_trace=True``
(``Engine.trace``) and replay with ``policy=ReplayPolicy(trace)``: the
victims, and therefore the greedy outputs, are then identical across modes.
On the device path a decision is recorded when the host applies it, one
step after it was made, still keyed by the deciding step's ``seq_len``
(the trace's meta says ``"host_apply_delay": 1``); the device already kept
the victims out of the very next attention, exactly as the host path does,
so a device-recorded trace replays token-identically on either path. A
replay always decides on the host.

Example (CPU, tiny random model, vtoken mode with StreamingLLM)::

    >>> import numpy as np
    >>> from vtoken.engine.model import LlamaModel, ModelConfig
    >>> from vtoken.engine.scheduler import Engine, EngineConfig
    >>> eng = Engine(LlamaModel(ModelConfig(vocab_size=128)),
    ...              EngineConfig(mode="vtoken", num_blocks=64, block_size=4, policy="streamingllm",
    ...                           policy_config={"budget": 8, "window": 4, "sink": 2}))
    >>> out = eng.generate([np.arange(10), np.arange(7)], max_new_tokens=6)
    >>> [len(r.output) for r in out]
    [6, 6]
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence, Union

import numpy as np

from vtoken import cdiv
from vtoken.engine.batch_plan import BatchLimits, BatchPlan, SeqState, owed_blocks, plan_batch
from vtoken.engine.model import LlamaModel
from vtoken.decisions.loop import DecisionLoop
from vtoken.engine.runner import ModelRunner, RunnerConfig, StepResult
from vtoken.engine.step_eviction import StepEviction
from vtoken.errors import InvalidArgumentError, InvalidTypeError, as_index_array, check_int, check_request_id, is_int
from vtoken.policies import AT_MODES, EvictionPolicy, ReplayPolicy, TraceRecorder
from vtoken.policies import get as get_policy
from vtoken.reclamation.manager import MODES, ReclaimConfig, ReclamationManager

PolicyLike = Union[str, EvictionPolicy, TraceRecorder, ReplayPolicy, None]


DEFAULT_HISTORY = 4096
"""Step stats and finished requests an :class:`Engine` keeps unless told otherwise (as the reclaimer's MetricsLog)."""


@dataclass
class EngineConfig:
    """Engine settings.

    Attributes:
        mode: ``native`` (no eviction), ``naive`` (evict; a block is freed
            once fully dead) or ``vtoken`` (evict + reclaim).
        num_blocks / block_size / layout: the KV cache (block 0 is the null
            block; the budget is ``num_blocks - 1`` blocks).
        max_num_reqs: most requests running at once (and the largest decode graph).
        max_num_tokens: most prefill tokens per step (a prompt must fit); with
            ``chunked_prefill``, the per-step budget of ALL new tokens (vLLM's
            ``max_num_batched_tokens``; at least ``max_num_reqs``, and at least
            SnapKV's ``window``), and a prompt no longer has to fit.
        chunked_prefill: mix decode tokens and prompt chunks in one step within
            ``max_num_tokens`` (:mod:`vtoken.engine.batch_plan`); off by default.
        policy / policy_config: a registered policy name and its config
            (``vtoken.policies.get``); ignored in ``native`` mode. A policy
            object can be passed to :class:`Engine` instead.
        reclaim: a :class:`ReclaimConfig` or its fields as a dict; its ``mode``
            is overridden by ``mode``.
        cuda_graph: decode CUDA graphs (``None``: on iff the model is on CUDA).
        eos_token_id: stop a request at this token (``None``: only at
            ``max_new_tokens``, what the paired experiments use);
            :meth:`Engine.from_pretrained` takes the checkpoint's.
        cpu_threads: torch's intra-op threads for a CPU model, set when the
            engine is built (default 1: on a loaded 2-core machine 2 threads
            ran a step about 15x slower than 1); ``None`` leaves torch's setting.
        decision: ``"device"`` (a :class:`~vtoken.decisions.loop.DecisionLoop`;
            no per-token host work) or ``"host"`` (numpy per request, the
            baseline). A :class:`ReplayPolicy` always decides on the host.
        decision_graph: replay the device decisions from CUDA graphs (CUDA
            models only; off by default until it has run on a GPU).
        history: a long-lived engine's bound (default
            :data:`DEFAULT_HISTORY`): the last ``N`` step stats
            (``Engine.stats``) and finished requests (``Engine.finished``) are
            kept, a finished request leaves ``Engine.requests`` (``step()``
            and ``generate()`` hand it to the caller), and
            :meth:`Engine.summary` reads running totals (its p95 latency over
            the kept requests). ``None`` keeps every step and finished request:
            what a bounded run's whole-run metrics read (the experiments opt in).
    """

    mode: str = "vtoken"
    num_blocks: int = 1024
    block_size: int = 16
    layout: str = "nhd"
    max_num_reqs: int = 32
    max_num_tokens: int = 4096
    policy: Optional[str] = None
    policy_config: dict = field(default_factory=dict)
    reclaim: Any = None
    cuda_graph: Optional[bool] = None
    eos_token_id: Optional[int] = None
    cpu_threads: Optional[int] = 1
    decision: str = "device"
    decision_graph: bool = False
    chunked_prefill: bool = False
    history: Optional[int] = DEFAULT_HISTORY

    def __post_init__(self):
        # NOTE: every field is checked here, when the config is built, not later in Engine():
        # the KV cache fields by the RunnerConfig the engine derives, the limits by BatchLimits.
        RunnerConfig(num_blocks=self.num_blocks, block_size=self.block_size, layout=self.layout,
                     max_num_reqs=self.max_num_reqs, max_num_tokens=self.max_num_tokens)
        BatchLimits(self.max_num_reqs, self.max_num_tokens, self.block_size,
                    chunked=self.chunked_prefill if isinstance(self.chunked_prefill, bool) else False)
        if self.cuda_graph is not None and not isinstance(self.cuda_graph, bool):
            raise InvalidTypeError(f"cuda_graph: expected a bool or None, got {type(self.cuda_graph).__name__}")
        if self.policy is not None and not isinstance(self.policy, str):
            raise InvalidTypeError(f"policy: expected a registered policy name or None (pass a policy object to "
                                   f"Engine), got {type(self.policy).__name__}")
        if not isinstance(self.policy_config, dict):
            raise InvalidTypeError(f"policy_config: expected a dict, got {type(self.policy_config).__name__}")
        if self.policy is not None:
            get_policy(self.policy, **self.policy_config)  # an unknown name or a bad config raises now
        if self.decision not in ("device", "host"):
            raise InvalidArgumentError(f"decision: expected 'device' or 'host', got {self.decision!r}")
        if not isinstance(self.decision_graph, bool):
            raise InvalidTypeError(f"decision_graph: expected a bool, got {type(self.decision_graph).__name__}")
        if not isinstance(self.chunked_prefill, bool):
            raise InvalidTypeError(f"chunked_prefill: expected a bool, got {type(self.chunked_prefill).__name__}")
        if self.chunked_prefill:  # its token budget's rules (whole-prompt configs are checked by the runner)
            BatchLimits(self.max_num_reqs, self.max_num_tokens, self.block_size, chunked=True)
        if self.mode not in MODES:
            raise InvalidArgumentError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.cpu_threads is not None:
            check_int("cpu_threads", self.cpu_threads, min_value=1)
        if self.eos_token_id is not None:
            check_int("eos_token_id", self.eos_token_id)
        if self.history is not None:
            check_int("history", self.history, min_value=1)
        if self.reclaim is None:
            self.reclaim = ReclaimConfig(mode=self.mode)
        elif isinstance(self.reclaim, dict):
            self.reclaim = ReclaimConfig(**{**self.reclaim, "mode": self.mode})
        elif isinstance(self.reclaim, ReclaimConfig):
            self.reclaim = dataclasses.replace(self.reclaim, mode=self.mode)
        else:
            raise InvalidTypeError(f"reclaim: expected a ReclaimConfig or dict, got {type(self.reclaim).__name__}")


@dataclass
class Request:
    """One generation request and its bookkeeping (times are ``time.perf_counter()`` seconds)."""

    request_id: Hashable
    prompt: np.ndarray
    max_new_tokens: int
    output: list = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_preemptions: int = 0
    text: Optional[str] = None  # the decoded output, set at finish when the engine has a tokenizer
    retained_blocks: Optional[int] = None  # blocks held when the request finished
    live_tokens: Optional[int] = None  # live tokens when it finished
    peak_blocks: int = 0  # most blocks it held at once
    accumulator: Any = None
    _pending: Optional[np.ndarray] = None  # tokens to prefill (prompt, or everything on recompute)
    _prefilled: int = 0  # of _pending, the tokens already run (chunked prefill)

    @property
    def finished(self) -> bool:
        return self.finish_time is not None

    @property
    def latency(self) -> Optional[float]:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class StepStats:
    """What one engine step did (host wall-clock, blocks after the step)."""

    step: int
    kind: str  # "prefill", "decode" or "mixed" (what ran; as planned when nothing could run)
    num_reqs: int
    num_tokens: int
    preempted: int
    evicted: int
    allocated_blocks: int
    live_tokens: int
    free_blocks: int
    backpressure: bool
    seconds: float


def _seq_state(req: Request) -> SeqState:
    """A running request as the batch planner sees it (a complete prompt: it decodes)."""
    if req._pending is None:
        return SeqState(req.request_id, 0)
    return SeqState(req.request_id, len(req._pending), req._prefilled)


class Engine:
    """Continuous-batching engine over :class:`ModelRunner` and a :class:`ReclamationManager`.

    Args:
        model: the :class:`LlamaModel`.
        config: :class:`EngineConfig`.
        policy: overrides ``config.policy``: a name, an :class:`EvictionPolicy`,
            a :class:`TraceRecorder` or a :class:`ReplayPolicy`.
        record_trace: wrap the policy in a :class:`TraceRecorder` (``self.trace``).
        tokenizer: a :class:`~vtoken.checkpoints.tokenizer.Tokenizer`: prompts may
            then be strings or chat messages, and finished requests carry ``text``.
        runner_factory: builds the runner from the :class:`RunnerConfig` the engine
            derives (default ``ModelRunner(model, ...)``); e.g. a
            :class:`~vtoken.engine.trace_runner.TraceRunner`, the real table without
            a model forward (``model`` is then unused). The engine calls its
            ``warmup(score_sink=...)`` once, when built (CUDA graphs are captured there).
    """

    def __init__(self, model: Optional[LlamaModel], config: EngineConfig, *, policy: PolicyLike = None,
                 record_trace: bool = False, tokenizer=None, runner_factory=None):
        if not isinstance(config, EngineConfig):
            raise InvalidTypeError(f"config: expected an EngineConfig, got {type(config).__name__}")
        if tokenizer is not None and not (hasattr(tokenizer, "encode") and hasattr(tokenizer, "decode")):
            raise InvalidTypeError(f"tokenizer: expected a Tokenizer (encode/decode), got {type(tokenizer).__name__}")
        self.config = config
        self.tokenizer = tokenizer
        self.mode = config.mode
        policy = config.policy if policy is None else policy
        if isinstance(policy, str):
            policy = get_policy(policy, **config.policy_config)
        if policy is not None and not hasattr(policy, "select_victims"):
            raise InvalidTypeError(f"policy: expected a policy name or object, got {type(policy).__name__}")
        if self.mode != "native" and policy is None:
            raise InvalidArgumentError(f"policy: expected a policy in mode {self.mode!r} (it evicts), got None")
        if record_trace:
            if policy is None or isinstance(policy, (TraceRecorder, ReplayPolicy)):
                raise InvalidArgumentError("record_trace: expected a plain policy to record, got "
                                           f"{type(policy).__name__}")
            policy = TraceRecorder(policy, meta={"mode": self.mode})
        self.policy = policy if self.mode != "native" else None
        self.trace = policy if isinstance(policy, TraceRecorder) else None
        source = getattr(self.policy, "score_source", "none")
        self._window = int(getattr(getattr(self.policy, "policy", self.policy), "window", 0)) \
            if source == "window" else 0
        decider = self.trace.policy if self.trace is not None else self.policy
        # when decisions happen (EvictionPolicy.at); a replay decides when its recording did
        self.decides_at = getattr(decider, "at", None) or getattr(decider, "meta", {}).get("at", "decode")
        if self.decides_at not in AT_MODES:
            raise InvalidArgumentError(f"policy: expected a trace recorded at one of {AT_MODES}, "
                                       f"got at={self.decides_at!r}")
        self.limits = BatchLimits(config.max_num_reqs, config.max_num_tokens, config.block_size,
                                  chunked=config.chunked_prefill,
                                  min_final_chunk=self._window if config.chunked_prefill else 0)
        on_device = config.decision == "device" and isinstance(decider, EvictionPolicy)
        runner_config = RunnerConfig(
            num_blocks=config.num_blocks, block_size=config.block_size, layout=config.layout,
            max_num_reqs=config.max_num_reqs, max_num_tokens=config.max_num_tokens,
            key_scores="sum" if source == "exact" and not on_device else "none", cuda_graph=config.cuda_graph,
        )
        if runner_factory is not None and not callable(runner_factory):
            raise InvalidTypeError(f"runner_factory: expected a callable (RunnerConfig -> runner), "
                                   f"got {type(runner_factory).__name__}")
        self.runner = ModelRunner(model, runner_config) if runner_factory is None else runner_factory(runner_config)
        if on_device and getattr(self.runner, "mirror", None) is None:
            raise InvalidArgumentError("decision: expected 'host' with a runner that keeps no device mirror "
                                       f"({type(self.runner).__name__}), got 'device'")
        self.table = self.runner.table
        self.decisions = DecisionLoop(decider, self.runner.mirror, num_blocks=config.num_blocks,
                                      block_size=config.block_size, max_reqs=config.max_num_reqs,
                                      cuda_graph=config.decision_graph) if on_device else None
        self._score_sink = self.decisions if on_device and source == "exact" else None
        if self.trace is not None and on_device:
            self.trace.meta["host_apply_delay"] = 1
        self.eviction = StepEviction(self.policy, self.decisions, self.trace, self.runner, self.decides_at)
        self.reclaimer = ReclamationManager(
            self.table, config.reclaim, kv_caches=self.runner.kv_caches, layout=self.runner.layout,
            mirror=self.runner.mirror, device=self.runner.device,
            pending_kills=None if self.decisions is None else self.decisions.pending_victims,
        )
        self.runner.reclaimer = self.reclaimer
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.requests: dict[Hashable, Request] = {}
        self.stats: list[StepStats] = []
        # running totals over the whole run: summary() needs no full history (EngineConfig.history)
        self.totals = {"finished": 0, "generated_tokens": 0, "seconds": 0.0, "evicted": 0,
                       "retained_blocks": 0, "live_tokens": 0}
        self.step_count = 0
        self.peak_blocks = 0
        self.peak_running = 0
        self.num_preemptions = 0
        self._next_id = 0
        # CUDA graphs of every padded batch size, captured here, before serving (a no-op on CPU)
        self.runner.warmup(score_sink=self._score_sink)
        if self.decisions is not None:
            self.decisions.warmup(self.runner.slot_lists)
        if config.cpu_threads is not None and self.runner.device.type == "cpu":
            import torch

            torch.set_num_threads(config.cpu_threads)  # last: a refused config changes nothing

    # -------------------------------------------------------------- requests
    @property
    def usable_blocks(self) -> int:
        """Blocks one request alone can ever use: all but the null block, less the vtoken headroom reserve
        (an automatic one sized for that one request)."""
        led = self.table.ledger
        reserve = self.config.reclaim.resolve(led.usable_blocks, block_size=self.config.block_size, running=1)[1] \
            if self.reclaimer.reclaims else 0
        return led.usable_blocks - reserve

    @classmethod
    def from_pretrained(cls, model: str, config: Optional[EngineConfig] = None, *, device="cpu", dtype=None,
                        policy: PolicyLike = None, record_trace: bool = False) -> "Engine":
        """An engine over a real checkpoint with its tokenizer: a known name (``"smollm2"``, fetched and
        cached on first use), a ``.gguf`` file or an HF directory (:func:`vtoken.engine.pretrained.load_checkpoint`).
        ``eos_token_id`` is the checkpoint's unless ``config`` sets one."""
        from vtoken.engine.pretrained import load_checkpoint

        config = EngineConfig() if config is None else config
        if config.cpu_threads is not None and str(device) == "cpu":
            import torch

            torch.set_num_threads(config.cpu_threads)  # before loading: the load runs on the CPU too
        ck = load_checkpoint(model, device=device, dtype=dtype)
        if config.eos_token_id is None and ck.eos_token_id is not None:
            config = dataclasses.replace(config, eos_token_id=ck.eos_token_id)
        return cls(ck.model, config, policy=policy, record_trace=record_trace, tokenizer=ck.tokenizer)

    def encode(self, prompt, *, arg: str = "prompt") -> np.ndarray:
        """A prompt as token ids: ids pass through; a string or chat messages need the engine's tokenizer."""
        from vtoken.checkpoints.tokenizer import is_text_prompt

        if is_text_prompt(prompt):
            if self.tokenizer is None:
                raise InvalidArgumentError(f"{arg}: expected token ids (this engine has no tokenizer: build it with "
                                           "Engine.from_pretrained or tokenizer=...), got text")
            return self.tokenizer.encode(prompt, arg=arg)
        return as_index_array(arg, prompt, allow_empty=False)

    def _checked_prompt(self, prompt, max_new_tokens, arg: str = "prompt") -> np.ndarray:
        """``prompt`` as token ids that fit the block budget and, without chunked prefill, one prefill
        (a typed error naming ``arg`` if not)."""
        prompt = self.encode(prompt, arg=arg)
        check_int("max_new_tokens", max_new_tokens, min_value=1)
        vocab = self.runner.model.config.vocab_size
        if prompt.min() < 0 or prompt.max() >= vocab:
            raise InvalidArgumentError(f"{arg}: expected token ids in [0, {vocab}), got {prompt[(prompt < 0) | (prompt >= vocab)][:8].tolist()}")
        # NOTE: the rotary embedding computes any position, so a prompt past the model's context would run
        # on positions it never saw in training; a runner without a model (TraceRunner) has no such limit.
        max_pos = getattr(self.runner.model.config, "max_position_embeddings", None)
        if max_pos is not None and len(prompt) > max_pos:
            raise InvalidArgumentError(f"{arg}: expected at most max_position_embeddings ({max_pos}) tokens, "
                                       f"got {len(prompt)}")
        longest = len(prompt) + int(max_new_tokens) - 1  # what a recompute may have to prefill
        if not self.limits.chunked and longest > self.config.max_num_tokens:
            raise InvalidArgumentError(
                f"{arg}: expected len(prompt) + max_new_tokens - 1 <= max_num_tokens ({self.config.max_num_tokens}) "
                f"so a recompute fits one prefill (or chunked_prefill=True), got {longest}"
            )
        if cdiv(longest, self.config.block_size) > self.usable_blocks:
            raise InvalidArgumentError(
                f"{arg}: expected a request that fits the block budget ({self.usable_blocks} blocks), "
                f"got one needing up to {cdiv(longest, self.config.block_size)}"
            )
        return prompt

    def add_request(self, prompt, max_new_tokens: int, request_id: Optional[Hashable] = None) -> Hashable:
        """Queue a request (token ids, or text / chat messages with a tokenizer); returns its id.
        The prompt must fit the block budget and, without chunked prefill, one prefill."""
        prompt = self._checked_prompt(prompt, max_new_tokens)
        if request_id is None:
            while self._next_id in self.requests:
                self._next_id += 1
            request_id = self._next_id
        check_request_id("request_id", request_id)  # NOTE: a NaN id would be lost by every dict lookup
        if request_id in self.requests:
            raise InvalidArgumentError(f"request_id: expected a new id, got {request_id!r}")
        req = Request(request_id, prompt, int(max_new_tokens), arrival_time=time.perf_counter())
        req._pending = prompt
        self.requests[request_id] = req
        self.waiting.append(req)
        return request_id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ step
    def step(self) -> list[Request]:
        """Run one engine step (one forward); returns the requests that finished in it."""
        t0 = time.perf_counter()
        applied = self.eviction.apply_device_victims()
        budget = self.reclaimer.admission_budget()
        plan = plan_batch([_seq_state(r) for r in self.running],
                          (SeqState(r.request_id, len(r._pending)) for r in self.waiting), self.limits,
                          free_blocks=budget.free_blocks, backpressure=budget.backpressure)
        self._admit(plan)
        batch = [(self.requests[c.request_id], c) for c in plan.chunks]  # (request, its Chunk)
        res, preempted = self._forward(batch)
        done, evicted = [], 0
        if res is not None and batch:
            done, evicted = self._after_forward(batch, res)
        self.reclaimer.note_waiting(self._owed_blocks())  # after the step: what it appended is no longer owed
        self.reclaimer.launch(self.reclaimer.maybe_plan())
        self.reclaimer.commit()
        led = self.table.ledger
        self.peak_blocks = max(self.peak_blocks, led.num_allocated)
        self.peak_running = max(self.peak_running, len(self.running))
        kind = BatchPlan(tuple(c for _, c in batch)).kind if batch else plan.kind
        self.stats.append(StepStats(
            step=self.step_count, kind=kind, num_reqs=len(batch), num_tokens=sum(c.num_tokens for _, c in batch),
            preempted=preempted, evicted=evicted + applied, allocated_blocks=led.num_allocated,
            live_tokens=int(led.total_live), free_blocks=led.num_free, backpressure=budget.backpressure,
            seconds=time.perf_counter() - t0,
        ))
        self.totals["seconds"] += self.stats[-1].seconds
        self.totals["evicted"] += evicted + applied
        self._trim()
        self.step_count += 1
        return done

    def _trim(self) -> None:
        """With ``config.history = N``: keep the last N step stats and finished requests, and forget finished
        requests' ids. NOTE: trimmed once a container holds 2N, so the cost is O(1) amortized per step."""
        n = self.config.history
        if n is None:
            return
        if len(self.stats) >= 2 * n:
            del self.stats[:-n]
        if len(self.finished) >= 2 * n:
            del self.finished[:-n]

    def _admit(self, plan: BatchPlan) -> list[Request]:
        """Move the plan's admitted requests (the queue's head, in order) to the running set, registered."""
        admitted = []
        for rid in plan.admitted:
            req = self.waiting.popleft()
            assert req.request_id == rid, "the plan admits the queue's head, in order"
            req.accumulator = self.policy.make_accumulator() if self.policy is not None and self.decisions is None \
                else None  # the device loop keeps its scores on the device
            self.runner.add_request(rid)
            admitted.append(req)
        self.running.extend(admitted)
        return admitted

    def _forward(self, batch: list) -> tuple[Optional[StepResult], int]:
        """Run ``batch`` (shrunk in place); when blocks run out, shed its last (most recently admitted)
        request and retry. Returns the result (None: nothing ran) and the preemptions."""
        preempted = 0
        while batch:
            self.reclaimer.before_forward()
            reqs = [r.request_id for r, _ in batch]
            if all(c.decode for _, c in batch):
                res = self.runner.decode(reqs, [r.output[-1] for r, _ in batch], score_sink=self._score_sink)
            else:
                toks = [np.asarray(r.output[-1:]) if c.decode else
                        r._pending[r._prefilled: r._prefilled + c.num_tokens] for r, c in batch]
                window = [self._window if c.completes_prompt else 0 for _, c in batch]  # SnapKV votes once
                res = self.runner.prefill(reqs, toks, window=window, score_sink=self._score_sink)
            if res is not None:
                return res, preempted
            req, chunk = batch.pop()
            if not chunk.admitted:
                self._preempt(req)
                preempted += 1
                continue
            shed = [req]  # admitted this step: back to the queue's head
            if not self.limits.chunked:  # whole prompts: admission checked their blocks, so only foreign
                shed += [r for r, _ in reversed(batch)]  # allocations get here; shed them all
                batch.clear()
            for r in shed:
                self.runner.finish(r.request_id)
                self.running.remove(r)
                self.waiting.appendleft(r)
        return None, preempted

    def _owed_blocks(self) -> int:
        """Blocks the engine knows it will need beyond the running requests' per-token growth (the trigger's
        projected demand): the rest of every partial prompt, and the waiting prompts that free request slots
        could admit next."""
        S = self.config.block_size
        owed = owed_blocks(map(_seq_state, self.running), S)
        slots = max(0, self.config.max_num_reqs - len(self.running))
        return owed + sum(cdiv(len(r._pending), S) for r in itertools.islice(self.waiting, slots))

    def _preempt(self, req: Request) -> None:
        """Release ``req``'s blocks and queue it first, to recompute everything it has."""
        self.runner.finish(req.request_id)
        self.running.remove(req)
        req._pending = np.concatenate([req.prompt, np.asarray(req.output, dtype=np.int64)])
        req._prefilled = 0
        req.num_preemptions += 1
        req.accumulator = None
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _after_forward(self, batch: list, res: StepResult) -> tuple[list, int]:
        now = time.perf_counter()
        nxt = res.next_tokens()
        table, eos = self.table, self.config.eos_token_id
        done = []
        # The step's new tokens as the policy sees them: a completed prompt is new as a whole (as unchunked).
        num_new = np.array([c.num_tokens for _, c in batch], dtype=np.int64)
        for i, (r, c) in enumerate(batch):
            r.peak_blocks = max(r.peak_blocks, table.held_blocks(r.request_id))
            if not c.decode:
                if not c.completes_prompt:
                    r._prefilled += c.num_tokens
                    continue  # mid-prompt: its logits are ignored
                num_new[i] = len(r._pending)
                r._pending, r._prefilled = None, 0
            r.output.append(int(nxt[i]))
            if r.first_token_time is None:
                r.first_token_time = now
            if len(r.output) >= r.max_new_tokens or (eos is not None and r.output[-1] == eos):
                done.append(r)
        evicted = 0
        if self.policy is not None:
            done_ids = {id(r) for r in done}
            finished = np.array([id(r) in done_ids for r, _ in batch], dtype=bool)
            mid = np.array([not c.samples for _, c in batch], dtype=bool)
            prompt_done = np.array([c.completes_prompt for _, c in batch], dtype=bool)
            evicted = self.eviction.decide(batch, res, num_new, finished=finished, mid=mid, prompt_done=prompt_done)
        for r in done:
            r.retained_blocks = table.held_blocks(r.request_id)
            r.live_tokens = table.live_count(r.request_id)
            r.finish_time = now
            if self.tokenizer is not None:
                r.text = self.tokenizer.decode(r.output)
            self.runner.finish(r.request_id)
            self.running.remove(r)
            self.finished.append(r)
            t = self.totals
            t["finished"] += 1
            t["generated_tokens"] += len(r.output)
            t["retained_blocks"] += r.retained_blocks
            t["live_tokens"] += r.live_tokens
            if self.config.history is not None:
                del self.requests[r.request_id]  # handed to the caller by step()
        return done, evicted

    # ------------------------------------------------------------------- run
    def generate(self, prompts: Sequence, max_new_tokens: Union[int, Sequence[int]], *,
                 concurrency: Optional[int] = None, max_steps: Optional[int] = None) -> list[Request]:
        """Serve ``prompts`` to completion; returns their :class:`Request` records in prompt order.

        ``concurrency=None`` queues every prompt at once (open loop). With
        ``concurrency=C`` the run is closed-loop: C requests are submitted, and
        each completion submits the next one (its latency counts from then).
        A prompt is token ids, or, with a tokenizer, a string or a list of chat
        messages (one string or one chat alone is one prompt); each finished
        request then carries its decoded ``text``. Every prompt is checked and
        encoded before any is queued.
        """
        from vtoken.checkpoints.tokenizer import is_text_prompt

        if is_text_prompt(prompts):
            prompts = [prompts]
        n = len(prompts)
        mnt = [max_new_tokens] * n if isinstance(max_new_tokens, (int, np.integer)) else list(max_new_tokens)
        if len(mnt) != n:
            raise InvalidArgumentError(f"max_new_tokens: expected {n} values (one per prompt), got {len(mnt)}")
        prompts = [self._checked_prompt(p, m, f"prompts[{i}]") for i, (p, m) in enumerate(zip(prompts, mnt))]
        if concurrency is not None and not (is_int(concurrency) and concurrency >= 1):
            raise InvalidArgumentError(f"concurrency: expected an int >= 1 or None, got {concurrency!r}")
        if max_steps is not None:
            check_int("max_steps", max_steps, min_value=1)
        ids, submitted, records = [], 0, {}
        limit = n if concurrency is None else min(concurrency, n)
        while submitted < limit:
            ids.append(self.add_request(prompts[submitted], mnt[submitted]))
            records[ids[-1]] = self.requests[ids[-1]]  # kept here: a bounded engine forgets finished ids
            submitted += 1
        steps = 0
        while self.has_work():
            if max_steps is not None and steps >= max_steps:
                raise InvalidArgumentError(f"max_steps: expected the run to finish within {max_steps} steps, it did not")
            finished = self.step()
            steps += 1
            for _ in finished:
                if submitted < n:
                    ids.append(self.add_request(prompts[submitted], mnt[submitted]))
                    records[ids[-1]] = self.requests[ids[-1]]
                    submitted += 1
        return [records[i] for i in ids]

    # --------------------------------------------------------------- summary
    def summary(self) -> dict:
        """Totals of the run so far (JSON-ready)."""
        return engine_summary(self)


def engine_summary(engine: Engine) -> dict:
    """:meth:`Engine.summary`: the engine's running totals as JSON-ready figures."""
    t = engine.totals
    S = engine.config.block_size
    tokens, wall, done = t["generated_tokens"], t["seconds"], t["finished"]
    lat = sorted(r.latency for r in engine.finished)  # the kept ones (the last `history`; all with None)
    rec = engine.reclaimer.metrics.summary()
    return {
        "mode": engine.mode,
        "policy": getattr(engine.policy, "name", None),
        "requests": done,
        "generated_tokens": tokens,
        "steps": engine.step_count,
        "seconds": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "p95_latency_s": float(np.percentile(lat, 95)) if lat else None,
        "mean_retained_blocks": t["retained_blocks"] / done if done else None,
        "utilization": t["live_tokens"] / (t["retained_blocks"] * S) if done and t["retained_blocks"] else None,
        "peak_blocks": engine.peak_blocks,
        "peak_running": engine.peak_running,
        "preemptions": engine.num_preemptions,
        "relocated_tokens": rec.get("moves", 0),
        "reclaimed_blocks": rec.get("freed_blocks", 0),
        "fresh_dst_blocks": rec.get("dst_blocks", 0),  # fresh destinations taken: net freed = reclaimed - this
        "backpressure_steps": rec.get("backpressure_steps", 0),
    }
