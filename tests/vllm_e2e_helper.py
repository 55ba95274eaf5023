"""End-to-end helper for the vLLM tests: a tiny random Llama on disk and one ``LLM.generate`` run.

Run as a script (one vLLM engine per process: vLLM caches its attention
backend choice per process, and the tests compare configurations)::

    python tests/vllm_e2e_helper.py '{"model_dir": "...", "mode": "native", ...}'

It prints one JSON line (prefixed ``VTOKEN_RESULT``) with the generated token
ids per request, the connector's counters and the block pool state at the end.
No hub, no tokenizer: prompts are token ids (``skip_tokenizer_init=True``).
"""
from __future__ import annotations

import json
import os
import random
import sys
import time

TINY_LLAMA = dict(vocab=512, hidden=128, layers=2, heads=4, kv_heads=2, inter=256)


def make_tiny_llama(path: str, *, vocab=512, hidden=128, layers=2, heads=4, kv_heads=2, inter=256, seed=0) -> str:
    """Write a random-weight Llama checkpoint (config.json + model.safetensors) to ``path``."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    d = hidden // heads
    cfg = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=d, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32", bos_token_id=1,
        eos_token_id=2, hidden_act="silu",
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std):
        return (torch.randn(*shape, generator=g) * std).contiguous()

    # NOTE: large-ish std so greedy argmax margins are wide and attention is
    # peaked: eviction then changes outputs, and tiny numeric differences do not.
    t = {"model.embed_tokens.weight": r(vocab, hidden, std=1.0), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": r(vocab, hidden, std=0.2)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = r(heads * d, hidden, std=0.2)
        t[p + "self_attn.k_proj.weight"] = r(kv_heads * d, hidden, std=0.2)
        t[p + "self_attn.v_proj.weight"] = r(kv_heads * d, hidden, std=0.2)
        t[p + "self_attn.o_proj.weight"] = r(hidden, heads * d, std=0.1)
        t[p + "mlp.gate_proj.weight"] = r(inter, hidden, std=0.1)
        t[p + "mlp.up_proj.weight"] = r(inter, hidden, std=0.1)
        t[p + "mlp.down_proj.weight"] = r(hidden, inter, std=0.1)
        t[p + "input_layernorm.weight"] = torch.ones(hidden)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def prompts_for(cfg: dict) -> list[list[int]]:
    if "prompt_ids" in cfg:  # given token ids (e.g. chat prompts a real checkpoint's tokenizer encoded)
        return [list(p) for p in cfg["prompt_ids"]]
    rng = random.Random(cfg.get("seed", 0))
    lo, hi = cfg.get("prompt_len", [40, 80])
    out = [[rng.randrange(3, TINY_LLAMA["vocab"]) for _ in range(rng.randrange(lo, hi + 1))]
           for _ in range(cfg.get("num_prompts", 4))]
    for i, j in cfg.get("duplicate", []):  # identical prompts share prefix-cache blocks
        out[j] = list(out[i])
    return out


def _lift_cpu_async_override() -> None:
    """vLLM's CPU platform turns async scheduling off ("not required on CPU"); turn it back on after it."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _vtoken_plugin_loaded() -> bool:
    from vtoken.integrations.vllm import plugin

    return bool(plugin._REGISTERED)


def _model_runner(core):
    return core.model_executor.driver_worker.worker.model_runner if hasattr(core.model_executor, "driver_worker") \
        else None


def _runner_name(core):
    mr = _model_runner(core)
    return None if mr is None else f"{type(mr).__module__}.{type(mr).__name__}"


def _backend_name(core):
    mr = _model_runner(core)
    groups = getattr(mr, "attn_groups", None) if mr is not None else None
    if groups:
        return groups[0][0].backend.__name__
    backends = getattr(mr, "attn_backends", None) if mr is not None else None  # Model Runner V2
    if backends:
        first = next(iter(backends.values())) if isinstance(backends, dict) else backends[0]
        return first.__name__ if isinstance(first, type) else type(first).__name__
    return None


def _enable_model_runner_v2_on_cpu() -> None:
    """Model Runner V2 needs an active Triton backend; stock Triton has none for CPU.

    Registers a stand-in "cpu" backend whose driver reports active (before
    vLLM is imported) and runs V2's Triton kernels in Triton's interpreter
    (``TRITON_INTERPRET=1``): a test device for V2's control flow, not a
    way to serve.
    """
    import types

    # First: Triton's own library functions (tl.max, ...) take interpreter form only when
    # TRITON_INTERPRET is set before triton is imported.
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    # vtoken's own ops keep their CPU paths (torch references), as in the V1 runs.
    os.environ["VTOKEN_BACKEND"] = "torch"
    import triton.backends

    class _ActiveDriver:
        @staticmethod
        def is_active():
            return True

    triton.backends.backends.setdefault("cpu", types.SimpleNamespace(driver=_ActiveDriver, compiler=None))


