"""End to end with vLLM 0.32's ``LLM.generate`` on CPU: a random-weight tiny Llama saved locally.

Each configuration runs in its own process (``tests/vllm_e2e_helper.py``):
vLLM caches its attention-backend choice per process, and a fresh engine per
run keeps the runs independent. All runs are greedy, on token-id prompts.

- (a) installed but not configured, vtoken changes nothing (vanilla vLLM
  gives the tokens of a run without vtoken's plugin); the plugin in native
  mode is token-identical to vanilla vLLM (CPU_ATTN);
- (b) with H2O, naive and vtoken are token-identical, vtoken relocates and
  holds fewer blocks (read from vLLM's BlockPool), and eviction really changes
  the outputs (the attention reads only live tokens);
- (c) a long run with many requests, admission pressure and preemptions
  leaks no block: the pool is full again at the end;
- (e) outputs do not depend on how prompts are chunked: a small
  ``max_num_batched_tokens`` splits every prefill, naive gives the tokens of
  whole prefills, and vtoken those of naive (no eviction mid-prefill);
- (f) vLLM's async scheduling (the CPU platform's override lifted inside the
  run): the AsyncScheduler schedules step N+1 before step N's output arrives;
  naive == vtoken == the synchronous runs, and no block leaks;
- (g) vLLM's Model Runner V2 (its CPU runner; V2's own Triton kernels run in
  Triton's interpreter behind a stand-in "cpu" backend, inside the run):
  naive == vtoken == the V1 runs, and no block leaks;
- (h) ``full_decode_graphs`` (fixed slot lists sized by the KV cache's
  slots, no prefix caching; decode batches on the decode kernel path): the
  default run's tokens (the CPU runs no CUDA
  graph: this checks what the option changes outside the graph);
- (d) tensor parallel 2 (two CPU workers over gloo) gives the tokens, the
  evictions and the relocations of tensor parallel 1: the ranks' attention
  scores are summed, every rank copies its own KV heads.

Skipped when vllm is not installed (``.ci/vllm_tests.sh`` installs it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vtoken.integrations.vllm import vllm_available

VLLM_OK, VLLM_WHY = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_OK, reason=f"needs vllm 0.32: {VLLM_WHY}")]

HELPER = os.path.join(os.path.dirname(__file__), "vllm_e2e_helper.py")
PROMPTS = {"num_prompts": 4, "prompt_len": [60, 100], "max_tokens": 48, "duplicate": [[0, 3]]}
H2O = {"policy": "h2o", "policy_config": {"budget": 0.5, "window": 8, "sink": 0}}
RECLAIM = {"low_watermark": 1.0, "check_interval": 1, "headroom_blocks": 4, "theta_F": 0.1}


def run_vllm(cfg: dict, **extra_env) -> dict:
    env = dict(os.environ)
    env.update(extra_env)
    # The CPU build has no Triton backend: inside vLLM, vtoken's ops use the
    # C++ CPU ops / torch references, not the Triton interpreter the unit tests use.
    env.pop("TRITON_INTERPRET", None)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vtoken's debug checks follow the suite: on (tests/conftest.py), off in
    # .ci/vllm_tests.sh's production lane.
    env.setdefault("VTOKEN_DEBUG_INVARIANTS", "1")
    proc = subprocess.run([sys.executable, HELPER, json.dumps(cfg)], capture_output=True, text=True, env=env,
                          timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VTOKEN_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"vLLM run failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("VTOKEN_RESULT "):])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vllm_e2e_helper import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama_e2e")))


@pytest.fixture(scope="module")
def runs(model_dir):
    """Every configuration once (about 30 s each on a 2-core machine)."""
    base = {"model_dir": model_dir, "make_model": False, **PROMPTS}
    out = {
        # CPU_ATTN needs block sizes that are multiples of 32.
        "vanilla": run_vllm({**base, "block_size": 32}),
        # vLLM loads only the general plugins VLLM_PLUGINS names: none of vtoken's here.
        "without_vtoken": run_vllm({**base, "block_size": 32}, VLLM_PLUGINS="no-such-plugin"),
        "native": run_vllm({**base, "block_size": 32, "mode": "native"}),
        "naive": run_vllm({**base, "block_size": 16, "mode": "naive", **H2O, "reclaim": RECLAIM}),
        "vtoken": run_vllm({**base, "block_size": 16, "mode": "vtoken", **H2O, "reclaim": RECLAIM}),
    }
    print("\nvLLM e2e:", json.dumps({k: {"stats": v["stats"], "times": v["times"]} for k, v in out.items()}))
    return out


def test_a_native_mode_is_token_identical_to_vanilla_vllm(runs):
    # Installed but not configured, vtoken changes nothing: the same tokens as without its plugin.
    assert runs["vanilla"]["vtoken_plugin_loaded"] and not runs["without_vtoken"]["vtoken_plugin_loaded"]
    assert runs["vanilla"]["outputs"] == runs["without_vtoken"]["outputs"]
    assert runs["vanilla"]["backend"] == runs["without_vtoken"]["backend"] == "CPUAttentionBackend"
    assert runs["native"]["backend"] == "VTokenAttentionBackend"
    assert runs["native"]["outputs"] == runs["vanilla"]["outputs"]
    assert all(len(o) == PROMPTS["max_tokens"] for o in runs["native"]["outputs"])
    assert runs["native"]["stats"]["evicted_tokens"] == 0


def test_b_naive_and_vtoken_are_token_identical_and_vtoken_holds_fewer_blocks(runs):
    naive, vt = runs["naive"], runs["vtoken"]
    assert naive["backend"] == vt["backend"] == "VTokenAttentionBackend"
    assert vt["outputs"] == naive["outputs"]
    # Eviction is real: attention over the live tokens changes what is generated.
    assert naive["outputs"] != runs["native"]["outputs"]
    sn, sv = naive["stats"], vt["stats"]
    assert sn["evicted_tokens"] == sv["evicted_tokens"] > 0
    assert sv["relocations"] > 0 and sv["reclaimed_blocks"] > 0 and sn["relocations"] == 0
    assert sv["steps"] == sn["steps"]
    # Blocks the requests hold, read from vLLM's BlockPool every step (in use minus vtoken's headroom stash).
    assert sv["peak_blocks_held"] < sn["peak_blocks_held"]
    assert sv["sum_blocks_held"] < sn["sum_blocks_held"]
    for r in (naive, vt):
        assert r["free_blocks_after_shutdown"] == r["num_gpu_blocks"] - 1


def test_c_long_run_with_many_requests_leaks_no_block(model_dir):
    cfg = {
        "model_dir": model_dir, "make_model": False, "num_prompts": 24, "prompt_len": [40, 120], "max_tokens": 40,
        "seed": 1, "block_size": 16, "num_blocks": 40, "max_model_len": 512, "max_num_seqs": 6, "mode": "vtoken", **H2O,
        "reclaim": {**RECLAIM, "low_watermark": 0.25, "headroom_blocks": 3},
    }
    r = run_vllm(cfg)
    print("\nvLLM e2e long run:", json.dumps({"stats": r["stats"], "times": r["times"]}))
    assert len(r["outputs"]) == 24 and all(len(o) == 40 for o in r["outputs"])
    st = r["stats"]
    assert st["relocations"] > 0 and st["evicted_tokens"] > 0
    assert r["table_requests_end"] == 0
    # Every block is back: vLLM's free queue plus vtoken's stash, then the stash too.
    assert r["free_blocks_end"] + r["headroom_held_end"] == r["num_gpu_blocks"] - 1
    assert r["free_blocks_after_shutdown"] == r["num_gpu_blocks"] - 1


def test_e_outputs_do_not_depend_on_prefill_chunking(model_dir):
    # NOTE: distinct prompts: a prefix-cache hit skips the hit tokens' own queries, so
    # the scores a policy sees depend on how long the hit is, which chunking changes.
    base = {"model_dir": model_dir, "make_model": False, **PROMPTS, "duplicate": [], "block_size": 16, **H2O,
            "reclaim": RECLAIM}
    whole = run_vllm({**base, "mode": "naive"})
    # Every prompt (60-100 tokens) is prefilled in 2-3 chunks.
    naive = run_vllm({**base, "mode": "naive", "max_num_batched_tokens": 40})
    vt = run_vllm({**base, "mode": "vtoken", "max_num_batched_tokens": 40})
    print("\nvLLM e2e chunked:", json.dumps({k: {"stats": v["stats"]} for k, v in (("naive", naive), ("vtoken", vt))}))
    assert naive["stats"]["steps"] > whole["stats"]["steps"]  # the prefills really were split
    assert naive["outputs"] == whole["outputs"]
    assert vt["outputs"] == naive["outputs"]
    assert vt["stats"]["evicted_tokens"] == naive["stats"]["evicted_tokens"] > 0
    assert vt["stats"]["relocations"] > 0


def test_j_failed_relocation_copies_roll_back_and_change_no_token(model_dir, runs):
    """The worker's 1st and 3rd copies write garbage into their destinations, then raise (docs/vllm.md,
    "Copies and frees"): their plans roll back, nothing reads the garbage, the tokens are naive's."""
    base = {"model_dir": model_dir, "make_model": False, **PROMPTS, "block_size": 16, **H2O, "reclaim": RECLAIM}
    vt = run_vllm({**base, "mode": "vtoken", "fail_copy_launches": [0, 2]})
    st = vt["stats"]
    print("\nvLLM e2e failed copies:", json.dumps({"stats": st, "times": vt["times"]}))
    assert vt["outputs"] == runs["naive"]["outputs"]
    assert st["copies_failed"] == 2 and st["plans_rolled_back"] >= 2
    assert st["copies_confirmed"] > 0 and st["relocations"] > 0  # the other copies committed
    assert st["evicted_tokens"] == runs["naive"]["stats"]["evicted_tokens"]
    assert vt["table_requests_end"] == 0
    assert vt["free_blocks_after_shutdown"] == vt["num_gpu_blocks"] - 1


