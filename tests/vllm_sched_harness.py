"""A real vLLM 0.32 ``Scheduler`` with the vtoken connector and no model, for unit tests.

The scheduler, ``KVCacheManager``, ``BlockPool`` and prefix cache are vLLM's
own classes. The model is replaced by :class:`FakeWorker`: it runs vtoken's
real :class:`~vtoken.integrations.vllm.worker.WorkerSide` on a CPU KV cache,
writes a per-token fingerprint at every new slot (instead of K/V), produces
deterministic "sampled" tokens and attention scores (the worker's device
policy decides from them, as in vLLM), and checks after every
step that each live token's fingerprint is found at the slot the scheduler's
table gives it (so relocations moved the right bytes).
"""
from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
import torch

NUM_KV_HEADS, HEAD_DIM = 2, 8


def make_scheduler(model_dir: str, *, block_size: int = 16, num_blocks: int = 64, max_num_seqs: int = 8,
                   max_model_len: int = 1024, prefix_caching: bool = True, extra: dict | None = None,
                   max_num_batched_tokens: int = 2048, async_scheduling: bool = False):
    """A vLLM ``Scheduler`` (``AsyncScheduler`` with ``async_scheduling``) bound to a vtoken connector."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    kvt = None
    if extra is not None:
        kvt = KVTransferConfig(kv_connector="VTokenConnector", kv_connector_module_path="vtoken.integrations.vllm.connector",
                               kv_role="kv_both", kv_connector_extra_config=extra)
    args = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=block_size,
                      max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens,
                      enable_prefix_caching=prefix_caching, enforce_eager=True, kv_transfer_config=kvt)
    cfg = args.create_engine_config()
    cfg.cache_config.num_gpu_blocks = num_blocks
    # The CPU platform turns async scheduling off; the scheduler classes themselves run anywhere.
    cfg.scheduler_config.async_scheduling = bool(async_scheduling)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(vllm_config=cfg, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(cfg),
                     block_size=block_size, log_stats=False)


def make_request(req_id: str, prompt: list[int], max_tokens: int, block_size: int):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def fingerprints(token_ids) -> np.ndarray:
    """Per position, a float32-exact rolling hash of the tokens up to it.

    Equal prefixes give equal values (like K/V), so the prefix-cache blocks two
    requests share hold the right bytes for both.
    """
    out = np.empty(len(token_ids), dtype=np.float32)
    h = 0
    for i, t in enumerate(token_ids):
        h = (h * 1000003 + int(t) + 1) % (1 << 23)
        out[i] = h + 1
    return out


class FakeWorker:
    """vtoken's WorkerSide over a CPU KV cache, with fingerprints in place of K/V.

    With ``async_outputs`` the engine loop is vLLM's batch queue of depth 2
    (``EngineCore.step_with_batch_queue``, what async scheduling runs): step
    N+1 is scheduled (and executed) before step N's output reaches the
    scheduler. The worker keeps its own copy of every request's tokens, as
    vLLM's worker does, since the scheduler learns the sampled ones late.
    """

    def __init__(self, sched, *, checking: bool = True, seed: int = 0, async_outputs: bool = False,
                 v2_builder: bool = False):
        from vtoken.integrations.vllm.worker import WorkerSide

        self.sched = sched
        side = sched.connector.scheduler_side
        nb, bs = side.pool.num_gpu_blocks, side.S
        self.cache = torch.zeros(nb, NUM_KV_HEADS, bs, 2 * HEAD_DIM, dtype=torch.float32)
        rc = side.reclaim_config
        sc = sched.scheduler_config
        fixed = sc.max_num_seqs * sched.vllm_config.model_config.max_model_len if side.config.full_decode_graphs \
            else None  # as the connector sizes them
        self.worker = WorkerSide(max_reqs=sc.max_num_seqs, max_tokens=sc.max_num_batched_tokens,
                                 max_moves=rc.max_moves_per_step, policy=side.config.make_policy(),
                                 checking=checking, fixed_slot_lists=fixed)
        self.worker.register_kv_caches({"model.layers.0.self_attn.attn": self.cache})
        self.seed = int(seed)
        self.bs = bs
        self.steps = 0
        self.async_outputs = bool(async_outputs)
        self.in_flight: list = []  # (SchedulerOutput, ModelRunnerOutput) not yet given to the scheduler
        self.max_in_flight = 0
        self.tokens: dict = {}  # request -> every token the worker knows (prompt + sampled)
        # Model Runner V2's order: vLLM's attention builder first (rows in V2's order, padded as
        # for a full CUDA graph), then handle_preemptions, then start_load_kv with the request ids.
        self.builder = None
        self.attention: list = []  # (row order, metadata) per step, with v2_builder
        if v2_builder:
            from vllm.v1.kv_cache_interface import FullAttentionSpec

            from vtoken.integrations.vllm.attention import VTokenAttentionMetadataBuilder

            spec = FullAttentionSpec(block_size=bs, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
            from vtoken.integrations.vllm.attention import VTokenAttentionImpl, bind_worker

            layer = "model.layers.0.self_attn.attn"
            # The model's attention layer as vLLM registers it; the connector binds the worker to it.
            impl = VTokenAttentionImpl(num_heads=NUM_KV_HEADS, head_size=HEAD_DIM, scale=1.0, num_kv_heads=NUM_KV_HEADS)
            sched.vllm_config.compilation_config.static_forward_context[layer] = SimpleNamespace(impl=impl)
            bind_worker(sched.vllm_config, [layer], self.worker)
            self.builder = VTokenAttentionMetadataBuilder(spec, [layer], sched.vllm_config, torch.device("cpu"))
            self.builder.runner_v2 = True  # the CPU config picks the V1 runner; this builder plays V2's part

    def _rng(self, req_id: str, stream: int):
        """Draws of one request at this step: independent of the batch's row order."""
        return np.random.default_rng((self.seed, zlib.crc32(str(req_id).encode()), self.steps, stream))

    def _write(self, req_id: str, first_token: int, slots: np.ndarray) -> None:
        s = torch.from_numpy(slots.astype(np.int64))
        fp = fingerprints(self.tokens[req_id][: first_token + len(slots)])
        vals = torch.from_numpy(fp[first_token:])
        self.cache[s // self.bs, :, s % self.bs, :] = vals[:, None, None]

    def step(self, after_schedule=None):
        """One engine step: schedule, "forward", copy, sample; then an output goes back. Returns the SchedulerOutput.

        ``after_schedule(so)``, if given, runs between the schedule and the execution.
        """
        so = self.sched.schedule()
        if after_schedule is not None:
            after_schedule(so)
        self.in_flight.append((so, self._execute(so)))
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        while self.in_flight and (not self.async_outputs or len(self.in_flight) == 2
                                  or so.total_num_scheduled_tokens == 0):
            self.sched.update_from_output(*self.in_flight.pop(0))
        self.steps += 1
        self.check_bytes()
        return so

    def _execute(self, so):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        w = self.worker
        for d in so.scheduled_new_reqs:
            self.tokens[d.req_id] = list(self.sched.requests[d.req_id].all_token_ids)
        for r in so.scheduled_cached_reqs.resumed_req_ids:
            self.tokens[r] = list(self.sched.requests[r].all_token_ids)
        reqs = list(so.num_scheduled_tokens)
        if self.builder is not None:
            reqs = reqs[::-1]  # rows in an order of the runner's own, not the scheduler's
            self._v2_attention(so, reqs)
        else:
            w.begin_step(so.kv_connector_metadata)
        if reqs:
            qlens = np.array([so.num_scheduled_tokens[r] for r in reqs])
            bufs = w.buffers if self.builder is not None else w.build_slot_lists(reqs, qlens)
            slot_mapping = bufs.slot_mapping[: int(qlens.sum())].numpy()
            for r, first in zip(reqs, np.cumsum(qlens) - qlens):  # the "forward" writes the computed tokens' fingerprints
                n, k = w.mirror.num_tokens(r), so.num_scheduled_tokens[r]
                self._write(r, n - k, slot_mapping[first : first + k])
            if w.want_scores:  # per request and step, whatever the row order
                ptr = w.buffers.kv_indptr[: len(reqs) + 1].numpy()
                ks = torch.zeros(w.buffers.nnz_max, NUM_KV_HEADS)
                for i, r in enumerate(reqs):
                    draw = self._rng(r, 0).random((ptr[i + 1] - ptr[i], NUM_KV_HEADS), dtype=np.float32)
                    ks[ptr[i]: ptr[i + 1]] = torch.from_numpy(draw)
                w.score_out[: ks.shape[0]] += ks.sum(dim=1)  # as the attention's score_out adds them
        w.end_step()
        wmeta = w.worker_meta()
        w.clear()
        sampled, ids = [], []
        for r in reqs:
            # schedule() already counted this step's tokens (and, async, the pending outputs' placeholders).
            done_prefill = w.mirror.num_tokens(r) >= len(self.tokens[r])
            tok = [int(self._rng(r, 1).integers(3, 500))] if done_prefill else []
            self.tokens[r].extend(tok)
            sampled.append(tok)
            ids.append(r)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled,
                                 kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=wmeta))

    def _v2_attention(self, so, reqs: list, pad: int = 2) -> None:
        """Model Runner V2's order around one step's attention metadata (see ``v2_builder``)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        w = self.worker
        qlens = [so.num_scheduled_tokens[r] for r in reqs]
        t = int(sum(qlens))
        # Padded rows are empty (query_start_loc repeats the total), as V2 pads a full-graph batch.
        qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens), np.full(pad, t)]), dtype=torch.int32)
        table = self.sched.connector.scheduler_side.table
        slot_mapping = np.concatenate([table.slots(r)[table.num_tokens(r) - k:table.num_tokens(r)]
                                       for r, k in zip(reqs, qlens)]) if reqs else np.zeros(0, np.int32)
        n = len(reqs) + pad
        decode = bool(reqs) and max(qlens) == 1  # vLLM pads a decode batch's tokens with its rows
        cm = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=torch.zeros(n, dtype=torch.int32),
            num_reqs=n, num_actual_tokens=n if decode else t, max_query_len=max(qlens, default=0), max_seq_len=0,
            block_table_tensor=torch.zeros(n, 1, dtype=torch.int32),
            slot_mapping=torch.from_numpy(slot_mapping.astype(np.int64)), req_idx=np.arange(len(reqs)),
        )
        meta = self.builder.build(0, cm)
        assert meta.worker is w  # the forward reaches the worker through the metadata
        if w.fixed_slot_lists is None:
            assert meta.kv_indices is None  # nothing to read before the connector has the step
        else:  # the whole fixed buffer from the start, as a captured graph reads it
            assert meta.kv_indices is w.buffers.kv_indices
        w.begin_step(so.kv_connector_metadata)
        w.prepare_step(request_ids=list(reqs))
        # The metadata now reads the rows' live slots, in the runner's row order.
        want = [w.mirror.host_copy(r) for r in reqs]
        want = np.concatenate([sl[alive] for sl, alive in want]) if want else np.zeros(0, np.int32)
        ptr = meta.kv_indptr.numpy()
        assert ptr.shape == (n + 1,) and (ptr[len(reqs):] == ptr[len(reqs)]).all()  # padded rows: empty
        assert np.array_equal(meta.kv_indices[: ptr[-1]].numpy(), want)
        self.attention.append((list(reqs), meta))

    def check_bytes(self) -> None:
        """Every live token of every tracked request holds its fingerprint at its table slot."""
        side = self.sched.connector.scheduler_side
        t = side.table
        for r in t.requests():
            if r not in self.worker.mirror.tracked():
                continue
            ids = t.live_ids(r)
            # Tokens appended this step are written by the next forward: skip them.
            n_done = self.worker.mirror.num_tokens(r)
            ids = ids[ids < n_done]
            slots = t.slots(r)[ids].astype(np.int64)
            got = self.cache[slots // self.bs, 0, slots % self.bs, 0].numpy()
            want = fingerprints(self.tokens[r][:n_done])[ids]
            if not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)[:5]
                raise AssertionError(f"request {r}: tokens {ids[bad].tolist()} not at their slots")

    def run(self, max_steps: int = 10_000) -> int:
        n = 0
        while (self.sched.has_unfinished_requests() or self.in_flight) and n < max_steps:
            self.step()
            n += 1
        return n
