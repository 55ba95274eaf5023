"""Reclamation settings (:class:`ReclaimConfig`) and the per-step admission answer (:class:`AdmissionBudget`).

Both are re-exported by :mod:`vtoken.reclamation.manager`, where the manager that reads them lives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from vtoken.errors import InvalidArgumentError, InvalidTypeError, check_int, is_int

MODES = ("native", "naive", "vtoken")
PLANNERS = ("holes", "fresh")
Count = Union[int, float]

# NOTE: slots are int32 on the device, so one step can never address more moves
# than this; the copy engine's move buffer is sized from the smaller of this
# setting and the pool's slot count, never from the setting alone.
MAX_MOVES_PER_STEP = 2**31 - 1


@dataclass(frozen=True)
class ReclaimConfig:
    """Reclamation settings, validated on construction.

    The trigger is driven by memory pressure (docs/reclamation.md): it fires
    when the free blocks fall short of the projected demand, i.e. the blocks
    the running requests' growth and the waiting prompts need within the next
    ``check_interval + S`` steps, plus the headroom reserve; it then plans only
    until the shortfall is covered, at most ``max_moves_per_step`` moves a
    step. Without pressure nothing moves.

    Block counts (``low_watermark``, ``headroom_blocks``) are an ``int`` number
    of blocks, or a ``float`` in [0, 1]: a fraction of the pool's usable blocks.

    Attributes:
        mode: ``native`` | ``naive`` | ``vtoken``.
        theta_F: the waste floor: never reclaim while the pool's waste ratio F
            is at or below it (default 0.01: moving tokens to win back less
            than 1% of the pool is not worth the copies).
        low_watermark: a floor of free blocks to keep: fewer free blocks count
            as pressure even without projected demand (default 0: demand
            only; 1.0 treats memory as always low). Admissions are held back
            (backpressure) while reclamation is pending and free blocks are at
            or below it.
        planner: ``holes`` (the default: sources are emptied into the holes
            of the request's own denser blocks, :mod:`vtoken.reclamation.hole_planner`; a
            fresh-block plan only where it frees more and a reserve was set) or
            ``fresh`` (every plan fills fresh blocks from the reserve: the
            previous planner, kept for the paired measurements).
        headroom_blocks: destination reserve held back from admission and
            growth; ``None`` (the default) is 0 for the ``holes`` planner and
            sized to the running requests every step for ``fresh``
            (:func:`auto_headroom`).
        check_interval: steps between trigger checks (every step while
            pending), and the look-ahead of the projected demand.
        max_src_per_plan: sources per plan at most (sparsest first).
        max_moves_per_step: tokens moved per step at most (the rate limit), in
            ``[1, MAX_MOVES_PER_STEP]`` (2**31 - 1: slots are int32).
        min_gain: reclaim only if at least this many blocks can be freed.
        force_sync: the host waits on each copy (the paper's ablation).
        check_invariants: run I1/I2/I4 every step; ``None`` reads
            ``VTOKEN_DEBUG_INVARIANTS``.

    Example:
        >>> ReclaimConfig(low_watermark=0.2, headroom_blocks=0.02).resolve(1000)
        (200, 20)
        >>> ReclaimConfig(planner="fresh").resolve(1000, block_size=16, running=8)   # auto headroom, 8 requests
        (0, 12)
        >>> ReclaimConfig().resolve(1000, block_size=16, running=8)   # hole filling: no reserve
        (0, 0)
    """

    mode: str = "vtoken"
    planner: str = "holes"
    theta_F: float = 0.01
    low_watermark: Count = 0
    headroom_blocks: Optional[Count] = None
    check_interval: int = 8
    max_src_per_plan: int = 256
    max_moves_per_step: int = 8192
    min_gain: int = 1
    force_sync: bool = False
    check_invariants: Optional[bool] = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise InvalidArgumentError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.planner not in PLANNERS:
            raise InvalidArgumentError(f"planner: expected one of {PLANNERS}, got {self.planner!r}")
        if isinstance(self.theta_F, bool) or not isinstance(self.theta_F, (int, float)):
            raise InvalidTypeError(f"theta_F: expected a float, got {type(self.theta_F).__name__}")
        if not 0.0 <= float(self.theta_F) < 1.0:
            raise InvalidArgumentError(f"theta_F: expected a value in [0, 1), got {self.theta_F}")
        for name in ("low_watermark", "headroom_blocks"):
            v = getattr(self, name)
            if v is None and name == "headroom_blocks":
                continue
            if is_int(v):
                if v < 0:
                    raise InvalidArgumentError(f"{name}: expected >= 0 blocks, got {v}")
            elif isinstance(v, float):
                if not 0.0 <= v <= 1.0:
                    raise InvalidArgumentError(f"{name}: expected a fraction in [0, 1] (or an int), got {v}")
            else:
                raise InvalidTypeError(f"{name}: expected an int (blocks) or a float (fraction)"
                                       f"{' or None (auto)' if name == 'headroom_blocks' else ''}, got {type(v).__name__}")
        check_int("check_interval", self.check_interval, min_value=1)
        check_int("max_src_per_plan", self.max_src_per_plan, min_value=2)
        check_int("max_moves_per_step", self.max_moves_per_step, min_value=1, max_value=MAX_MOVES_PER_STEP)
        check_int("min_gain", self.min_gain, min_value=1)
        if not isinstance(self.force_sync, bool):
            raise InvalidTypeError(f"force_sync: expected a bool, got {type(self.force_sync).__name__}")
        if self.check_invariants is not None and not isinstance(self.check_invariants, bool):
            raise InvalidTypeError(f"check_invariants: expected a bool or None, got {type(self.check_invariants).__name__}")

    def resolve(self, usable_blocks: int, *, block_size: Optional[int] = None, running: int = 0) -> tuple[int, int]:
        """``(low_watermark, headroom)`` in blocks for a pool of ``usable_blocks``.

        An automatic headroom (``headroom_blocks=None``) is sized for
        ``running`` requests of ``block_size`` tokens per block
        (:func:`auto_headroom`); ``block_size`` is required then.
        """

        def blocks(v) -> int:
            return int(v) if is_int(v) else int(math.ceil(v * usable_blocks))

        wm = blocks(self.low_watermark)
        if self.headroom_blocks is None and self.planner == "holes":
            hr = 0  # hole filling needs no spare block
        elif self.headroom_blocks is None:
            if block_size is None:
                raise InvalidArgumentError("block_size: expected the pool's block size to size the automatic "
                                           "headroom (headroom_blocks=None), got None")
            hr = min(auto_headroom(running, block_size), usable_blocks)
        else:
            hr = blocks(self.headroom_blocks)
        if self.mode == "vtoken" and hr > usable_blocks:
            raise InvalidArgumentError(f"headroom_blocks: expected <= usable blocks ({usable_blocks}), got {hr}")
        return wm, hr


# NOTE: the reserve must cover one step's destinations. Random victims leave
# scattered holes, so a source block keeps ~S - 1 live tokens and freeing one
# block takes ~S - 1 destinations; R requests grow by R / S blocks a step, so
# keeping pace takes ~R * (S - 1) / S destinations a step; 1.5x that leaves
# slack. Measured on the capacity frontier (paper-0.50, 22 requests of 16K
# tokens, trace-only): a reserve of 16 failed at step 609, 24 passed at 519.5
# blocks per request, 31 (this formula) at 513.9, the packed size plus the tail.
HEADROOM_FACTOR = 1.5


def auto_headroom(running: int, block_size: int) -> int:
    """The automatic destination reserve for ``running`` requests: ``ceil(1.5 * R * (S - 1) / S)``, at least 1."""
    running = check_int("running", running)
    block_size = check_int("block_size", block_size, min_value=1)
    return max(1, math.ceil(HEADROOM_FACTOR * running * (block_size - 1) / block_size))


@dataclass(frozen=True)
class AdmissionBudget:
    """What the scheduler may admit this step."""

    free_blocks: int  # free blocks minus the headroom reserve
    backpressure: bool  # True: admit nothing new this step (reclamation pending, memory low)
