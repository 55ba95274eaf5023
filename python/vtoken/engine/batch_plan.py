"""Batch composition of one engine step: who runs, how many tokens each, whose prompt completes.

Plain data in, plain data out (no model, runner or table): the embedded
:class:`~vtoken.engine.scheduler.Engine` executes a :class:`BatchPlan`, and a
model-free driver can replay the same scheduling over a modeled clock.

Two rules, chosen by ``BatchLimits.chunked``:

* **Whole prompts** (the default, the engine's behavior before chunking):
  waiting requests are admitted FIFO while their prompt's blocks fit the free
  blocks, the running set stays within ``max_num_reqs`` and the admitted
  prompts together within ``max_num_tokens``. If any is admitted, the step is
  their prefill; otherwise every running request decodes one token.
* **Chunked prefill** (vLLM's ``max_num_batched_tokens``): ``max_num_tokens``
  is the step's token budget, spent in this order:

  1. every decoding request gets its one token (``max_num_tokens >=
     max_num_reqs`` is required, so they always fit);
  2. partially prefilled prompts continue, in admission order;
  3. waiting requests are admitted FIFO, with the whole-prompt rules for
     blocks and ``max_num_reqs`` (the blocks the partial prompts still have to
     open are counted as taken), each starting with a chunk of what is left.

  A prompt with ``r`` tokens left and ``a`` tokens of budget left gets ``r``
  if ``r <= a`` (this step completes it), else ``min(a, r - min_final_chunk)``:
  a chunk never leaves a remainder shorter than ``min_final_chunk``, so the
  step that completes a prompt runs at least its last ``min_final_chunk``
  tokens (the engine sets SnapKV's observation window: its votes come from the
  last ``window`` queries of that step, as in an unchunked prefill). A prompt
  that can get no such chunk waits, and nothing behind it is scheduled (FIFO:
  a later, shorter prompt never overtakes it, so it cannot starve).

Example::

    >>> limits = BatchLimits(max_num_reqs=4, max_num_tokens=8, block_size=4, chunked=True)
    >>> running = [SeqState("a", prompt_len=5, prefilled=5), SeqState("b", prompt_len=20, prefilled=4)]
    >>> plan = plan_batch(running, [SeqState("c", prompt_len=6)], limits, free_blocks=10)
    >>> [(c.request_id, c.num_tokens, c.completes_prompt) for c in plan.chunks], plan.kind
    ([('a', 1, False), ('b', 7, False)], 'mixed')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from vtoken import cdiv
from vtoken.errors import InvalidArgumentError, InvalidTypeError, check_int

__all__ = ["BatchLimits", "BatchPlan", "Chunk", "SeqState", "chunk_size", "plan_batch"]


@dataclass(frozen=True)
class BatchLimits:
    """The scheduler's limits (see the module docstring for how each is used)."""

    max_num_reqs: int
    max_num_tokens: int
    block_size: int
    chunked: bool = False
    min_final_chunk: int = 0

    def __post_init__(self):
        for name in ("max_num_reqs", "max_num_tokens", "block_size"):
            check_int(name, getattr(self, name), min_value=1)
        check_int("min_final_chunk", self.min_final_chunk)
        if not isinstance(self.chunked, bool):
            raise InvalidTypeError(f"chunked: expected a bool, got {type(self.chunked).__name__}")
        if self.chunked and self.max_num_tokens < self.max_num_reqs:
            raise InvalidArgumentError(f"max_num_tokens: expected >= max_num_reqs ({self.max_num_reqs}) with chunked "
                                       f"prefill (every decode token fits the step's budget), got {self.max_num_tokens}")
        if self.chunked and self.max_num_tokens < self.min_final_chunk:
            raise InvalidArgumentError(f"max_num_tokens: expected >= min_final_chunk ({self.min_final_chunk}, e.g. "
                                       f"SnapKV's window: a prompt's last chunk holds it) with chunked prefill, got "
                                       f"{self.max_num_tokens}")


@dataclass(frozen=True)
class SeqState:
    """One request as the planner sees it: its prompt (everything to recompute after a preemption) and how
    much of it has run. ``prefilled == prompt_len``: the request decodes."""

    request_id: Hashable
    prompt_len: int
    prefilled: int = 0

    @property
    def remaining(self) -> int:
        return self.prompt_len - self.prefilled


def owed_blocks(running, block_size: int) -> int:
    """The blocks the partial prompts among ``running`` (SeqStates) have yet to open (0 for a decoder)."""
    return sum(cdiv(r.prompt_len, block_size) - cdiv(r.prefilled, block_size) for r in running if r.remaining > 0)


