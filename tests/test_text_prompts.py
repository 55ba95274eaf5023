"""Prompt files, the shipped prompt set, the quality metrics and the policy defaults, without a model."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from vtoken import policies
from vtoken.errors import InvalidArgumentError
from vtoken.experiments.prompts import parse_prompt_line, read_prompts, shipped_prompts, text_prompts, \
    workload_prompts
from vtoken.experiments.quality import differing_tokens, first_divergence, rouge_l_f1


def test_prompt_lines_plain_text_chat_lists_and_message_objects(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    f = tmp_path / "p.txt"
    f.write_text("Name a river.\n\n" + json.dumps(chat) + "\n" + json.dumps({"messages": chat}) + "\n[not json\n")
    got = read_prompts(str(f))
    assert got == [[{"role": "user", "content": "Name a river."}], chat, chat,
                   [{"role": "user", "content": "[not json"}]]
    assert parse_prompt_line("   ", "x") is None
    with pytest.raises(InvalidArgumentError, match=r"line 1\)\[0\]"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps([{"role": "user"}]) + "\n")
        read_prompts(str(bad))
    with pytest.raises(InvalidArgumentError, match="prompts: expected a readable file"):
        read_prompts(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(InvalidArgumentError, match="at least one prompt"):
        read_prompts(str(empty))
    with pytest.raises(InvalidArgumentError, match="got both"):
        text_prompts("a", str(f))
    assert text_prompts("Hello") == [[{"role": "user", "content": "Hello"}]] and text_prompts() is None


def test_the_shipped_set_holds_24_to_32_distinct_user_prompts():
    got = shipped_prompts()
    assert 24 <= len(got) <= 32
    texts = [p[-1]["content"] for p in got]
    assert len(set(texts)) == len(texts) and all(p[-1]["role"] == "user" for p in got)
    lengths = sorted(len(t) for t in texts)
    assert lengths[0] < 80 and lengths[-1] > 600  # short and long


def test_random_prompts_without_a_tokenizer_and_text_needs_one():
    ids = workload_prompts(3, length=5, vocab_size=50, seed=1)
    assert [p.shape for p in ids] == [(5,)] * 3 and all(p.dtype == np.int64 for p in ids)
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        workload_prompts(2, texts=[[{"role": "user", "content": "x"}]], length=5, vocab_size=50)


def test_quality_metrics_by_their_definitions():
    assert rouge_l_f1("The cat sat on the mat.", "the cat lay on the mat") == pytest.approx(2 * (5 / 6) ** 2 / (5 / 3))
    assert rouge_l_f1("a b c", "a b c") == 1.0 and rouge_l_f1("x", "y") == 0.0 and rouge_l_f1("", "") == 1.0
    assert rouge_l_f1("", "words") == 0.0
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2 and first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [1]) == 0
    assert differing_tokens([1, 2, 3], [1, 5, 3, 4]) == 2 and differing_tokens([7], [7]) == 0


def test_every_policy_protects_four_sinks_by_default_and_a_low_cap_is_raised_with_a_warning():
    rng = np.random.default_rng(0)
    ids = np.arange(200)
    for name in policies.available():
        p = policies.get(name, budget=0.5, window=8)
        assert p.sink == 4, name
        acc = p.make_accumulator()
        if acc is not None:  # the sinks get the LOWEST scores: only protection keeps them
            acc.update(ids, np.where(ids < 4, 0.0, rng.random(200) + 1.0))
        votes = np.where(ids < 4, 0.0, rng.random(200) + 1.0) if p.score_source == "window" else None
        victims = p.select_victims(p.view(0, 0, ids, num_new=1, scores=acc, window_scores=votes))
        assert victims.size > 0 and not np.isin(victims, np.arange(4)).any(), name
    with pytest.warns(policies.BudgetRaisedWarning, match=r"cap 10 < sink \+ window = 36; raised to 36"):
        p = policies.get("h2o", budget=10)
    assert p.budget.cap == 36
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert policies.get("h2o", budget=36).budget.cap == 36  # at the bound: no warning


def test_decision_plan_at_decode_and_at_prefill():
    decides, num_new = policies.decision_plan("decode", [5, 1], [True, False])
    assert decides.tolist() == [True, True] and num_new.tolist() == [5, 1]
    decides, num_new = policies.decision_plan("prefill", [5, 1], [True, False])
    assert decides.tolist() == [True, False] and num_new.tolist() == [1, 1]
    with pytest.raises(InvalidArgumentError, match="at: expected one of"):
        policies.decision_plan("later", [1], [True])
    with pytest.raises(InvalidArgumentError, match="snapkv.at: expected one of"):
        policies.get("snapkv", at="decode")
    assert policies.get("snapkv").at == "prefill" and policies.get("h2o").at == "decode"
    assert policies.get("tova", at="prefill").max_victims_per_step is None
    assert policies.get("tova").max_victims_per_step == 1


# ---------------------------------------------------------------- bad input: typed, one line
@pytest.mark.parametrize("content, match", [
    (b"Name a river.\n\xff\xfe oops\n", r"prompts \(p.txt line 2\): expected UTF-8 text, got the byte b'\\xff'"),
    (b"[" * 100000 + b"]" * 100000 + b"\n", r"prompts \(p.txt line 1\): expected chat messages .* nested too deeply"),
    (json.dumps([{"role": "wizard", "content": "hi"}]).encode() + b"\n",
     r"prompts \(p.txt line 1\)\[0\]\.role: expected one of \('system', 'user', 'assistant', 'tool'\), got 'wizard'"),
    (json.dumps([{"role": "user", "content": "a\ud800b"}]).encode() + b"\n",
     r"prompts \(p.txt line 1\)\[0\]\.content: expected valid Unicode text, got a lone surrogate '\\ud800' at index 1"),
])
def test_a_bad_prompt_file_is_refused_naming_the_line(tmp_path, content, match):
    bad = tmp_path / "p.txt"
    bad.write_bytes(content)
    with pytest.raises(InvalidArgumentError, match=match):
        read_prompts(str(bad))


def test_chat_messages_check_role_and_text():
    from vtoken.checkpoints.tokenizer import check_messages, check_text

    with pytest.raises(InvalidArgumentError, match=r"m\[1\]\.role: expected one of"):
        check_messages("m", [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}])
    with pytest.raises(InvalidArgumentError, match=r"t: expected valid Unicode text, got a lone surrogate"):
        check_text("t", "ok \udfff")
    assert check_messages("m", [{"role": "system", "content": "é"}]) == [{"role": "system", "content": "é"}]


@pytest.mark.parametrize("ids", [bytearray(b"\x01\x02"), b"\x01\x02", memoryview(b"\x01\x02")])
def test_bytes_are_never_token_ids(ids):
    from vtoken.errors import InvalidTypeError, as_index_array

    with pytest.raises(InvalidTypeError, match=r"prompt: expected integer ids .* \(decode bytes to str first\)"):
        as_index_array("prompt", ids)
