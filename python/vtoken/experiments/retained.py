"""``vtoken retained``: the paper's Figure 7, the same victims leave fewer retained blocks.

For every policy, the same requests are served by the embedded engine in
``naive`` mode (the policy runs live; its victims are recorded) and in
``vtoken`` mode (the trace is replayed), all requests resident at once. Per
policy and mode: blocks retained per request at finish, their utilization
(live / (retained x S)), and the packed lower bound ``ceil(live / S)``; the
greedy outputs of the two modes must be identical.

Example:
    >>> from vtoken.experiments.common import ModelSpec
    >>> from vtoken.experiments.retained import RetainedConfig, run_retained
    >>> res = run_retained(RetainedConfig(policies=("streamingllm",), requests=2, prompt_len=24, output_len=12,
    ...                                   block_size=4, window=4, model=ModelSpec(device="cpu")))
    >>> row = res.rows["streamingllm"]; n, v = row["naive"], row["vtoken"]
    >>> row["outputs_identical"], v["retained_blocks_per_request"] <= n["retained_blocks_per_request"]
    (True, True)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from vtoken.errors import InvalidArgumentError
from vtoken.experiments.common import (
    save_figure,
    EAGER_RECLAIM,
    ModelSpec,
    Progress,
    check_kv_cache,
    check_policy,
    check_pool,
    check_run_options,
    fit_num_blocks,
    full_blocks,
    paired_run,
    policy_config,
    reclaim_json,
    resident_engine_config,
    supported_at,
    warm_up,
)
from vtoken.experiments.prompts import workload_prompts

MODES = ("naive", "vtoken")
KEYS = ("retained_blocks_per_request", "utilization", "ideal_blocks_per_request", "peak_blocks_per_request",
        "waste_ratio_mean", "evicted_tokens", "relocated_tokens", "reclaimed_blocks")


def _all_policies() -> tuple:
    from vtoken.policies import available

    return tuple(available())


@dataclass
class RetainedConfig:
    policies: tuple = field(default_factory=_all_policies)
    evict_ratio: float = 0.5
    window: Optional[int] = None  # every policy's recent window (None: its default, at most 32)
    sink: Optional[int] = None  # the policy's attention sinks (None: its default, 4)
    at: Optional[str] = None  # "decode" or "prefill" (None: the policy's default)
    requests: int = 4
    prompt_len: int = 128  # random prompts' length (a real model serves text prompts instead)
    prompts: Optional[list] = None  # chat prompts; None: the shipped set on a real model
    output_len: int = 128
    block_size: int = 16
    seed: int = 0
    model: ModelSpec = field(default_factory=ModelSpec)

    def __post_init__(self):
        self.policies = tuple(check_policy(p) for p in self.policies)
        if not self.policies:
            raise InvalidArgumentError("policies: expected at least one policy, got none")
        if len(set(self.policies)) != len(self.policies):
            raise InvalidArgumentError(f"policies: expected unique policies, got {list(self.policies)}")
        check_run_options(self, ("requests", "prompt_len", "output_len", "block_size"))
        per_request = full_blocks(self.prompt_len, self.output_len, self.block_size)
        check_pool("prompt_len + output_len", self.prompt_len + self.output_len, per_request + 1, self.block_size)
        check_pool("requests", self.requests, self.num_blocks, self.block_size)

    @property
    def num_blocks(self) -> int:
        """A pool that holds every request unevicted, in every mode (nothing queues)."""
        return fit_num_blocks(self.requests, full_blocks(self.prompt_len, self.output_len, self.block_size),
                              self.block_size)


@dataclass
class RetainedResult:
    config: RetainedConfig
    model: str
    rows: dict  # policy -> {"naive": {...}, "vtoken": {...}, "outputs_identical": bool, "reduction": float}
    seconds: float
    num_blocks: Optional[int] = None  # the pool the run used (text prompts size it from their lengths)

    def to_dict(self) -> dict:
        c = self.config
        return {
            "config": {"policies": list(c.policies), "evict_ratio": c.evict_ratio, "window": c.window, "sink": c.sink, "at": c.at,
                       "requests": c.requests, "prompt_len": c.prompt_len, "output_len": c.output_len,
                       "block_size": c.block_size, "num_blocks": self.num_blocks or c.num_blocks, "seed": c.seed},
            "model": self.model,
            "policies": self.rows,
            "reclaim": reclaim_json(EAGER_RECLAIM),  # the vtoken mode's reclamation settings
            "seconds": self.seconds,
        }


def run_retained(cfg: RetainedConfig, *, progress: Optional[Progress] = None) -> RetainedResult:
    t0 = time.perf_counter()
    model, tokenizer, _ = cfg.model.load()
    prompts = workload_prompts(cfg.requests, tokenizer=tokenizer, texts=cfg.prompts, length=cfg.prompt_len,
                               vocab_size=model.config.vocab_size, seed=cfg.seed)
    lens = [len(p) for p in prompts]
    num_blocks = fit_num_blocks(cfg.requests, full_blocks(max(lens), cfg.output_len, cfg.block_size), cfg.block_size)
    check_kv_cache("requests", cfg.requests, model, num_blocks, cfg.block_size)
    engine_cfg = resident_engine_config(prompts, cfg.output_len, num_blocks=num_blocks, block_size=cfg.block_size,
                                        reclaim=dict(EAGER_RECLAIM))
    warm_up(model, engine_cfg, max(lens))
    rows = {}
    for name in cfg.policies:
        runs = paired_run(model, prompts, cfg.output_len, modes=MODES, policy=name,
                          policy_cfg=policy_config(name, cfg.evict_ratio, cfg.window, cfg.sink, supported_at(name, cfg.at)),
                          engine_cfg=engine_cfg, progress=progress)
        row = {m: {k: runs[m].to_dict()[k] for k in KEYS} for m in MODES}
        row["outputs_identical"] = runs["naive"].outputs == runs["vtoken"].outputs
        n, v = row["naive"]["retained_blocks_per_request"], row["vtoken"]["retained_blocks_per_request"]
        row["reduction"] = 1.0 - v / n
        rows[name] = row
    return RetainedResult(cfg, cfg.model.describe(model), rows, time.perf_counter() - t0, num_blocks)


def format_retained(res: RetainedResult) -> str:
    c = res.config
    lines = [
        f"vtoken retained (Fig. 7): {c.requests} requests x ({c.prompt_len} prompt + {c.output_len} output) tokens, "
        f"block size {c.block_size}, evict {100 * c.evict_ratio:g}%, naive vs vtoken on one recorded trace per policy",
        f"model: {res.model}",
        "",
        f"{'policy':<13} {'evicted':>8} {'naive blk/req':>13} {'vtoken blk/req':>14} {'packed':>7} {'reduction':>9} "
        f"{'naive util':>10} {'vtoken util':>11} {'outputs':>9}",
    ]
    for name, r in res.rows.items():
        n, v = r["naive"], r["vtoken"]
        lines.append(
            f"{name:<13} {n['evicted_tokens']:>8d} {n['retained_blocks_per_request']:>13.1f} "
            f"{v['retained_blocks_per_request']:>14.1f} {v['ideal_blocks_per_request']:>7.1f} "
            f"{100 * r['reduction']:>8.1f}% {100 * n['utilization']:>9.1f}% {100 * v['utilization']:>10.1f}% "
            f"{'identical' if r['outputs_identical'] else 'DIFFERENT':>9}"
        )
    lines += [
        "",
        "blk/req: blocks held at finish (mean); packed: ceil(live / S); util: live / (blocks x S); "
        "outputs: greedy tokens, naive vs vtoken",
        f"total {res.seconds:.1f} s",
    ]
    return "\n".join(lines)


def plot_retained(res: RetainedResult, path: str, plt) -> None:
    import numpy as np

    names = list(res.rows)
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, key, title, scale in ((axes[0], "retained_blocks_per_request", "blocks retained per request", 1),
                                  (axes[1], "utilization", "utilization (%)", 100)):
        for i, (mode, color) in enumerate((("naive", "#d9822b"), ("vtoken", "#2b7bd9"))):
            ax.bar(x + (i - 0.5) * 0.38, [scale * res.rows[n][mode][key] for n in names], 0.38, label=mode,
                   color=color)
        if key == "retained_blocks_per_request":
            ax.scatter(x, [res.rows[n]["vtoken"]["ideal_blocks_per_request"] for n in names], marker="_", s=300,
                       color="black", label="packed")
        ax.set_xticks(x, names, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    c = res.config
    fig.suptitle(f"Fig. 7: retained blocks on identical victims (evict {100 * c.evict_ratio:g}%, "
                 f"{c.requests} x ({c.prompt_len}+{c.output_len}), S={c.block_size})", fontsize=10)
    save_figure(fig, path)