def _fail_worker_copies(launches: list) -> None:
    """The worker's relocation copies number ``launches`` (0-based) write garbage into their destinations, then raise.

    The worker lives in this process (no multiprocessing, one rank); the
    scheduler's bookkeeping engine has no caches and is left alone.
    """
    import numpy as np
    import torch

    from vtoken.device.copy_engine import CopyEngine

    launch, count = CopyEngine.launch, [0]

    def failing(self, src_slots, dst_slots, *, step):
        if not self.kv_caches:
            return launch(self, src_slots, dst_slots, step=step)
        k, count[0] = count[0], count[0] + 1
        if k not in launches:
            return launch(self, src_slots, dst_slots, step=step)
        d = torch.as_tensor(np.asarray(dst_slots, dtype=np.int64))
        for c in self.kv_caches:  # vLLM's [num_blocks, num_kv_heads, block_size, 2 * head_size] view
            c[d // c.shape[2], :, d % c.shape[2], :] = 1e4
        raise RuntimeError(f"simulated failure of relocation copy {k}")

    CopyEngine.launch = failing


def run(cfg: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if cfg.get("fail_copy_launches"):
        _fail_worker_copies(list(cfg["fail_copy_launches"]))
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = dict(
        model=cfg["model_dir"], skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True,
        block_size=cfg.get("block_size", 32), max_model_len=cfg.get("max_model_len", 1024),
        max_num_seqs=cfg.get("max_num_seqs", 8), max_num_batched_tokens=cfg.get("max_num_batched_tokens", 2048),
        num_gpu_blocks_override=cfg.get("num_blocks", 256), kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=cfg.get("prefix_caching", True),
    )
    if cfg.get("tp", 1) > 1:
        kw.update(tensor_parallel_size=cfg["tp"], distributed_executor_backend="mp")
    if cfg.get("mode") is not None:
        # Without "check_invariants" the connector follows VTOKEN_DEBUG_INVARIANTS (run_vllm passes the suite's).
        extra = {"mode": cfg["mode"]}
        for k in ("policy", "policy_config", "reclaim", "check_invariants", "full_decode_graphs"):
            if k in cfg:
                extra[k] = cfg[k]
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="VTokenConnector", kv_connector_module_path="vtoken.integrations.vllm.connector",
            kv_role="kv_both", kv_connector_extra_config=extra,
        )
    if cfg.get("async_scheduling"):
        _lift_cpu_async_override()
        kw["async_scheduling"] = True
    t1 = time.perf_counter()
    llm = LLM(**kw)
    t2 = time.perf_counter()
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.get("max_tokens", 64), ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts_for(cfg)]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    t3 = time.perf_counter()
    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    conn = sched.connector
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "backend": _backend_name(core),
        "runner": _runner_name(core),
        "tp": cfg.get("tp", 1),
        "stats": conn.stats() if conn is not None else {},
        "scheduler": type(sched).__name__,
        "vtoken_plugin_loaded": _vtoken_plugin_loaded(),
        "num_gpu_blocks": int(pool.num_gpu_blocks),
        "free_blocks_end": int(pool.get_num_free_blocks()),
        "times": {"import_s": t1 - t0, "init_s": t2 - t1, "generate_s": t3 - t2},
    }
    if conn is not None:
        side = conn.scheduler_side
        result["headroom_held_end"] = side.alloc.held
        result["table_requests_end"] = len(side.table.requests())
        side.shutdown()  # the stash goes back to vLLM
        result["free_blocks_after_shutdown"] = int(pool.get_num_free_blocks())
        side.ledger.check_conservation()
    return result


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    if cfg.get("model_runner_v2"):  # first: before anything imports vLLM or defines a Triton kernel
        _enable_model_runner_v2_on_cpu()
    if cfg.get("make_model", True) and not os.path.exists(os.path.join(cfg["model_dir"], "config.json")):
        make_tiny_llama(cfg["model_dir"])
    print("VTOKEN_RESULT " + json.dumps(run(cfg)), flush=True)
