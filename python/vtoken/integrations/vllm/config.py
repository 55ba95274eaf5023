"""The vtoken connector's configuration: ``KVTransferConfig.kv_connector_extra_config``.

Keys (all optional):

===================  =========================================================
``mode``             ``"native"`` (indirection only, no eviction), ``"naive"``
                     (evict; a block is freed once fully dead) or ``"vtoken"``
                     (evict + reclaim). Default ``"vtoken"``.
``policy``           a registered policy name (``vtoken.policies.available()``);
                     required unless ``mode == "native"``.
``policy_config``    keyword arguments of ``vtoken.policies.get(policy, ...)``,
                     e.g. ``{"budget": 0.5, "window": 32, "sink": 4}``.
``reclaim``          fields of :class:`vtoken.reclamation.config.ReclaimConfig` except
                     ``mode`` (``theta_F``, ``low_watermark``,
                     ``headroom_blocks``, ``check_interval``,
                     ``max_src_per_plan``, ``max_moves_per_step``, ``min_gain``,
                     ``force_sync``, ``check_invariants``). Two defaults
                     differ from the library's: ``low_watermark`` 0.10 (the
                     connector cannot see vLLM's waiting queue as demand) and
                     ``headroom_blocks`` 0.02 (a stash taken once, at bind).
``drop_tainted_hashes``  in the modes that evict, never hash (for the prefix
                     cache) a block filled after a request's prompt, whose K/V
                     may come from a pruned context (default ``True``; see
                     docs/vllm.md, "Prefix caching").
``full_decode_graphs``  let vLLM replay uniform decode batches from full CUDA
                     graphs (the builder then reports
                     ``UNIFORM_SINGLE_TOKEN_DECODE``; default ``False``: it
                     has not run on a GPU yet, see docs/vllm.md, "CUDA graphs").
                     The slot-list buffers are then fixed at the KV cache's
                     slots (``num_gpu_blocks x block_size``) and never move, so
                     prefix caching must be off (refused otherwise).
``check_invariants`` run vtoken's invariant checks every step on both sides
                     (table/ledger vs vLLM's block lists, mirror vs slot
                     mapping, I1 around copies). ``None`` (default) reads
                     ``VTOKEN_DEBUG_INVARIANTS``.
===================  =========================================================
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from vtoken.errors import InvalidArgumentError, InvalidTypeError, debug_checks_enabled

MODES = ("native", "naive", "vtoken")
VLLM_LOW_WATERMARK = 0.10  # free-block floor, slack beyond the waiting head's demand (see make_reclaim_config)
VLLM_HEADROOM_SHARE = 0.02  # the headroom stash, a fixed share of the pool (see make_reclaim_config)
_KEYS = ("mode", "policy", "policy_config", "reclaim", "drop_tainted_hashes", "full_decode_graphs", "check_invariants")


@dataclass(frozen=True)
class VTokenVLLMConfig:
    """Validated ``kv_connector_extra_config``; see the module docstring."""

    mode: str = "vtoken"
    policy: Optional[str] = None
    policy_config: dict = field(default_factory=dict)
    reclaim: dict = field(default_factory=dict)
    drop_tainted_hashes: bool = True
    full_decode_graphs: bool = False
    check_invariants: Optional[bool] = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise InvalidArgumentError(f"mode: expected one of {MODES}, got {self.mode!r}")
        if self.policy is not None and not isinstance(self.policy, str):
            raise InvalidTypeError(f"policy: expected a policy name (str), got {type(self.policy).__name__}")
        if self.mode != "native" and self.policy is None:
            raise InvalidArgumentError(f"policy: expected a policy name for mode {self.mode!r}, got None")
        for name in ("policy_config", "reclaim"):
            if not isinstance(getattr(self, name), dict):
                raise InvalidTypeError(f"{name}: expected a dict, got {type(getattr(self, name)).__name__}")
        if "mode" in self.reclaim:
            raise InvalidArgumentError("reclaim: expected no 'mode' key (the connector's 'mode' sets it), got one")
        for name in ("drop_tainted_hashes", "full_decode_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidTypeError(f"{name}: expected a bool, got {type(getattr(self, name)).__name__}")
        if self.check_invariants is not None and not isinstance(self.check_invariants, bool):
            raise InvalidTypeError(f"check_invariants: expected a bool or None, got {type(self.check_invariants).__name__}")
        # Build both once so a bad policy or reclaim config fails at startup, naming the key.
        self.make_policy()
        self.make_reclaim_config()

    @classmethod
    def from_extra_config(cls, extra: Optional[dict]) -> "VTokenVLLMConfig":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_KEYS))
        if unknown:
            raise InvalidArgumentError(f"kv_connector_extra_config: expected keys among {list(_KEYS)}, got unknown {unknown}")
        return cls(**extra)

    @property
    def evicts(self) -> bool:
        return self.mode != "native"

    @property
    def checking(self) -> bool:
        if self.check_invariants is not None:
            return self.check_invariants
        return debug_checks_enabled()

    def make_policy(self):
        """A fresh policy object, or None in native mode."""
        if not self.evicts:
            return None
        from vtoken import policies

        policy = policies.get(self.policy, **self.policy_config)
        if policy.score_source not in ("exact", "none"):
            raise InvalidArgumentError(
                f"policy: expected a policy scored by exact attention or by nothing (the vLLM backend returns "
                f"token_attention key scores), got {self.policy!r} with score source {policy.score_source!r}"
            )
        return policy

    def make_reclaim_config(self):
        from vtoken.reclamation.manager import ReclaimConfig

        fields = {f.name for f in dataclasses.fields(ReclaimConfig)} - {"mode"}
        unknown = sorted(set(self.reclaim) - fields)
        if unknown:
            raise InvalidArgumentError(f"reclaim: expected keys among {sorted(fields)}, got unknown {unknown}")
        cfg: dict[str, Any] = dict(self.reclaim)
        cfg.setdefault("check_invariants", self.check_invariants)
        # NOTE: two library defaults do not fit vLLM. Its waiting queue is vLLM's own, so the connector
        # reports only its head as demand (the request vLLM tried to admit; the embedded engine reports
        # every prompt a free slot could admit): a free-block floor of 10% is kept as slack. And its headroom is a physical stash taken once, at bind, so it cannot
        # follow the running requests: 2% of the pool.
        cfg.setdefault("low_watermark", VLLM_LOW_WATERMARK)
        cfg.setdefault("headroom_blocks", VLLM_HEADROOM_SHARE)
        return ReclaimConfig(mode=self.mode, **cfg)
