"""The ``vllm.general_plugins`` entry point (``vtoken = vtoken.integrations.vllm.plugin:register``).

vLLM calls :func:`register` in every process it starts (API server, engine
core, workers) before building a model. It:

1. registers :class:`vtoken.integrations.vllm.attention.VTokenAttentionBackend`
   as ``AttentionBackendEnum.CUSTOM`` (select it with
   ``attention_config={"backend": "CUSTOM"}``; honoured on CUDA);
2. on the CPU platform, which always picks ``CPU_ATTN``, overrides that member
   with a path that resolves to vtoken's backend only when the config being
   built uses the vtoken connector (vLLM's ``CPUAttentionBackend`` otherwise);
3. wraps ``GPUModelRunner._build_attention_metadata`` / ``_dummy_run`` of the
   V1 runner (the V1 CPU runner inherits them) to hand the batch's request
   order to the runner's vtoken metadata builders (``batch_req_ids``, for the
   build in progress): on V1 neither the builders nor the connector receive
   request ids. Model Runner V2 passes them to the connector's
   ``start_load_kv`` and needs no hook;
4. wraps ``profile_run`` of both runners to hold, during vLLM's profiling
   forward, the memory the worker's attention workspaces take later
   (:func:`vtoken.integrations.vllm.workspace.profile_reserve_bytes`), so the
   KV cache is sized without it (docs/vllm.md, "Memory");
5. wraps ``EngineArgs.create_engine_config`` to validate the vtoken
   connector's ``kv_connector_extra_config`` when vLLM builds its config, so
   a bad key fails ``vllm serve`` / ``LLM(...)`` at once, naming the key,
   not after the weights are loaded.

The connector itself needs no registration: ``kv_connector_module_path``
loads it. :func:`register` is idempotent and never raises on an unsupported
vLLM (it logs why it did nothing), so installing vtoken cannot break vLLM.
"""
from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger("vtoken.vllm")

BACKEND_PATH = "vtoken.integrations.vllm.attention.VTokenAttentionBackend"
CPU_DISPATCH_PATH = "vtoken.integrations.vllm.attention.CPUAttentionOrVToken"
_REGISTERED = False


def register() -> None:
    """Register vtoken's attention backend and runner hook with vLLM (see module docstring)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vtoken.integrations.vllm import vllm_available

    ok, why = vllm_available()
    if not ok:
        logger.warning("vtoken: vLLM plugin not registered: %s", why)
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_DISPATCH_PATH)
    _install_runner_hook()
    _install_config_check()
    _REGISTERED = True


CONNECTOR_MODULE = "vtoken.integrations.vllm.connector"


def _install_config_check() -> None:
    """Validate vtoken's extra config in ``create_engine_config`` (see module docstring, 5.)."""
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_engine_config
    if getattr(create, "_vtoken_hook", False):
        return

    @functools.wraps(create)
    def create_engine_config(self, *args, **kwargs):
        config = create(self, *args, **kwargs)
        kt = config.kv_transfer_config
        if kt is not None and kt.kv_connector_module_path == CONNECTOR_MODULE:
            from vtoken.integrations.vllm.config import VTokenVLLMConfig

            VTokenVLLMConfig.from_extra_config(kt.kv_connector_extra_config)  # raises, naming the key
        return config

    create_engine_config._vtoken_hook = True
    EngineArgs.create_engine_config = create_engine_config


def _vtoken_builders(runner) -> list:
    """The V1 runner's vtoken attention metadata builders (one per attention group and micro-batch)."""
    from vtoken.integrations.vllm.attention import VTokenAttentionMetadataBuilder

    return [b for groups in runner.attn_groups for group in groups for b in group.metadata_builders
            if isinstance(b, VTokenAttentionMetadataBuilder)]


def _install_runner_hook() -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _install_batch_order_hook(GPUModelRunner)
    _install_profile_hook(GPUModelRunner)
    _install_profile_hook(GPUModelRunnerV2)


def _install_batch_order_hook(runner_cls) -> None:
    """Hand the V1 runner's row order to its vtoken builders around each metadata build (module docstring, 3.)."""
    build = runner_cls._build_attention_metadata
    if getattr(build, "_vtoken_hook", False):
        return

    @functools.wraps(build)
    def _build_attention_metadata(self, *args, **kwargs):
        num_reqs = kwargs["num_reqs"] if "num_reqs" in kwargs else args[1]
        # A profiling / capture batch (_dummy_run) has no vtoken requests: the builder reads no KV.
        order = None if getattr(self, "_vtoken_in_dummy_run", False) else list(self.input_batch.req_ids[:num_reqs])
        builders = _vtoken_builders(self)
        outer = [b.batch_req_ids for b in builders]
        for b in builders:
            b.batch_req_ids = order
        try:
            return build(self, *args, **kwargs)
        finally:
            for b, o in zip(builders, outer):
                b.batch_req_ids = o

    _build_attention_metadata._vtoken_hook = True
    runner_cls._build_attention_metadata = _build_attention_metadata

    dummy = runner_cls._dummy_run

    @functools.wraps(dummy)
    def _dummy_run(self, *args, **kwargs):
        prev = getattr(self, "_vtoken_in_dummy_run", False)
        self._vtoken_in_dummy_run = True
        try:
            return dummy(self, *args, **kwargs)
        finally:
            self._vtoken_in_dummy_run = prev

    runner_cls._dummy_run = _dummy_run


def _install_profile_hook(runner_cls) -> None:
    """Hold the workspaces' reserve during ``runner_cls.profile_run`` (see module docstring, 4.)."""
    from vtoken.integrations.vllm import workspace

    profile = runner_cls.profile_run
    if getattr(profile, "_vtoken_hook", False):
        return

    @functools.wraps(profile)
    def profile_run(self, *args, **kwargs):
        # NOTE: vLLM takes the profile's peak (memory_profiling: persistent + transient) as the
        # memory the KV cache may not use. The reserve is live through the dummy forward and the
        # sampler run, as the worker's preallocated workspaces are through every later step. They
        # cannot be allocated before the profile instead: their size follows the KV capacity the
        # profile decides, and the connector's worker side only exists after it.
        n = workspace.profile_reserve_bytes(self)
        # Held by the runner it is profiled for, for the profile only.
        self.vtoken_profile_reserve = torch.empty(n, dtype=torch.uint8, device=self.device) if n else None
        try:
            return profile(self, *args, **kwargs)
        finally:
            self.vtoken_profile_reserve = None

    profile_run._vtoken_hook = True
    runner_cls.profile_run = profile_run
