"""``vtoken sla``: the paper's Figure 8, throughput under a latency SLA, closed loop.

For each mode and each concurrency C, the embedded engine serves
``rounds x C`` requests closed-loop: C are submitted, and each completion
submits the next (``Engine.generate(..., concurrency=C)``), under a fixed block
budget. Admission, backpressure and preemption by recompute are the engine's
own, so a mode that runs out of blocks queues or recomputes, and pays for it
in latency.

Measured per point (host wall-clock; a step's tokens count at its end, when
they are on the host):

- **throughput**: generated tokens / time from the first submission to the
  end of the last step;
- **p95 per-token latency**: the 95th percentile, over every generated token
  but each request's first, of the time since the same request's previous
  token (inter-token latency; a preempted request's recompute stall lands in
  the token after it). The first token's latency (TTFT) is reported apart.

The SLA is ``sla_factor x`` naive's p95 at ``sla_concurrency`` (1.05 x at
C=8 by default); each mode's score is its best throughput over the sweep
among the points whose p95 meets the SLA (``None`` if none does).

The policy runs live in each evicting mode (no trace replay): preemption by
recompute re-prefills a request and changes what the policy is asked, so the
modes cannot share one trace here. Reclamation uses :class:`ReclaimConfig`'s
defaults (reclaim when the free blocks fall short of the projected demand:
the running requests' growth, the waiting prompts and the headroom), as a
server would. Numbers are measurements of this machine, not a model; the same
metrics on a modeled H200 clock are :mod:`vtoken.experiments.sla_modeled`
(``vtoken sla --cost-model h200``), which shares :func:`timed_engine_class`,
:func:`serve`, :func:`token_times`, :func:`sla_bound` and :func:`best_under_sla`.

Example:
    >>> from vtoken.experiments.common import ModelSpec
    >>> from vtoken.experiments.sla import SlaConfig, run_sla
    >>> res = run_sla(SlaConfig(concurrency=(1, 2), sla_concurrency=2, rounds=1, prompt_len=16, output_len=8,
    ...                         block_size=4, num_blocks=24, window=4, model=ModelSpec(device="cpu")))
    >>> sorted(res.best), res.sla_s > 0
    (['naive', 'native', 'vtoken'], True)
"""
from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from vtoken.errors import InvalidArgumentError, check_int
from vtoken.experiments.common import (
    save_figure,
    PolicyChoice,
    reclaim_json,
    ModelSpec,
    Progress,
    check_kv_cache,
    check_memory,
    check_policy,
    check_pool,
    check_run_options,
    parse_int_list,
    warm_up,
)
from vtoken.experiments.prompts import workload_prompts

MODES = ("native", "naive", "vtoken")
PROMPT_OVERHEAD_BYTES = 112  # one numpy array object: sys.getsizeof(np.zeros(0, np.int64)), numpy 2


@dataclass
class SlaConfig(PolicyChoice):
    concurrency: tuple = (1, 2, 4, 8, 12, 16)
    rounds: int = 2  # requests per point = rounds x C
    prompt_len: int = 64  # random prompts' length (a real model serves text prompts instead)
    prompts: Optional[list] = None  # chat prompts; None: the shipped set on a real model
    output_len: int = 128
    block_size: int = 16
    num_blocks: int = 128
    sla_concurrency: int = 8
    sla_factor: float = 1.05
    seed: int = 0
    model: ModelSpec = field(default_factory=ModelSpec)

    def __post_init__(self):
        check_policy(self.policy)
        self.concurrency = parse_int_list("concurrency", self.concurrency)
        check_run_options(self, ("rounds", "prompt_len", "output_len", "block_size", "sla_concurrency"))
        check_int("num_blocks", self.num_blocks, min_value=2)
        check_pool("num_blocks", self.num_blocks, self.num_blocks, self.block_size)
        check_sla_target(self)