@dataclass(frozen=True)
class Chunk:
    """One request's share of a step: ``num_tokens`` new tokens; ``decode``: one token after its prompt;
    ``completes_prompt``: this step runs the last prompt token (the request samples its first token);
    ``admitted``: the request is new this step."""

    request_id: Hashable
    num_tokens: int
    decode: bool = False
    completes_prompt: bool = False
    admitted: bool = False

    @property
    def samples(self) -> bool:
        """The step gives the request a next token (a mid-prompt chunk's logits are ignored)."""
        return self.decode or self.completes_prompt


@dataclass(frozen=True)
class BatchPlan:
    """A step's composition: the running requests' chunks in running order, then the admitted ones (FIFO)."""

    chunks: tuple

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def admitted(self) -> list:
        return [c.request_id for c in self.chunks if c.admitted]

    @property
    def kind(self) -> str:
        """``"decode"`` (only decode tokens, or nothing to run), ``"prefill"`` (only prompt chunks) or ``"mixed"``."""
        decodes = sum(c.decode for c in self.chunks)
        return "decode" if decodes == len(self.chunks) else "prefill" if decodes == 0 else "mixed"


def chunk_size(remaining: int, available: int, min_final_chunk: int = 0) -> int:
    """Tokens a prompt with ``remaining`` tokens left runs when ``available`` budget tokens are left (0: wait)."""
    if remaining <= available:
        return remaining
    return max(0, min(available, remaining - min_final_chunk))


def plan_batch(running: Sequence[SeqState], waiting: Sequence[SeqState], limits: BatchLimits, *,
               free_blocks: int, backpressure: bool = False) -> BatchPlan:
    """The next step's :class:`BatchPlan`.

    ``running``: the running requests in admission order; ``waiting``: the
    queue, first to admit first (their ``prefilled`` is 0); ``free_blocks``:
    the blocks admission may take; ``backpressure``: admit nothing.
    """
    if not isinstance(limits, BatchLimits):
        raise InvalidTypeError(f"limits: expected a BatchLimits, got {type(limits).__name__}")
    free_blocks = check_int("free_blocks", free_blocks, min_value=-(1 << 62))
    if limits.chunked:
        return _plan_chunked(running, waiting, limits, free_blocks, backpressure)
    admitted = [] if backpressure else _admit(waiting, limits, len(running), free_blocks, limits.max_num_tokens)
    if admitted:
        return BatchPlan(tuple(admitted))
    return BatchPlan(tuple(Chunk(r.request_id, 1, decode=True) for r in running))


def _admit(waiting, limits: BatchLimits, num_running: int, free_blocks: int, tokens: int) -> list:
    """FIFO admission: whole prompts' blocks within ``free_blocks``, chunks within ``tokens`` (budget left)."""
    admitted = []
    for req in waiting:
        if num_running + len(admitted) >= limits.max_num_reqs:
            break
        need = cdiv(req.prompt_len, limits.block_size)
        n = chunk_size(req.prompt_len, tokens, limits.min_final_chunk) if limits.chunked else req.prompt_len
        if need > free_blocks or n == 0 or n > tokens:
            break
        free_blocks -= need
        tokens -= n
        admitted.append(Chunk(req.request_id, n, completes_prompt=n == req.prompt_len, admitted=True))
    return admitted


def _plan_chunked(running, waiting, limits: BatchLimits, free_blocks: int, backpressure: bool) -> BatchPlan:
    S = limits.block_size
    tokens = limits.max_num_tokens - sum(r.remaining == 0 for r in running)
    sizes, blocked = {}, False
    for r in running:
        if r.remaining > 0 and not blocked:
            n = chunk_size(r.remaining, tokens, limits.min_final_chunk)
            blocked = n == 0
            sizes[r.request_id] = n
            tokens -= n
    chunks = []
    for r in running:
        if r.remaining == 0:
            chunks.append(Chunk(r.request_id, 1, decode=True))
        elif sizes.get(r.request_id, 0):
            n = sizes[r.request_id]
            chunks.append(Chunk(r.request_id, n, completes_prompt=n == r.remaining))
    if not (backpressure or blocked) and tokens > 0:
        # The blocks the partial prompts still open are theirs: admission checked them whole.
        chunks += _admit(waiting, limits, len(running), free_blocks - owed_blocks(running, S), tokens)
    return BatchPlan(tuple(chunks))
