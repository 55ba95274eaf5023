"""``vtoken sla --cost-model h200``: Fig. 8 (throughput at a latency SLA vs offered load) on a modeled H200.

On a CPU the wall-clock ``vtoken sla`` cannot show the paper's effect: its
step time grows with the batch, so the SLA binds on compute. Here the clock
is modeled instead: the engine's real scheduler, admission, backpressure,
preemption by recompute, eviction policy and reclamation run over the real
token table and block ledger (:class:`~vtoken.engine.trace_runner.TraceRunner`:
no model forward), and after every step the clock advances by the H200
roofline's time for what that step computed
(:class:`~vtoken.experiments.cost_model.H200Roofline`: weights read once, the
K/V of every attended live token, the FLOPs, a fixed overhead). Decisions and
memory are real; only the clock is modeled.

- **Attended tokens.** A step's request attends the live tokens it holds:
  native everything (it never evicts), naive and vtoken only their live ones
  (dead tokens are never listed). Naive and vtoken with the same batch and
  victims therefore take the same modeled time; vtoken's gain is that more
  requests fit.
- **Policy.** Live in every evicting mode, deciding on the host over
  synthetic attention (:class:`~vtoken.experiments.synthetic_scores.SyntheticScores`):
  a trace run has no attention of its own.
- **Memory.** The KV pool is ``num_blocks`` (by default a 2 GiB slice, see
  :class:`ModeledSlaConfig`), or what a server on one H200 gets for the shape
  (:meth:`H200Roofline.kv_blocks`) at ``memory_utilization`` (vLLM's
  ``gpu_memory_utilization``: the share of HBM the server may use, weights
  included).
- **Metrics.** Exactly the wall-clock run's (:mod:`vtoken.experiments.sla`:
  closed loop, throughput, p95 per-token latency, SLA = ``sla_factor x``
  naive's p95 at ``sla_concurrency``, each mode's best throughput within it),
  on the modeled clock; every time field is named ``modeled_*``.

Example (a tiny pool and workload; a second on a CPU):
    >>> from vtoken.experiments.sla_modeled import ModeledSlaConfig, run_modeled_sla
    >>> res = run_modeled_sla(ModeledSlaConfig(shapes=("llama-8b",), concurrency=(1, 2), sla_concurrency=2,
    ...                                        rounds=1, prompt_len=32, output_len=16, num_blocks=16))
    >>> r = res.shapes["llama-8b"]; sorted(r.best), r.sla_s > 0
    (['naive', 'native', 'vtoken'], True)
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from vtoken.errors import InvalidArgumentError, InvalidTypeError, check_int
from vtoken.experiments.common import (
    save_figure,
    PolicyChoice,
    Progress,
    check_pool,
    check_run_options,
    make_prompts,
    parse_int_list,
    reclaim_json,
)
from vtoken.experiments.cost_model import H200Roofline, ModelShape, ModeledClock, check_memory_utilization
from vtoken.experiments.sla import (
    MODES,
    best_under_sla,
    check_sla_target,
    serve,
    sla_bound,
    timed_engine_class,
    token_times,
)

SHAPES = {"llama-8b": ModelShape.llama_8b, "mistral-7b": ModelShape.mistral_7b}
PAPER_SPEEDUP = 1.37  # the vToken paper's Fig. 8: "up to 1.37x" throughput at the SLA
PREFIX = "modeled_"  # every modeled time field


DEFAULT_NUM_BLOCKS = 1025  # 1,024 usable blocks of 16: 2 GiB of either shape's KV (see ModeledSlaConfig)


@dataclass
class ModeledSlaConfig(PolicyChoice):
    """The modeled sweep (see the module docstring).

    The KV pool is ``num_blocks`` (the null block included), or with
    ``num_blocks=None`` the whole H200's for each shape at
    ``memory_utilization`` (:meth:`H200Roofline.kv_blocks`).

    NOTE: the default pool is a 2 GiB slice of the H200's (the whole one at 0.9
    is 52,852 blocks, 845,632 tokens, for llama-8b) so that the sweep runs on a
    CPU in minutes. Memory binds once the running requests fill the pool, so a
    memory-bound point generates about as many tokens as the pool holds, and
    the engine's host policy path took 340-430 us per request and decode step
    (h2o, 64 requests of 1,024 + 256 tokens) on the 2-core development machine:
    minutes per point for the whole pool. In the slice the KV read stays small
    next to the weights, the regime where a bigger batch is nearly free.
    """

    shapes: tuple = tuple(SHAPES)
    concurrency: tuple = (8, 16, 24, 32, 40, 48, 56, 64)
    rounds: int = 2
    prompt_len: int = 256
    output_len: int = 256
    block_size: int = 16
    num_blocks: Optional[int] = DEFAULT_NUM_BLOCKS
    memory_utilization: Optional[float] = None
    sla_concurrency: int = 16
    sla_factor: float = 1.05
    seed: int = 0
    roofline: H200Roofline = field(default_factory=H200Roofline)

    def __post_init__(self):
        from vtoken.experiments.common import check_policy

        check_policy(self.policy)
        if isinstance(self.shapes, str):
            self.shapes = tuple(x.strip() for x in self.shapes.split(",") if x.strip())
        shapes = tuple(self.shapes)
        if not shapes or any(s not in SHAPES for s in shapes) or len(set(shapes)) != len(shapes):
            raise InvalidArgumentError(f"shapes: expected distinct names among {sorted(SHAPES)}, got {self.shapes!r}")
        self.shapes = shapes
        self.concurrency = parse_int_list("concurrency", self.concurrency)
        check_run_options(self, ("rounds", "prompt_len", "output_len", "block_size", "sla_concurrency"))
        if (self.num_blocks is None) == (self.memory_utilization is None):
            raise InvalidArgumentError(f"num_blocks: expected num_blocks or memory_utilization (the whole H200's "
                                       f"pool), got {self.num_blocks!r} and {self.memory_utilization!r}")
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, min_value=2)
            check_pool("num_blocks", self.num_blocks, self.num_blocks, self.block_size)
        else:
            check_memory_utilization(self.memory_utilization)
        check_sla_target(self)
        if not isinstance(self.roofline, H200Roofline):
            raise InvalidTypeError(f"roofline: expected an H200Roofline, got {type(self.roofline).__name__}")
        for name in self.shapes:  # every pool is checked before any run
            self.pool_blocks(SHAPES[name]())

    def pool_blocks(self, shape: ModelShape) -> int:
        """The KV pool of ``shape`` in blocks, the null block included."""
        if self.num_blocks is not None:
            return self.num_blocks
        n = self.roofline.kv_blocks(shape, self.block_size, memory_utilization=self.memory_utilization) + 1
        if n < 2:
            raise InvalidArgumentError(f"memory_utilization: expected room for a KV block next to {shape.name}'s "
                                       f"weights, got {self.memory_utilization!r} (none)")
        check_pool("memory_utilization", self.memory_utilization, n, self.block_size)
        return n

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "roofline"}
        d["shapes"], d["concurrency"] = list(self.shapes), list(self.concurrency)
        return d


class ForwardMarks:
    """A :class:`~vtoken.experiments.sla.TimedEngine` clock that marks each step boundary with the
    :class:`~vtoken.engine.trace_runner.Forward` records of the step before it (the trace runner's);
    :func:`modeled_times` turns them into a shape's modeled times."""

    def mark(self, engine) -> list:
        return engine.runner.take_forwards()


def modeled_times(marks: list, shape: ModelShape, roofline: H200Roofline) -> np.ndarray:
    """Modeled seconds at each step boundary: every forward of ``marks`` advances a :class:`ModeledClock`."""
    clock = ModeledClock(shape, roofline)
    out = np.empty(len(marks), dtype=np.float64)
    for k, forwards in enumerate(marks):
        for f in forwards:
            clock.advance(f.past, f.new)
        out[k] = clock.now
    return out


@dataclass
class ShapeResult:
    """One shape's sweep."""

    shape: ModelShape
    num_blocks: int
    block_size: int
    points: dict  # mode -> list of per-concurrency dicts (serve's counts + token_times, modeled)
    sla_s: float
    best: dict  # mode -> {"concurrency", "modeled_throughput_tok_s", "modeled_p95_token_latency_s"} or None
    host_seconds: float  # the sweep's host time (shared by the shapes of one pool)

    def ratio(self, mode: str, base: str) -> Optional[float]:
        a, b = self.best.get(mode), self.best.get(base)
        return a[PREFIX + "throughput_tok_s"] / b[PREFIX + "throughput_tok_s"] if a and b else None

    def to_dict(self) -> dict:
        s = self.shape
        return {
            "shape": dataclasses.asdict(s),
            "weight_bytes": s.weight_bytes,
            "kv_bytes_per_token": s.kv_bytes_per_token,
            "num_blocks": self.num_blocks,
            "kv_cache_bytes": (self.num_blocks - 1) * self.block_size * s.kv_bytes_per_token,
            "points": self.points,
            PREFIX + "sla_p95_token_latency_s": self.sla_s,
            "best_under_sla": self.best,
            "vtoken_over_naive": self.ratio("vtoken", "naive"),
            "vtoken_over_native": self.ratio("vtoken", "native"),
            "paper_up_to": PAPER_SPEEDUP,
            "host_seconds": self.host_seconds,
        }


@dataclass
class ModeledSlaResult:
    config: ModeledSlaConfig
    shapes: dict  # name -> ShapeResult
    seconds: float  # host time of the whole run

    def to_dict(self) -> dict:
        return {
            "modeled": True,
            "cost_model": "h200",
            "title": "vtoken sla (Fig. 8), modeled H200",
            "roofline": dataclasses.asdict(self.config.roofline),
            "config": self.config.to_dict(),
            "shapes": {k: v.to_dict() for k, v in self.shapes.items()},
            "paper_up_to": PAPER_SPEEDUP,
            "reclaim": reclaim_json(),
            "host_seconds": self.seconds,
        }


def _points(shapes: list, num_blocks: int, mode: str, cfg: ModeledSlaConfig, C: int) -> dict:
    """One trace engine run of ``mode`` at concurrency ``C``; its point on each of ``shapes``' clocks.

    NOTE: one run serves every shape of the same pool: the engine's decisions do
    not depend on time (a closed loop submits on completions, not on a clock),
    and the pool is counted in blocks, so a shape only sets what a step costs.
    """
    from vtoken.engine.scheduler import EngineConfig
    from vtoken.engine.trace_runner import trace_engine
    from vtoken.experiments.synthetic_scores import SyntheticScores

    P, O = cfg.prompt_len, cfg.output_len
    prompts = make_prompts(cfg.rounds * C, P, min(s.vocab_size for s in shapes), cfg.seed)
    evicts = mode != "native"
    ecfg = EngineConfig(mode=mode, num_blocks=num_blocks, block_size=cfg.block_size, max_num_reqs=C,
                        max_num_tokens=max(C * P, P + O), decision="host",
                        policy=cfg.policy if evicts else None,
                        policy_config=cfg.chosen_policy_config()
                        if evicts else {})
    t0 = time.perf_counter()
    eng = trace_engine(ecfg, vocab_size=min(s.vocab_size for s in shapes),
                       engine_class=functools.partial(timed_engine_class(), clock=ForwardMarks()),
                       attention=SyntheticScores(length=P + O, seed=cfg.seed) if evicts else None)
    point = serve(eng, prompts, O, C)
    point["steps"] = eng.step_count
    point["host_seconds"] = time.perf_counter() - t0
    return {s.name: {**point, **token_times(eng, modeled_times(eng.marks, s, cfg.roofline), prefix=PREFIX)}
            for s in shapes}


def run_modeled_sla(cfg: ModeledSlaConfig, *, progress: Optional[Progress] = None) -> ModeledSlaResult:
    """Sweep every mode and concurrency of ``cfg``; ``progress``: one ``advance()`` per engine run."""
    if not isinstance(cfg, ModeledSlaConfig):
        raise InvalidTypeError(f"cfg: expected a ModeledSlaConfig, got {type(cfg).__name__}")
    t0 = time.perf_counter()
    pools: dict = {}  # pool size -> the shapes that share it (one engine run each)
    for name in cfg.shapes:
        shape = SHAPES[name]()
        pools.setdefault(cfg.pool_blocks(shape), []).append(shape)
    out = {}
    for nb, shapes in pools.items():
        ts = time.perf_counter()
        points = {s.name: {m: [] for m in MODES} for s in shapes}
        for C in cfg.concurrency:
            for mode in MODES:
                if progress is not None:
                    progress.set_description(f"{'/'.join(s.name for s in shapes)} {mode} C={C}")
                for name, p in _points(shapes, nb, mode, cfg, C).items():
                    points[name][mode].append(p)
                if progress is not None:
                    progress.advance()
        for s in shapes:
            sla = sla_bound(points[s.name], cfg.sla_concurrency, cfg.sla_factor, prefix=PREFIX)
            out[s.name] = ShapeResult(s, nb, cfg.block_size, points[s.name], sla,
                                      best_under_sla(points[s.name], sla, prefix=PREFIX), time.perf_counter() - ts)
    return ModeledSlaResult(cfg, {name: out[name] for name in cfg.shapes}, time.perf_counter() - t0)


def num_runs(cfg: ModeledSlaConfig) -> int:
    """Engine runs :func:`run_modeled_sla` makes (a progress bar's total)."""
    pools = {cfg.pool_blocks(SHAPES[name]()) for name in cfg.shapes}
    return len(pools) * len(MODES) * len(cfg.concurrency)


# --------------------------------------------------------------------------- output


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def format_modeled_sla(res: ModeledSlaResult) -> str:
    c, r = res.config, res.config.roofline
    lines = [
        f"vtoken sla (Fig. 8), modeled H200: closed loop, {c.rounds} x C requests of ({c.prompt_len} prompt + "
        f"{c.output_len} output) tokens, policy {c.policy} (evict {100 * c.evict_ratio:g}%), blocks of {c.block_size}",
        f"roofline: {r.hbm_bandwidth / 1e12:g} TB/s HBM, {r.flops_rate / 1e12:g} TFLOP/s bf16 x {r.mfu:g}, "
        f"{1e3 * r.step_overhead:g} ms per step; time is modeled, decisions and memory are the engine's",
    ]
    for name, sr in res.shapes.items():
        s = sr.shape
        full = r.kv_blocks(s, c.block_size)
        lines += [
            "",
            f"{name} (modeled H200): {s.num_layers} layers, {s.num_heads}/{s.num_kv_heads} heads, head_dim "
            f"{s.head_dim}; {s.weight_bytes / 1e9:.1f} GB of weights read per step, "
            f"{s.kv_bytes_per_token // 1024} KiB of KV per token",
            f"KV pool: {sr.num_blocks - 1:,} blocks ({(sr.num_blocks - 1) * c.block_size * s.kv_bytes_per_token / 2**30:.1f}"
            f" GiB; the whole H200 at memory utilization 0.9: {full:,})",
            f"{'mode':<8} {'C':>3} {'modeled tok/s':>13} {'modeled p95 ms/tok':>18} {'modeled p95 TTFT s':>18} "
            f"{'preempted':>9} {'peak blocks':>11} {'SLA':>4}",
        ]
        for mode, pts in sr.points.items():
            for p in pts:
                lat = p[PREFIX + "p95_token_latency_s"]
                ok = lat is not None and lat <= sr.sla_s
                lines.append(
                    f"{mode:<8} {p['concurrency']:>3d} {p[PREFIX + 'throughput_tok_s']:>13.0f} {_ms(lat):>18} "
                    f"{p[PREFIX + 'p95_ttft_s']:>18.2f} {p['preemptions']:>9d} {p['peak_blocks']:>11d} "
                    f"{'ok' if ok else '-':>4}"
                )
        lines.append(f"SLA (modeled): p95 per-token latency <= {c.sla_factor:g} x naive's at C={c.sla_concurrency} "
                     f"= {_ms(sr.sla_s)} ms")
        for mode, b in sr.best.items():
            lines.append(f"  best under SLA, {mode:<7}: " + (
                "none" if b is None else f"{b[PREFIX + 'throughput_tok_s']:.0f} modeled tokens/s at "
                                         f"C={b['concurrency']}"))
        ratios = [f"vtoken / {base}: {sr.ratio('vtoken', base):.2f}x" for base in ("naive", "native")
                  if sr.ratio("vtoken", base) is not None]
        lines.append("  " + ", ".join(ratios + [f"the paper: up to {PAPER_SPEEDUP}x"]))
    lines.append(f"host time {res.seconds:.1f} s")
    return "\n".join(lines)


def plot_modeled_sla(res: ModeledSlaResult, path: str, plt) -> None:
    """Per shape: modeled throughput vs offered load (filled: p95 within the SLA) and p95 vs load."""
    colors = {"native": "#888888", "naive": "#d9822b", "vtoken": "#2b7bd9"}
    n = len(res.shapes)
    fig, axes = plt.subplots(n, 2, figsize=(10, 3.6 * n), squeeze=False)
    for row, (name, sr) in zip(axes, res.shapes.items()):
        tput, lat = row
        for mode, pts in sr.points.items():
            cs = [p["concurrency"] for p in pts]
            t = [p[PREFIX + "throughput_tok_s"] for p in pts]
            ms = [1e3 * (p[PREFIX + "p95_token_latency_s"] or float("nan")) for p in pts]
            ok = [p[PREFIX + "p95_token_latency_s"] is not None and p[PREFIX + "p95_token_latency_s"] <= sr.sla_s
                  for p in pts]
            tput.plot(cs, t, "-", color=colors.get(mode), label=mode)
            tput.scatter(cs, t, color=[colors.get(mode) if k else "white" for k in ok], edgecolors=colors.get(mode),
                         zorder=3)
            lat.plot(cs, ms, "o-", color=colors.get(mode), label=mode)
        ratio = sr.ratio("vtoken", "naive")
        tput.set_title(f"{name}, modeled H200: throughput at the SLA (filled: p95 within it)"
                       + (f"; vtoken/naive {ratio:.2f}x" if ratio else ""), fontsize=9)
        tput.set_xlabel("offered load: concurrent requests (closed loop)")
        tput.set_ylabel("modeled tokens/s")
        tput.legend(fontsize=8)
        lat.axhline(1e3 * sr.sla_s, color="red", linestyle="--", label="SLA")
        lat.set_title(f"{name}, modeled H200: p95 per-token latency", fontsize=9)
        lat.set_xlabel("offered load: concurrent requests (closed loop)")
        lat.set_ylabel("modeled p95 ms/token")
        lat.legend(fontsize=8)
    c = res.config
    save_figure(fig, path, f"vtoken sla --cost-model h200 (modeled H200): {c.prompt_len} + {c.output_len} "
                           f"tokens, {c.policy} evict {c.evict_ratio:g}")
