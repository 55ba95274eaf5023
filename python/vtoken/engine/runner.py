"""ModelRunner: prefill and decode steps of the embedded engine over vtoken's token table.

The runner owns the paged KV cache and the fixed-address step buffers, and
drives one :class:`~vtoken.engine.model.LlamaModel` step at a time:

1. ``table.sync_new_tokens_batch`` assigns slots to the step's new tokens (the
   slot mapping of their K/V writes); ``None`` (out of blocks) is returned to
   the caller unchanged, so a scheduler can preempt and retry;
2. every request's live slots, in logical order, are packed into the
   fixed-address ``kv_indices`` / ``kv_indptr`` buffers (FlashInfer naming);
3. the model writes the new K/V and attends over exactly the live tokens.

On CUDA the decode step is captured in a CUDA graph per padded batch size
(``graph_batch_sizes``), every size at warm-up (:meth:`ModelRunner.warmup`,
before the first step), so serving only replays. Before each replay the inputs
are overwritten IN PLACE (the buffers never change address); padding requests
get an empty slot list and PAD slot mapping. Relocation (compaction) never runs
inside the graph: the ``StepHooks`` run before and after the forward, on the
compute stream, outside the captured region. On CPU every step runs eager over the same
buffers.

The slot lists come from :class:`vtoken.device.buffers.DeviceMirror` (the device
copy of the token table) and ``ops.build_slot_lists`` into the fixed-address
:class:`vtoken.device.buffers.SlotListBuffers`. The mirror follows the table through
its delta journal, so any table change (the runner's, the reclaimer's moves,
a direct call) reaches the device at the next build.

Example (CPU, tiny random model)::

    >>> import numpy as np
    >>> from vtoken.engine.model import LlamaModel, ModelConfig
    >>> from vtoken.engine.runner import ModelRunner, RunnerConfig
    >>> runner = ModelRunner(LlamaModel(ModelConfig(vocab_size=128)), RunnerConfig(num_blocks=32, block_size=4))
    >>> runner.add_request("a"); runner.add_request("b")
    >>> out = runner.prefill(["a", "b"], [np.array([1, 2, 3]), np.array([4, 5])])
    >>> nxt = out.next_tokens(); nxt.shape
    (2,)
    >>> runner.evict("a", [1])
    >>> out = runner.decode(["a", "b"], nxt); out.logits.shape, out.kv_indptr.tolist()
    (torch.Size([2, 128]), [0, 3, 6])
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Hashable, Optional, Protocol, Sequence

import numpy as np
import torch

from vtoken import PAD_SLOT, cdiv
from vtoken.device.buffers import DeviceMirror, SlotListBuffers
from vtoken.device.copy_engine import StagingRing
from vtoken.engine.kv_cache import KV_LAYOUTS
from vtoken.engine.model import LlamaModel, ModelOutput, StepInputs
from vtoken.errors import InvalidArgumentError, InvalidTypeError, InvariantViolation, as_index_array, check_int, \
    is_int
from vtoken.bookkeeping.ledger import BlockLedger
from vtoken.bookkeeping.pool import BlockPool
from vtoken.device.step_graphs import padded_batch_sizes
from vtoken.bookkeeping.table import TokenTable

PAD = PAD_SLOT


class StepHooks(Protocol):
    """Called around every forward, on the host, outside any CUDA graph.

    ``pre_forward`` runs before the step's inputs are staged (e.g. the
    reclaimer's ``compute_stream.wait_event(E)``); ``post_forward`` runs right
    after the forward was launched (e.g. the stage-aware relocation copy).
    """

    def pre_forward(self, runner: "ModelRunner") -> None: ...

    def post_forward(self, runner: "ModelRunner", result: "StepResult") -> None: ...


@dataclass
class RunnerConfig:
    """Sizes of the KV cache and of the fixed-address step buffers.

    Attributes:
        num_blocks: physical KV blocks (block 0 is the null block; the budget
            is ``num_blocks - 1``).
        block_size: tokens per block (``S``).
        layout: KV layout name (:data:`vtoken.engine.kv_cache.KV_LAYOUTS`).
        max_num_reqs: most requests in one step.
        max_num_tokens: most new tokens in one step (prefill chunk budget).
        max_kv_indices: capacity of ``kv_indices`` (``nnz_max``); default
            ``num_blocks * block_size``, the most distinct live slots (raise it
            when requests share prefix blocks: a shared slot is listed once per
            holder).
        key_scores: what every step returns for eviction policies: ``"none"``,
            ``"sum"`` or ``"per_layer"`` (see :class:`~vtoken.engine.model.ModelOutput`).
        cuda_graph: capture decode steps; ``None`` = on iff the model is on CUDA.
        graph_batch_sizes: padded decode batch sizes to capture (all of them at
            :meth:`ModelRunner.warmup`); default :func:`vtoken.device.step_graphs.padded_batch_sizes`
            of ``max_num_reqs``. A batch above the largest runs eagerly.
    """

    num_blocks: int
    block_size: int = 16
    layout: str = "nhd"
    max_num_reqs: int = 64
    max_num_tokens: int = 4096
    max_kv_indices: Optional[int] = None
    key_scores: str = "none"
    cuda_graph: Optional[bool] = None
    graph_batch_sizes: Optional[tuple] = None

    def __post_init__(self):
        for name in ("num_blocks", "block_size", "max_num_reqs", "max_num_tokens"):
            check_int(name, getattr(self, name), min_value=1)
        if self.num_blocks < 2:
            raise InvalidArgumentError(f"num_blocks: expected >= 2 (block 0 is the null block), got {self.num_blocks}")
        if self.layout not in KV_LAYOUTS:
            raise InvalidArgumentError(f"layout: expected one of {KV_LAYOUTS}, got {self.layout!r}")
        if self.key_scores not in ("none", "sum", "per_layer"):
            raise InvalidArgumentError(f"key_scores: expected 'none', 'sum' or 'per_layer', got {self.key_scores!r}")
        if self.max_kv_indices is None:
            self.max_kv_indices = self.num_blocks * self.block_size
        if self.max_kv_indices < 1:
            raise InvalidArgumentError(f"max_kv_indices: expected >= 1, got {self.max_kv_indices}")
        if self.graph_batch_sizes is None:
            self.graph_batch_sizes = padded_batch_sizes(self.max_num_reqs)
        sizes = tuple(sorted(set(int(b) for b in self.graph_batch_sizes)))
        if not sizes or sizes[0] < 1 or sizes[-1] > self.max_num_reqs:
            raise InvalidArgumentError(
                f"graph_batch_sizes: expected sizes in [1, max_num_reqs={self.max_num_reqs}], got {self.graph_batch_sizes}"
            )
        self.graph_batch_sizes = sizes


@dataclass
class StepResult:
    """The outcome of one step.

    Attributes:
        logits: float32 ``[R, vocab]`` on the device: each request's last token.
            On the CUDA-graph path this is a view of the graph's static output:
            consume it (e.g. :meth:`next_tokens`) before the next step.
        kv_indptr: int64 host ``[R + 1]``: request r's rows in ``key_scores``.
        token_ids: host int64 arrays, one per request: the logical ids of the
            listed keys (row order of ``key_scores``); set when key scores are on.
        key_scores / layer_key_scores: see :class:`~vtoken.engine.model.ModelOutput`
            (rows ``kv_indptr[-1]:`` are padding).
        slot_mapping: int32 host ``[T]``: where the new tokens' K/V went.
        window_votes: device float32 ``[nnz_max, num_kv_heads]`` for a prefill run
            with a window: the attention a request's last ``window`` new queries
            give each of its listed keys, summed over layers, queries and each
            GQA group (SnapKV's votes), rows as ``kv_indices`` (zero for the
            requests with no window and past ``kv_indptr[-1]``). :attr:`window_scores`
            is the same per request on the host.
        graph: True when the step replayed a CUDA graph.
    """

    logits: torch.Tensor
    kv_indptr: np.ndarray
    slot_mapping: np.ndarray
    token_ids: Optional[list] = None
    key_scores: Optional[torch.Tensor] = None
    layer_key_scores: Optional[torch.Tensor] = None
    all_logits: Optional[torch.Tensor] = None
    window_votes: Optional[torch.Tensor] = None
    graph: bool = False

    @functools.cached_property
    def window_scores(self) -> Optional[list]:
        """Host float32 ``[n_live_r, num_kv_heads]`` per request: :attr:`window_votes` split (one copy, cached:
        callers index it per request)."""
        if self.window_votes is None:
            return None
        votes = self.window_votes.cpu().numpy()
        return [votes[self.kv_indptr[r]: self.kv_indptr[r + 1]] for r in range(len(self.kv_indptr) - 1)]

    def next_tokens(self) -> np.ndarray:
        """Greedy next token per request (int64 host array; one device->host copy)."""
        return self.logits.argmax(dim=-1).cpu().numpy()

    def request_key_scores(self, r: int) -> torch.Tensor:
        """Request ``r``'s rows of ``key_scores``: ``[n_live_r, num_kv_heads]``."""
        if self.key_scores is None:
            raise InvalidArgumentError("key_scores: expected a runner with key_scores != 'none', got none")
        return self.key_scores[int(self.kv_indptr[r]) : int(self.kv_indptr[r + 1])]


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    output: ModelOutput