def run_variant(model_dir, runs, label: str, **variant) -> tuple:
    """naive and vtoken under a vLLM variant: both give the base (synchronous, V1) naive run's tokens, no leak."""
    base = {"model_dir": model_dir, "make_model": False, **PROMPTS, "block_size": 16, **H2O, "reclaim": RECLAIM,
            **variant}
    naive = run_vllm({**base, "mode": "naive"})
    vt = run_vllm({**base, "mode": "vtoken"})
    print(f"\nvLLM e2e {label}:", json.dumps({k: {"stats": v["stats"], "times": v["times"]}
                                             for k, v in (("naive", naive), ("vtoken", vt))}))
    assert naive["backend"] == vt["backend"] == "VTokenAttentionBackend"
    assert vt["outputs"] == naive["outputs"] == runs["naive"]["outputs"]
    assert vt["stats"]["evicted_tokens"] == naive["stats"]["evicted_tokens"] == runs["naive"]["stats"]["evicted_tokens"]
    assert vt["stats"]["relocations"] > 0 and vt["stats"]["reclaimed_blocks"] > 0
    for r in (naive, vt):
        assert r["table_requests_end"] == 0
        assert r["free_blocks_after_shutdown"] == r["num_gpu_blocks"] - 1
    return naive, vt


def test_f_async_scheduling_gives_the_synchronous_tokens_and_leaks_nothing(model_dir, runs):
    naive, vt = run_variant(model_dir, runs, "async", async_scheduling=True)
    assert naive["scheduler"] == vt["scheduler"] == "AsyncScheduler"
    assert runs["naive"]["scheduler"] == "Scheduler"


