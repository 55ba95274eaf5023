"""``vtoken demo``: one paired Native / Naive-Evict / vToken run, end to end (the README's main job).

The same ``requests`` random prompts are served in the three modes of
docs/architecture.md §7 by the embedded engine, all resident at once (no queuing, no
preemption, so every mode sees the same batches). ``policy`` runs live in
``naive`` and ``vtoken`` modes, deciding on the device (the engine's
decision loop); both must make the same decisions, checked decision for
decision, so both evict exactly the same tokens, and their greedy outputs
must be identical token for token. Reclamation treats memory as always low (see
:data:`vtoken.experiments.common.EAGER_RECLAIM`).

Reported per mode (see :class:`vtoken.experiments.common.ModeRun`):

- **retained/req**: blocks a request still holds when it finishes (mean);
- **utilization**: live tokens / (retained blocks x S) at finish;
- **steady**: the pool's live tokens / (allocated blocks x S) after each
  decode step, averaged over the second half of the steps (steady state);
- **F**: the pool's waste ratio ``1 - live / (allocated x S)`` after each
  step, averaged over the run's steps;
- **peak**: the most blocks the pool held at once, and **peak/req**, the most
  one request held at once;
- **tokens/s**: generated tokens over the run's step time (host wall-clock);
- **max concurrency** at the demo budget: the largest N with
  ``N x peak/req + headroom(N) <= B``, where ``B = num_blocks - 1`` and
  ``headroom(N)`` is vtoken's automatic reserve for N running requests (0 in
  the other modes). Every request here runs in lockstep (same lengths, same
  start), so N of them peak together; queuing does not count as fitting.

Example:
    >>> from vtoken.experiments.common import ModelSpec
    >>> from vtoken.experiments.demo import DemoConfig, run_demo
    >>> res = run_demo(DemoConfig(requests=2, prompt_len=24, output_len=16, block_size=4, window=4,
    ...                           num_blocks=40, model=ModelSpec(device="cpu")))
    >>> nv, vt = res.modes["naive"], res.modes["vtoken"]
    >>> res.outputs_identical, vt.retained_blocks_per_request < nv.retained_blocks_per_request
    (True, True)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from vtoken.errors import InvalidArgumentError, check_int
from vtoken.experiments.common import (
    save_figure,
    PolicyChoice,
    EAGER_RECLAIM,
    ModelSpec,
    Progress,
    check_kv_cache,
    check_memory,
    check_policy,
    check_pool,
    check_run_options,
    fit_num_blocks,
    full_blocks,
    paired_run,
    reclaim_json,
    resident_engine_config,
    warm_up,
)
from vtoken.experiments.prompts import workload_prompts, workload_texts
from vtoken.experiments.sla import PROMPT_OVERHEAD_BYTES
from vtoken.reclamation.config import PLANNERS, auto_headroom

MODES = ("native", "naive", "vtoken")
DEFAULT_NUM_BLOCKS = 256


@dataclass
class DemoConfig(PolicyChoice):
    requests: int = 8
    # NOTE: 512, not 128: packing leaves about one block of slack per request (its tail, and holes
    # short of a whole block), so steady utilization reaches 95% only from ~20 live blocks per request
    # (measured, h2o at 50%: 91.4% steady at 128 prompt tokens, 95.9% at 512).
    prompt_len: int = 512  # random prompts' length (a real model serves text prompts instead)
    output_len: Optional[int] = None  # None: 256 on a random preset, 48 on a real checkpoint (CPU-friendly)
    block_size: int = 16
    num_blocks: Optional[int] = None  # None: 256, or the smallest pool that holds every request if more
    prompts: Optional[list] = None  # chat prompts (lists of messages); None: the shipped set on a real model
    theta_f: Optional[float] = None  # the waste floor (None: ReclaimConfig.theta_F's default)
    planner: str = "holes"  # vtoken's relocation planner (ReclaimConfig.planner)
    seed: int = 0
    model: ModelSpec = field(default_factory=ModelSpec)

    def __post_init__(self):
        check_policy(self.policy)
        if self.planner not in PLANNERS:
            raise InvalidArgumentError(f"planner: expected one of {PLANNERS}, got {self.planner!r}")
        if self.theta_f is not None and (isinstance(self.theta_f, bool) or not isinstance(self.theta_f, (int, float))
                                         or not 0 <= self.theta_f < 1):
            raise InvalidArgumentError(f"theta_f: expected a value in [0, 1), got {self.theta_f!r}")
        if self.output_len is None:
            self.output_len = 48 if self.model.path is not None else 256
        check_run_options(self, ("requests", "prompt_len", "output_len", "block_size"))
        # NOTE: bound the sizes before anything is allocated: one request's blocks, then every request's
        # pool (int32 slot ids), then the random prompts in memory (a huge --requests would otherwise grow
        # memory until the process is killed).
        per_request = full_blocks(self.prompt_len, self.output_len, self.block_size)
        check_pool("prompt_len + output_len", self.prompt_len + self.output_len, per_request + 1, self.block_size)
        check_pool("requests", self.requests, fit_num_blocks(self.requests, per_request, self.block_size),
                   self.block_size)
        if self.prompts is None and self.model.path is None:
            check_memory("requests", self.requests, self.requests * (8 * self.prompt_len + PROMPT_OVERHEAD_BYTES),
                         "prompts")
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, min_value=2)
            check_pool("num_blocks", self.num_blocks, self.num_blocks, self.block_size)
            if self.prompts is None and self.model.path is None:  # random prompts: their size is known now
                self.pool_for(self.prompt_len)

    @property
    def reclaim(self) -> dict:
        """The vtoken mode's ReclaimConfig fields: memory pressure declared (the pool at its limit)."""
        base = dict(EAGER_RECLAIM, planner=self.planner)
        return base if self.theta_f is None else dict(base, theta_F=float(self.theta_f))

    def pool_for(self, prompt_len: int) -> int:
        """The pool that holds every request (prompts of at most ``prompt_len`` tokens) unevicted; checks a given one."""
        per_request = full_blocks(prompt_len, self.output_len, self.block_size)
        if self.num_blocks is None:
            return max(DEFAULT_NUM_BLOCKS, fit_num_blocks(self.requests, per_request, self.block_size))
        need = self.requests * per_request
        have = self.num_blocks - 1 - auto_headroom(self.requests, self.block_size)
        if need > have:
            raise InvalidArgumentError(
                f"num_blocks: expected a budget that holds all {self.requests} requests unevicted "
                f"({need} blocks + the null block + vtoken's headroom), got {self.num_blocks} "
                f"({have} usable in vtoken mode)"
            )
        return self.num_blocks


