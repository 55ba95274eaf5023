"""The capacity frontier under a fixed block budget (the paper's Figure 10).

For each mode (``native``, ``naive``, ``vtoken``) this finds the largest
concurrency C such that C identical requests (``prompt_len`` prompt tokens,
``output_len`` generated tokens) all run to completion **at once** in a pool of
``num_blocks`` KV blocks.

Feasibility of one C (one full simulation):

- all C requests are admitted in the first step under the engine's rule
  (``ReclamationManager.admission_budget()``: free blocks minus the headroom
  reserve, and nothing while backpressure holds). A request left waiting makes
  C infeasible: queuing does not count as concurrency;
- every block allocation of every step succeeds. The first one that fails (in
  the engine, the point where a request is preempted by recompute) makes C
  infeasible;
- the vtoken headroom (destination blocks held back from allocation) is inside
  the same ``num_blocks`` budget: growth never allocates from it.

The search probes the analytic upper bound first (:func:`upper_bound`: the
requests run in lockstep, so at their peak-live moment every one holds at
least ``ceil(live / S)`` blocks at once) and then bisects, assuming that
feasibility is monotone in C. Every probe is kept in the result.

Two drivers:

- ``trace_only=True``: the REAL :class:`~vtoken.bookkeeping.table.TokenTable`,
  :class:`~vtoken.bookkeeping.ledger.BlockLedger`, planner and
  :class:`~vtoken.reclamation.manager.ReclamationManager` run the engine's step protocol
  (admission budget, ``before_forward``, slot assignment, eviction, plan,
  launch, commit) with the model forward skipped. The copy engine runs its CPU
  path with no KV tensors: every plan is launched and committed, only no bytes
  move. Victims come from the named policy, run ONCE per request and decision
  on the real table's live ids (score policies see a synthetic attention,
  :class:`SyntheticAttention`), recorded in a :class:`VictimTrace` and replayed
  in every mode and at every C, so all modes see identical decisions. Long
  contexts run in seconds on a CPU.
- ``trace_only=False``: the embedded :class:`~vtoken.engine.Engine` (a
  random-weight Llama, :class:`vtoken.experiments.common.ModelSpec`); the
  policy ranks tokens by the model's real attention. Slow on a CPU: for small
  configurations, or a GPU.

The eviction schedule: the policy keeps at most ``kv_budget`` live tokens per
request (a :class:`~vtoken.policies.Budget` cap; ``kv_budget`` defaults to
``round((1 - evict_ratio) * kv_tokens)``). A request holds KV for
``kv_tokens = prompt_len + output_len - 1`` tokens at its end (the last
generated token is never fed back), so its full retention is
``ceil(kv_tokens / S)`` blocks and its ideal packed size ``ceil(kv_budget / S)``.

Presets (:data:`PRESETS`): the paper's request, 8192 prompt + 8129 output
tokens (16320 KV tokens = 1020 blocks at S = 16) under a KV budget of 8192
tokens (half of a 16K context: 512 blocks packed, 8128 tokens evicted), in
the paper's two block budgets: 5427 blocks (``paper-0.35``) and 11519 blocks
(``paper-0.50``).

Example (trace-only, a small configuration; about a second on a CPU):
    >>> from vtoken.experiments.frontier import FrontierConfig, run_frontier
    >>> res = run_frontier(FrontierConfig(num_blocks=193, prompt_len=128, output_len=129, trace_only=True))
    >>> res.full_blocks_per_request, res.ideal_packed_blocks_per_request
    (16, 8)
    >>> res.max_concurrency["native"], res.max_concurrency["vtoken"] > res.max_concurrency["naive"]
    (12, True)
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from vtoken import cdiv
from vtoken.errors import InvalidArgumentError, InvalidTypeError, InvariantViolation, check_int
from vtoken.experiments.common import check_kv_cache, check_memory, check_pool, save_figure
from vtoken.experiments.synthetic_scores import SyntheticAttention
from vtoken.bookkeeping.ledger import BlockLedger
from vtoken.bookkeeping.pool import BlockPool
from vtoken.reclamation.manager import MODES, ReclaimConfig, ReclamationManager
from vtoken.bookkeeping.table import TokenTable

# The paper's Figure 10 setting (see the module docstring).
PAPER_REQUEST = {"block_size": 16, "prompt_len": 8192, "output_len": 8129, "kv_budget": 8192}
PRESETS = {
    "paper-0.35": {"num_blocks": 5427, **PAPER_REQUEST},
    "paper-0.50": {"num_blocks": 11519, **PAPER_REQUEST},
}

# The reclamation the presets used to impose before the trigger was driven by memory pressure:
# continuous (every step, at any free count, down to F = 0). It reached the same frontier; the
# search runs it a second time for comparison (FrontierConfig.compare_continuous), reporting its
# write amplification next to the default's.
CONTINUOUS_RECLAIM = {"theta_F": 0.0, "low_watermark": 1.0, "check_interval": 1}
# NOTE: peak host memory of a trace-only search per pool slot (num_blocks x S), default request:
# 299 B (tracemalloc) at 1025 blocks, 179 B at 4097 and 258 B (max RSS growth) at 8193; 320 allows
# for the spread. The run's table, ledger, trace and probes all grow with the pool.
TRACE_ONLY_BYTES_PER_SLOT = 320


@dataclass
class FrontierConfig:
    """What to measure. See the module docstring for the definitions.

    Attributes:
        num_blocks: KV blocks in the pool, the null block included (vLLM's
            ``num_gpu_blocks``); the budget is ``num_blocks - 1``.
        block_size: tokens per block (S).
        prompt_len / output_len: every request's prompt and generated tokens.
        policy: a registered eviction policy name (``vtoken.policies.available()``).
        policy_config: extra policy fields (``window``, ``sink``, ...); the
            budget is always the ``kv_budget`` cap.
        evict_ratio: the share of a request's KV tokens evicted by its end;
            sets ``kv_budget`` when that is ``None``.
        kv_budget: live tokens kept per request (``None``: from ``evict_ratio``).
        modes: the modes to search.
        trace_only: drive the runtime without the model (see module docstring).
        seed: seeds the policy, the synthetic attention and the prompts.
        reclaim: :class:`ReclaimConfig` fields of vtoken mode over the
            library's defaults (the pressure-driven trigger, the automatic
            headroom sized to the running requests).
        compare_continuous: search vtoken a second time with
            :data:`CONTINUOUS_RECLAIM` (the presets' former settings) and
            report both write amplifications.
        max_concurrency: largest C probed (``None``: the analytic bound).
    """

    num_blocks: int = 1025
    block_size: int = 16
    prompt_len: int = 512
    output_len: int = 513
    policy: str = "random"
    policy_config: dict = field(default_factory=dict)
    evict_ratio: float = 0.5
    kv_budget: Optional[int] = None
    modes: tuple = MODES
    trace_only: bool = False
    seed: int = 0
    reclaim: dict = field(default_factory=dict)
    max_concurrency: Optional[int] = None
    compare_continuous: bool = True

    def __post_init__(self):
        check_int("num_blocks", self.num_blocks, min_value=2)
        check_int("block_size", self.block_size, min_value=1)
        check_pool("num_blocks", self.num_blocks, self.num_blocks, self.block_size)
        check_int("prompt_len", self.prompt_len, min_value=1)
        check_int("output_len", self.output_len, min_value=1)
        check_int("seed", self.seed)
        if isinstance(self.evict_ratio, bool) or not isinstance(self.evict_ratio, (int, float)):
            raise InvalidTypeError(f"evict_ratio: expected a float, got {type(self.evict_ratio).__name__}")
        if not 0.0 <= float(self.evict_ratio) < 1.0:
            raise InvalidArgumentError(f"evict_ratio: expected a value in [0, 1), got {self.evict_ratio}")
        if self.kv_budget is None:
            self.kv_budget = max(1, round((1.0 - float(self.evict_ratio)) * self.kv_tokens))
        check_int("kv_budget", self.kv_budget, min_value=1)
        from vtoken.policies import available

        if not isinstance(self.policy, str) or self.policy.lower() not in available():
            raise InvalidArgumentError(f"policy: expected one of {available()}, got {self.policy!r}")
        self.policy = self.policy.lower()
        if not isinstance(self.policy_config, dict) or "budget" in self.policy_config:
            raise InvalidArgumentError(
                f"policy_config: expected a dict without 'budget' (kv_budget sets it), got {self.policy_config!r}"
            )
        modes = tuple(self.modes)
        if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
            raise InvalidArgumentError(f"modes: expected distinct modes among {MODES}, got {self.modes!r}")
        self.modes = modes
        if not isinstance(self.reclaim, dict):
            raise InvalidTypeError(f"reclaim: expected a dict of ReclaimConfig fields, got {type(self.reclaim).__name__}")
        if "mode" in self.reclaim:
            raise InvalidArgumentError("reclaim: expected ReclaimConfig fields without 'mode' (set per mode), got 'mode'")
        self.reclaim_config("vtoken")  # validates the fields now
        if not isinstance(self.compare_continuous, bool):
            raise InvalidTypeError(f"compare_continuous: expected a bool, got {type(self.compare_continuous).__name__}")
        if self.max_concurrency is not None:
            check_int("max_concurrency", self.max_concurrency, min_value=1)
        self.make_policy()  # validates policy_config now, not in the middle of a search

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "FrontierConfig":
        """The preset ``name`` (:data:`PRESETS`) with ``overrides`` applied."""
        if name not in PRESETS:
            raise InvalidArgumentError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_options(cls, preset: Optional[str] = None, *, window: Optional[int] = None,
                     sink: Optional[int] = None, reclaim: Optional[dict] = None, **options) -> "FrontierConfig":
        """Build from command-line options, where ``None`` means "not given".

        A ``preset`` supplies the defaults that the given options override; an
        explicit ``evict_ratio`` without ``kv_budget`` replaces the preset's
        budget. ``window`` and ``sink`` go to ``policy_config``; ``reclaim`` holds
        :class:`ReclaimConfig` fields (``None`` values dropped).
        """
        if preset is not None and preset not in PRESETS:
            raise InvalidArgumentError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
        base = dict(PRESETS[preset]) if preset is not None else {}
        given = {k: v for k, v in options.items() if v is not None}
        if "evict_ratio" in given and "kv_budget" not in given:
            base.pop("kv_budget", None)
        for key, value in (("window", window), ("sink", sink)):
            if value is not None:
                given["policy_config"] = {**given.get("policy_config", {}), key: value}
        rec = {k: v for k, v in (reclaim or {}).items() if v is not None}
        return cls(**{**base, **given}, reclaim=rec)

    @property
    def kv_tokens(self) -> int:
        """KV tokens a request holds at its last step: the last generated token is never fed back."""
        return self.prompt_len + self.output_len - 1

    def reclaim_config(self, mode: str) -> ReclaimConfig:
        """The :class:`ReclaimConfig` of ``mode``: the library's defaults under ``reclaim``, except the
        debug checks, off unless asked for (O(pool) work a step: the search is a benchmark of capacity)."""
        return ReclaimConfig(**{"check_invariants": False, **self.reclaim, "mode": mode})

    def headroom(self, mode: str, concurrency: int) -> int:
        """Blocks held back from the requests in ``mode`` (vtoken's reserve; 0 otherwise)."""
        if mode != "vtoken":
            return 0
        return self.reclaim_config(mode).resolve(self.num_blocks - 1, block_size=self.block_size,
                                                 running=concurrency)[1]

    def make_policy(self):
        """The policy, with the ``kv_budget`` cap.

        Unless ``policy_config`` sets one, the protected window is the policy's
        default capped at :data:`vtoken.experiments.common.MAX_DEFAULT_WINDOW`,
        as in the other experiments (StreamingLLM's 1020-token default would
        otherwise protect more than a small budget).
        """
        from vtoken.experiments.common import MAX_DEFAULT_WINDOW
        from vtoken.policies import get

        extra = dict(self.policy_config)
        if "window" not in extra:
            extra["window"] = min(int(get(self.policy).window), MAX_DEFAULT_WINDOW)
        return get(self.policy, **{**extra, "budget": int(self.kv_budget)})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["modes"] = list(self.modes)
        # every field the vtoken runs used (mode aside: set per mode), so the dict builds the same config back
        d["reclaim"] = {k: v for k, v in dataclasses.asdict(self.reclaim_config("vtoken")).items() if k != "mode"}
        return d


@dataclass
class Probe:
    """One simulation of C concurrent requests in one mode."""

    mode: str
    concurrency: int
    feasible: bool
    reason: str  # "ok", or why not
    steps: int  # engine steps run (to completion, or to the failure)
    headroom_blocks: int  # the reserve held back (vtoken), inside the budget
    peak_allocated_blocks: int  # most blocks allocated at once (right after a step's appends)
    blocks_per_request: float  # peak_allocated_blocks / C
    final_blocks_per_request: float  # blocks held per request at the last step
    utilization_mean: Optional[float]  # live / (allocated * S) after each step's commit, 2nd half of decode
    utilization_min: Optional[float]
    relocated_tokens: int
    reclaimed_blocks: int  # net: sources freed minus destinations used
    plans: int
    seconds: float

    @property
    def write_amplification(self) -> Optional[float]:
        """Tokens moved per block reclaimed (net), or None when nothing was reclaimed."""
        return self.relocated_tokens / self.reclaimed_blocks if self.reclaimed_blocks > 0 else None

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "write_amplification": self.write_amplification}


@dataclass
class ModeFrontier:
    """The search result of one mode."""

    mode: str
    max_concurrency: int
    upper_bound: int  # the analytic bound the search started from
    best: Optional[Probe]  # the probe at max_concurrency (None if 0)
    probes: list

    def to_dict(self) -> dict:
        return {"mode": self.mode, "max_concurrency": self.max_concurrency, "upper_bound": self.upper_bound,
                "best": self.best.to_dict() if self.best else None, "probes": [p.to_dict() for p in self.probes]}


@dataclass
class FrontierResult:
    config: FrontierConfig
    modes: dict  # mode -> ModeFrontier
    full_blocks_per_request: int  # ceil(kv_tokens / S): what native keeps
    ideal_packed_blocks_per_request: int  # ceil(min(kv_budget, kv_tokens) / S)
    ideal_max_concurrency: int  # floor(usable blocks / ideal packed)
    policy_decisions: int  # decisions the policy made (trace-only: each replayed in every probe)
    seconds: float
    continuous: Optional[ModeFrontier] = None  # vtoken searched again with CONTINUOUS_RECLAIM

    @property
    def max_concurrency(self) -> dict:
        return {m: f.max_concurrency for m, f in self.modes.items()}

    @property
    def write_amplification(self) -> dict:
        """vtoken's tokens moved per block reclaimed at its frontier, with the default reclamation and with
        the continuous one (when compared)."""
        out = {}
        if "vtoken" in self.modes and self.modes["vtoken"].best is not None:
            out["default"] = self.modes["vtoken"].best.write_amplification
        if self.continuous is not None and self.continuous.best is not None:
            out["continuous"] = self.continuous.best.write_amplification
        return out

    @property
    def blocks_per_request(self) -> dict:
        return {m: (f.best.blocks_per_request if f.best else None) for m, f in self.modes.items()}

    def to_dict(self) -> dict:
        cfg = self.config
        best = {m: f.best for m, f in self.modes.items()}

        def per_mode(attr):
            return {m: (getattr(b, attr) if b else None) for m, b in best.items()}

        return {
            "max_concurrency": self.max_concurrency,
            "blocks_per_request": self.blocks_per_request,
            "ideal_packed_blocks_per_request": self.ideal_packed_blocks_per_request,
            "num_blocks": cfg.num_blocks,
            "usable_blocks": cfg.num_blocks - 1,
            "full_blocks_per_request": self.full_blocks_per_request,
            "ideal_max_concurrency": self.ideal_max_concurrency,
            "final_blocks_per_request": per_mode("final_blocks_per_request"),
            "utilization": per_mode("utilization_mean"),
            "utilization_min": per_mode("utilization_min"),
            "headroom_blocks": per_mode("headroom_blocks"),
            "relocated_tokens": per_mode("relocated_tokens"),
            "reclaimed_blocks": per_mode("reclaimed_blocks"),
            "write_amplification": self.write_amplification,
            "continuous_reclaim": None if self.continuous is None else {
                "settings": dataclasses.asdict(ReclaimConfig(**{**cfg.reclaim, **CONTINUOUS_RECLAIM})),
                **self.continuous.to_dict()},
            "upper_bound": {m: f.upper_bound for m, f in self.modes.items()},
            "kv_tokens": cfg.kv_tokens,
            "kv_budget": cfg.kv_budget,
            "evicted_fraction": max(0.0, 1.0 - cfg.kv_budget / cfg.kv_tokens),
            "policy_decisions": self.policy_decisions,
            "seconds": self.seconds,
            "config": cfg.to_dict(),
            "probes": {m: [p.to_dict() for p in f.probes] for m, f in self.modes.items()},
        }


# --------------------------------------------------------------------------- victims


class VictimTrace:
    """The victims of every (request, decision): decided once by the policy, replayed everywhere.

    Decision ``k`` of a request is made at ``seq_len = prompt_len + k`` (after
    the prefill for ``k = 0``, after decode step ``k`` otherwise), keyed like
    the engine's victim traces by ``(request_id, seq_len)``. A miss runs the
    policy on the live ids of the table at hand: they are the same in every
    evicting mode, since a request's live set depends only on its own earlier
    decisions (replaying a victim that is not live raises in the table).
    """

    def __init__(self, cfg: FrontierConfig):
        self.cfg = cfg
        self.policy = cfg.make_policy()
        self.source = self.policy.score_source
        self._victims: dict[int, list] = {}
        self._state: dict[int, tuple] = {}
        self.decisions = 0
        self.seconds = 0.0  # host time spent in the policy (and its synthetic scores)

    def victims(self, req: int, k: int, table: TokenTable) -> np.ndarray:
        """Sorted victim ids of decision ``k`` of ``req``; decided on ``table`` the first time."""
        done = self._victims.setdefault(req, [])
        if k < len(done):
            return done[k]
        if k != len(done):
            raise InvalidArgumentError(f"k: expected decision {len(done)} of request {req} next, got {k}")
        t0 = time.perf_counter()
        cfg, policy = self.cfg, self.policy
        if req not in self._state:
            syn = SyntheticAttention(cfg.kv_tokens, seed=cfg.seed, request=req) if self.source != "none" else None
            self._state[req] = (syn, policy.make_accumulator())
        syn, acc = self._state[req]
        ids = table.live_ids(req)
        seq_len = cfg.prompt_len + k
        window_scores = None
        if self.source == "exact":
            acc.update(ids, syn.prefill(seq_len) if k == 0 else syn.decode(ids))
        elif self.source == "window" and k == 0:  # SnapKV votes once, at the end of prefill (num_new = 1)
            window_scores = syn.prefill(seq_len, window=policy.window)
        num_new = 1 if (k > 0 or window_scores is not None) else cfg.prompt_len
        view = policy.view(req, seq_len, ids, seq_len=seq_len, num_new=num_new, scores=acc,
                           window_scores=window_scores)
        v = policy.select_victims(view)
        done.append(v)
        self.decisions += 1
        self.seconds += time.perf_counter() - t0
        return v


# --------------------------------------------------------------------------- drivers


def _utilization(util: list) -> tuple[Optional[float], Optional[float]]:
    """Mean and min over the second half of the decode steps (the steady state)."""
    if not util:
        return None, None
    tail = np.asarray(util[len(util) // 2:], dtype=np.float64)
    return float(tail.mean()), float(tail.min())


def _reclaim_totals(mgr: ReclamationManager) -> tuple[int, int, int]:
    t = mgr.metrics.totals  # running totals: the metrics ring keeps only the newest steps
    return t.moves, t.freed_blocks - t.dst_blocks, t.plans


def _tick(progress, label: str, j: int, n: int) -> None:
    if progress is not None:
        progress.set_description(f"{label}: step {j}/{n}")


def simulate_trace_only(cfg: FrontierConfig, mode: str, C: int, trace: Optional[VictimTrace] = None,
                        progress=None) -> Probe:
    """One trace-only run of ``C`` requests in ``mode`` (the real runtime, no model forward).

    ``trace`` holds the victims to replay (a new one is made if ``None``);
    ``progress``: an object with ``set_description(text)`` (e.g.
    :class:`vtoken.experiments.common.Progress`).
    """
    check_int("C", C, min_value=1)
    if mode not in MODES:
        raise InvalidArgumentError(f"mode: expected one of {MODES}, got {mode!r}")
    t0 = time.perf_counter()
    S, P, O = cfg.block_size, cfg.prompt_len, cfg.output_len
    evicts = mode != "native"
    if evicts and trace is None:
        trace = VictimTrace(cfg)
    ledger = BlockLedger(BlockPool(cfg.num_blocks), S)
    table = TokenTable(ledger, initial_tokens=C * cfg.kv_tokens)
    # No KV tensors: the copy engine's CPU path launches and commits every plan, moving no bytes.
    mgr = ReclamationManager(table, cfg.reclaim_config(mode))
    reqs = list(range(C))
    ones = np.ones(C, dtype=np.int64)
    util: list = []
    peak = 0
    label = f"{mode} C={C}"

    def probe(feasible: bool, reason: str, steps: int) -> Probe:
        moves, net, plans = _reclaim_totals(mgr)
        u_mean, u_min = _utilization(util)
        return Probe(mode, C, feasible, reason, steps, ledger.reserved, peak, peak / C, ledger.num_allocated / C,
                     u_mean, u_min, moves, net, plans, time.perf_counter() - t0)

    def evict(k: int) -> None:
        per = [trace.victims(r, k, table) for r in reqs]
        table.evict_flat(reqs, np.concatenate(per), np.fromiter(map(len, per), dtype=np.int64, count=C))

    # Step 0: admission under the engine's rule, then one prefill of every prompt.
    budget = mgr.admission_budget()
    fit = 0 if budget.backpressure else min(C, budget.free_blocks // cdiv(P, S))
    if fit < C:
        return probe(False, f"queued: {fit} of {C} requests fit at admission", 0)
    for r in reqs:
        table.add_request(r)
    mgr.before_forward()
    if table.sync_new_tokens_batch(reqs, np.full(C, P, dtype=np.int64)) is None:  # pragma: no cover (fit above)
        return probe(False, "allocation failure at step 0 (prefill)", 0)
    peak = ledger.num_allocated
    if evicts and O > 1:
        evict(0)
    mgr.launch(mgr.maybe_plan())
    mgr.commit()
    every = max(1, (O - 1) // 50)
    # Decode step j feeds generated token j back (one new KV slot per request) and samples token j + 1.
    for j in range(1, O):
        mgr.admission_budget()
        mgr.before_forward()
        if table.sync_new_tokens_batch(reqs, ones) is None:
            return probe(False, f"allocation failure at step {j} (the engine would preempt)", j)
        peak = max(peak, ledger.num_allocated)
        if evicts and j < O - 1:  # after its last decode a request finishes: no decision then
            evict(j)
        mgr.launch(mgr.maybe_plan())
        mgr.commit()
        util.append(ledger.total_live / (ledger.num_allocated * S))
        if j % every == 0:
            _tick(progress, label, j, O - 1)
    out = probe(True, "ok", O)
    for r in reqs:
        mgr.finish_request(r)
    ledger.check_conservation()
    if ledger.num_free != ledger.usable_blocks:  # every block came back: nothing leaked
        raise InvariantViolation(f"{ledger.usable_blocks - ledger.num_free} blocks leaked after the run")
    return out


class _PeakHook:
    """Runner hook: blocks allocated right after each forward's appends (before eviction)."""

    def __init__(self, ledger):
        self.ledger, self.peak = ledger, 0

    def pre_forward(self, runner) -> None:
        pass

    def post_forward(self, runner, result) -> None:
        self.peak = max(self.peak, self.ledger.num_allocated)


def simulate_engine(cfg: FrontierConfig, mode: str, C: int, model, progress=None) -> Probe:
    """One run of ``C`` requests in ``mode`` on the embedded engine (model forward included)."""
    from vtoken.engine import Engine, EngineConfig

    check_int("C", C, min_value=1)
    if mode not in MODES:
        raise InvalidArgumentError(f"mode: expected one of {MODES}, got {mode!r}")
    t0 = time.perf_counter()
    S, P, O = cfg.block_size, cfg.prompt_len, cfg.output_len
    # NOTE: the token budget admits every prompt in the first step, as the trace-only driver does.
    eng = Engine(model, EngineConfig(
        mode=mode, num_blocks=cfg.num_blocks, block_size=S, max_num_reqs=C,
        max_num_tokens=max(C * P, cfg.kv_tokens), reclaim=cfg.reclaim_config(mode),
        history=None,  # the point reads every finished request
    ), policy=cfg.make_policy() if mode != "native" else None)
    led = eng.table.ledger
    hook = _PeakHook(led)
    eng.runner.hooks.append(hook)
    rng = np.random.default_rng([cfg.seed, 0xE9])
    vocab = model.config.vocab_size
    util: list = []

    def probe(feasible: bool, reason: str) -> Probe:
        moves, net, plans = _reclaim_totals(eng.reclaimer)
        u_mean, u_min = _utilization(util)
        held = sum(r.retained_blocks for r in eng.finished) if feasible else led.num_allocated
        return Probe(mode, C, feasible, reason, eng.step_count, led.reserved, hook.peak, hook.peak / C, held / C,
                     u_mean, u_min, moves, net, plans, time.perf_counter() - t0)

    try:
        for r in range(C):
            eng.add_request(rng.integers(0, vocab, P), O, request_id=r)
    except InvalidArgumentError as e:  # one request alone exceeds the budget
        return probe(False, f"rejected: {e}")
    every = max(1, O // 50)
    while eng.has_work():
        eng.step()
        st = eng.stats[-1]
        if eng.num_preemptions:
            return probe(False, f"preempted at step {st.step}")
        if eng.waiting:
            return probe(False, f"queued: {len(eng.waiting)} of {C} requests waiting at step {st.step}")
        if st.kind == "decode":
            util.append(st.live_tokens / (st.allocated_blocks * S) if st.allocated_blocks else 1.0)
        if eng.step_count % every == 0:
            _tick(progress, f"{mode} C={C}", eng.step_count, O)
    return probe(True, "ok")


# --------------------------------------------------------------------------- search


def upper_bound(cfg: FrontierConfig, mode: str) -> int:
    """The largest C the budget could hold with perfect packing: any larger C is infeasible.

    The requests run in lockstep, so at a peak-live moment every one of them
    holds at least ``ceil(peak_live / S)`` blocks at once: the whole prompt
    right after prefill, and in evicting modes ``min(kv_tokens, kv_budget + 1)``
    at the last step (the budget plus the token appended then, never
    evicted), while vtoken's reserve is held back too.
    """
    S, P, L = cfg.block_size, cfg.prompt_len, cfg.kv_tokens
    peak_live = L if mode == "native" else max(P, min(L, cfg.kv_budget + (1 if cfg.output_len > 1 else 0)))
    per = cdiv(peak_live, S)
    usable = cfg.num_blocks - 1
    c = usable // per
    while c > 0 and c * per + cfg.headroom(mode, c) > usable:
        c -= 1
    return c if cfg.max_concurrency is None else min(c, cfg.max_concurrency)


def max_probes(cfg: FrontierConfig) -> int:
    """The most probes :func:`search_mode` makes over every mode (for a progress bar's total)."""
    modes = list(cfg.modes) + (["vtoken"] if compares_continuous(cfg) else [])
    return sum(1 + math.ceil(math.log2(max(upper_bound(cfg, m), 1))) for m in modes)


def search_mode(cfg: FrontierConfig, mode: str, simulate: Callable[[int], Probe], progress=None) -> ModeFrontier:
    """The largest feasible C in [0, upper_bound]: probe the bound, then bisect (monotone feasibility)."""
    ub = upper_bound(cfg, mode)
    probes: list[Probe] = []
    lo, hi, best = 0, ub + 1, None  # lo: feasible (0 trivially); hi: infeasible
    c = ub
    while hi - lo > 1:
        p = simulate(c)
        probes.append(p)
        if progress is not None:
            progress.advance()
        if p.feasible:
            lo, best = c, p
        else:
            hi = c
        c = (lo + hi) // 2
    return ModeFrontier(mode, lo, ub, best, probes)


def run_frontier(cfg: FrontierConfig, *, model=None, progress=None) -> FrontierResult:
    """Search the frontier of every mode of ``cfg``.

    ``model``: the engine driver's :class:`~vtoken.engine.LlamaModel` (default:
    the ``tiny`` preset of :class:`vtoken.experiments.common.ModelSpec`);
    unused with ``trace_only``. ``progress``: an object with
    ``set_description(text)`` and ``advance()`` (one per probe), e.g.
    :class:`vtoken.experiments.common.Progress` with ``max_probes(cfg)``.
    """
    if not isinstance(cfg, FrontierConfig):
        raise InvalidTypeError(f"cfg: expected a FrontierConfig, got {type(cfg).__name__}")
    t0 = time.perf_counter()
    trace = None
    if cfg.trace_only:
        check_memory("num_blocks", cfg.num_blocks, cfg.num_blocks * cfg.block_size * TRACE_ONLY_BYTES_PER_SLOT,
                     "trace-only run")
        trace = VictimTrace(cfg)  # one trace, replayed by every mode at every C (and by the comparison)

        def simulator(c, mode):
            return lambda C: simulate_trace_only(c, mode, C, trace, progress)
    else:
        if model is None:
            from vtoken.experiments.common import ModelSpec

            model = ModelSpec(seed=cfg.seed).build()
        check_kv_cache("num_blocks", cfg.num_blocks, model, cfg.num_blocks, cfg.block_size)

        def simulator(c, mode):
            return lambda C: simulate_engine(c, mode, C, model, progress)

    modes = {m: search_mode(cfg, m, simulator(cfg, m), progress) for m in cfg.modes}
    continuous = None
    if compares_continuous(cfg):
        cont = continuous_config(cfg)
        continuous = search_mode(cont, "vtoken", simulator(cont, "vtoken"), progress)
    ideal = cdiv(min(cfg.kv_budget, cfg.kv_tokens), cfg.block_size)
    return FrontierResult(
        config=cfg, modes=modes, full_blocks_per_request=cdiv(cfg.kv_tokens, cfg.block_size),
        ideal_packed_blocks_per_request=ideal, ideal_max_concurrency=(cfg.num_blocks - 1) // ideal,
        policy_decisions=trace.decisions if trace is not None else 0, seconds=time.perf_counter() - t0,
        continuous=continuous,
    )


def compares_continuous(cfg: FrontierConfig) -> bool:
    return cfg.compare_continuous and "vtoken" in cfg.modes


def continuous_config(cfg: FrontierConfig) -> FrontierConfig:
    """``cfg`` with :data:`CONTINUOUS_RECLAIM` over its reclaim fields (the comparison search)."""
    return dataclasses.replace(cfg, reclaim={**cfg.reclaim, **CONTINUOUS_RECLAIM}, compare_continuous=False)


# --------------------------------------------------------------------------- output


def format_result(res: FrontierResult) -> str:
    cfg = res.config
    lines = [
        f"vtoken frontier: num_blocks={cfg.num_blocks} block_size={cfg.block_size} prompt={cfg.prompt_len} "
        f"output={cfg.output_len} policy={cfg.policy} kv_budget={cfg.kv_budget} "
        f"({'trace-only' if cfg.trace_only else 'engine'}, seed {cfg.seed})",
        f"  a request: {res.full_blocks_per_request} blocks in full, {res.ideal_packed_blocks_per_request} packed; "
        f"ideal packed bound: {res.ideal_max_concurrency} requests",
        f"  {'mode':<7} {'max C':>5} {'blocks/req':>10} {'at end':>7} {'util.':>7} {'headroom':>8} "
        f"{'relocated':>10} {'moves/blk':>9}  probes (C: ok / x)",
    ]
    rows = list(res.modes.items()) + ([("vtoken*", res.continuous)] if res.continuous is not None else [])
    for m, f in rows:
        b = f.best
        wa = b.write_amplification if b else None
        probes = " ".join(f"{p.concurrency}:{'ok' if p.feasible else 'x'}" for p in f.probes)
        lines.append(
            f"  {m:<7} {f.max_concurrency:>5} {(f'{b.blocks_per_request:.1f}' if b else '-'):>10} "
            f"{(f'{b.final_blocks_per_request:.1f}' if b else '-'):>7} "
            f"{(f'{100 * b.utilization_mean:.2f}%' if b and b.utilization_mean is not None else '-'):>7} "
            f"{(b.headroom_blocks if b else '-'):>8} {(b.relocated_tokens if b else '-'):>10} "
            f"{(f'{wa:.1f}' if wa is not None else '-'):>9}  {probes}"
        )
    if res.continuous is not None:
        lines.append("  vtoken*: continuous reclamation (every step, down to F = 0), the presets' former settings; "
                     "moves/blk: tokens moved per block reclaimed (net)")
    lines.append("  blocks/req: peak blocks per request; util.: live / (allocated x S) after reclamation, "
                 f"steady state (2nd half); {res.seconds:.1f} s")
    return "\n".join(lines)


def plot_result(res: FrontierResult, path: str, plt) -> None:
    """Bar chart of the max concurrency per mode with the ideal packed bound (``plt``: matplotlib.pyplot)."""
    modes = list(res.modes)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    colors = {"native": "#888888", "naive": "#d98c3f", "vtoken": "#3f7fd9"}
    bars = ax.bar(modes, [res.modes[m].max_concurrency for m in modes], color=[colors[m] for m in modes])
    ax.bar_label(bars)
    ax.axhline(res.ideal_max_concurrency, ls="--", color="k", lw=1,
               label=f"ideal packed bound ({res.ideal_max_concurrency})")
    ax.set_ylim(0, 1.2 * max([res.ideal_max_concurrency, *(b.get_height() for b in bars)], default=1))
    ax.set_ylabel("max feasible concurrency")
    ax.set_title(f"{res.config.num_blocks} blocks; a request: {res.full_blocks_per_request} blocks full, "
                 f"{res.ideal_packed_blocks_per_request} packed", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    save_figure(fig, path)
