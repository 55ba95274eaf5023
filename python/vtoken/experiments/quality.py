"""``vtoken quality``: what eviction does to the text, per policy, on a real model and real prompts.

Every prompt of the set (default: the shipped 28 chat prompts) is served
once with the full KV cache (``native``), then, for each policy x evict ratio
x decision mode (``at="prefill"``: compress each prompt once after its
prefill; ``at="decode"``: evict during decode to the budget; SnapKV has only
the prefill mode), in ``naive`` and ``vtoken`` modes on one paired run
(:func:`vtoken.experiments.common.paired_run`: the decisions of both are
checked equal). Generation is greedy and stops at the checkpoint's
end-of-sequence token or after ``max_new_tokens``.

Reported per row, against native's output of the same prompt:

- **exact**: the share of prompts whose output is token-for-token native's;
- **first divergence**: the mean index of the first output token that differs
  from native's (an identical output counts its full length; one output
  ending before the other diverges where it ends);
- **ROUGE-L**: the mean F1 of the longest common subsequence of the decoded
  texts' words (lowercased ``\\w+`` runs), as the ``rouge-score`` package
  computes ROUGE-L without stemming;
- **naive vs vtoken**: output tokens that differ between the two (the count
  of positions, lengths included): exactly 0 is the contract, the paper's
  Table 2 done token for token.

The metrics, on their own::

    >>> rouge_l_f1("the cat sat on the mat", "the cat lay on the mat")
    0.8333333333333334
    >>> first_divergence([1, 2, 3], [1, 2, 4]), first_divergence([1, 2], [1, 2])
    (2, 2)
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from vtoken.errors import InvalidArgumentError, check_int
from vtoken.experiments.common import (
    save_figure,
    EAGER_RECLAIM,
    ModelSpec,
    Progress,
    check_kv_cache,
    check_policy,
    check_ratio,
    fit_num_blocks,
    full_blocks,
    paired_run,
    policy_config,
    reclaim_json,
    resident_engine_config,
)
from vtoken.experiments.prompts import workload_prompts, workload_texts
from vtoken.policies import AT_MODES

DEFAULT_MODEL = "smollm2"
AT = tuple(reversed(AT_MODES))  # prefill first: the kvpress semantics most comparisons use


def _all_policies() -> tuple:
    from vtoken.policies import available

    return tuple(available())


@dataclass
class QualityConfig:
    policies: tuple = field(default_factory=_all_policies)
    ratios: tuple = (0.25, 0.5, 0.75)  # evict ratios: the share of each request's tokens evicted
    at: tuple = AT  # decision modes
    max_new_tokens: int = 32
    window: Optional[int] = None  # every policy's recent window (None: its default, at most 32)
    sink: Optional[int] = None  # every policy's attention sinks (None: its default, 4)
    block_size: int = 16
    prompts: Optional[list] = None  # chat prompts; None: the shipped set
    model: ModelSpec = field(default_factory=lambda: ModelSpec(path=DEFAULT_MODEL))

    def __post_init__(self):
        self.policies = tuple(check_policy(p) for p in self.policies)
        self.ratios = tuple(check_ratio("ratios", r) for r in self.ratios)
        self.at = tuple(self.at)
        for a in self.at:
            if a not in AT:
                raise InvalidArgumentError(f"at: expected values among {AT}, got {a!r}")
        if not self.policies or not self.ratios or not self.at:
            raise InvalidArgumentError("policies/ratios/at: expected at least one value each, got an empty list")
        check_int("max_new_tokens", self.max_new_tokens, min_value=1)
        check_int("block_size", self.block_size, min_value=1)
        for name in ("window", "sink"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        if self.model.path is None:
            raise InvalidArgumentError("model: expected a real checkpoint (quality is measured on text), "
                                       "got a random-weight preset")


# ----------------------------------------------------------------------------- metrics
def first_divergence(a, b) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length if one is a prefix of the other)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def differing_tokens(a, b) -> int:
    """Positions where ``a`` and ``b`` differ, the length difference included."""
    n = min(len(a), len(b))
    return int((np.asarray(a[:n]) != np.asarray(b[:n])).sum()) + abs(len(a) - len(b))


def _words(text: str) -> list:
    return re.findall(r"\w+", text.lower())


def rouge_l_f1(candidate: str, reference: str) -> float:
    """ROUGE-L F1 of two texts over their lowercased word runs (LCS; 0 when either is empty)."""
    a, b = _words(candidate), _words(reference)
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


# ----------------------------------------------------------------------------- run
@dataclass
class QualityRow:
    policy: str
    at: str
    evict_ratio: float
    exact_match: float
    first_divergence: float
    rouge_l: float
    naive_vs_vtoken_tokens: int  # must be 0
    evicted_tokens: int
    seconds: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class QualityResult:
    config: QualityConfig
    model: str
    num_prompts: int
    prompt_tokens: list
    native_tokens: int
    rows: list  # QualityRow
    seconds: float

    def to_dict(self) -> dict:
        c = self.config
        return {
            "config": {"policies": list(c.policies), "ratios": list(c.ratios), "at": list(c.at),
                       "max_new_tokens": c.max_new_tokens, "window": c.window, "sink": c.sink,
                       "block_size": c.block_size},
            "model": self.model, "num_prompts": self.num_prompts, "prompt_tokens": self.prompt_tokens,
            "native_tokens": self.native_tokens, "rows": [r.to_dict() for r in self.rows],
            "naive_vs_vtoken_identical": all(r.naive_vs_vtoken_tokens == 0 for r in self.rows),
            "reclaim": reclaim_json(EAGER_RECLAIM),  # the vtoken mode's reclamation settings
            "seconds": self.seconds,
        }


def _combos(cfg: QualityConfig) -> list:
    from vtoken.policies import get

    return [(p, a, r) for p in cfg.policies for a in cfg.at if a in type(get(p)).at_modes for r in cfg.ratios]


def run_quality(cfg: QualityConfig, *, progress: Optional[Progress] = None) -> QualityResult:
    from vtoken.engine.scheduler import Engine, EngineConfig

    t0 = time.perf_counter()
    model, tokenizer, eos = cfg.model.load()
    texts = workload_texts(cfg.prompts)
    prompts = workload_prompts(len(texts), tokenizer=tokenizer, texts=texts)
    lens = [len(p) for p in prompts]
    num_blocks = fit_num_blocks(len(prompts), full_blocks(max(lens), cfg.max_new_tokens, cfg.block_size),
                                cfg.block_size)
    check_kv_cache("block_size", cfg.block_size, model, num_blocks, cfg.block_size)
    engine_cfg = resident_engine_config(prompts, cfg.max_new_tokens, num_blocks=num_blocks,
                                        block_size=cfg.block_size, reclaim=dict(EAGER_RECLAIM), eos_token_id=eos)
    native = [list(r.output) for r in Engine(model, EngineConfig(mode="native", **engine_cfg)).generate(
        prompts, cfg.max_new_tokens)]
    native_text = [tokenizer.decode(o) for o in native]
    if progress is not None:
        progress.advance()
    rows = []
    for policy, at, ratio in _combos(cfg):
        t1 = time.perf_counter()
        runs = paired_run(model, prompts, cfg.max_new_tokens, modes=("naive", "vtoken"), policy=policy,
                          policy_cfg=policy_config(policy, ratio, cfg.window, cfg.sink, at), engine_cfg=engine_cfg)
        out, other = runs["vtoken"].outputs, runs["naive"].outputs
        rows.append(QualityRow(
            policy=policy, at=at, evict_ratio=ratio,
            exact_match=float(np.mean([o == n for o, n in zip(out, native)])),
            first_divergence=float(np.mean([first_divergence(o, n) for o, n in zip(out, native)])),
            rouge_l=float(np.mean([rouge_l_f1(tokenizer.decode(o), t) for o, t in zip(out, native_text)])),
            naive_vs_vtoken_tokens=sum(differing_tokens(a, b) for a, b in zip(out, other)),
            evicted_tokens=runs["naive"].evicted_tokens, seconds=time.perf_counter() - t1,
        ))
        if progress is not None:
            progress.advance()
    return QualityResult(cfg, cfg.model.describe(model), len(prompts), lens, sum(len(o) for o in native), rows,
                         time.perf_counter() - t0)


def num_runs(cfg: QualityConfig) -> int:
    """Progress units: the native run and one per (policy, mode, ratio)."""
    return 1 + len(_combos(cfg))


def format_quality(res: QualityResult) -> str:
    c = res.config
    lines = [
        f"vtoken quality: {res.num_prompts} chat prompts ({min(res.prompt_tokens)}-{max(res.prompt_tokens)} tokens), "
        f"greedy, up to {c.max_new_tokens} new tokens (stop at end of sequence); native produced "
        f"{res.native_tokens} tokens",
        f"model: {res.model}",
        "",
        f"{'policy':<13} {'at':<8} {'evict':>5} {'exact':>6} {'first div':>9} {'ROUGE-L':>7} {'evicted':>8} "
        f"{'naive vs vtoken':>15}",
    ]
    for r in res.rows:
        lines.append(f"{r.policy:<13} {r.at:<8} {r.evict_ratio:>5.2f} {100 * r.exact_match:>5.0f}% "
                     f"{r.first_divergence:>9.1f} {r.rouge_l:>7.3f} {r.evicted_tokens:>8d} "
                     f"{r.naive_vs_vtoken_tokens:>13d} t")
    same = all(r.naive_vs_vtoken_tokens == 0 for r in res.rows)
    lines += [
        "",
        "exact: outputs equal to native's; first div: mean index of the first token that differs from native's; "
        "ROUGE-L: F1 vs native's text;",
        f"naive vs vtoken: differing output tokens ({'0 in every row: IDENTICAL' if same else 'NOT 0: a bug'}); "
        f"total {res.seconds:.0f} s",
    ]
    return "\n".join(lines)


def plot_quality(res: QualityResult, path: str, plt) -> None:
    ats = list(res.config.at)
    fig, axes = plt.subplots(1, len(ats), figsize=(5.2 * len(ats), 3.6), squeeze=False)
    for ax, at in zip(axes[0], ats):
        for i, policy in enumerate(res.config.policies):
            pts = [(r.evict_ratio, r.rouge_l) for r in res.rows if r.policy == policy and r.at == at]
            if pts:  # one color per policy in every panel
                ax.plot(*zip(*pts), marker="o", label=policy, color=f"C{i}")
        ax.set_title(f"at={at}", fontsize=10)
        ax.set_xlabel("evict ratio")
        ax.set_ylabel("ROUGE-L F1 vs full KV")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
    fig.suptitle(f"vtoken quality: {res.num_prompts} prompts, {res.model.split(' (')[0]}", fontsize=10)
    save_figure(fig, path)
