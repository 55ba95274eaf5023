"""Block surgery: keep a request's vLLM block list equal to vtoken's block list.

vLLM sizes every allocation from the *length* of a request's block list
(``cdiv(num_tokens, block_size) - len(req_to_blocks[req])``, see
docs/vllm.md). vtoken's table keeps the same length and puts the null block
(id 0) at every position whose block it released, exactly like vLLM's
sliding-window managers (``_remove_blocks_in_range``); a relocation's
destinations take the first positions its sources freed. The helpers here
copy those changes into ``req_to_blocks`` position by position. They never
change a reference count: the allocator adapter already freed (or allocated)
the blocks involved.
"""
from __future__ import annotations

import numpy as np

from vtoken.errors import InvariantViolation
from vtoken.bookkeeping.pool import NULL_BLOCK


def block_ids(manager, req_id) -> np.ndarray:
    """The ids of ``req_id``'s vLLM block list (int32; 0 = null block)."""
    blocks = manager.req_to_blocks.get(req_id, ())
    return np.fromiter((b.block_id for b in blocks), dtype=np.int32, count=len(blocks))


def apply_block_list(manager, block_pool, req_id, new_ids: np.ndarray) -> np.ndarray:
    """Rewrite the positions of ``req_id``'s vLLM list where the table's ``new_ids`` differ from it.

    ``new_ids``: the table's block list of ``req_id`` now. vLLM's list is the
    only other copy: it held the table's previous list (the mirror appends
    vLLM's own allocations, and this is the only writer of earlier positions),
    so the positions that differ are exactly the table's changes. Positions
    past ``new_ids`` (blocks vLLM allocated ahead) are left alone. Returns the
    positions changed (int64). Raises ``InvariantViolation`` when vLLM's list
    is shorter than the table's.
    """
    new_ids = np.asarray(new_ids, dtype=np.int32)
    blocks = manager.req_to_blocks.get(req_id)
    if blocks is None or len(blocks) < len(new_ids):
        raise InvariantViolation(
            f"surgery: vLLM's block list of {req_id!r} has {0 if blocks is None else len(blocks)} entries, "
            f"vtoken's {len(new_ids)}"
        )
    changed = np.flatnonzero(block_ids(manager, req_id)[: len(new_ids)] != new_ids)
    null = block_pool.null_block
    for p in changed.tolist():
        b = int(new_ids[p])
        blocks[p] = null if b == NULL_BLOCK else block_pool.blocks[b]
    return changed