@dataclass
class DemoResult:
    config: DemoConfig
    model: str
    modes: dict  # mode -> ModeRun
    outputs_identical: bool  # naive and vtoken greedy outputs, token for token
    seconds: float
    num_blocks: int = DEFAULT_NUM_BLOCKS  # the pool the run used
    prompt_lens: list = field(default_factory=list)  # tokens per prompt
    prompts: Optional[list] = None  # the user text of each request (text prompts only)
    texts: dict = field(default_factory=dict)  # mode -> decoded output per request (a real model only)

    @property
    def reclaim(self) -> dict:
        """Every ReclaimConfig field the vtoken mode ran with."""
        return reclaim_json(self.config.reclaim)

    def to_dict(self) -> dict:
        c = self.config
        modes = {m: r.to_dict() for m, r in self.modes.items()}
        for m, texts in self.texts.items():
            modes[m]["texts"] = texts
        for m in ("naive", "vtoken"):
            modes[m]["identical"] = self.outputs_identical  # naive vs vtoken, token for token
        return {
            "config": {"policy": c.policy, "evict_ratio": c.evict_ratio, "window": c.window, "sink": c.sink, "at": c.at,
                       "requests": c.requests, "prompt_len": c.prompt_len, "output_len": c.output_len,
                       "block_size": c.block_size, "num_blocks": self.num_blocks, "theta_f": c.theta_f,
                       "planner": c.planner, "seed": c.seed},
            "model": self.model,
            "prompt_lens": self.prompt_lens,
            "prompts": self.prompts,
            "modes": modes,
            "outputs_identical": self.outputs_identical,
            "identical": self.outputs_identical,  # naive vs vtoken, token for token (texts included)
            "reclaim": self.reclaim,  # the vtoken mode's reclamation settings
            "seconds": self.seconds,
        }


def run_demo(cfg: DemoConfig, *, progress: Optional[Progress] = None) -> DemoResult:
    import time

    t0 = time.perf_counter()
    model, tokenizer, _ = cfg.model.load()
    if tokenizer is None and cfg.prompts is None:  # random prompts: refuse their KV cache before making them
        arg, value = ("requests", cfg.requests) if cfg.num_blocks is None else ("num_blocks", cfg.num_blocks)
        check_kv_cache(arg, value, model, cfg.pool_for(cfg.prompt_len), cfg.block_size)
    prompts = workload_prompts(cfg.requests, tokenizer=tokenizer, texts=cfg.prompts, length=cfg.prompt_len,
                               vocab_size=model.config.vocab_size, seed=cfg.seed)
    lens = [len(p) for p in prompts]
    num_blocks = cfg.pool_for(max(lens))
    check_pool("num_blocks", num_blocks, num_blocks, cfg.block_size)
    check_kv_cache("num_blocks", num_blocks, model, num_blocks, cfg.block_size)
    # NOTE: every request generates output_len tokens (a benchmark's ignore-eos: the requests stay in
    # lockstep, so peak/req means what the table says); the texts are cut at the end-of-sequence token.
    engine_cfg = resident_engine_config(prompts, cfg.output_len, num_blocks=num_blocks, block_size=cfg.block_size,
                                        reclaim=cfg.reclaim)
    warm_up(model, engine_cfg, max(lens))
    runs = paired_run(model, prompts, cfg.output_len, modes=MODES, policy=cfg.policy,
                      policy_cfg=cfg.chosen_policy_config(),
                      engine_cfg=engine_cfg, progress=progress)
    same = runs["naive"].outputs == runs["vtoken"].outputs
    texts, users = {}, None
    if tokenizer is not None:
        texts = {m: [tokenizer.decode(o) for o in r.outputs] for m, r in runs.items()}
        users = [chat[-1]["content"] for chat in workload_texts(cfg.prompts, cfg.requests)]
    return DemoResult(cfg, cfg.model.describe(model), runs, same, time.perf_counter() - t0, num_blocks, lens, users,
                      texts)