def checked_prefill(reqs: Sequence[Hashable], token_ids: Sequence, window) -> tuple[list, list, np.ndarray]:
    """A prefill's arguments checked (typed errors naming them, before any state changes): the requests as a
    list, one token array (>= 1 ids) per request, and ``window`` (an int for every request, or one per
    request, each >= 0) as int64 per request. Shared by every runner's ``prefill``."""
    reqs = list(reqs)
    if is_int(window):
        window = np.full(len(reqs), check_int("window", window), dtype=np.int64)
    else:
        window = as_index_array("window", window)
        if window.shape != (len(reqs),) or (window.size and window.min() < 0):
            raise InvalidArgumentError(f"window: expected an int >= 0 or {len(reqs)} of them (one per request), "
                                       f"got {window.tolist()[:8]}")
    if len(token_ids) != len(reqs):
        raise InvalidArgumentError(f"token_ids: expected {len(reqs)} arrays (one per request), got {len(token_ids)}")
    toks = [as_index_array(f"token_ids[{i}]", t, allow_empty=False) for i, t in enumerate(token_ids)]
    return reqs, toks, window


def runner_table(config: "RunnerConfig", table: Optional[TokenTable]) -> TokenTable:
    """A runner's token table: a new one over a fresh pool of ``config``'s size, or ``table`` if it matches."""
    if table is None:
        return TokenTable(BlockLedger(BlockPool(config.num_blocks), block_size=config.block_size))
    if table.S != config.block_size or table.ledger.num_blocks != config.num_blocks:
        raise InvalidArgumentError(
            f"table: expected block_size {config.block_size} and {config.num_blocks} blocks, "
            f"got {table.S} and {table.ledger.num_blocks}"
        )
    return table


