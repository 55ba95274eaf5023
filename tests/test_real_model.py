"""The engine on a real trained model (SmolLM2-135M-Instruct), text in and text out.

The checkpoint is fetched once into ``$VTOKEN_CACHE`` (default
``~/.cache/vtoken``) and exported once next to it, so reruns neither download
nor convert again (a fresh machine does both, about 30 s).

* text API: strings and chat messages in, decoded text out; ``eos_token_id``
  from the checkpoint; bad prompts refused before anything is queued;
* naive == vtoken, token for token, for all six policies in both decision
  modes (``at="prefill"`` and ``at="decode"``), on chat prompts;
* prefill compression keeps exactly ``floor((1 - ratio) L)`` prompt tokens and
  evicts the positions the policy's definition names: StreamingLLM the oldest
  non-sink ones, H2O the lowest accumulated attention (checked against
  ``transformers``' own attention probabilities of the exported model);
* the library's defaults never wreck the text: every policy at evict ratio 0.5
  on 4 short chat prompts gives non-degenerate output (the check:
  :func:`degenerate`), while the setting the defaults replaced (no sink, a
  budget below the window) does wreck it, so the check has teeth.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("safetensors")

from vtoken.engine.pretrained import load_checkpoint  # noqa: E402
from vtoken.engine.scheduler import Engine, EngineConfig  # noqa: E402
from vtoken.errors import InvalidArgumentError  # noqa: E402
from vtoken.experiments.common import paired_run, policy_config  # noqa: E402
from vtoken.experiments.prompts import shipped_prompts  # noqa: E402
from vtoken.policies import available  # noqa: E402

SHORT = [
    [{"role": "user", "content": "List five tips for staying focused while studying."}],
    [{"role": "user", "content": "What is the capital of Japan, and what is it known for?"}],
    [{"role": "user", "content": "Tell a short story about a robot who learns to paint."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
]


@pytest.fixture(scope="module")
def ck():
    torch.set_num_threads(1)
    return load_checkpoint("smollm2", progress=None)


@pytest.fixture(autouse=True)
def torch_attention(monkeypatch):
    monkeypatch.setenv("VTOKEN_BACKEND", "torch")  # the Triton interpreter is far too slow for a 30-layer model


def engine_cfg(ck, prompts, max_new, **kw):
    lens = [len(p) for p in prompts]
    blocks = sum(-(-(n + max_new) // 16) for n in lens) + 64
    return dict(num_blocks=blocks, block_size=16, max_num_reqs=len(prompts),
                max_num_tokens=max(sum(lens), max(lens) + max_new), **kw)


def degenerate(text: str, tokens) -> str:
    """Why an output is degenerate, or '' if it is not. Degenerate: a token repeated more than 8 times in a row,
    fewer than 3 words, or, from 12 words on, fewer than a third of them distinct (a loop such as "a silent one,
    a silent one, ..."). A short correct answer ("The capital of Japan is Tokyo.") passes."""
    run, longest = 1, 1
    for a, b in zip(tokens, tokens[1:]):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    if longest > 8:
        return f"a token repeated {longest} times in a row"
    words = re.findall(r"[a-z]+", text.lower())
    if len(words) < 3:
        return f"only {len(words)} words"
    if len(words) >= 12 and len(set(words)) < len(words) / 3:
        return f"{len(set(words))} distinct words of {len(words)}"
    return ""


# ----------------------------------------------------------------------------- text in, text out
def test_text_and_chat_prompts_decode_to_text_and_stop_at_the_checkpoints_eos(ck):
    assert ck.eos_token_id == ck.tokenizer.eos_token_id == 2  # <|im_end|>, from the GGUF's metadata
    eng = Engine(ck.model, EngineConfig(mode="native", num_blocks=64, eos_token_id=ck.eos_token_id),
                 tokenizer=ck.tokenizer)
    out = eng.generate([[{"role": "user", "content": "What is the capital of France?"}], "The capital of France is"],
                       32)
    chat, plain = out
    assert "Paris" in chat.text and chat.output[-1] == 2 and len(chat.output) < 32  # stopped at the end of turn
    assert chat.text == ck.tokenizer.hf.decode(chat.output[:-1], skip_special_tokens=True)
    assert plain.text == ck.tokenizer.decode(plain.output) and "Paris" in plain.text
    # one chat alone is one prompt; the chat template opened the assistant's turn
    ids = ck.tokenizer.encode(SHORT[0])
    assert ck.tokenizer.hf.decode(ids).endswith("<|im_start|>assistant\n")
    # Engine.from_pretrained reads eos from the checkpoint (the cached export here)
    eng2 = Engine.from_pretrained("smollm2", EngineConfig(mode="native", num_blocks=64))
    assert eng2.config.eos_token_id == 2 and eng2.tokenizer is not None


def test_bad_prompts_are_refused_before_anything_is_queued(ck):
    eng = Engine(ck.model, EngineConfig(mode="native", num_blocks=64), tokenizer=ck.tokenizer)
    with pytest.raises(InvalidArgumentError, match=r"prompts\[1\]\[0\]"):
        eng.generate(["fine", [{"role": "user"}]], 4)  # the second is a chat with a message without content
    with pytest.raises(InvalidArgumentError, match=r"prompts\[0\]: expected a non-empty string"):
        eng.generate([""], 4)
    with pytest.raises(InvalidArgumentError, match=r"prompts\[1\]: expected a request that fits the block budget"):
        eng.generate(["fine", "word " * 2000], 4)  # the first is valid: nothing may be queued either
    assert not eng.has_work() and not eng.requests
    bare = Engine(ck.model, EngineConfig(mode="native", num_blocks=64))
    with pytest.raises(InvalidArgumentError, match="no tokenizer"):
        bare.generate(["hello"], 4)


# ----------------------------------------------------------------------------- naive == vtoken
NEW = 8  # tokens per request: the decode-mode policies evict from the first decode steps on (window 8)


@pytest.mark.parametrize("at", ["decode", "prefill"])
def test_naive_equals_vtoken_for_every_policy_on_the_real_model(ck, at):
    prompts = [ck.tokenizer.encode(c) for c in SHORT[:2]]  # ~40 tokens: window 8 lets prefill mode evict too
    cfg = engine_cfg(ck, prompts, NEW, eos_token_id=ck.eos_token_id)
    checked = 0
    for name in available():
        if name == "snapkv" and at == "decode":
            continue  # SnapKV is defined at the end of the prompt only
        pcfg = policy_config(name, 0.5, window=8, at=at)
        runs = paired_run(ck.model, prompts, NEW, modes=("naive", "vtoken"), policy=name, policy_cfg=pcfg,
                          engine_cfg=cfg)
        assert runs["naive"].outputs == runs["vtoken"].outputs, name
        assert runs["naive"].evicted_tokens > 0, name
        checked += 1
    assert checked == (6 if at == "prefill" else 5)


# ----------------------------------------------------------------------------- prefill compression
def _prefill_victims(ck, policy, prompt, ratio=0.5, window=8):
    eng = Engine(ck.model, EngineConfig(mode="vtoken", num_blocks=64, policy=policy,
                                        policy_config=policy_config(policy, ratio, window=window, at="prefill")),
                 record_trace=True)
    eng.generate([prompt], 4)
    dec = eng.trace.decisions
    assert len(dec) == 1 and dec[0].step == len(prompt)  # one decision, when the prompt completed; none after
    return np.asarray(dec[0].token_ids)


def test_prefill_mode_keeps_exactly_the_budget_and_evicts_what_each_policy_defines(ck):
    from transformers import AutoModelForCausalLM

    chat = next(p for p in shipped_prompts() if len(p[0]["content"]) > 600)
    prompt = ck.tokenizer.encode(chat)
    L, sink, window = len(prompt), 4, 8
    keep = int(L * 0.5)
    cand = np.arange(sink, L - window)
    # StreamingLLM: the oldest non-sink tokens go
    v = _prefill_victims(ck, "streamingllm", prompt)
    assert L - len(v) == keep and np.array_equal(v, cand[: L - keep])
    # H2O: the lowest accumulated attention of the prompt's queries (all layers, heads, queries), per transformers
    hf = AutoModelForCausalLM.from_pretrained(ck.source, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        att = hf(torch.from_numpy(prompt)[None], output_attentions=True).attentions
    mass = sum(a[0].double().sum(dim=(0, 1)) for a in att).numpy()  # [L] keys
    del hf
    v = _prefill_victims(ck, "h2o", prompt)
    assert L - len(v) == keep and np.isin(v, cand).all()
    kept = np.setdiff1d(cand, v)
    # the victims are the lowest-mass candidates (float32 sums in another order: a relative 1e-4 margin)
    assert mass[v].max() <= mass[kept].min() * (1 + 1e-4)
    # TOVA drops the whole excess at once in prefill mode (its one-per-step rule is a decode rule)
    v = _prefill_victims(ck, "tova", prompt)
    assert L - len(v) == keep and np.isin(v, cand).all()


# ----------------------------------------------------------------------------- defaults never wreck output
ANSWER = 24  # tokens per answer at most: the evicting policies act from the first decode step on
def test_default_settings_never_wreck_the_text_and_the_old_ones_did(ck):
    prompts = [ck.tokenizer.encode(c) for c in SHORT]
    cfg = engine_cfg(ck, prompts, ANSWER, eos_token_id=ck.eos_token_id)  # an answer ends at its end of turn
    for name in available():
        eng = Engine(ck.model, EngineConfig(mode="vtoken", policy=name, policy_config=policy_config(name, 0.5),
                                            **cfg), tokenizer=ck.tokenizer)
        for r in eng.generate(prompts, ANSWER):
            why = degenerate(r.text, r.output)
            assert not why, f"{name}: {why}: {r.text!r}"
    # the settings the defaults replaced (no sink, window 32 > the budget): position 0 goes, the text breaks
    eng = Engine(ck.model, EngineConfig(mode="vtoken", policy="h2o", policy_config={"budget": 0.5, "window": 32,
                                                                                     "sink": 0}, **cfg),
                 tokenizer=ck.tokenizer)
    broken = [degenerate(r.text, r.output) for r in eng.generate(prompts, ANSWER)]
    assert any(broken), "expected the sinkless config to degenerate at least one answer"


# ----------------------------------------------------------------------------- the CLI on the real model
def test_demo_and_quality_json_on_the_real_model(ck, capsys):
    import json

    from vtoken.cli import main

    # the CLI loads through the same cache as the fixture did ($VTOKEN_CACHE or ~/.cache/vtoken): no fetch again
    assert main(["demo", "--model", "smollm2", "--requests", "2", "--output-len", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["identical"] is True and got["modes"]["vtoken"]["identical"] is True
    for mode in ("native", "naive", "vtoken"):
        texts = got["modes"][mode]["texts"]
        assert len(texts) == 2 and all(isinstance(t, str) and t for t in texts)
    assert got["prompts"][0] == shipped_prompts()[0][0]["content"]
    assert main(["quality", "--policies", "h2o,snapkv", "--ratios", "0.5", "--prompt", "Name three rivers in Europe.",
                 "--max-new-tokens", "8", "--window", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    rows = {(r["policy"], r["at"]): r for r in got["rows"]}
    assert set(rows) == {("h2o", "prefill"), ("h2o", "decode"), ("snapkv", "prefill")}  # SnapKV: prefill only
    assert got["naive_vs_vtoken_identical"] is True
    for r in rows.values():
        assert r["naive_vs_vtoken_tokens"] == 0 and 0 <= r["exact_match"] <= 1 and 0 <= r["rouge_l"] <= 1
        assert r["evicted_tokens"] > 0