def format_demo(res: DemoResult) -> str:
    c = res.config
    lens = res.prompt_lens or [c.prompt_len]
    prompt = f"{lens[0]}" if min(lens) == max(lens) else f"{min(lens)}-{max(lens)}"
    lines = [
        f"vtoken demo: {c.requests} requests x ({prompt} prompt + {c.output_len} output) tokens, "
        f"block size {c.block_size}, budget {res.num_blocks - 1} blocks, policy {c.policy} "
        f"(evict {100 * c.evict_ratio:g}%, decided on the device in each mode, decisions checked equal)",
        f"model: {res.model}",
        "",
        f"{'mode':<8} {'retained/req':>12} {'utilization':>11} {'steady':>7} {'F':>6} {'peak':>6} {'peak/req':>8} "
        f"{'tokens/s':>9} {'max concurrency':>15}",
    ]
    for m, r in res.modes.items():
        lines.append(
            f"{m:<8} {r.retained_blocks_per_request:>12.1f} {100 * r.utilization:>10.1f}% "
            f"{(f'{100 * r.steady_utilization:.1f}%' if r.steady_utilization is not None else '-'):>7} "
            f"{r.waste_ratio_mean:>6.3f} "
            f"{r.peak_blocks:>6d} {r.peak_blocks_per_request:>8d} {r.tokens_per_s:>9.0f} {r.max_concurrency:>15d}"
        )
    vt = res.modes["vtoken"]
    n_tok = sum(len(o) for o in vt.outputs)
    verdict = "IDENTICAL" if res.outputs_identical else "DIFFERENT (a bug: please report it)"
    lines += [
        "",
        f"greedy outputs, naive vs vtoken: {verdict} ({c.requests} requests, {n_tok} tokens; "
        f"{res.modes['naive'].evicted_tokens} tokens evicted in each, {vt.summary['relocated_tokens']} relocated "
        f"and {vt.summary['reclaimed_blocks']} blocks reclaimed by vtoken)",
        "retained/req: blocks held at finish; utilization: live / (retained x S); steady: the pool's live / "
        "(allocated x S), mean over the second half of the decode steps; F: pool waste ratio, mean over steps;",
        "reclamation: memory pressure declared (the pool at its limit), the library's other defaults "
        f"(waste floor theta_F {res.reclaim['theta_F']:g}, planner {res.reclaim['planner']}: "
        + ("hole filling, no headroom)" if res.reclaim['planner'] == "holes" else
           "fresh blocks, headroom sized to the running requests)"),
        "max concurrency: the most lockstep requests of peak/req blocks resident at once, vtoken's headroom for "
        f"them inside the budget ({res.modes['vtoken'].usable_blocks} usable with this run's requests)",
        f"total {res.seconds:.1f} s",
    ]
    if res.texts:
        lines[2:2] = side_by_side(res) + [""]
    return "\n".join(lines)


def side_by_side(res: DemoResult, *, shown: int = 3, width: int = 38, rows: int = 6) -> list:
    """The first ``shown`` prompts, each with its native / naive / vtoken texts in columns (wrapped, cut)."""
    import textwrap

    modes = list(res.texts)
    out = []
    for i in range(min(shown, len(res.prompts or []))):
        out += ["", f"prompt {i}: {textwrap.shorten(res.prompts[i], 110)}",
                "  ".join(f"{m:<{width}}" for m in modes)]
        cols = [textwrap.wrap(" ".join(res.texts[m][i].split()) or "(empty)", width)[:rows] for m in modes]
        for k in range(max(len(col) for col in cols)):
            out.append("  ".join(f"{(col[k] if k < len(col) else ''):<{width}}" for col in cols).rstrip())
    return out


def plot_demo(res: DemoResult, path: str, plt) -> None:
    modes = list(res.modes)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    panels = [
        ("blocks retained per request", [res.modes[m].retained_blocks_per_request for m in modes]),
        ("utilization at finish (%)", [100 * res.modes[m].utilization for m in modes]),
        (f"max concurrency at {res.num_blocks - 1} blocks", [res.modes[m].max_concurrency for m in modes]),
    ]
    colors = ["#888888", "#d9822b", "#2b7bd9"]
    for ax, (title, vals) in zip(axes, panels):
        ax.bar(modes, vals, color=colors[: len(modes)])
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(vals):
            ax.annotate(f"{v:.1f}" if isinstance(v, float) else str(v), (i, v), ha="center", va="bottom", fontsize=8)
    c = res.config
    save_figure(fig, path, f"vtoken demo: {c.policy}, evict {100 * c.evict_ratio:g}%, {c.requests} x "
                           f"({c.prompt_len}+{c.output_len}) tokens, S={c.block_size}")