def checked_decode(reqs: Sequence[Hashable], token_ids) -> tuple[list, list]:
    """A decode's arguments checked: the requests as a list and one 1-token array per request."""
    reqs = list(reqs)
    ids = as_index_array("token_ids", token_ids)
    if len(ids) != len(reqs):
        raise InvalidArgumentError(f"token_ids: expected {len(reqs)} tokens (one per request), got {len(ids)}")
    return reqs, [ids[i : i + 1] for i in range(len(ids))]


def checked_batch(reqs: list, toks: list, config: "RunnerConfig", vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A step's batch checked against ``config`` (request count, uniqueness, token ids, the token budget);
    returns the new tokens per request and all of them flat. Shared by every runner's step."""
    nreq = len(reqs)
    if nreq == 0:
        raise InvalidArgumentError("reqs: expected at least one request, got none")
    if nreq > config.max_num_reqs:
        raise InvalidArgumentError(f"reqs: expected at most max_num_reqs={config.max_num_reqs}, got {nreq}")
    if len(set(reqs)) != nreq:
        raise InvalidArgumentError("reqs: expected unique requests, got duplicates")
    counts = np.fromiter((len(t) for t in toks), dtype=np.int64, count=nreq)
    ids = np.concatenate(toks)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise InvalidArgumentError(f"token_ids: expected ids in [0, {vocab_size}), "
                                   f"got {ids[(ids < 0) | (ids >= vocab_size)][:8].tolist()}")
    total = int(counts.sum())
    if total > config.max_num_tokens:
        raise InvalidArgumentError(f"token_ids: expected at most max_num_tokens={config.max_num_tokens} new tokens, "
                                   f"got {total}")
    return counts, ids


class ModelRunner:
    """Runs prefill and decode steps of ``model`` over a :class:`TokenTable` (see module docstring).

    Args:
        model: the :class:`LlamaModel` (its device and dtype set the cache's).
        config: :class:`RunnerConfig`.
        table: an existing :class:`TokenTable` to run over (e.g. the one a
            reclamation manager owns); by default a new one over a built-in
            :class:`BlockPool` of ``config.num_blocks`` blocks.
        hooks: :class:`StepHooks` called around every forward.
    """

    def __init__(self, model: LlamaModel, config: RunnerConfig, *, table: Optional[TokenTable] = None,
                 hooks: Sequence[StepHooks] = ()):
        if not isinstance(model, LlamaModel):
            raise InvalidTypeError(f"model: expected a LlamaModel, got {type(model).__name__}")
        if not isinstance(config, RunnerConfig):
            raise InvalidTypeError(f"config: expected a RunnerConfig, got {type(config).__name__}")
        self.model = model
        self.config = config
        self.device = model.lm_head.weight.device
        table = runner_table(config, table)
        self.table = table
        self.hooks = list(hooks)
        self.kv_caches, self.layout = model.allocate_kv_caches(config.num_blocks, config.block_size,
                                                              layout=config.layout)
        self.use_graph = (self.device.type == "cuda") if config.cuda_graph is None else bool(config.cuda_graph)
        if self.use_graph and self.device.type != "cuda":
            raise InvalidArgumentError(f"cuda_graph: expected a CUDA model for graph capture, got device {self.device}")
        # --- fixed-address buffers. Slot lists: the mirror builds them on the device.
        t, r, nnz = config.max_num_tokens, config.max_num_reqs, config.max_kv_indices
        self.mirror = DeviceMirror(table, self.device)  # follows the table's journal (requests already in it too)
        self.slot_lists = SlotListBuffers(max_reqs=r, nnz_max=nnz, max_tokens=t, device=self.device)
        # Token inputs: one int32 arena [input_ids | positions | q_indptr | window rows], filled by ONE H2D
        # copy. (int32 is enough: embedding and RoPE take int32 ids / positions; window rows index the step's
        # tokens.)
        self._tok = torch.zeros(3 * t + r + 1, dtype=torch.int32, device=self.device)
        self.input_ids, self.positions = self._tok[:t], self._tok[t : 2 * t]
        self.q_indptr, self.window_rows = self._tok[2 * t : 2 * t + r + 1], self._tok[2 * t + r + 1 :]
        # NOTE: a staging buffer is reused only once its copy's event completed (no host wait).
        self._staging = StagingRing(pinned=True, dtype=torch.int32, prealloc=2, capacity=self._tok.numel()) \
            if self.device.type == "cuda" else None
        self._graphs: dict[int, _Graph] = {}  # padded batch -> graph, all captured over _graph_score_out
        self._graph_pool = None
        self._graph_sink = None  # the score sink the graphs were captured for (warmup)
        self._graph_score_out = None  # its score buffer at capture: graphs bake in its address
        self.warmed_up = False
        self.num_graph_replays = 0
        self.num_graph_captures = 0
        self.reclaimer = None  # a vtoken.reclamation.manager.ReclamationManager, set by the scheduler (finish_request)

    # ------------------------------------------------------------- requests
    def add_request(self, req: Hashable, prefix_blocks=None) -> None:
        """Register ``req`` (optionally over shared full prefix blocks; see ``TokenTable.add_request``)."""
        self.table.add_request(req, prefix_blocks)

    def evict(self, req: Hashable, token_ids) -> None:
        """Mark ``token_ids`` of ``req`` dead; they are never attended again (the mirror follows the table)."""
        self.table.evict(req, token_ids)

    def finish(self, req: Hashable) -> np.ndarray:
        """Drop ``req`` and release its blocks (also the way to preempt it for recompute).

        Goes through the reclaimer when one is attached (its uncommitted plan is
        rolled back first). Returns the freed block ids.
        """
        if self.reclaimer is not None:
            return self.reclaimer.finish_request(req)
        return self.table.finish(req)

    # ------------------------------------------------------------------ steps
    def prefill(self, reqs: Sequence[Hashable], token_ids: Sequence, *, all_logits: bool = False,
                window: int = 0, score_sink=None) -> Optional[StepResult]:
        """Append ``token_ids[i]`` (>= 1 tokens) to ``reqs[i]`` and run them (varlen, causal).

        Works for a first prompt, a prompt chunk, or a recompute after
        preemption: the tokens go after what the request already holds, at the
        next logical positions. ``window > 0`` also returns the
        observation-window votes (``StepResult.window_votes``): one int for every
        request, or one per request (0: none; a chunked prefill asks only for
        the requests whose prompt the step completes). ``score_sink``:
        an object whose ``token_mass`` (float32, indexed by mirror position) the
        step's attention adds every listed key's mass into (e.g. a
        :class:`vtoken.decisions.loop.DecisionLoop`). Returns
        ``None``, with nothing changed, when the block budget cannot hold the
        new tokens.
        """
        reqs, toks, window = checked_prefill(reqs, token_ids, window)
        return self._step(reqs, toks, decode=False, all_logits=all_logits, window=window, score_sink=score_sink)

    def decode(self, reqs: Sequence[Hashable], token_ids, *, score_sink=None) -> Optional[StepResult]:
        """Append one token per request and run a decode step (CUDA graph on GPU).

        ``score_sink``: as :meth:`prefill`.

        Returns ``None``, with nothing changed, when the block budget cannot
        hold the new tokens.
        """
        reqs, toks = checked_decode(reqs, token_ids)
        return self._step(reqs, toks, decode=True, all_logits=False, score_sink=score_sink)

    def _step(self, reqs: list, toks: list, *, decode: bool, all_logits: bool, window: Optional[np.ndarray] = None,
              score_sink=None) -> Optional[StepResult]:
        cfg, table = self.config, self.table
        nreq = len(reqs)
        if window is not None and not window.any():
            window = None
        counts, ids = checked_batch(reqs, toks, cfg, self.model.config.vocab_size)
        padded = next((b for b in cfg.graph_batch_sizes if b >= nreq), None) if decode and self.use_graph else None
        if padded is not None:  # a graph replay: checked before anything changes
            if not self.warmed_up:
                raise InvalidArgumentError("cuda_graph: expected ModelRunner.warmup() before the first decode "
                                           "(graphs are captured at warm-up, never while serving), got none")
            if score_sink is not self._graph_sink:
                raise InvalidArgumentError(f"score_sink: expected the sink the graphs were captured for at warm-up "
                                           f"({type(self._graph_sink).__name__}), got {type(score_sink).__name__}")
        total = int(counts.sum())
        start = np.fromiter((table.num_tokens(r) for r in reqs), dtype=np.int64, count=nreq)
        S = cfg.block_size
        if int((cdiv(start + counts, S) - cdiv(start, S)).sum()) > table.ledger.admission_free:
            return None  # out of blocks (the table would refuse the appends): the caller sheds a request
        live_after = np.fromiter((table.live_count(r) for r in reqs), dtype=np.int64, count=nreq) + counts
        if int(live_after.sum()) > cfg.max_kv_indices:
            raise InvalidArgumentError(
                f"reqs: expected at most max_kv_indices={cfg.max_kv_indices} listed keys, got {int(live_after.sum())}"
            )
        for h in self.hooks:
            h.pre_forward(self)
        # --- state change: slots for the new tokens (None: out of blocks, nothing changed)
        slot_mapping = table.sync_new_tokens_batch(reqs, counts)
        if slot_mapping is None:
            return None
        positions = np.repeat(start - np.cumsum(counts) + counts, counts) + np.arange(total)
        q_indptr = np.zeros(nreq + 1, dtype=np.int64)
        np.cumsum(counts, out=q_indptr[1:])
        token_ids = [table.live_ids(r) for r in reqs] if cfg.key_scores != "none" else None

        graph = padded is not None
        padded = padded or nreq
        rows = None
        if window is not None:
            n_win = np.minimum(counts, window)  # 0 for a request with no window: no rows
            rows = np.repeat(q_indptr[1:] - n_win, n_win) + np.arange(int(n_win.sum())) - np.repeat(
                np.cumsum(n_win) - n_win, n_win)
        self.mirror.build(self.slot_lists, reqs, counts)  # kv_indices, kv_indptr, slot_mapping (PAD tails)
        kv_indptr = self.slot_lists.kv_indptr_host[: nreq + 1].copy()
        self._stage_tokens(ids, positions, q_indptr, padded=padded, window_rows=rows)
        # read after build: a mirror re-layout in build gives the sink a new buffer
        score_out = score_sink.token_mass if score_sink is not None else None
        if graph:
            out = self._replay(padded, score_out)
            self.num_graph_replays += 1
        else:
            step = self._step_inputs(nreq, total, decode)
            if rows is not None:  # staged with the tokens: a device cast, no copy from the host
                step.window_indices = self.window_rows[: len(rows)].to(torch.int64)
            out = self.model(step, self.kv_caches, self.layout, all_logits=all_logits, key_scores=cfg.key_scores,
                             score_out=score_out)
        result = StepResult(
            logits=out.logits[:nreq], kv_indptr=kv_indptr, slot_mapping=slot_mapping, token_ids=token_ids,
            key_scores=out.key_scores, layer_key_scores=out.layer_key_scores, all_logits=out.all_logits,
            graph=graph,
        )
        if window is not None:
            result.window_votes = self._window_votes(reqs, out.window_queries, n_win, step.window_indices)
        for h in self.hooks:
            h.post_forward(self, result)
        return result

    def _window_votes(self, reqs, queries: torch.Tensor, n_win: np.ndarray,
                      window_indices: torch.Tensor) -> torch.Tensor:
        """Window queries vs each windowed request's live keys, every layer, summed: rows as kv_indices (device).

        Everything comes from device buffers (no host copy, no sync): the
        keys' slots and ids are the request's rows of the slot lists
        (``kv_indices``, ``kv_pos``), the queries' positions are the staged
        ``positions`` at ``window_indices``; only the row counts are host ints.

        NOTE: a request with a window completes a fresh prompt (the engine
        evicts nothing before a prompt completes), so the device lists exactly
        the host table's live keys for it, in logical order. Its rows start at
        the DEVICE's ``kv_indptr``: a request before it in a mixed batch may
        hold victims the device killed and the host has not applied yet, which
        shifts the device offsets.
        """
        from vtoken.policies.scores import window_key_scores

        S, sl = self.config.block_size, self.slot_lists
        views = [self.layout.canonical_view(c) for c in self.kv_caches]
        votes = torch.zeros(sl.nnz_max, self.model.config.num_kv_heads, dtype=torch.float32, device=self.device)
        q_pos = self.positions[window_indices]
        lo = 0
        for i, req in enumerate(reqs):
            hi = lo + int(n_win[i])
            if hi == lo:
                continue
            rows = sl.kv_indptr[i].to(torch.int64) + torch.arange(self.table.live_count(req), device=self.device)
            slots = sl.kv_indices[rows].to(torch.int64)
            key_ids = sl.kv_pos[rows]
            total = None
            for layer, view in enumerate(views):
                keys = view[slots // S, slots % S, 0]  # [n_live, Hkv, D]
                # validate=False: a window query always sees a key (its own token), and the check reads the device
                s = window_key_scores(queries[layer, lo:hi], keys, key_ids=key_ids, query_ids=q_pos[lo:hi],
                                      validate=False)
                total = s if total is None else total + s
            votes.index_copy_(0, rows, total.to(torch.float32))
            lo = hi
        return votes

    # -------------------------------------------------------------- buffers
    def _stage_tokens(self, ids, positions, q_indptr, *, padded: int, window_rows=None) -> None:
        """Write input ids, positions, q_indptr (and window rows) into their fixed-address buffers (one H2D on CUDA).

        Graph padding rows (``len(ids) .. padded``) get token 0 at position 0;
        the slot lists give them no key and a PAD slot mapping.
        """
        t, r, total, nreq = self.config.max_num_tokens, self.config.max_num_reqs, len(ids), len(q_indptr) - 1
        n_tok = max(total, padded)
        host = self._staging.acquire(self._tok.numel()) if self._staging is not None else self._tok
        h = host.numpy()
        h[:n_tok] = 0
        h[:total] = ids
        h[t : t + n_tok] = 0
        h[t : t + total] = positions
        h[2 * t : 2 * t + nreq + 1] = q_indptr
        n = 2 * t + nreq + 1  # only the used prefix of the arena travels
        if window_rows is not None:
            w0 = 2 * t + r + 1
            h[w0 : w0 + len(window_rows)] = window_rows
            n = w0 + len(window_rows)
        if self._staging is None:
            return
        self._tok[:n].copy_(host[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._staging.retire(host, event)

    def _step_inputs(self, nreq: int, total: int, decode: bool) -> StepInputs:
        """Views of the fixed-address buffers for ``nreq`` requests and ``total`` new tokens."""
        sl = self.slot_lists
        return StepInputs(
            input_ids=self.input_ids[:total], positions=self.positions[:total],
            slot_mapping=sl.slot_mapping[:total], kv_indices=sl.kv_indices,
            kv_indptr=sl.kv_indptr[: nreq + 1], q_indptr=None if decode else self.q_indptr[: nreq + 1],
            mirror_starts=sl.mirror_starts, kv_pos=sl.kv_pos,
        )

    # ----------------------------------------------------------- CUDA graphs
    def warmup(self, score_sink=None) -> None:
        """Capture the decode graph of every padded batch size (``graph_batch_sizes``) before serving.

        Call once, before the first step, with the ``score_sink`` the decodes
        will pass (the graphs add key masses into its ``token_mass``). Serving
        then only replays; the one recapture is of every size at once, when
        the sink's buffer moved (a mirror arena growth re-allocates it). On
        CPU, or with graphs off, nothing is captured.
        """
        self._graph_sink = score_sink
        if self.use_graph:
            self._capture_all(None if score_sink is None else score_sink.token_mass)
        self.warmed_up = True

    def _capture_all(self, score_out) -> None:
        self._graphs.clear()  # NOTE: dropped before capturing: graphs over a freed score buffer never replay
        self._graph_score_out = score_out
        for b in self.config.graph_batch_sizes:
            self._graphs[b] = self._capture(b, score_out)

    def _replay(self, batch: int, score_out=None) -> ModelOutput:
        if score_out is not self._graph_score_out:
            self._capture_all(score_out)  # the sink's buffer moved: graphs bake in its address
        g = self._graphs.get(batch)
        if g is None:
            raise InvariantViolation(f"decode graph: padded batch {batch} was not captured at warm-up "
                                     f"(captured: {sorted(self._graphs)})")
        g.graph.replay()
        return g.output

    def _capture(self, batch: int, score_out=None) -> _Graph:
        """Capture one decode step at padded batch size ``batch`` over the fixed buffers.

        The buffers' CURRENT contents are restored after warmup and capture, so
        a recapture in the middle of a step replays that step's inputs.
        """
        self.num_graph_captures += 1
        sl = self.slot_lists
        fixed = [self._tok, sl.kv_indices, sl.kv_indptr, sl.slot_mapping]
        saved = [b.clone() for b in fixed]
        # Warmup and capture see the padding state: no listed key, PAD slot mapping.
        self._tok.zero_()
        sl.kv_indptr.zero_()
        sl.kv_indices.fill_(PAD)
        sl.slot_mapping.fill_(PAD)
        step = self._step_inputs(batch, batch, decode=True)
        ks = self.config.key_scores
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile kernels / allocate workspaces outside the capture (no key listed:
                self.model(step, self.kv_caches, self.layout, key_scores=ks, score_out=score_out)  # adds nothing)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # NOTE: no host sync may happen in here; the kernels' debug content checks skip capture.
        with torch.cuda.graph(graph, pool=self._graph_pool):
            output = self.model(step, self.kv_caches, self.layout, key_scores=ks, score_out=score_out)
        for b, v in zip(fixed, saved):
            b.copy_(v)
        return _Graph(graph, output)
