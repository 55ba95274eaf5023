"""Text prompts for the engine experiments: the shipped chat set, files, and random ids for random models.

- :func:`shipped_prompts`: 28 chat prompts written for vtoken (``prompts.jsonl``
  next to this module): short instructions, facts, stories, and long ones that
  read a passage, plan or calculate, so prompts run from a few dozen to a few
  hundred tokens through SmolLM2's chat template.
- :func:`read_prompts`: a file of prompts. A line that parses as JSON is a
  list of chat messages (``[{"role": "user", "content": "..."}]``) or an
  object with a ``"messages"`` list; any other non-empty line is one user
  message. Blank lines are skipped.
- :func:`workload_prompts`: what an experiment serves: the given text prompts
  (or the shipped set when the model has a tokenizer), encoded and cycled to
  the request count; random token ids for a random-weight model.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import numpy as np

from vtoken.errors import InvalidArgumentError

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts.jsonl")


def _user(text: str) -> list:
    return [{"role": "user", "content": text}]


def parse_prompt_line(line: str, where: str):
    """One line of a prompt file as chat messages (see module docstring); None for a blank line."""
    from vtoken.checkpoints.tokenizer import check_messages, check_text

    text = line.strip()
    if not text:
        return None
    if text[0] in "[{":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return _user(text)  # a prompt that merely starts with a bracket
        except RecursionError:  # NOTE: json recurses per nesting level; a deep line would crash the reader
            raise InvalidArgumentError(f"{where}: expected chat messages (a list of {{'role', 'content'}} objects), "
                                       f"got JSON nested too deeply to read") from None
        messages = obj.get("messages") if isinstance(obj, dict) else obj
        return check_messages(where, messages)
    return _user(check_text(where, text))


def read_prompts(path: str) -> list:
    """Every prompt of a file, as chat messages (see module docstring)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise InvalidArgumentError(f"prompts: expected a readable file of prompts, got {path!r}")
    out = []
    with open(path, "rb") as f:
        raw = f.read()
    name = os.path.basename(os.fspath(path))
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise InvalidArgumentError(f"prompts ({name} line {line}): expected UTF-8 text, got the byte "
                                   f"{raw[e.start:e.start + 1]!r} at offset {e.start}") from None
    # the lines text mode would give (universal newlines), not str.splitlines' wider set
    for i, line in enumerate(content.replace("\r\n", "\n").replace("\r", "\n").split("\n"), 1):
        msgs = parse_prompt_line(line, f"prompts ({name} line {i})")
        if msgs is not None:
            out.append(msgs)
    if not out:
        raise InvalidArgumentError(f"prompts: expected at least one prompt in {path!r}, got none")
    return out


def shipped_prompts() -> list:
    """The shipped chat prompt set (28 prompts)."""
    return read_prompts(SHIPPED)


def text_prompts(prompt: Optional[str] = None, prompts_file: Optional[str] = None) -> Optional[list]:
    """The CLI's ``--prompt TEXT`` / ``--prompts FILE`` as chat messages (None when neither is given)."""
    if prompt is not None and prompts_file is not None:
        raise InvalidArgumentError("prompt: expected --prompt or --prompts, got both")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidArgumentError(f"prompt: expected a non-empty text, got {prompt!r}")
        return [_user(prompt)]
    return None if prompts_file is None else read_prompts(prompts_file)


def workload_prompts(n: int, *, tokenizer=None, texts: Optional[Sequence] = None, length: int = 0,
                     vocab_size: int = 0, seed: int = 0) -> list:
    """``n`` prompts as int64 token ids (see module docstring): texts need a tokenizer."""
    if texts is not None and tokenizer is None:
        raise InvalidArgumentError("prompts: expected a model with a tokenizer for text prompts "
                                   "(--model NAME or --model-path DIR), got a random-weight preset")
    if tokenizer is None:
        rng = np.random.default_rng(seed)
        return [rng.integers(0, vocab_size, length, dtype=np.int64) for _ in range(n)]
    encoded = [tokenizer.encode(t) for t in workload_texts(texts)]
    return [encoded[i % len(encoded)] for i in range(n)]


def workload_texts(texts: Optional[Sequence] = None, n: Optional[int] = None) -> list:
    """The chat prompts a real model serves (``texts``, or the shipped set), cycled to ``n`` when given:
    the texts behind :func:`workload_prompts`' ids, in the same order."""
    texts = list(shipped_prompts() if texts is None else texts)
    return texts if n is None else [texts[i % len(texts)] for i in range(n)]
