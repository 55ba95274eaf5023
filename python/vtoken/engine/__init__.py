"""vtoken's embedded reference engine (docs/architecture.md §8): a Llama-family model in
plain torch over the paged, token-indexed KV cache, and the runner that drives
prefill and decode steps over the token table (CUDA graphs on GPU), and the
continuous-batching scheduler with the native / naive / vtoken modes."""
from vtoken.engine.kv_cache import KV_LAYOUTS, allocate_kv_caches, write_kv
from vtoken.engine.model import LlamaModel, ModelConfig, ModelOutput, StepInputs
from vtoken.engine.pretrained import Checkpoint, load_checkpoint
from vtoken.engine.runner import ModelRunner, RunnerConfig, StepHooks, StepResult
from vtoken.engine.scheduler import Engine, EngineConfig, Request, StepStats

__all__ = [
    "KV_LAYOUTS", "Checkpoint", "Engine", "EngineConfig", "LlamaModel", "ModelConfig", "ModelOutput", "ModelRunner",
    "Request", "RunnerConfig", "StepHooks", "StepInputs", "StepStats", "StepResult", "allocate_kv_caches",
    "load_checkpoint", "write_kv",
]