def check_sla_target(cfg) -> None:
    """The SLA's reference point of a sweep config: ``sla_concurrency`` among the swept ``concurrency``
    values, and ``sla_factor`` a number > 0 (shared by the wall-clock and the modeled sweeps)."""
    if cfg.sla_concurrency not in cfg.concurrency:
        raise InvalidArgumentError(
            f"sla_concurrency: expected one of the swept concurrencies {list(cfg.concurrency)}, "
            f"got {cfg.sla_concurrency}"
        )
    if isinstance(cfg.sla_factor, bool) or not isinstance(cfg.sla_factor, (int, float)) or cfg.sla_factor <= 0:
        raise InvalidArgumentError(f"sla_factor: expected a number > 0, got {cfg.sla_factor!r}")


class WallClock:
    """Marks each step boundary with the host's clock: what the wall-clock run times tokens with."""

    def mark(self, engine) -> float:
        return time.perf_counter()

    @staticmethod
    def times(marks: list) -> np.ndarray:
        """Seconds at each step boundary (the marks themselves)."""
        return np.asarray(marks, dtype=np.float64)


@functools.lru_cache(maxsize=None)
def timed_engine_class():
    """An :class:`~vtoken.engine.scheduler.Engine` subclass that records when every token was generated.

    Times are kept as step boundaries: boundary ``k`` is the end of the
    engine's ``k``-th step (0: the first submission). ``marks[k]`` is
    ``clock.mark(engine)`` taken there (default :class:`WallClock`: the host's
    time; the modeled H200 run marks each step's composition and turns the
    marks into times later, once per shape). ``first_steps`` holds
    ``(submitted, first token)`` boundaries per request and ``gap_steps``
    ``(previous token, this token)`` for every later token; a step's tokens
    count at its end, when they are on the host.

    (Built on first use so that importing this module, which the CLI does to
    build its parser, does not import torch.)
    """
    from vtoken.engine.scheduler import Engine

    class TimedEngine(Engine):
        def __init__(self, *a, clock=None, **kw):
            super().__init__(*a, **kw)
            self.clock = WallClock() if clock is None else clock
            self.marks: list = []
            self.first_steps: list = []
            self.gap_steps: list = []
            self._submitted: dict = {}  # request id -> boundary
            self._last: dict = {}  # request id -> (tokens seen, boundary of the last one)

        def _mark(self) -> int:
            while len(self.marks) <= self.step_count:
                self.marks.append(self.clock.mark(self))
            return self.step_count

        def add_request(self, *a, **kw):
            rid = super().add_request(*a, **kw)
            self._submitted[rid] = self._mark()
            return rid

        def step(self):
            done = super().step()
            k = self._mark()
            for r in itertools.chain(self.running, done):
                n = len(r.output)
                prev = self._last.get(r.request_id)
                if prev is None:
                    if n:
                        self.first_steps.append((self._submitted[r.request_id], k))
                        self._last[r.request_id] = (n, k)
                elif n > prev[0]:
                    self.gap_steps.append((prev[1], k))
                    self._last[r.request_id] = (n, k)
            return done

    return TimedEngine


def serve(eng, prompts: list, output_len: int, concurrency: int) -> dict:
    """Serve ``prompts`` closed-loop at ``concurrency`` on a :class:`TimedEngine`; the point's counts."""
    out = eng.generate(prompts, output_len, concurrency=concurrency)
    s = eng.summary()
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "generated_tokens": sum(len(r.output) for r in out),
        "preemptions": s["preemptions"],
        "peak_running": s["peak_running"],
        "peak_blocks": s["peak_blocks"],
        "relocated_tokens": s["relocated_tokens"],
        "reclaimed_blocks": s["reclaimed_blocks"],
        "backpressure_steps": s["backpressure_steps"],
    }


def token_times(eng, times: np.ndarray, *, prefix: str = "") -> dict:
    """A served :class:`TimedEngine`'s time metrics (module docstring), ``times[k]`` being the clock at
    step boundary ``k``; each named ``prefix`` + the metric."""
    times = np.asarray(times, dtype=np.float64)
    if times.shape != (len(eng.marks),):
        raise InvalidArgumentError(f"times: expected one per step boundary ({len(eng.marks)}), got {times.shape}")
    first = np.asarray(eng.first_steps, dtype=np.int64).reshape(-1, 2)
    later = np.asarray(eng.gap_steps, dtype=np.int64).reshape(-1, 2)
    gaps = times[later[:, 1]] - times[later[:, 0]]
    ttfts = times[first[:, 1]] - times[first[:, 0]]
    seconds = float(times[-1] - times[0]) if times.size else 0.0
    tokens = len(first) + len(later)  # every token is a request's first or a later one
    return {
        prefix + "seconds": seconds,
        prefix + "throughput_tok_s": tokens / seconds if seconds > 0 else 0.0,
        prefix + "p95_token_latency_s": float(np.percentile(gaps, 95)) if gaps.size else None,
        prefix + "mean_token_latency_s": float(gaps.mean()) if gaps.size else None,
        prefix + "p95_ttft_s": float(np.percentile(ttfts, 95)) if ttfts.size else None,
    }


