"""vtoken's attention backend for vLLM 0.32: attention over each request's live slots.

The backend reads K/V through ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``
(:func:`vtoken.device.ops.token_attention`), never through vLLM's block table, so a
token the policy evicted is never attended, even while its block is alive
(this is what makes Naive-Evict honest), and a relocated token is read at its
new slot. Positions are vLLM's (``num_computed_tokens + query position``):
RoPE was applied at write time and never changes; the attention length is the
live count.

KV cache layout: vLLM 0.32 hands every backend one tensor per layer, logically
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` with K in the first
``head_dim`` of the last dim (``vllm_fused`` in :mod:`vtoken.layout`), in any
of vLLM's physical orders; :class:`vtoken.layout.KVLayout` takes the strides
from the tensor. New K/V are written at vLLM's ``slot_mapping`` (PAD -1
skipped): by vLLM's ``reshape_and_cache_flash`` on CUDA (the FlashAttention
backend's write), by an indexed copy on CPU.

CUDA graphs: by default the builder reports ``AttentionCGSupport.NEVER``, so
vLLM runs attention eagerly between the pieces of a PIECEWISE graph
(``cudagraph_mode`` ``NONE`` and ``PIECEWISE`` work; vLLM downgrades its
default ``FULL_AND_PIECEWISE`` to ``PIECEWISE`` and rejects ``FULL``). With
the connector's ``full_decode_graphs`` it reports
``UNIFORM_SINGLE_TOKEN_DECODE``: the metadata of every batch then points at
the worker's fixed-address slot lists (sized for the worst case, never moved,
padding rows empty), uniform decode takes the decode kernel path (launch
parameters from shapes only), and the key-score accumulation is a kernel of
the forward (``score_out``), so a captured graph replays the step.

Per step the first layer plans ``token_attention`` (:meth:`vtoken.integrations.
vllm.worker.WorkerSide.plan_attention`) and every layer runs the plan, as the
embedded engine does: no per-layer validation of the slot lists, no per-layer
allocation; the workspaces come from one buffer the worker preallocated. Not yet run on a GPU: see
docs/vllm.md, "CUDA graphs".

Selection: ``AttentionBackendEnum.CUSTOM`` (registered by the plugin; select
it with ``attention_config={"backend": "CUSTOM"}``). The CPU platform always
asks for ``CPU_ATTN``; the plugin overrides that member with
``vtoken.integrations.vllm.attention.CPUAttentionOrVToken``, which resolves
(module ``__getattr__``) to :class:`VTokenAttentionBackend` when the vLLM
config being built uses the vtoken connector and to vLLM's
``CPUAttentionBackend`` otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from vtoken.errors import InvariantViolation
from vtoken_kernels.contracts import MAX_HEAD_DIM

CONNECTOR_NAME = "VTokenConnector"

# --------------------------------------------------------------------------- batch order
# NOTE: vLLM's CommonAttentionMetadata does not name the requests of its rows. On the
# V1 runner the plugin wraps GPUModelRunner._build_attention_metadata / _dummy_run
# (docs/vllm.md) to hand the persistent batch's order to this backend's builders
# (VTokenAttentionMetadataBuilder.batch_req_ids); Model Runner V2 names the requests
# in the connector's start_load_kv (request_ids).
UNPUBLISHED = object()  # no runner hook around this build: the batch order is unknown


def bind_worker(vllm_config, layer_names, worker) -> None:
    """Bind ``worker`` (a :class:`vtoken.integrations.vllm.worker.WorkerSide`) to the vtoken attention layers named.

    The connector calls it at ``register_kv_caches`` with the layers whose KV
    caches it registered; each layer's builder reads the worker from its first
    layer (:meth:`VTokenAttentionMetadataBuilder.worker`) and hands it to the
    forward in the metadata it builds. None unbinds.
    """
    layers = vllm_config.compilation_config.static_forward_context
    for name in layer_names:
        impl = getattr(layers.get(name), "impl", None)
        if isinstance(impl, VTokenAttentionImpl):
            impl.worker = worker


# --------------------------------------------------------------------------- backend
class VTokenAttentionBackend(AttentionBackend):
    """Token-indexed attention over vtoken's slot lists (decoder self-attention)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]  # slots are decomposed as (slot // S, slot % S): any S

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [d for d in range(16, MAX_HEAD_DIM + 1, 16)]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["VTokenAttentionImpl"]:
        return VTokenAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["VTokenAttentionMetadataBuilder"]:
        return VTokenAttentionMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class VTokenAttentionMetadata:
    """One step's attention inputs. The slot lists are filled in just before the forward.

    vLLM builds this (``build``) before Model Runner V2 hands the connector the
    step's table events, so the builder records only what vLLM knows; the
    connector's ``start_load_kv`` (vLLM calls it before the forward because
    the scheduler side marks every step ``has_sync_kv_loads``) applies the
    events, rebuilds the slot lists and sets ``kv_indices`` / ``kv_indptr``
    (:meth:`vtoken.integrations.vllm.worker.WorkerSide.prepare_step`).
    """

    num_actual_tokens: int
    num_reqs: int
    q_indptr: torch.Tensor  # int32 [num_reqs + 1], vLLM's query_start_loc
    query_lens: Optional[np.ndarray] = None  # host, per row: the tokens each request computes this step
    seq_lens: Optional[np.ndarray] = None  # host upper bound per row (debug checks)
    slot_mapping: Optional[torch.Tensor] = None  # vLLM's (debug checks)
    req_ids: Optional[list] = None  # the V1 runner's batch order (plugin hook); V2 names it in start_load_kv
    worker: Optional[object] = None  # the WorkerSide bound to the layers (bind_worker); None: no KV this step
    kv_indices: Optional[torch.Tensor] = None  # int32 [>= total] (fixed-address buffer), None: no KV this step
    kv_indptr: Optional[torch.Tensor] = None  # int32 [num_reqs + 1], padding rows empty
    want_scores: bool = False
    uniform_decode: bool = False  # one query per request (padded rows included): the decode kernel path
    plan: Optional[object] = None  # the step's ops.TokenAttentionStep, planned by the first layer, run by all
    plan_key: Optional[tuple] = None  # (num_q_heads, dtype, scale) it was planned for


