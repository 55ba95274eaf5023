"""Shared helpers of the token-table tests: exact snapshot comparison and builders."""
from __future__ import annotations

import numpy as np

from vtoken.bookkeeping.ledger import BlockLedger
from vtoken.bookkeeping.pool import BlockPool
from vtoken.bookkeeping.table import TokenTable


def assert_same(a, b, path: str = "snapshot") -> None:
    """Assert two snapshot values are identical: numpy arrays bit for bit (dtype included)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), f"{path}: array vs {type(b).__name__}"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: contents differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def make_table(num_blocks: int = 64, block_size: int = 16, **kw) -> TokenTable:
    return TokenTable(BlockLedger(BlockPool(num_blocks), block_size), **kw)