def sla_bound(points: dict, sla_concurrency: int, sla_factor: float, *, prefix: str = "") -> float:
    """The SLA: ``sla_factor x`` naive's p95 per-token latency at ``sla_concurrency``."""
    ref = next(p for p in points["naive"] if p["concurrency"] == sla_concurrency)
    if ref[prefix + "p95_token_latency_s"] is None:
        raise InvalidArgumentError("output_len: expected >= 2 (per-token latency needs a second token), got 1")
    return sla_factor * ref[prefix + "p95_token_latency_s"]


def best_under_sla(points: dict, sla: float, *, prefix: str = "") -> dict:
    """Per mode, the point of highest throughput whose p95 per-token latency is within ``sla`` (None if none)."""
    lat, thr = prefix + "p95_token_latency_s", prefix + "throughput_tok_s"
    best = {}
    for mode, pts in points.items():
        ok = [p for p in pts if p[lat] is not None and p[lat] <= sla]
        b = max(ok, key=lambda p: p[thr]) if ok else None
        best[mode] = None if b is None else {k: b[k] for k in ("concurrency", thr, lat)}
    return best


@dataclass
class SlaResult:
    config: SlaConfig
    model: str
    points: dict  # mode -> list of per-concurrency dicts
    sla_s: float  # the p95 per-token latency bound
    best: dict  # mode -> {"concurrency", "throughput_tok_s", "p95_token_latency_s"} or None
    seconds: float

    def to_dict(self) -> dict:
        c = self.config
        nv = self.best.get("naive")
        vt = self.best.get("vtoken")
        return {
            "config": {"policy": c.policy, "evict_ratio": c.evict_ratio, "window": c.window, "sink": c.sink, "at": c.at,
                       "concurrency": list(c.concurrency), "rounds": c.rounds, "prompt_len": c.prompt_len,
                       "output_len": c.output_len, "block_size": c.block_size, "num_blocks": c.num_blocks,
                       "sla_concurrency": c.sla_concurrency, "sla_factor": c.sla_factor, "seed": c.seed},
            "model": self.model,
            "points": self.points,
            "sla_p95_token_latency_s": self.sla_s,
            "best_under_sla": self.best,
            "vtoken_over_naive": (vt["throughput_tok_s"] / nv["throughput_tok_s"]) if nv and vt else None,
            "reclaim": reclaim_json(),  # the vtoken mode's reclamation settings
            "seconds": self.seconds,
        }


def _point(model, mode: str, cfg: SlaConfig, C: int, tokenizer=None) -> dict:
    from vtoken.engine.scheduler import EngineConfig

    n = cfg.rounds * C
    prompts = workload_prompts(n, tokenizer=tokenizer, texts=cfg.prompts, length=cfg.prompt_len,
                               vocab_size=model.config.vocab_size, seed=cfg.seed)
    longest = max(len(p) for p in prompts)
    ecfg = EngineConfig(mode=mode, num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_num_reqs=C,
                        max_num_tokens=max(C * longest, longest + cfg.output_len),
                        policy=None if mode == "native" else cfg.policy,
                        policy_config={} if mode == "native" else cfg.chosen_policy_config(),
                        history=None)  # the summary's latency percentiles cover every request
    eng = timed_engine_class()(model, ecfg)
    point = serve(eng, prompts, cfg.output_len, C)
    return {**point, **token_times(eng, WallClock.times(eng.marks))}


