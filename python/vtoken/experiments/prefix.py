"""``vtoken prefix``: the paper's Table 1, reclamation next to prefix sharing.

``requests`` requests are split into groups of ``degree``; the requests of a
group share one ``prefix_len``-token prefix (full blocks) and each has a
private ``suffix_len``-token suffix, then generates ``output_len`` tokens:

1. the first request of each group prefills the prefix;
2. the others join through ``TokenTable.add_request(prefix_blocks=...)``:
   the prefix blocks get one more reference each (SHARED), nothing is copied;
3. every request prefills its suffix (one step), then decodes; the policy
   evicts after every step, prefix tokens included (a holder's dead token in a
   shared block only dies for that holder).

The policy runs live in ``naive`` mode (victims recorded), and ``vtoken``
replays the trace; both run the same steps on the embedded engine's runner,
with reclamation as in the demo (memory treated as always low).

Reported per degree:

- **shared blocks skipped**: of the blocks that were SHARED while some holder
  had a dead token in them at a reclamation check (so compaction would pay if
  they were private), the share that no plan ever used as a source (the
  planner must skip ``ref > 1``: 100%). Also checked: every token of a block
  still shared at the end sits in its original slot for every holder.
- **reclaimed blocks**: freed by vtoken's reclamation, split by where the
  source sat in the request's block list: after the prefix (suffix and
  decode blocks) or inside it (only possible where the prefix is private, at
  degree 1, or once a block lost all but one holder).
- **retained blocks**: distinct blocks allocated at the end of decoding
  (a shared block counts once), naive vs vtoken.

Example:
    >>> from vtoken.experiments.common import ModelSpec
    >>> from vtoken.experiments.prefix import PrefixConfig, run_prefix
    >>> res = run_prefix(PrefixConfig(degrees=(2,), requests=2, prefix_len=16, suffix_len=8, output_len=10,
    ...                               block_size=4, window=4, model=ModelSpec(device="cpu")))
    >>> row = res.rows[0]; row["shared_blocks_used_as_sources"], row["shared_slots_intact"], row["outputs_identical"]
    (0, True, True)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from vtoken import cdiv
from vtoken.errors import InvalidArgumentError
from vtoken.policies import decision_plan
from vtoken.experiments.common import (
    save_figure,
    PolicyChoice,
    reclaim_json,
    EAGER_RECLAIM,
    ModelSpec,
    Progress,
    check_kv_cache,
    check_policy,
    check_pool,
    check_run_options,
    fit_num_blocks,
    full_blocks,
    make_prompts,
    parse_int_list,
    warm_up,
)


@dataclass
class PrefixConfig(PolicyChoice):
    degrees: tuple = (1, 2, 4, 8)
    requests: int = 8
    prefix_len: int = 128
    suffix_len: int = 32
    output_len: int = 64
    block_size: int = 16
    seed: int = 0
    model: ModelSpec = field(default_factory=ModelSpec)

    def __post_init__(self):
        check_policy(self.policy)
        self.degrees = parse_int_list("degrees", self.degrees)
        check_run_options(self, ("requests", "prefix_len", "suffix_len", "output_len", "block_size"))
        tokens = self.prefix_len + self.suffix_len + self.output_len
        per_request = full_blocks(self.prefix_len + self.suffix_len, self.output_len, self.block_size)
        check_pool("prefix_len + suffix_len + output_len", tokens, per_request + 1, self.block_size)
        check_pool("requests", self.requests, self.num_blocks, self.block_size)
        if self.prefix_len % self.block_size:
            raise InvalidArgumentError(
                f"prefix_len: expected a multiple of block_size ({self.block_size}): only full blocks are shared, "
                f"got {self.prefix_len}"
            )
        bad = [d for d in self.degrees if self.requests % d]
        if bad:
            raise InvalidArgumentError(f"degrees: expected divisors of requests ({self.requests}), got {bad}")

    @property
    def num_blocks(self) -> int:
        """A pool that holds every request unevicted and unshared (nothing ever runs out)."""
        return fit_num_blocks(self.requests,
                              full_blocks(self.prefix_len + self.suffix_len, self.output_len, self.block_size),
                              self.block_size)


@dataclass
class PrefixResult:
    config: PrefixConfig
    model: str
    rows: list  # one dict per degree
    seconds: float

    def to_dict(self) -> dict:
        c = self.config
        return {
            "config": {"degrees": list(c.degrees), "requests": c.requests, "prefix_len": c.prefix_len,
                       "suffix_len": c.suffix_len, "output_len": c.output_len, "block_size": c.block_size,
                       "num_blocks": c.num_blocks, "policy": c.policy, "evict_ratio": c.evict_ratio,
                       "window": c.window, "sink": c.sink, "at": c.at, "seed": c.seed},
            "model": self.model,
            "degrees": self.rows,
            "reclaim": reclaim_json(EAGER_RECLAIM),  # the vtoken mode's reclamation settings
            "seconds": self.seconds,
        }


class _SharedPrefixRun:
    """One mode at one sharing degree, stepped by hand over an Engine's runner, table, policy and reclaimer."""

    def __init__(self, model, cfg: PrefixConfig, degree: int, mode: str, trace=None):
        from vtoken.engine.scheduler import Engine, EngineConfig
        from vtoken.policies import ReplayPolicy

        self.cfg, self.degree = cfg, degree
        groups = cfg.requests // degree
        ecfg = dict(mode=mode, num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_num_reqs=cfg.requests,
                    max_num_tokens=max(groups * cfg.prefix_len, cfg.requests * cfg.suffix_len),
                    reclaim=dict(EAGER_RECLAIM), decision="host")  # stepped by hand: decides on the host
        if trace is None:
            self.eng = Engine(model, EngineConfig(policy=cfg.policy, policy_config=cfg.chosen_policy_config(), **ecfg),
                              record_trace=True)
            self.replay = None
        else:
            self.replay = ReplayPolicy(trace)
            self.eng = Engine(model, EngineConfig(**ecfg), policy=self.replay)
        self.policy = self.eng.policy
        inner = getattr(self.policy, "policy", self.policy)
        self.window = int(inner.window) if getattr(self.policy, "score_source", "none") == "window" else 0
        self.acc: dict = {}
        self.shared_with_dead: set = set()
        self.shared_sourced: set = set()
        self.src_prefix = self.src_suffix = 0
        self.evicted = 0

    # -------------------------------------------------------------------- steps
    def _step(self, rids: list, toks: list, *, prefill: bool, evict: bool, num_new: int) -> np.ndarray:
        eng, runner, rec = self.eng, self.eng.runner, self.eng.reclaimer
        rec.before_forward()
        res = runner.prefill(rids, toks, window=self.window) if prefill else runner.decode(rids, toks)
        if res is None:  # the pool is sized for every request unshared: only a bug gets here
            raise InvalidArgumentError("num_blocks: expected room for every request, got an out-of-blocks step")
        nxt = res.next_tokens()
        if res.key_scores is not None:
            from vtoken.policies import accumulate_batch

            accumulate_batch([self.acc.get(r) for r in rids], res.token_ids, res.key_scores, res.kv_indptr)
        if evict:
            # the suffix prefill completes every prompt; the policy's plan says who decides (EvictionPolicy.at)
            decides, protect = decision_plan(eng.decides_at, np.full(len(rids), num_new), np.full(len(rids), prefill))
            for i, r in enumerate(rids):
                if not decides[i]:
                    continue
                ids = eng.table.live_ids(r)
                seq_len = eng.table.num_tokens(r)
                ws = res.window_scores[i] if res.window_scores is not None else None
                view = self.policy.view(r, seq_len, ids, seq_len=seq_len, num_new=int(protect[i]),
                                        scores=self.acc.get(r), window_scores=ws)
                victims = self.policy.select_victims(view)
                if len(victims):
                    runner.evict(r, victims)
                    self.evicted += len(victims)
        self._observe_shared(rids)
        plans = rec.maybe_plan()
        self._observe_plans(plans)
        rec.launch(plans)
        rec.commit()
        return nxt

    def _observe_shared(self, rids: list) -> None:
        """Shared blocks in which some holder has a dead token, right before the reclamation check."""
        from vtoken.bookkeeping.ledger import SHARED

        led, table, S = self.eng.table.ledger, self.eng.table, self.cfg.block_size
        self._shared_now = set(np.flatnonzero(led.state == SHARED).tolist())
        if not self._shared_now:
            return
        k = self.cfg.prefix_len // S
        for r in rids:
            blocks = table.block_list(r)[:k]
            dead = ~table.live_mask(r)[: k * S].reshape(k, S).all(axis=1)
            self.shared_with_dead.update(b for b in blocks[dead].tolist() if b in self._shared_now)

    def _observe_plans(self, plans) -> None:
        led, k = self.eng.table.ledger, self.cfg.prefix_len // self.cfg.block_size
        for p in plans:
            src = np.asarray(p.src_blocks, dtype=np.int64)
            self.shared_sourced.update(b for b in src.tolist() if b in self._shared_now)
            in_prefix = int((led.pos[src] < k).sum())
            self.src_prefix += in_prefix
            self.src_suffix += len(src) - in_prefix

    # ---------------------------------------------------------------------- run
    def run(self, prefixes: list, suffixes: list) -> dict:
        cfg, eng = self.cfg, self.eng
        runner, table, led = eng.runner, eng.table, eng.table.ledger
        S, k, d = cfg.block_size, cfg.prefix_len // cfg.block_size, self.degree
        rids = list(range(cfg.requests))
        leaders = rids[::d]
        for r in leaders:
            runner.add_request(r)
            self.acc[r] = self.policy.make_accumulator()
        # 1. The leaders prefill the prefix (their first token comes with the suffix).
        self._step(leaders, [prefixes[r // d] for r in leaders], prefill=True, evict=False, num_new=cfg.prefix_len)
        # 2. The others share the leader's prefix blocks.
        for r in rids:
            if r % d:
                runner.add_request(r, prefix_blocks=table.block_list(r - r % d)[:k])
                self.acc[r] = self.policy.make_accumulator()
        shared_blocks = int(led.num_shared)
        prefix_slots = {r: table.slots(r)[: cfg.prefix_len] for r in rids}
        # 3. Every request prefills its suffix, then decodes; the policy evicts after each step but the last.
        outputs = {r: [] for r in rids}
        nxt = self._step(rids, [suffixes[r] for r in rids], prefill=True, evict=cfg.output_len > 1,
                         num_new=cfg.suffix_len)
        for step in range(1, cfg.output_len + 1):
            for i, r in enumerate(rids):
                outputs[r].append(int(nxt[i]))
            if step == cfg.output_len:
                break
            nxt = self._step(rids, nxt, prefill=False, evict=step < cfg.output_len - 1, num_new=1)
        if self.replay is not None:
            self.replay.check_complete()
        # Blocks still shared were shared all along (references only drop): their slots must be untouched.
        from vtoken.bookkeeping.ledger import SHARED

        intact = True
        for r in rids:
            blocks = table.block_list(r)[:k]
            still = led.state[blocks] == SHARED
            if still.any():
                now = table.slots(r)[: cfg.prefix_len].reshape(k, S)[still]
                intact &= bool(np.array_equal(now, prefix_slots[r].reshape(k, S)[still]))
        out = {
            "outputs": [outputs[r] for r in rids],
            "retained_blocks": int(led.num_allocated),
            "live_tokens": int(led.total_live),
            "shared_blocks": shared_blocks,
            "shared_slots_intact": intact,
            "evicted_tokens": self.evicted,
            "summary": eng.reclaimer.metrics.summary(),
        }
        for r in rids:
            runner.finish(r)
        if led.num_allocated:
            raise InvalidArgumentError(f"prefix: expected every block released at the end, got {led.num_allocated}")
        return out


def run_prefix(cfg: PrefixConfig, *, progress: Optional[Progress] = None) -> PrefixResult:
    t0 = time.perf_counter()
    model = cfg.model.build()
    check_kv_cache("requests", cfg.requests, model, cfg.num_blocks, cfg.block_size)
    warm_up(model, dict(num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                        max_num_tokens=cfg.prefix_len + cfg.suffix_len + cfg.output_len), cfg.prefix_len)
    rows = []
    for d in cfg.degrees:
        if progress is not None:
            progress.set_description(f"degree {d}")
        prefixes = make_prompts(cfg.requests // d, cfg.prefix_len, model.config.vocab_size, cfg.seed)
        suffixes = make_prompts(cfg.requests, cfg.suffix_len, model.config.vocab_size, cfg.seed + 1)
        naive_run = _SharedPrefixRun(model, cfg, d, "naive")
        naive = naive_run.run(prefixes, suffixes)
        vt_run = _SharedPrefixRun(model, cfg, d, "vtoken", trace=naive_run.eng.trace)
        vt = vt_run.run(prefixes, suffixes)
        with_dead = len(vt_run.shared_with_dead)
        skipped = len(vt_run.shared_with_dead - vt_run.shared_sourced)
        rows.append({
            "degree": d,
            "groups": cfg.requests // d,
            "shared_blocks": vt["shared_blocks"],
            "shared_blocks_with_dead_tokens": with_dead,
            "shared_blocks_skipped": skipped,
            "shared_skipped_pct": 100.0 * skipped / with_dead if with_dead else None,
            "shared_blocks_used_as_sources": len(vt_run.shared_sourced),
            "shared_slots_intact": vt["shared_slots_intact"],
            "reclaimed_blocks": vt["summary"].get("freed_blocks", 0),
            "reclaimed_suffix_blocks": vt_run.src_suffix,
            "reclaimed_prefix_blocks": vt_run.src_prefix,
            "relocated_tokens": vt["summary"].get("moves", 0),
            "naive_retained_blocks": naive["retained_blocks"],
            "vtoken_retained_blocks": vt["retained_blocks"],
            "retained_vs_naive": vt["retained_blocks"] / naive["retained_blocks"],
            "packed_blocks": cdiv(vt["live_tokens"], cfg.block_size),
            "evicted_tokens": naive["evicted_tokens"],
            "outputs_identical": naive["outputs"] == vt["outputs"],
        })
        if progress is not None:
            progress.advance()
    return PrefixResult(cfg, cfg.model.describe(model), rows, time.perf_counter() - t0)


def format_prefix(res: PrefixResult) -> str:
    c = res.config
    lines = [
        f"vtoken prefix (Table 1): {c.requests} requests, shared prefix {c.prefix_len} + private suffix {c.suffix_len} "
        f"+ {c.output_len} output tokens, block size {c.block_size}, "
        f"policy {c.policy} (evict {100 * c.evict_ratio:g}%)",
        f"model: {res.model}",
        "",
        f"{'degree':>6} {'shared':>6} {'w/ dead':>7} {'skipped':>8} {'reclaimed suffix':>16} {'prefix':>6} "
        f"{'naive blocks':>12} {'vtoken blocks':>13} {'vs naive':>8} {'outputs':>9}",
    ]
    for r in res.rows:
        pct = "n/a" if r["shared_skipped_pct"] is None else f"{r['shared_skipped_pct']:.0f}%"
        lines.append(
            f"{r['degree']:>6d} {r['shared_blocks']:>6d} {r['shared_blocks_with_dead_tokens']:>7d} {pct:>8} "
            f"{r['reclaimed_suffix_blocks']:>16d} {r['reclaimed_prefix_blocks']:>6d} {r['naive_retained_blocks']:>12d} "
            f"{r['vtoken_retained_blocks']:>13d} {100 * r['retained_vs_naive']:>7.1f}% "
            f"{'identical' if r['outputs_identical'] else 'DIFFERENT':>9}"
        )
    lines += [
        "",
        "shared: prefix blocks with ref > 1; w/ dead: shared blocks in which a holder had evicted tokens; skipped: of "
        "those, never a relocation source;",
        "reclaimed suffix / prefix: blocks freed by vtoken whose source sat after / inside the prefix; blocks: "
        "distinct blocks allocated at the end (shared once)",
        f"total {res.seconds:.1f} s",
    ]
    return "\n".join(lines)


def plot_prefix(res: PrefixResult, path: str, plt) -> None:
    degrees = [r["degree"] for r in res.rows]
    x = np.arange(len(degrees))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(x - 0.19, [r["naive_retained_blocks"] for r in res.rows], 0.38, label="naive", color="#d9822b")
    ax.bar(x + 0.19, [r["vtoken_retained_blocks"] for r in res.rows], 0.38, label="vtoken", color="#2b7bd9")
    ax.set_xticks(x, [f"degree {d}" for d in degrees])
    ax.set_ylabel("blocks allocated at the end")
    ax.set_title("Table 1: prefix sharing (shared blocks are never relocated)", fontsize=10)
    ax.legend(fontsize=8)
    save_figure(fig, path)
