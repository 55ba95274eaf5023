"""The memory the vtoken worker's attention holds, and its place in vLLM's memory profile.

The worker preallocates, at ``register_kv_caches``, everything the attention
needs per listed key ("entry" of the slot lists): the slot lists themselves
(int32 ``kv_indices`` and ``kv_pos``), the float32 per-entry score buffer, and
the attention plan's float32 workspace (:func:`vtoken_kernels.token_attention.
workspace_numel`: the decode logits ``[num_q_heads, entries]`` dominate). The
entries are bounded by what can be resident, :func:`listed_capacity`.

vLLM sizes the KV cache from the peak memory of one profiling forward that
runs before the KV cache (and the connector's worker side) exists, with no
attention metadata. :func:`profile_reserve_bytes` is what the plugin holds
during that run (a bound of the workspaces, from an upper bound of the KV
capacity), on the profiled runner (``vtoken_profile_reserve``), so the KV
cache is sized without the memory the workspaces take later. See
docs/vllm.md, "Memory".
"""
from __future__ import annotations

from dataclasses import dataclass

from vtoken.errors import InvalidArgumentError

# int32 kv_indices + int32 kv_pos (the slot lists) + float32 score (the worker's per-entry buffer)
BYTES_PER_ENTRY = 12
F32 = 4


def listed_capacity(num_slots: int, max_reqs: int, max_model_len: int) -> int:
    """Slot-list entries the worker preallocates: the KV cache's slots, bounded by ``max_reqs x max_model_len``.

    NOTE: without prefix caching no slot is listed twice, so a batch never lists
    more keys than there are slots: this is exact for fixed slot lists (the
    connector refuses ``full_decode_graphs`` with prefix caching). With prefix
    caching a shared slot is listed once per holder and the growable lists may
    pass it (see :class:`vtoken.integrations.vllm.worker.WorkerSide`).
    """
    for name, v in (("num_slots", num_slots), ("max_reqs", max_reqs), ("max_model_len", max_model_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(f"{name}: expected an int >= 1, got {v!r}")
    return min(num_slots, max_reqs * max_model_len)


@dataclass(frozen=True)
class AttentionWorkspace:
    """The shapes that size the worker's attention memory (per tensor-parallel rank).

    ``num_q_heads`` / ``head_dim``: the attention's; ``max_reqs`` / ``max_tokens``:
    rows and query tokens per step; ``scores``: the policy reads attention mass
    (the decode logits workspace exists only then).
    """

    num_q_heads: int
    head_dim: int
    max_reqs: int
    max_tokens: int
    scores: bool

    def __post_init__(self):
        for name in ("num_q_heads", "head_dim", "max_reqs", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name}: expected an int >= 1, got {v!r}")

    def attention_numel(self, entries: int, device) -> int:
        """float32 elements of the attention plan's workspace on ``device`` for ``entries`` listed keys."""
        from vtoken_kernels.token_attention import workspace_numel

        return workspace_numel(num_q_tokens=self.max_tokens, num_q_heads=self.num_q_heads, nnz_max=entries,
                               head_dim=self.head_dim, max_reqs=self.max_reqs, scores=self.scores, device=device)

    def nbytes(self, entries: int, device) -> int:
        """Bytes the worker holds for ``entries`` listed keys: slot lists, score buffer, attention workspace."""
        return BYTES_PER_ENTRY * entries + F32 * self.attention_numel(entries, device)


def profile_reserve_bytes(runner) -> int:
    """Bytes to hold during vLLM's profiling forward for the worker's later workspaces (0 off CUDA).

    ``runner``: vLLM's model runner (V1 or V2), its model loaded. See :func:`reserve_bytes_for`.
    """
    import torch

    from vtoken.integrations.vllm.attention import vtoken_selected

    cfg = runner.vllm_config
    if not vtoken_selected(cfg) or torch.device(runner.device).type != "cuda":
        return 0
    total = torch.cuda.mem_get_info(runner.device)[1]
    free_for_kv = int(total * cfg.cache_config.gpu_memory_utilization) - torch.cuda.memory_allocated(runner.device)
    return reserve_bytes_for(cfg, runner.get_kv_cache_spec(), free_for_kv, runner.device)


def reserve_bytes_for(vllm_config, kv_cache_specs: dict, free_for_kv: int, device) -> int:
    """The workspaces' bytes for the most KV tokens ``free_for_kv`` bytes could hold.

    The KV capacity is not known during the profile (it is what the profile
    decides), so the entries are bounded from above: ``free_for_kv`` (the memory
    vLLM may still give the KV cache: ``gpu_memory_utilization`` of the device,
    less what is allocated before the profile) over the KV bytes of one token
    in every layer (``kv_cache_specs``: vLLM's per-layer specs), and by
    ``max_num_seqs x max_model_len``. The worker's :func:`listed_capacity` is at
    most this bound, since the KV cache vLLM then sizes is smaller.
    """
    from vtoken.integrations.vllm.config import VTokenVLLMConfig

    specs = list(kv_cache_specs.values())
    if not specs or free_for_kv <= 0:
        return 0
    vt = VTokenVLLMConfig.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
    kv_bytes_per_token = sum(s.page_size_bytes for s in specs) / specs[0].block_size
    tokens = max(1, int(free_for_kv // kv_bytes_per_token))
    shape = workspace_shape(vllm_config, vt)
    return shape.nbytes(listed_capacity(tokens, shape.max_reqs, vllm_config.model_config.max_model_len), device)


def workspace_shape(vllm_config, vtoken_config) -> AttentionWorkspace:
    """The :class:`AttentionWorkspace` of this vLLM config's worker (what the connector gives ``WorkerSide``)."""
    sc, mc = vllm_config.scheduler_config, vllm_config.model_config
    max_reqs, max_tokens = sc.max_num_seqs, sc.max_num_batched_tokens
    if vtoken_config.full_decode_graphs:  # a full decode graph's batch is padded up to a capture size
        capture = vllm_config.compilation_config.max_cudagraph_capture_size or 0
        max_reqs, max_tokens = max(max_reqs, capture), max(max_tokens, capture)
    policy = vtoken_config.make_policy()
    return AttentionWorkspace(
        num_q_heads=mc.get_num_attention_heads(vllm_config.parallel_config), head_dim=mc.get_head_size(),
        max_reqs=max_reqs, max_tokens=max_tokens, scores=policy is not None and policy.score_source == "exact",
    )
