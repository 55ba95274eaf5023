"""Experiments behind the ``vtoken`` CLI subcommands: one module per experiment,
each a config dataclass plus a ``run_*`` function returning a result dataclass."""