class VTokenAttentionMetadataBuilder(AttentionMetadataBuilder[VTokenAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        """Full graphs for uniform decode batches when the connector opts in (``full_decode_graphs``)."""
        if full_decode_graphs(vllm_config):
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        # V2 names the rows' requests to the connector (start_load_kv); V1 only through the plugin's hook.
        self.runner_v2 = bool(vllm_config.use_v2_model_runner)
        # The V1 runner's row order for the build in progress, set by the plugin's hook around it;
        # None: a dummy batch (warm-up, CUDA-graph capture); UNPUBLISHED: no hook ran.
        self.batch_req_ids = UNPUBLISHED

    @property
    def worker(self):
        """The WorkerSide bound to this builder's layers (:func:`bind_worker`), or None before ``register_kv_caches``."""
        layer = self.vllm_config.compilation_config.static_forward_context.get(self.layer_names[0])
        return getattr(getattr(layer, "impl", None), "worker", None)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> VTokenAttentionMetadata:
        cm = common_attn_metadata
        q_indptr = cm.query_start_loc[: cm.num_reqs + 1]
        meta = VTokenAttentionMetadata(cm.num_actual_tokens, cm.num_reqs, q_indptr,
                                       uniform_decode=cm.max_query_len == 1 and cm.num_actual_tokens == cm.num_reqs)
        worker = self.worker
        req_ids = self.batch_req_ids
        if worker is None or not worker.ready:
            return meta  # profiling before the KV caches exist: no KV to read
        meta.worker = worker  # the forward plans and scores through it
        if req_ids is None:  # the V1 runner's dummy batch (warm-up, CUDA-graph capture)
            worker.attach_fixed_slot_lists(meta)  # a captured graph must read the fixed buffers
            return meta
        if req_ids is UNPUBLISHED and not self.runner_v2:
            raise InvariantViolation(
                "vtoken attention: the V1 runner's batch order was not published (the plugin's hook on "
                "GPUModelRunner._build_attention_metadata did not run); is vtoken's plugin loaded?"
            )
        meta.query_lens = np.diff(cm.query_start_loc_cpu[: cm.num_reqs + 1].numpy().astype(np.int64))
        if worker.checking and cm.seq_lens_cpu_upper_bound is not None:
            meta.seq_lens = cm.seq_lens_cpu_upper_bound[: cm.num_reqs].numpy().copy()
        meta.slot_mapping = cm.slot_mapping
        meta.req_ids = None if req_ids is UNPUBLISHED else list(req_ids)
        worker.expect_attention(meta)
        return meta


class VTokenAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto",
                 logits_soft_cap=None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None, **kwargs) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window not in (None, -1),
            "logits_soft_cap": logits_soft_cap not in (None, 0, 0.0),
            "sinks": sinks is not None,
            "attn_type": attn_type != AttentionType.DECODER,
            "kv_cache_dtype": kv_cache_dtype not in ("auto", "float16", "bfloat16"),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"vtoken attention backend: unsupported options {bad}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.worker = None  # the connector's WorkerSide, bound at register_kv_caches (bind_worker)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Write the step's K/V at ``slot_mapping`` (PAD -1 skipped), ``vllm_fused`` layout."""
        d = self.head_size
        if kv_cache.is_cuda:
            from vllm._custom_ops import reshape_and_cache_flash

            key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
            reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype,
                                    layer._k_scale, layer._v_scale)
            return
        n = slot_mapping.shape[0]
        sm = slot_mapping.to(torch.int64)
        keep = sm >= 0
        sm, k, v = sm[keep], key[:n][keep], value[:n][keep]
        bs = kv_cache.shape[2]
        blk, off = sm // bs, sm % bs
        kv_cache[blk, :, off, :d] = k.to(kv_cache.dtype)
        kv_cache[blk, :, off, d:] = v.to(kv_cache.dtype)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Optional[VTokenAttentionMetadata], output: torch.Tensor,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("vtoken attention backend: fused output quantization is not supported")
        if attn_metadata is None:  # warm-up
            return output
        t = attn_metadata.num_actual_tokens
        out = output[:t]
        if attn_metadata.kv_indices is None:
            out.zero_()
            return output
        # NOTE: vLLM hands every layer of a KV cache group the same metadata object, so the first
        # layer plans the step (validation, tiling, workspaces) and the others only run the plan.
        worker = attn_metadata.worker
        step = worker.plan_attention(attn_metadata, num_q_heads=self.num_heads, dtype=query.dtype, scale=self.scale)
        step.run(query[:t], kv_cache, out=out, score_out=worker.score_out if attn_metadata.want_scores else None)
        return output


# --------------------------------------------------------------------------- CPU routing
def vtoken_selected(vllm_config=None) -> bool:
    """Whether the vLLM config being built runs the vtoken connector."""
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None:
        return False
    kvt = getattr(vllm_config, "kv_transfer_config", None)
    return kvt is not None and kvt.kv_connector == CONNECTOR_NAME and bool(
        (kvt.kv_connector_module_path or "").startswith("vtoken.")
    )


def full_decode_graphs(vllm_config) -> bool:
    """Whether the vtoken connector of ``vllm_config`` opts in to full decode graphs."""
    if not vtoken_selected(vllm_config):
        return False
    from vtoken.integrations.vllm.config import VTokenVLLMConfig

    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    return VTokenVLLMConfig.from_extra_config(extra).full_decode_graphs


def __getattr__(name: str):
    # PEP 562: resolved by AttentionBackendEnum.CPU_ATTN.get_class() on the CPU platform.
    if name == "CPUAttentionOrVToken":
        if vtoken_selected():
            return VTokenAttentionBackend
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
