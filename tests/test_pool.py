"""BlockPool: the built-in allocator (null block 0, no partial allocation, batched ref-counted free)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from table_helpers import assert_same
from vtoken.errors import InvalidArgumentError, InvalidTypeError
from vtoken.bookkeeping.pool import NULL_BLOCK, BlockAllocator, BlockPool

SIZES = [2, 3, 17, 64]
SEEDS = [0, 1, 2]


def pool_state(pool: BlockPool) -> dict:
    return {"free": np.sort(pool.free_ids()), "num_free": pool.num_free,
            "ref": pool.ref_count(np.arange(1, pool.num_blocks))}


def test_satisfies_the_allocator_protocol():
    assert isinstance(BlockPool(4), BlockAllocator)


@pytest.mark.parametrize("n", SIZES)
def test_null_block_is_never_handed_out(n):
    pool = BlockPool(n)
    assert pool.num_blocks == n and pool.num_free == n - 1
    ids = pool.allocate(n - 1)
    assert ids.dtype == np.int32
    assert sorted(ids.tolist()) == list(range(1, n))
    assert NULL_BLOCK not in ids
    assert pool.num_free == 0
    assert pool.allocate(1) is None
    assert pool.ref_count(ids).tolist() == [1] * (n - 1)


def test_allocate_zero_and_low_ids_first():
    pool = BlockPool(8)
    z = pool.allocate(0)
    assert z.dtype == np.int32 and z.size == 0 and pool.num_free == 7
    assert pool.allocate(3).tolist() == [1, 2, 3]


@pytest.mark.parametrize("n", SIZES)
def test_never_a_partial_allocation(n):
    pool = BlockPool(n)
    pool.allocate((n - 1) // 2)
    before = pool_state(pool)
    assert pool.allocate(pool.num_free + 1) is None
    assert_same(before, pool_state(pool))


def test_free_is_batched_and_lifo():
    pool = BlockPool(10)
    ids = pool.allocate(6)
    freed = pool.free(ids[[4, 1, 2]])
    assert freed.dtype == np.int32 and sorted(freed.tolist()) == sorted(ids[[4, 1, 2]].tolist())
    assert pool.num_free == 9 - 6 + 3
    # The blocks just freed are handed out before older free blocks.
    again = pool.allocate(3)
    assert sorted(again.tolist()) == sorted(ids[[4, 1, 2]].tolist())


def test_free_empty_is_a_noop():
    pool = BlockPool(4)
    before = pool_state(pool)
    assert pool.free([]).size == 0
    assert_same(before, pool_state(pool))


def test_refcounts_incref_decref():
    pool = BlockPool(6)
    (b,) = pool.allocate(1).tolist()
    pool.incref([b])
    pool.incref(np.array([b], dtype=np.int16))
    assert pool.ref_count([b]).tolist() == [3]
    assert pool.decref([b]).size == 0  # still referenced
    assert pool.free([b, b]).tolist() == [b]  # two references dropped in one batch
    assert pool.num_free == 5
    assert pool.ref_count([b]).tolist() == [0]


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda p, b: p.free([b, b]), InvalidArgumentError, "ids: .*double free"),
        (lambda p, b: p.free([5]), InvalidArgumentError, "ids: .*double free"),
        (lambda p, b: p.free([0]), InvalidArgumentError, r"ids: expected block ids in \[1, 8\)"),
        (lambda p, b: p.free([8]), InvalidArgumentError, r"ids: expected block ids in \[1, 8\)"),
        (lambda p, b: p.free([-1]), InvalidArgumentError, "ids: "),
        (lambda p, b: p.free(np.array([1.0])), InvalidTypeError, "ids: expected an integer array"),
        (lambda p, b: p.free(np.array([True])), InvalidTypeError, "ids: expected an integer array"),
        (lambda p, b: p.free(np.array([[b]])), InvalidTypeError, "ids: expected a 1-D array"),
        (lambda p, b: p.incref([5]), InvalidArgumentError, "ids: expected allocated blocks"),
        (lambda p, b: p.incref([0]), InvalidArgumentError, "ids: "),
        (lambda p, b: p.allocate(-1), InvalidArgumentError, "n: expected an int >= 0, got -1"),
        (lambda p, b: p.allocate(1.0), InvalidTypeError, "n: expected an int >= 0, got float 1.0"),
        (lambda p, b: p.allocate(True), InvalidTypeError, "n: expected an int >= 0, got bool True"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, exc, match):
    pool = BlockPool(8)
    (b,) = pool.allocate(1).tolist()  # block 1 allocated, 2..7 free
    before = pool_state(pool)
    with pytest.raises(exc, match=match):
        call(pool, b)
    assert_same(before, pool_state(pool))


@pytest.mark.parametrize("bad, exc", [(1, InvalidArgumentError), (0, InvalidArgumentError),
                                      (-3, InvalidArgumentError), (2.0, InvalidTypeError),
                                      (True, InvalidTypeError), ("8", InvalidTypeError)])
def test_constructor_rejects_bad_sizes(bad, exc):
    """A count out of range is a ValueError, anything but an int a TypeError; block 0 is the null block."""
    with pytest.raises(exc, match="num_blocks: expected an int >= 2, got "):
        BlockPool(bad)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [2, 9, 33])
def test_random_sequences_match_a_reference_model(seed, n):
    """allocate / incref / free against a dict of reference counts."""
    rng = random.Random(seed)
    pool = BlockPool(n)
    ref = {}  # block -> count
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            k = rng.randint(0, n)
            ids = pool.allocate(k)
            if k > n - 1 - len(ref):
                assert ids is None
            else:
                assert len(ids) == k and not set(ids.tolist()) & set(ref) and NULL_BLOCK not in ids
                ref.update({b: 1 for b in ids.tolist()})
        elif op < 0.6 and ref:
            bs = rng.sample(sorted(ref), rng.randint(1, len(ref)))
            pool.incref(bs)
            for b in bs:
                ref[b] += 1
        elif ref:
            bs = rng.sample(sorted(ref), rng.randint(1, len(ref)))
            freed = pool.free(bs)
            expect = []
            for b in bs:
                ref[b] -= 1
                if ref[b] == 0:
                    del ref[b]
                    expect.append(b)
            assert sorted(freed.tolist()) == sorted(expect)
        assert pool.num_free == n - 1 - len(ref)
        assert sorted(pool.free_ids().tolist()) == sorted(set(range(1, n)) - set(ref))
        if ref:
            assert pool.ref_count(sorted(ref)).tolist() == [ref[b] for b in sorted(ref)]