def test_g_model_runner_v2_gives_the_v1_tokens_and_leaks_nothing(model_dir, runs):
    naive, vt = run_variant(model_dir, runs, "Model Runner V2", model_runner_v2=True)
    assert naive["runner"] == vt["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"  # V2's CPU runner
    assert runs["naive"]["runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"  # the V1 one


def test_h_full_decode_graphs_option_gives_the_same_tokens(model_dir):
    # NOTE: without prefix caching (the option refuses it: its slot lists are sized by the KV
    # cache's slots), so the reference is the default naive run without prefix caching too.
    ref = run_vllm({"model_dir": model_dir, "make_model": False, **PROMPTS, "block_size": 16, **H2O,
                    "reclaim": RECLAIM, "mode": "naive", "prefix_caching": False})
    run_variant(model_dir, {"naive": ref}, "full_decode_graphs", full_decode_graphs=True, prefix_caching=False)


@pytest.mark.slow
def test_d_tensor_parallel_2_matches_tensor_parallel_1(model_dir, runs):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"tensor parallel 2 needs 2 CPUs for its 2 workers, this process may use {len(cpus)}")
    cfg = {"model_dir": model_dir, "make_model": False, **PROMPTS, "block_size": 16, "mode": "vtoken", **H2O,
           "reclaim": RECLAIM, "tp": 2}
    # One core per worker (vLLM's automatic binding wants one NUMA node per worker).
    r = run_vllm(cfg, VLLM_CPU_OMP_THREADS_BIND=f"{cpus[0]}|{cpus[1]}")
    print("\nvLLM e2e TP=2:", json.dumps({"stats": r["stats"], "times": r["times"]}))
    tp1 = runs["vtoken"]
    assert r["tp"] == 2
    assert r["outputs"] == tp1["outputs"]
    for k in ("evicted_tokens", "relocations", "reclaimed_blocks", "peak_blocks_held", "sum_blocks_held"):
        assert r["stats"][k] == tp1["stats"][k], k
    assert r["free_blocks_after_shutdown"] == r["num_gpu_blocks"] - 1


# ----------------------------------------------------------------------------- a real model
REAL_CHATS = [
    "List five tips for staying focused while studying.",
    "What is the capital of Japan, and what is it known for?",
    "Tell a short story about a robot who learns to paint.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.fixture(scope="module")
def smollm2_dir():
    """SmolLM2-135M-Instruct exported as an HF directory (fetched and exported once into vtoken's cache)."""
    pytest.importorskip("gguf")
    from vtoken.checkpoints.loader import exported_dir

    return exported_dir("smollm2")


def test_i_vllm_serves_the_exported_real_model_naive_equals_vtoken(smollm2_dir):
    """vLLM loads vtoken's export of SmolLM2; h2o at ratio 0.5 on 4 chat prompts: naive == vtoken, token for token."""
    from vtoken.checkpoints.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(smollm2_dir)
    ids = [tok.encode([{"role": "user", "content": c}]).tolist() for c in REAL_CHATS]
    base = {"model_dir": smollm2_dir, "make_model": False, "prompt_ids": ids, "max_tokens": 40, "block_size": 16,
            "max_model_len": 512, "num_blocks": 64, "policy": "h2o",
            "policy_config": {"budget": 0.5, "window": 16}, "reclaim": RECLAIM}  # the default sink: 4
    naive = run_vllm({**base, "mode": "naive"})
    vt = run_vllm({**base, "mode": "vtoken"})
    assert vt["outputs"] == naive["outputs"]
    assert naive["stats"]["evicted_tokens"] == vt["stats"]["evicted_tokens"] > 0
    assert vt["stats"]["relocations"] > 0
    texts = [tok.decode(o) for o in vt["outputs"]]
    assert "Tokyo" in texts[1], texts[1]  # a trained model served right, through vLLM's own loader