def run_sla(cfg: SlaConfig, *, progress: Optional[Progress] = None) -> SlaResult:
    t0 = time.perf_counter()
    # A point makes its prompts up front: rounds x C arrays of prompt_len int64 ids.
    prompt_bytes = 8 * cfg.prompt_len + PROMPT_OVERHEAD_BYTES
    c = max(cfg.concurrency)
    check_memory("concurrency", c, c * prompt_bytes, "prompts")
    check_memory("rounds", cfg.rounds, cfg.rounds * c * prompt_bytes, "prompts")
    model, tokenizer, _ = cfg.model.load()
    check_kv_cache("num_blocks", cfg.num_blocks, model, cfg.num_blocks, cfg.block_size)
    warm_up(model, dict(num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                        max_num_tokens=cfg.prompt_len + cfg.output_len), cfg.prompt_len)
    points = {m: [] for m in MODES}
    # NOTE: the modes alternate at each C, so that a drift in machine load hits all of them alike.
    for C in cfg.concurrency:
        for mode in MODES:
            if progress is not None:
                progress.set_description(f"{mode} C={C}")
            points[mode].append(_point(model, mode, cfg, C, tokenizer))
            if progress is not None:
                progress.advance()
    sla = sla_bound(points, cfg.sla_concurrency, cfg.sla_factor)
    best = best_under_sla(points, sla)
    return SlaResult(cfg, cfg.model.describe(model), {m: points[m] for m in MODES}, sla, best,
                     time.perf_counter() - t0)


def format_sla(res: SlaResult) -> str:
    c = res.config
    lines = [
        f"vtoken sla (Fig. 8): closed loop, {c.rounds} x C requests of ({c.prompt_len} prompt + {c.output_len} output) "
        f"tokens, budget {c.num_blocks - 1} blocks of {c.block_size}, "
        f"policy {c.policy} (evict {100 * c.evict_ratio:g}%)",
        f"model: {res.model}",
        "",
        f"{'mode':<8} {'C':>3} {'tokens/s':>9} {'p95 ms/token':>12} {'p95 TTFT ms':>11} {'preempted':>9} "
        f"{'peak blocks':>11} {'SLA':>4}",
    ]
    for mode, pts in res.points.items():
        for p in pts:
            ok = p["p95_token_latency_s"] is not None and p["p95_token_latency_s"] <= res.sla_s
            lines.append(
                f"{mode:<8} {p['concurrency']:>3d} {p['throughput_tok_s']:>9.0f} "
                f"{1e3 * (p['p95_token_latency_s'] or float('nan')):>12.2f} {1e3 * p['p95_ttft_s']:>11.1f} "
                f"{p['preemptions']:>9d} {p['peak_blocks']:>11d} {'ok' if ok else '-':>4}"
            )
    lines += ["", f"SLA: p95 per-token latency <= {c.sla_factor:g} x naive's at C={c.sla_concurrency} "
                  f"= {1e3 * res.sla_s:.2f} ms"]
    for mode, b in res.best.items():
        lines.append(f"  best under SLA, {mode:<7}: " + (
            "none" if b is None else f"{b['throughput_tok_s']:.0f} tokens/s at C={b['concurrency']}"))
    d = res.to_dict()
    if d["vtoken_over_naive"] is not None:
        lines.append(f"  vtoken / naive: {d['vtoken_over_naive']:.2f}x")
    lines.append(f"total {res.seconds:.1f} s")
    return "\n".join(lines)


def plot_sla(res: SlaResult, path: str, plt) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = {"native": "#888888", "naive": "#d9822b", "vtoken": "#2b7bd9"}
    for mode, pts in res.points.items():
        pts = [p for p in pts if p["p95_token_latency_s"] is not None]
        ax.plot([1e3 * p["p95_token_latency_s"] for p in pts], [p["throughput_tok_s"] for p in pts], "o-",
                label=mode, color=colors.get(mode))
        for p in pts:
            ax.annotate(f"C={p['concurrency']}", (1e3 * p["p95_token_latency_s"], p["throughput_tok_s"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axvline(1e3 * res.sla_s, color="red", linestyle="--", label="SLA")
    ax.set_xlabel("p95 per-token latency (ms)")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title("Fig. 8: throughput vs p95 latency, closed loop", fontsize=10)
    ax.legend(fontsize=8)
    save_figure(fig, path)
