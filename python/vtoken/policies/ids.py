"""A request's live token ids as policies see them: validation and membership.

Shared by the policy contract (:mod:`vtoken.policies.base`) and the score
sources (:mod:`vtoken.policies.scores`), which both take live-id arrays from
the runtime; it imports neither, so they can import each other's pieces.
"""
from __future__ import annotations

import numpy as np

from vtoken.errors import InvalidArgumentError, as_index_array

__all__ = ["check_live_ids", "is_member"]


def check_live_ids(arg: str, token_ids) -> np.ndarray:
    """Return ``token_ids`` as a sorted unique non-negative int64 array, or raise naming ``arg``."""
    ids = as_index_array(arg, token_ids)
    if ids.size and (ids[0] < 0 or np.any(ids[1:] <= ids[:-1])):
        bad = np.flatnonzero(ids[1:] <= ids[:-1])
        where = f"ids[{bad[0]}:{bad[0] + 2}] = {ids[bad[0]:bad[0] + 2].tolist()}" if bad.size else f"ids[0] = {ids[0]}"
        raise InvalidArgumentError(
            f"{arg}: expected strictly increasing non-negative token ids (the live ids in logical order), got {where}"
        )
    return ids


def is_member(sorted_ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Bool mask: which ``values`` occur in the sorted array ``sorted_ids`` (O(m log n))."""
    if sorted_ids.size == 0:
        return np.zeros(values.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_ids, values), sorted_ids.size - 1)
    return sorted_ids[pos] == values
