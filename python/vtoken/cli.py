"""The ``vtoken`` command line.

One subcommand per experiment. The experiment itself lives in a module of its
own (``vtoken.experiments.<name>``); here each subcommand is one function that
declares its options and a handler, plus one line in ``SUBCOMMANDS``:

    def _add_demo(sub):
        p = sub.add_parser("demo", help="...")
        p.add_argument(...)
        p.set_defaults(func=_run_demo)   # _run_demo(args) -> exit code

    SUBCOMMANDS = [..., _add_demo]
"""
from __future__ import annotations

import argparse
import json
import sys

from vtoken.errors import VTokenError


def _add_fragmentation(sub) -> None:
    from vtoken.experiments.fragmentation import PATTERNS, FragmentationConfig

    d = FragmentationConfig()
    p = sub.add_parser(
        "fragmentation",
        help="waste ratio and block utilization after token-level eviction (Figure 1)",
        description="Prefill --requests requests of --context tokens in the real token table and block "
        "ledger, evict --evict-ratio of each by --pattern, and report the waste ratio F, the fraction of "
        "blocks at <= 25%% / <= 50%% utilization, blocks retained vs ideally packed per request, and the "
        "table's bytes per token.",
    )
    p.add_argument("--pattern", choices=PATTERNS, default=d.pattern, help="eviction pattern (default %(default)s)")
    p.add_argument("--evict-ratio", type=float, default=d.evict_ratio, help="fraction of tokens evicted (default %(default)s)")
    p.add_argument("--requests", type=int, default=d.requests, help="number of requests (default %(default)s)")
    p.add_argument("--context", type=int, default=d.context, help="tokens per request (default %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="RNG seed (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=_run_fragmentation, parser=p)


def _run_fragmentation(args) -> int:
    from vtoken.experiments.fragmentation import FragmentationConfig, format_result, run_fragmentation

    try:
        cfg = FragmentationConfig(pattern=args.pattern, evict_ratio=args.evict_ratio, requests=args.requests,
                                  context=args.context, block_size=args.block_size, seed=args.seed)
    except VTokenError as e:
        args.parser.error(str(e))
    res = run_fragmentation(cfg)
    print(json.dumps(res.to_dict()) if args.json else format_result(cfg, res))
    return 0


SUBCOMMANDS = [_add_fragmentation]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vtoken", description="vtoken: token-level KV virtualization for paged LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
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
