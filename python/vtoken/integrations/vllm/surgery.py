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
from vtoken.pool import NULL_BLOCK


def block_ids(manager, req_id) -> np.ndarray:
    """The ids of ``req_id``'s vLLM block list (int32; 0 = null block)."""
    blocks = manager.req_to_blocks.get(req_id, ())
    return np.fromiter((b.block_id for b in blocks), dtype=np.int32, count=len(blocks))


def apply_block_list(manager, block_pool, req_id, new_ids: np.ndarray, old_ids: np.ndarray) -> np.ndarray:
    """Rewrite positions of ``req_id``'s vLLM list where ``new_ids`` differs from ``old_ids``.

    ``old_ids`` is the list vtoken last wrote (or read); ``new_ids`` the
    table's block list now, same length. Positions past it are left alone.
    Returns the positions changed (int64). Raises ``InvariantViolation`` when
    vLLM's list no longer matches ``old_ids`` at a changed position or is
    shorter than the table's.
    """
    new_ids = np.asarray(new_ids, dtype=np.int32)
    old_ids = np.asarray(old_ids, dtype=np.int32)
    if new_ids.shape != old_ids.shape:
        raise InvariantViolation(f"surgery: block lists of {req_id!r} differ in length ({len(new_ids)} vs {len(old_ids)})")
    changed = np.flatnonzero(new_ids != old_ids)
    if changed.size == 0:
        return changed
    blocks = manager.req_to_blocks.get(req_id)
    if blocks is None or len(blocks) < len(new_ids):
        raise InvariantViolation(
            f"surgery: vLLM's block list of {req_id!r} has {0 if blocks is None else len(blocks)} entries, "
            f"vtoken's {len(new_ids)}"
        )
    null = block_pool.null_block
    for p in changed.tolist():
        if blocks[p].block_id != old_ids[p]:
            raise InvariantViolation(
                f"surgery: position {p} of {req_id!r} holds block {blocks[p].block_id} in vLLM, "
                f"vtoken expected {int(old_ids[p])}"
            )
        b = int(new_ids[p])
        blocks[p] = null if b == NULL_BLOCK else block_pool.blocks[b]
    return changed
