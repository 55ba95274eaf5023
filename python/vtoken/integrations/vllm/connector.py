"""``VTokenConnector``: vtoken as a vLLM 0.32 KV connector (``kv_connector_module_path``).

Load it with::

    KVTransferConfig(kv_connector="VTokenConnector",
                     kv_connector_module_path="vtoken.integrations.vllm.connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={...})   # see vtoken.integrations.vllm.config

The scheduler role drives :class:`vtoken.integrations.vllm.scheduler.SchedulerSide`,
the worker role :class:`vtoken.integrations.vllm.worker.WorkerSide`. vtoken
moves no KV across processes or nodes: ``get_num_new_matched_tokens`` always
reports 0 and touches no state, ``update_state_after_alloc`` records how many
tokens an admitted request has, and the load / save hooks are used as the pre-
and post-forward points of a step.
"""
from __future__ import annotations

from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.logger import init_logger

from vtoken.errors import InvalidArgumentError
from vtoken.integrations.vllm.config import VTokenVLLMConfig
from vtoken.integrations.vllm.meta import VTokenConnectorMetadata, VTokenWorkerMetadata

logger = init_logger(__name__)

__all__ = ["VTokenConnector", "VTokenConnectorMetadata", "VTokenWorkerMetadata"]


def _tensor_parallel_sum(vllm_config):
    """In-place sum over the tensor-parallel group (its device communicator), or None for one rank."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return None

    def reduce(t):
        from vllm.distributed.parallel_state import get_tp_group

        t.copy_(get_tp_group().all_reduce(t))

    return reduce


class VTokenConnector(KVConnectorBase_V1):
    """See the module docstring and docs/vllm.md."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        from vtoken.integrations.vllm import vllm_available

        ok, why = vllm_available()
        if not ok:  # it reads vLLM internals: an untested release is refused, not half-run
            raise InvalidArgumentError(f"vllm: {why}")
        self.vtoken_config = VTokenVLLMConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        if vllm_config.speculative_config is not None:
            raise InvalidArgumentError(
                "speculative decoding: expected none with the vtoken connector, got a speculative config"
            )
        if self.vtoken_config.evicts:
            from vllm.platforms import current_platform
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            # NOTE: on CPU the plugin routes CPU_ATTN to vtoken's backend. Elsewhere a
            # block-table backend would attend dead tokens and read freed blocks.
            if not current_platform.is_cpu() and vllm_config.attention_config.backend != AttentionBackendEnum.CUSTOM:
                raise InvalidArgumentError(
                    f"attention_config.backend: expected CUSTOM (vtoken's token-indexed attention) with mode "
                    f"{self.vtoken_config.mode!r}, got {vllm_config.attention_config.backend}"
                )
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise InvalidArgumentError(
                "pipeline_parallel_size: expected 1 with the vtoken connector, "
                f"got {vllm_config.parallel_config.pipeline_parallel_size}"
            )
        if self.vtoken_config.full_decode_graphs and vllm_config.cache_config.enable_prefix_caching:
            # NOTE: the fixed slot lists hold one entry per KV cache slot (what can be resident); a
            # prefix-cache hit lists a shared slot once per holder, past that bound.
            raise InvalidArgumentError(
                "enable_prefix_caching: expected False with full_decode_graphs (fixed slot lists sized by the "
                "KV cache's slots), got True"
            )
        if vllm_config.parallel_config.use_ubatching:
            # NOTE: micro-batches split one step's batch into separately built attention inputs; the
            # worker builds one set of slot lists per step and applies each step's table events once.
            raise InvalidArgumentError(
                "enable_dbo / ubatch_size: expected no dual-batch overlap or micro-batching with the vtoken "
                f"connector, got enable_dbo={vllm_config.parallel_config.enable_dbo}, "
                f"ubatch_size={vllm_config.parallel_config.ubatch_size}"
            )
        self.scheduler_side = None
        self.worker_side = None
        if role == KVConnectorRole.SCHEDULER:
            from vtoken.integrations.vllm.scheduler import SchedulerSide

            self.scheduler_side = SchedulerSide(self.vtoken_config)
        else:
            from vtoken.integrations.vllm import worker

            from vtoken.integrations.vllm.workspace import workspace_shape

            rc = self.vtoken_config.make_reclaim_config()
            # A full decode graph's batch is padded up to a capture size, which may pass max_num_seqs.
            shape = workspace_shape(vllm_config, self.vtoken_config)
            # NOTE: fixed slot lists are bounded by the KV cache's slots at register_kv_caches
            # (docs/vllm.md, "Memory"); max_num_seqs x max_model_len only caps a tiny model's.
            self.worker_side = worker.WorkerSide(
                max_reqs=shape.max_reqs, max_tokens=shape.max_tokens,
                max_moves=rc.max_moves_per_step, policy=self.vtoken_config.make_policy(),
                reduce_scores=_tensor_parallel_sum(vllm_config), force_sync=rc.force_sync,
                checking=self.vtoken_config.checking,
                fixed_slot_lists=(vllm_config.scheduler_config.max_num_seqs * vllm_config.model_config.max_model_len
                                  if self.vtoken_config.full_decode_graphs else None),
                attention=shape,
            )
        logger.info("vtoken connector (%s role): mode=%s policy=%s", role.name, self.vtoken_config.mode,
                    self.vtoken_config.policy)

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict) -> None:
        from vtoken.integrations.vllm.attention import bind_worker

        self.worker_side.register_kv_caches(kv_caches)
        # The attention of these layers reaches the worker through the metadata their builder makes.
        bind_worker(self._vllm_config, kv_caches, self.worker_side)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # Before the forward on both runners (V1: before the attention metadata is
        # built; Model Runner V2: after it, before start_load_kv).
        if isinstance(kv_connector_metadata, VTokenConnectorMetadata):
            self.worker_side.begin_step(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        # vtoken loads no KV from outside. Every step is marked has_sync_kv_loads, so both
        # runners call this before the forward, after handle_preemptions: the slot lists are
        # built here. Model Runner V2 names the batch's requests (request_ids, row order).
        if self.worker_side is not None:
            self.worker_side.prepare_step(kwargs.get("request_ids"))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        # Called once per step after the forward: launch the relocation copy.
        self.worker_side.end_step()

    def build_connector_worker_meta(self) -> Optional[VTokenWorkerMetadata]:
        return self.worker_side.worker_meta()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker_side is not None:
            self.worker_side.clear()

    def shutdown(self):
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()

    # ============================================================= scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind(kv_cache_manager)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        # NOTE: no "None" (needs more time) under memory pressure: see docs/vllm.md, "Admission". The
        # call only tells the reclamation trigger which prompt vLLM would admit next.
        self.scheduler_side.note_waiting_head(request.request_id, request.num_tokens, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler_side.note_admission(request.request_id, request.num_tokens)

    def build_connector_meta(self, scheduler_output) -> VTokenConnectorMetadata:
        return self.scheduler_side.build_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler_side.update_output(connector_output.kv_connector_worker_meta)

    def request_finished(self, request, block_ids: list[int]):
        self.scheduler_side.request_finished(request.request_id)
        return False, None

    def stats(self) -> dict:
        """Scheduler-side counters and pool state (the scheduler role only)."""
        return self.scheduler_side.summary() if self.scheduler_side is not None else {}
