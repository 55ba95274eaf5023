"""vtoken's vLLM 0.32 integration at unit level, with vLLM's own classes.

The scheduler, KV cache manager, block pool and prefix cache are vLLM's; the
model is replaced by ``tests/vllm_sched_harness.FakeWorker``, which runs
vtoken's real worker side on a CPU KV cache holding a fingerprint per token
and checks after every step that every live token sits at the slot vtoken's
table gives it. Skipped when vllm is not installed (``.ci/vllm_tests.sh``
installs it).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernel_device import cpu_engine_triton
from vtoken.device import ops
from vtoken.integrations.vllm import vllm_available

VLLM_OK, VLLM_WHY = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_OK, reason=f"needs vllm 0.32: {VLLM_WHY}")]

BS = 16
H2O = {"budget": 0.5, "window": 8, "sink": 0}
AGGRESSIVE = {"low_watermark": 1.0, "check_interval": 1, "headroom_blocks": 4, "theta_F": 0.1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vllm_e2e_helper import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def extra(mode, policy="h2o", policy_config=H2O, reclaim=AGGRESSIVE, **more):
    out = {"mode": mode, "check_invariants": True, **more}
    if mode != "native":
        out.update(policy=policy, policy_config=dict(policy_config), reclaim=dict(reclaim))
    return out


def prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]


def setup(model_dir, mode, *, num_blocks=128, prefix_caching=True, n=4, lo=60, hi=100, max_tokens=40, seed=0,
          max_num_seqs=8, max_num_batched_tokens=2048, async_scheduling=False, v2_builder=False, **kw):
    from vllm_sched_harness import FakeWorker, make_request, make_scheduler

    sched = make_scheduler(model_dir, block_size=BS, num_blocks=num_blocks, prefix_caching=prefix_caching,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           async_scheduling=async_scheduling, extra=extra(mode, **kw))
    for i, p in enumerate(prompts(n, lo, hi, seed)):
        sched.add_request(make_request(f"r{i}", p, max_tokens, BS))
    return sched, FakeWorker(sched, seed=seed, async_outputs=async_scheduling, v2_builder=v2_builder)


def side_of(sched):
    return sched.connector.scheduler_side


def pool_accounts(sched):
    """vLLM's free blocks + the distinct blocks running requests list + vtoken's stash == usable."""
    side = side_of(sched)
    listed = set()
    for blocks in side.stm.req_to_blocks.values():
        listed.update(b.block_id for b in blocks if not b.is_null)
    return side.pool.get_num_free_blocks() + len(listed) + side.alloc.held, side.pool.num_gpu_blocks - 1


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "cfg, err, match",
    [
        ({"mode": "lazy"}, ValueError, "mode: expected one of"),
        ({"mode": "naive"}, ValueError, "policy: expected a policy name for mode 'naive'"),
        ({"mode": "naive", "policy": "nope"}, ValueError, "policy: expected one of"),
        ({"mode": "vtoken", "policy": "h2o", "reclaim": {"mode": "naive"}}, ValueError, "reclaim: expected no 'mode'"),
        ({"mode": "vtoken", "policy": "h2o", "reclaim": {"theta": 0.3}}, ValueError, "unknown \\['theta'\\]"),
        ({"mode": "vtoken", "policy": "h2o", "reclaim": {"theta_F": 2.0}}, ValueError, "theta_F"),
        ({"mode": "vtoken", "policy": "snapkv"}, ValueError, "score source 'window'"),
        ({"mode": "native", "colour": 1}, ValueError, "unknown \\['colour'\\]"),
        ({"mode": "naive", "policy": "h2o", "policy_config": {"budget": 1.5}}, ValueError, "budget.ratio"),
    ],
)
def test_config_rejects_bad_extra_config(cfg, err, match):
    from vtoken.integrations.vllm.config import VTokenVLLMConfig

    with pytest.raises(err, match=match):
        VTokenVLLMConfig.from_extra_config(cfg)


def test_config_builds_policy_and_reclaim_config():
    from vtoken.integrations.vllm.config import VTokenVLLMConfig

    c = VTokenVLLMConfig.from_extra_config({"mode": "vtoken", "policy": "h2o", "policy_config": {"budget": 0.25},
                                            "reclaim": {"theta_F": 0.3, "headroom_blocks": 7}})
    assert c.make_policy().budget.ratio == 0.25
    rc = c.make_reclaim_config()
    assert (rc.mode, rc.theta_F, rc.headroom_blocks) == ("vtoken", 0.3, 7)
    assert rc.low_watermark == 0.10  # the connector's default: vLLM's waiting queue is not visible as demand
    assert VTokenVLLMConfig.from_extra_config({"mode": "native"}).make_policy() is None
    # Left unset, the headroom is a fixed 2% stash (taken once, at bind), not the engine's automatic one.
    rc = VTokenVLLMConfig.from_extra_config({"mode": "vtoken", "policy": "h2o"}).make_reclaim_config()
    assert (rc.headroom_blocks, rc.low_watermark, rc.theta_F) == (0.02, 0.10, 0.01)


# --------------------------------------------------------------------------- allocator
def _pool(n=16, caching=True):
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(n, caching, BS)


def test_allocator_satisfies_protocol_over_vllm_block_pool():
    from vtoken.integrations.vllm.allocator import VLLMBlockAllocator
    from vtoken.bookkeeping.pool import BlockAllocator

    pool = _pool(16)
    a = VLLMBlockAllocator(pool, headroom=3)
    assert isinstance(a, BlockAllocator)
    assert a.num_blocks == 16 and a.held == 3 and a.num_free == 15
    assert pool.get_num_free_blocks() == 12  # the stash is physically out of vLLM's free queue
    ids = a.allocate(5)  # stash first, then the pool
    assert len(set(ids.tolist())) == 5 and 0 not in ids.tolist()
    assert a.held == 0 and a.num_free == 10 and pool.get_num_free_blocks() == 10
    assert a.allocate(11) is None and a.num_free == 10  # never partial, nothing changed
    a.incref(ids[:2])
    assert a.ref_count(ids[:2]).tolist() == [2, 2]
    a.free(ids)
    assert a.ref_count(ids[:2]).tolist() == [1, 1] and a.num_free == 13
    snap = (pool.get_num_free_blocks(), [b.ref_cnt for b in pool.blocks])
    with pytest.raises(ValueError, match="double free"):
        a.free([int(ids[0]), int(ids[0])])
    with pytest.raises(ValueError, match="expected block ids in"):
        a.free([0])
    assert snap == (pool.get_num_free_blocks(), [b.ref_cnt for b in pool.blocks])
    a.free(ids[:2])
    assert a.num_free == 15
    assert a.top_up() == 3 and a.held == 3
    assert a.release_stash() == 3 and pool.get_num_free_blocks() == 15


def test_allocator_mirroring_hands_out_vllm_blocks_and_detached_skips_vllm_frees():
    from vtoken.errors import InvariantViolation
    from vtoken.integrations.vllm.allocator import VLLMBlockAllocator

    pool = _pool(16)
    a = VLLMBlockAllocator(pool)
    got = [b.block_id for b in pool.get_new_blocks(3)]  # vLLM allocates for a request
    assert a.num_free == 12
    with a.mirroring(got):
        assert a.num_free == 15  # queued ids count as free until the table claims them
        assert a.allocate(2).tolist() == got[:2]
        a.incref(got[:1])  # a prefix hit: vLLM's touch already counted it
        assert a.allocate(1).tolist() == got[2:]
    assert [pool.blocks[i].ref_cnt for i in got] == [1, 1, 1]
    with pytest.raises(InvariantViolation, match="not claimed"):
        with a.mirroring(got):
            a.allocate(1)
    with a.detached({got[0]}):
        a.free(got)  # got[0] is vLLM's to free
    assert [pool.blocks[i].ref_cnt for i in got] == [1, 0, 0]


def test_allocator_drops_hash_only_when_the_last_reference_goes():
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from vtoken.integrations.vllm.allocator import VLLMBlockAllocator

    pool = _pool(8)
    a = VLLMBlockAllocator(pool)
    ids = a.allocate(2)
    for i, b in enumerate(ids.tolist()):
        pool._insert_block_hash(make_block_hash_with_group_id(bytes([i + 1]) * 32, 0), pool.blocks[b], num_tokens=BS)
    a.incref(ids[:1])  # block 0 shared by two holders
    a.free(ids)  # one holder drops both
    assert pool.blocks[int(ids[0])].block_hash is not None  # still held: hash kept
    assert pool.blocks[int(ids[1])].block_hash is None  # freed: hash dropped
    assert a.hashes_dropped == 1


# --------------------------------------------------------------------------- one block list per request
def test_the_table_reads_and_writes_vllms_block_list_and_keeps_none_of_its_own(model_dir):
    from vtoken.errors import InvariantViolation
    from vtoken.integrations.vllm.block_lists import VLLMBlockLists, block_ids

    sched, fw = setup(model_dir, "native", n=1, lo=70, hi=70)
    fw.step()
    side = side_of(sched)
    t = side.table
    assert type(t.lists) is VLLMBlockLists and t.arena.blocks is None  # no block-list array in vtoken
    vlist = side.stm.req_to_blocks["r0"]
    assert t.block_list("r0").tolist() == block_ids(side.stm, "r0").tolist() and len(vlist) == 5
    b1 = vlist[1]
    t.evict("r0", np.arange(16, 32))  # block 1 dies whole: Naive-Evict releases it
    assert vlist[1] is side.pool.null_block and b1.ref_cnt == 0  # in vLLM's list at once, and freed
    assert t.block_list("r0")[1] == 0 and t.held_blocks("r0") == 4
    spare = side.pool.get_new_blocks(1)[0]
    t.lists.write(np.array([t.row_of("r0")]), np.array([1]), spare.block_id)  # a table write is vLLM's entry
    assert vlist[1] is spare and t.block_list("r0")[1] == spare.block_id
    t.lists.write(np.array([t.row_of("r0")]), np.array([1]), 0)
    with pytest.raises(InvariantViolation, match="has 5 entries, position 5 used"):
        t.lists.read(np.array([t.row_of("r0")]), np.array([5]))
    with pytest.raises(InvariantViolation, match="vLLM lists"):  # a claim checks vLLM's own allocation
        t.lists.claim(np.array([t.row_of("r0")]), np.array([2]), np.array([spare.block_id]))
    side.pool.free_blocks([spare])
    side.check()


def test_preemption_and_finish_leave_exactly_vllms_listed_blocks_to_vllm(model_dir):
    # A pool too small for every request: vLLM preempts, popping the list before build_meta hears of it.
    sched, fw = setup(model_dir, "vtoken", n=6, lo=70, hi=90, max_tokens=64, num_blocks=30,
                      reclaim={**AGGRESSIVE, "headroom_blocks": 2})
    side = side_of(sched)
    popped, told, kinds = {}, [], []
    pop, forget, detached = side.stm.pop_blocks_for_free, side._forget, side.alloc.detached

    def listed(rid):  # the non-null blocks of vLLM's list in the table's positions
        n = -(-side.table.num_tokens(rid) // BS)
        return {b.block_id for b in side.stm.req_to_blocks[rid][:n] if not b.is_null}

    def spy_pop(rid):
        if rid in side.table:  # preempted: vLLM frees it before vtoken is told
            popped[rid] = listed(rid)
        return pop(rid)

    def spy_forget(rid):
        kinds.append("preempted" if rid in popped else "finished")
        expected = popped.pop(rid) if rid in popped else listed(rid)
        forget(rid)
        assert told.pop() == expected, rid

    def spy_detached(ids):
        told.append({int(i) for i in ids})
        return detached(ids)

    side.stm.pop_blocks_for_free, side._forget, side.alloc.detached = spy_pop, spy_forget, spy_detached
    while sched.has_unfinished_requests():
        fw.step()
        free_plus_listed, usable = pool_accounts(sched)
        assert free_plus_listed == usable
    assert kinds.count("preempted") > 0 and kinds.count("finished") == 6 and not popped
    assert side.table.requests() == [] and side.pool.get_num_free_blocks() + side.alloc.held == usable


# --------------------------------------------------------------------------- vLLM's block lists in a real scheduler
@pytest.mark.parametrize("mode, policy, cfg", [
    ("naive", "streamingllm", {"budget": 0.5, "window": 8, "sink": 4}),  # whole blocks die: holes
    ("vtoken", "h2o", H2O),  # scattered deaths: relocations
])
def test_block_list_writes_keep_allocate_slots_correct(model_dir, mode, policy, cfg):
    sched, fw = setup(model_dir, mode, policy=policy, policy_config=cfg, max_tokens=48)
    side = side_of(sched)
    holes = 0
    while sched.has_unfinished_requests():
        so = fw.step()
        for rid in so.num_scheduled_tokens:
            if rid not in side.table:
                continue
            req = sched.requests[rid]
            blocks = side.stm.req_to_blocks[rid]
            # No extra block for a hole: the list is exactly as long as the tokens need.
            assert len(blocks) == -(-req.num_computed_tokens // BS)
            assert sum(not b.is_null for b in blocks) == side.table.held_blocks(rid)
            holes += sum(b.is_null for b in blocks)
            # vLLM's own arithmetic for the next token asks for a block only when the tail is full.
            need = side.stm.get_num_blocks_to_allocate(rid, req.num_computed_tokens + 1, [], req.num_computed_tokens,
                                                       0, req.num_computed_tokens + 1)
            assert need == int(req.num_computed_tokens % BS == 0)
        free_plus_listed, usable = pool_accounts(sched)
        assert free_plus_listed == usable
    assert holes > 0
    st = side.summary()
    if mode == "naive":
        assert st["naive_released_blocks"] > 0 and st["relocations"] == 0
    else:
        assert st["relocations"] > 0 and st["reclaimed_blocks"] > 0


def test_freed_blocks_return_to_the_block_pool(model_dir):
    sched, fw = setup(model_dir, "vtoken", n=6, max_tokens=32)
    side = side_of(sched)
    usable = side.pool.num_gpu_blocks - 1
    fw.run()
    st = side.summary()
    assert st["reclaimed_blocks"] > 0 and st["relocations"] > 0
    assert side.table.requests() == [] and not side.stm.req_to_blocks
    assert side.pool.get_num_free_blocks() + side.alloc.held == usable
    side.ledger.check_conservation()
    side.shutdown()
    assert side.pool.get_num_free_blocks() == usable and side.alloc.held == 0


def test_prefix_shared_blocks_are_never_relocated_or_dropped(model_dir):
    from vllm_sched_harness import make_request

    from vtoken.bookkeeping.ledger import SHARED

    sched, fw = setup(model_dir, "vtoken", n=1, lo=96, hi=96, max_tokens=40)
    side = side_of(sched)
    prompt = sched.requests["r0"].prompt_token_ids
    fw.step()  # r0's prompt is computed and hashed
    sched.add_request(make_request("r1", prompt, 40, BS))  # same prompt: prefix-cache hits
    plans = []
    real_plan = side.manager.maybe_plan

    def spy():
        out = real_plan()
        for p in out:
            plans.append((p.request, p.src_blocks.copy(), side.ledger.state[p.src_blocks].copy()))
        return out

    side.manager.maybe_plan = spy
    fw.step()
    shared = [b.block_id for b in side.stm.req_to_blocks["r1"] if b.ref_cnt > 1]
    assert len(shared) == 5  # (96 - 1) // 16 full prompt blocks hit; the last one is recomputed
    pos = {b: side.stm.req_to_blocks["r0"].index(side.pool.blocks[b]) for b in shared}
    while sched.has_unfinished_requests():
        fw.step()
        if "r0" not in side.table or "r1" not in side.table:
            break
        for b in shared:
            both = [side.stm.req_to_blocks[r][pos[b]].block_id == b for r in ("r0", "r1")]
            if all(both):  # still held by both: untouched
                assert side.pool.blocks[b].ref_cnt == 2 and side.ledger.state[b] == SHARED
                assert side.pool.blocks[b].block_hash is not None
    assert plans, "expected relocations of the private suffix"
    for _, src, states in plans:
        assert not set(src.tolist()) & set(shared)
        assert (states != SHARED).all()


def test_same_step_prefix_hits_share_blocks_allocated_in_that_step(model_dir):
    from vllm_sched_harness import make_request

    sched, fw = setup(model_dir, "vtoken", n=1, lo=80, hi=80, max_tokens=24)
    side = side_of(sched)
    prompt = sched.requests["r0"].prompt_token_ids
    sched.add_request(make_request("r1", prompt, 24, BS))  # admitted in the same step as r0
    so = fw.step()
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    shared = [b.block_id for b in side.stm.req_to_blocks["r1"] if b.ref_cnt == 2]
    assert len(shared) == 4  # (80 - 1) // 16 blocks hit blocks r0 got in this very step
    assert side.table.block_list("r1")[:4].tolist() == side.table.block_list("r0")[:4].tolist() == shared
    fw.run()
    assert side.pool.get_num_free_blocks() + side.alloc.held == side.pool.num_gpu_blocks - 1


def test_hashes_of_changed_blocks_are_dropped(model_dir):
    sched, fw = setup(model_dir, "vtoken", n=4, max_tokens=48)
    side = side_of(sched)
    freed_sources, dests = set(), set()
    real_plan = side.manager.maybe_plan

    def spy():
        out = real_plan()
        for p in out:
            freed_sources.update(p.src_blocks.tolist())
            dests.update(p.dst_blocks.tolist() + p.fill_blocks.tolist())  # fresh or hole-filled: bytes changed
        return out

    side.manager.maybe_plan = spy
    checked_taint = 0
    while sched.has_unfinished_requests():
        fw.step()
        for rid, st in side._reqs.items():
            if not st.hashing_frozen:
                continue
            blocks = side.stm.req_to_blocks[rid]
            for b in blocks[st.prompt_tokens // BS :]:  # filled after the prompt: never hashed, even once full
                assert b.is_null or b.block_hash is None
                checked_taint += int(not b.is_null)
            clean = [b for b in blocks[: st.prompt_tokens // BS] if not b.is_null and b.block_id not in dests]
            assert all(b.block_hash is not None for b in clean)  # untouched prompt blocks keep theirs
        for b in dests:
            assert side.pool.blocks[b].block_hash is None
        for b in freed_sources:
            blk = side.pool.blocks[b]
            assert blk.ref_cnt > 0 or blk.block_hash is None  # freed by vtoken: no hash
        freed_sources = {b for b in freed_sources if side.pool.blocks[b].ref_cnt == 0}
    assert dests and checked_taint > 0
    assert side.alloc.hashes_dropped > 0


def test_native_mode_keeps_every_hash(model_dir):
    sched, fw = setup(model_dir, "native", n=2, max_tokens=40)
    side = side_of(sched)
    fw.step()
    fw.step()
    for rid in ("r0", "r1"):
        full = [b for b in side.stm.req_to_blocks[rid][: side.stm.num_cached_block[rid]]]
        assert full and all(b.block_hash is not None for b in full)
    fw.run()
    assert side.summary()["evicted_tokens"] == 0 and side.alloc.hashes_dropped == 0


def test_admission_query_is_side_effect_free_and_never_holds_a_request_back(model_dir):
    from vllm_sched_harness import make_request

    sched, fw = setup(model_dir, "vtoken", n=3, max_tokens=64)
    side = side_of(sched)
    for _ in range(64):
        fw.step()
        if side.manager.pending:
            break
    assert side.manager.pending  # reclamation pending at low memory: the old backpressure case
    sched.add_request(make_request("late", prompts(1, 40, 40, seed=7)[0], 8, BS))
    before = (side.summary(), side.manager.trigger.pending, dict(side._admitting))
    for _ in range(3):
        assert sched.connector.get_num_new_matched_tokens(sched.requests["late"], 0) == (0, False)
    assert (side.summary(), side.manager.trigger.pending, dict(side._admitting)) == before
    so = fw.step()
    assert "late" in so.num_scheduled_tokens
    fw.run()
    assert side.table.requests() == []


@pytest.mark.parametrize("mode, admits", [("naive", False), ("vtoken", True)])
def test_reclamation_frees_blocks_for_the_waiting_prompt(model_dir, mode, admits):
    """vLLM admits a waiting request by its whole prompt's blocks: vtoken reclaims for that demand too.

    33 usable blocks, prompts of 9 blocks: 3 requests are admitted, the 4th
    waits (6 free). After h2o halves the running requests, reclamation can
    free enough for it, but only if the trigger counts its prompt: the
    library's default trigger (no low-watermark override) saw only the
    running requests' growth and stopped ~2 blocks short.
    """
    sched, fw = setup(model_dir, mode, num_blocks=34, n=4, lo=144, hi=144, max_tokens=64, max_num_seqs=4,
                      reclaim={})
    side = side_of(sched)
    fw.step()
    assert [r.request_id for r in sched.running] == ["r0", "r1", "r2"]  # r3's 9 blocks do not fit
    while len(sched.running) < 4 and len(sched.requests) == 4:  # until r3 runs or a request finishes
        fw.step()
    assert (len(sched.running) == 4) == admits  # all four at once, before any request finished
    if admits:
        assert side.summary()["reclaimed_blocks"] >= 3
        assert side.manager.trigger.waiting_blocks == 0  # r3 admitted: no demand left
    fw.run()
    assert side.table.requests() == []


def test_no_eviction_before_the_whole_prompt_is_computed(model_dir):
    """Chunked prefill: a request becomes evictable only once its last prompt chunk is computed."""
    sched, fw = setup(model_dir, "vtoken", n=4, lo=150, hi=250, max_tokens=32, num_blocks=160,
                      max_num_seqs=4, max_num_batched_tokens=64)
    side = side_of(sched)
    decided, chunked = [], set()
    prompt_len = {rid: r.num_prompt_tokens for rid, r in sched.requests.items()}
    real_update = side.update_output

    def spy(worker_meta):
        for dec in worker_meta.decisions:
            # seq_len: the request's tokens when the worker decided (and killed) these victims
            decided.extend((rid, seq_len, prompt_len[rid]) for rid, seq_len, _ in dec.rows())
        return real_update(worker_meta)

    side.update_output = spy
    while sched.has_unfinished_requests():
        so = fw.step()
        for rid, n in so.num_scheduled_tokens.items():
            if 0 < n < prompt_len[rid]:
                chunked.add(rid)
    assert len(chunked) == 4 and len(decided) > 0
    assert all(seq_len > prompt for _, seq_len, prompt in decided), decided[:4]  # from the first decode step on
    assert side.summary()["evicted_tokens"] > 0


@pytest.mark.parametrize("drop", [True, False])
def test_blocks_filled_after_the_prompt_are_never_hashed_so_a_same_schedule_admission_cannot_hit_them(model_dir, drop):
    """A block a decode step fills gets no hash, not even in the schedule that fills it.

    vLLM hashes the block in ``allocate_slots`` of the running request, then
    admits the waiting ones in the same ``schedule()``: a new request whose
    prompt is the running request's whole sequence would hit that block,
    whose K/V were computed after evictions the scheduler learns only later.
    """
    from vllm_sched_harness import make_request

    h2o_sink = {"budget": 0.5, "window": 8, "sink": BS}  # block 0 survives: its hash stays, a hit is possible
    sched, fw = setup(model_dir, "naive", n=1, lo=80, hi=80, max_tokens=200, policy_config=h2o_sink,
                      reclaim={}, drop_tainted_hashes=drop)
    side = side_of(sched)
    a = sched.requests["r0"]
    prompt = a.num_prompt_tokens
    for _ in range(200):
        # The next schedule fills a block that starts after the prompt, and evictions happened.
        if side.summary()["evicted_tokens"] > 0 and a.num_tokens % BS == 0 and a.num_tokens - BS >= prompt:
            break
        fw.step()
    assert side.summary()["evicted_tokens"] > 0 and a.num_tokens - BS >= prompt
    sched.add_request(make_request("copy", list(a.all_token_ids) + [7, 8, 9], 4, BS))
    so = fw.step()
    new = {d.req_id: d for d in so.scheduled_new_reqs}
    hit = new["copy"].num_computed_tokens
    assert hit >= BS  # the clean prompt blocks are still shared
    if drop:
        assert hit <= prompt // BS * BS
    else:  # the same schedule hashed a block filled after the prompt and the copy hit it: what the default prevents
        assert hit > prompt
    fw.run()


def _decisions_of(sched):
    """Wrap the scheduler side's update_output to collect every applied decision as {(rid, seq_len): ids}."""
    side, out = side_of(sched), {}
    real = side.update_output

    def spy(worker_meta):
        for dec in getattr(worker_meta, "decisions", ()):
            for rid, seq_len, ids in dec.rows():
                out[(rid, seq_len)] = ids.tolist()
        return real(worker_meta)

    side.update_output = spy
    return out


@pytest.mark.parametrize("mode", ["naive", "vtoken"])
def test_async_scheduler_decides_and_reclaims_like_the_synchronous_one(model_dir, mode):
    """vLLM's AsyncScheduler schedules step N+1 before step N's output (and decisions) arrive."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    runs = {}
    for use_async in (False, True):
        sched, fw = setup(model_dir, mode, n=6, lo=40, hi=120, max_tokens=48, num_blocks=96,
                          max_num_batched_tokens=96, async_scheduling=use_async)
        assert isinstance(sched, AsyncScheduler) == use_async
        decisions = _decisions_of(sched)
        fw.run()  # every step checks each live token's bytes at its table slot
        side = side_of(sched)
        assert side.table.requests() == [] and not fw.in_flight
        assert fw.max_in_flight == (2 if use_async else 1)  # async: a step scheduled before the last output
        listed, usable = pool_accounts(sched)
        assert listed == usable  # no block leaked
        side.ledger.check_conservation()
        runs[use_async] = (decisions, side.summary(), fw.tokens)
    (d_sync, s_sync, t_sync), (d_async, s_async, t_async) = runs[False], runs[True]
    # The device kills a step's victims right after its forward in both: the same decisions, the same tokens.
    assert d_async == d_sync and len(d_sync) > 0
    assert t_async == t_sync
    assert s_async["evicted_tokens"] == s_sync["evicted_tokens"] > 0
    if mode == "vtoken":
        assert s_async["relocations"] > 0 and s_async["reclaimed_blocks"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_model_runner_v2_order_fills_the_attention_metadata_at_start_load_kv(model_dir, async_scheduling):
    """V2 builds attention metadata before handle_preemptions and names its rows only in start_load_kv.

    The harness drives vtoken's builder with V2-style ``CommonAttentionMetadata``
    (``req_idx``, rows in the runner's order, two padding rows as for a full
    CUDA graph), then the events, then ``prepare_step(request_ids)``; it checks
    each step that the metadata reads exactly the rows' live slots and that
    padding rows are empty. Decisions and bytes equal the V1 order's run.
    """
    runs = {}
    for v2 in (False, True):
        sched, fw = setup(model_dir, "vtoken", n=5, max_tokens=40, async_scheduling=async_scheduling, v2_builder=v2)
        decisions = _decisions_of(sched)
        fw.run()
        runs[v2] = (decisions, side_of(sched).summary()["evicted_tokens"], fw.tokens)
        if v2:
            assert len(fw.attention) == fw.steps
            # Fixed-address buffers: every step's metadata views the same storage.
            assert len({m.kv_indices.data_ptr() for _, m in fw.attention if m.kv_indices is not None}) == 1
            assert len({m.kv_indptr.data_ptr() for _, m in fw.attention if m.kv_indptr is not None}) == 1
    assert runs[True] == runs[False] and runs[True][1] > 0


def test_full_decode_graphs_opt_in_reports_uniform_decode_and_keeps_every_address(model_dir):
    """``full_decode_graphs``: the builder lets vLLM capture uniform decode; the slot lists never move."""
    from vllm.v1.attention.backend import AttentionCGSupport

    from vtoken.integrations.vllm.attention import VTokenAttentionMetadataBuilder

    runs = {}
    for full in (False, True):
        # NOTE: no prefix caching: the connector refuses it with full_decode_graphs (fixed lists sized by slots).
        sched, fw = setup(model_dir, "vtoken", n=5, max_tokens=40, v2_builder=True, full_decode_graphs=full,
                          prefix_caching=False)
        support = VTokenAttentionMetadataBuilder.get_cudagraph_support(sched.vllm_config, None)
        assert support == (AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE if full else AttentionCGSupport.NEVER)
        decisions = _decisions_of(sched)
        fw.run()
        runs[full] = (decisions, fw.tokens)
        if full:
            w = fw.worker
            metas = [m for _, m in fw.attention]
            assert w.buffers.nnz_max == w.fixed_slot_lists and w.stats["slot_list_grows"] == 0
            assert {m.kv_indices.data_ptr() for m in metas} == {w.buffers.kv_indices.data_ptr()}
            assert {m.kv_indices.numel() for m in metas} == {w.buffers.nnz_max}  # whole buffers: fixed shapes
            assert {m.kv_indptr.data_ptr() for m in metas} == {w.buffers.kv_indptr.data_ptr()}
            # Decode steps (padded rows included, as vLLM pads a captured batch) take the decode path.
            assert {m.uniform_decode for m in metas} == {False, True}
            assert all(m.uniform_decode == (int(m.query_lens.max()) == 1) for m in metas)
    assert runs[True] == runs[False]


def test_preemption_drops_the_request_and_its_blocks(model_dir):
    # A pool too small for every request: vLLM preempts (frees the blocks itself).
    sched, fw = setup(model_dir, "vtoken", n=6, lo=70, hi=90, max_tokens=64, num_blocks=30,
                      reclaim={**AGGRESSIVE, "headroom_blocks": 2})
    side = side_of(sched)
    preempted = 0
    while sched.has_unfinished_requests():
        so = fw.step()
        preempted += len(so.preempted_req_ids or ())
    assert preempted > 0
    assert side.table.requests() == []
    assert side.pool.get_num_free_blocks() + side.alloc.held == side.pool.num_gpu_blocks - 1
    side.ledger.check_conservation()


def test_request_preempted_then_aborted_before_the_next_step_frees_nothing_twice(model_dir):
    from vllm.v1.request import RequestStatus

    sched, fw = setup(model_dir, "naive", n=3, max_tokens=32)
    side = side_of(sched)
    fw.step()
    fw.step()
    assert sched.reset_prefix_cache(reset_running_requests=True)  # preempts every running request
    assert not side.stm.req_to_blocks and "r0" in side.table  # vLLM freed the blocks; vtoken not told yet
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)  # request_finished before any build_meta
    assert "r0" not in side.table
    assert side.pool.get_num_free_blocks() == side.pool.num_gpu_blocks - 1  # nothing freed twice
    fw.run()
    assert side.table.requests() == [] and side.pool.get_num_free_blocks() == side.pool.num_gpu_blocks - 1
    side.ledger.check_conservation()


# --------------------------------------------------------------------------- worker side pieces
def test_worker_metadata_aggregates_the_ranks_reports_by_step():
    from vtoken.errors import InvariantViolation
    from vtoken.integrations.vllm.meta import StepDecisions, VTokenWorkerMetadata

    def dec(step, ids):
        return StepDecisions(step, ("x",), np.array([20], np.int32), np.array([len(ids)], np.int32),
                             np.array(ids, np.int32))

    # Rank 0's record of step 4 reached its host, rank 1's did not yet: the union, in step order.
    a = VTokenWorkerMetadata(5, [dec(3, [1, 2]), dec(4, [5])])
    b = VTokenWorkerMetadata(5, [dec(3, [1, 2])])
    c = a.aggregate(b)
    assert [d.step for d in c.decisions] == [3, 4] and c.nbytes == a.nbytes
    assert [d.step for d in b.aggregate(a).decisions] == [3, 4]
    with pytest.raises(InvariantViolation, match="decided step 3 differently"):
        a.aggregate(VTokenWorkerMetadata(5, [dec(3, [1, 7])]))
    with pytest.raises(ValueError, match="other.step"):
        a.aggregate(VTokenWorkerMetadata(4, []))


def test_worker_slot_lists_grow_past_physical_slots_for_shared_prefixes():
    """100 requests over one 64-token shared prefix list 100x more keys than the cache has slots: no crash."""
    from vtoken.integrations.vllm.worker import WorkerSide

    num_blocks, bs, h, d = 8, 32, 2, 16
    w = WorkerSide(max_reqs=128, max_tokens=4096, max_moves=64)
    w.register_kv_caches({"layer0": torch.zeros(num_blocks, h, bs, 2 * d)})
    assert w.buffers.nnz_max == num_blocks * bs
    n, prefix = 100, np.arange(64)  # blocks 0 and 1, shared by every request
    events = [("add", r, f"r{r}") for r in range(n)]
    suffix = 64 + np.arange(n)  # each request's own next token (blocks 2..5)
    slots = np.concatenate([np.concatenate([prefix, [suffix[r]]]) for r in range(n)])
    events.append(("append", np.arange(n), np.full(n, 65), slots))
    w.mirror.apply(events)
    reqs = [f"r{r}" for r in range(n)]
    bufs = w.build_slot_lists(reqs, np.ones(n, dtype=np.int64))
    assert bufs.nnz_max >= n * 65 and w.stats["slot_list_grows"] == 1 and w._scores.numel() == bufs.nnz_max
    assert bufs.kv_indices[: n * 65].view(n, 65).tolist() == [prefix.tolist() + [int(suffix[r])] for r in range(n)]
    assert bufs.slot_mapping[:n].tolist() == suffix.tolist()


def test_attention_impl_writes_the_vllm_fused_layout():
    from vtoken.integrations.vllm.attention import VTokenAttentionImpl

    nb, h, d = 6, 2, 8
    impl = VTokenAttentionImpl(num_heads=4, head_size=d, scale=d ** -0.5, num_kv_heads=h)
    cache = torch.full((nb, h, BS, 2 * d), float("nan"))
    slots = random.Random(0).sample(range(BS, nb * BS), 7)
    key, value = torch.randn(8, h, d), torch.randn(8, h, d)
    sm = torch.tensor(slots + [-1])  # a PAD row is skipped
    before = cache.clone()
    impl.do_kv_cache_update(None, key, value, cache, sm)
    for i, s in enumerate(slots):
        assert torch.equal(cache[s // BS, :, s % BS, :d], key[i])
        assert torch.equal(cache[s // BS, :, s % BS, d:], value[i])
    written = torch.zeros(nb, BS, dtype=torch.bool)
    for s in slots:
        written[s // BS, s % BS] = True
    untouched = ~written[:, None, :, None].expand_as(cache)
    assert torch.equal(cache[untouched].isnan(), before[untouched].isnan())
    with pytest.raises(NotImplementedError, match="sliding_window"):
        VTokenAttentionImpl(num_heads=4, head_size=d, scale=1.0, num_kv_heads=h, sliding_window=128)


def test_plugin_routes_cpu_attention_only_for_the_vtoken_connector(model_dir):
    from vllm.config import KVTransferConfig, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vtoken.integrations.vllm import attention, plugin

    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is attention.VTokenAttentionBackend
    plain = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=32).create_engine_config()
    kvt = KVTransferConfig(kv_connector="VTokenConnector", kv_connector_module_path="vtoken.integrations.vllm.connector",
                           kv_role="kv_both", kv_connector_extra_config={"mode": "native"})
    ours = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=32,
                      kv_transfer_config=kvt).create_engine_config()
    with set_current_vllm_config(plain):
        assert AttentionBackendEnum.CPU_ATTN.get_class() is CPUAttentionBackend
    with set_current_vllm_config(ours):
        assert AttentionBackendEnum.CPU_ATTN.get_class() is attention.VTokenAttentionBackend


def test_connector_refuses_dual_batch_overlap_and_micro_batching(model_dir):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from vtoken.errors import InvalidArgumentError
    from vtoken.integrations.vllm.connector import VTokenConnector

    kvt = KVTransferConfig(kv_connector="VTokenConnector", kv_connector_module_path="vtoken.integrations.vllm.connector",
                           kv_role="kv_both", kv_connector_extra_config={"mode": "native"})
    cfg = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=32,
                     kv_transfer_config=kvt).create_engine_config()
    for field, value in (("enable_dbo", True), ("ubatch_size", 2)):
        setattr(cfg.parallel_config, field, value)
        with pytest.raises(InvalidArgumentError, match="enable_dbo / ubatch_size"):
            VTokenConnector(cfg, KVConnectorRole.SCHEDULER)
        setattr(cfg.parallel_config, field, type(value)(0))
    assert VTokenConnector(cfg, KVConnectorRole.SCHEDULER).scheduler_side is not None


# --------------------------------------------------------------------------- attention plan and workspaces
def _scored_worker(num_blocks, bs, h, d, hq, *, max_reqs=8, max_tokens=64, fixed=None, layers=3, seed=0):
    """A WorkerSide with an exact-score policy (H2O) and its attention workspace, over ``layers`` random caches."""
    from vtoken import policies
    from vtoken.integrations.vllm.workspace import AttentionWorkspace

    from vtoken.integrations.vllm.worker import WorkerSide

    gen = torch.Generator().manual_seed(seed)
    shape = AttentionWorkspace(num_q_heads=hq, head_dim=d, max_reqs=max_reqs, max_tokens=max_tokens, scores=True)
    w = WorkerSide(max_reqs=max_reqs, max_tokens=max_tokens, max_moves=16, policy=policies.get("h2o", **H2O),
                   fixed_slot_lists=fixed, attention=shape)
    caches = {f"layer{i}": torch.randn(num_blocks, h, bs, 2 * d, generator=gen) for i in range(layers)}
    w.register_kv_caches(caches)
    return w, list(caches.values()), shape


def _register(w, lens, slots):
    """Register requests r0.. with ``lens[i]`` tokens at ``slots`` (concatenated) in the worker's mirror."""
    n = len(lens)
    w.mirror.apply([("add", r, f"r{r}") for r in range(n)]
                   + [("append", np.arange(n), np.asarray(lens), np.asarray(slots))])
    return [f"r{r}" for r in range(n)]


def _meta(w, reqs, qlens, decode):
    from vtoken.integrations.vllm.attention import VTokenAttentionMetadata

    bufs = w.build_slot_lists(reqs, np.asarray(qlens))
    n, total = len(reqs), int(bufs.kv_indptr_host[len(reqs)])
    q_indptr = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32)
    kv_indices = bufs.kv_indices if w.fixed_slot_lists is not None else bufs.kv_indices[:total]  # as prepare_step
    return VTokenAttentionMetadata(int(sum(qlens)), n, q_indptr, kv_indices=kv_indices,
                                   kv_indptr=bufs.kv_indptr[: n + 1], want_scores=w.want_scores,
                                   uniform_decode=decode, worker=w)


# Triton (the GPU's plan, interpreted here) and vtoken._C's C++ CPU kernel (what vLLM on CPU runs).
ATTENTION_BACKENDS = ["triton"] + (["cuda"] if ops.has_extension_op("token_attention") else [])


@cpu_engine_triton  # the worker's CPU tensors under both backends (vLLM's CPU path)
@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("fixed", [None, 1 << 30], ids=["cut_at_total", "fixed_lists"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_attention_plans_once_per_step_and_every_layer_matches_the_reference(monkeypatch, decode, fixed, backend):
    """One plan (one validation) per step, run by every layer; outputs and summed key masses match the oracle."""
    monkeypatch.setenv("VTOKEN_BACKEND", backend)
    from test_token_attention import KEY_SCORE_TOL, UNIT_ROUNDOFF

    from vtoken.device import ops
    from vtoken.integrations.vllm.attention import VTokenAttentionImpl
    from vtoken.reference.token_attention import token_attention as ref_attention
    from vtoken_kernels import contracts

    nb, bs, h, d, hq = 12, 16, 2, 32, 4
    w, caches, shape = _scored_worker(nb, bs, h, d, hq, fixed=fixed)
    rng = random.Random(1)
    lens = [37, 1, 64, 20]
    reqs = _register(w, lens, rng.sample(range(nb * bs), sum(lens)))
    qlens = [1, 1, 1, 1] if decode else [5, 1, 9, 3]
    calls = {"plan": 0, "validate": 0, "key_scores": 0}
    plan, validate, run = ops.plan_token_attention, contracts.validate_token_attention_step_args, ops.TokenAttentionStep.run

    def count(name, fn):
        def spy(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return spy

    def run_spy(self, *a, **k):
        calls["key_scores"] += bool(k.get("return_key_scores"))  # the [nnz, kv_heads] allocation
        return run(self, *a, **k)

    monkeypatch.setattr(ops, "plan_token_attention", count("plan", plan))
    monkeypatch.setattr(contracts, "validate_token_attention_step_args", count("validate", validate))
    monkeypatch.setattr(ops.TokenAttentionStep, "run", run_spy)
    impl = VTokenAttentionImpl(num_heads=hq, head_size=d, scale=d ** -0.5, num_kv_heads=h)
    meta = _meta(w, reqs, qlens, decode)
    assert meta.kv_indices.numel() == (nb * bs if fixed else sum(lens))  # fixed: the whole buffer, PAD tail
    t = meta.num_actual_tokens
    gen = torch.Generator().manual_seed(2)
    qs = [torch.randn(t + 3, hq, d, generator=gen) for _ in caches]  # vLLM pads its query rows
    outs = []
    for q, cache in zip(qs, caches):  # the worker comes with the metadata
        out = torch.full((t + 3, hq, d), float("nan"))
        impl.forward(None, q, None, None, cache, meta, out)
        outs.append(out)
    assert calls == {"plan": 1, "validate": 1, "key_scores": 0} and w.stats["attention_plans"] == 1
    ws = w._workspace.untyped_storage().data_ptr()
    if backend == "triton":
        assert meta.plan.plan.lse.untyped_storage().data_ptr() == ws  # carved from the preallocated workspace
        if decode:
            assert meta.plan.plan.logits.untyped_storage().data_ptr() == ws
    else:
        assert isinstance(meta.plan.plan, ops.TokenAttentionExtensionPlan)
        assert meta.plan.plan.workspace.untyped_storage().data_ptr() == ws  # its key scores: a view of it
    # Oracle: the float64 reference per layer; key masses summed over layers and kv heads.
    lay = w.layout
    total = meta.kv_indices.numel()
    u = UNIT_ROUNDOFF[torch.float32]
    mass = torch.zeros(total, dtype=torch.float64)
    for q, cache, out in zip(qs, caches, outs):
        o, ks = ref_attention(q[:t].double(), cache.double(), lay, meta.kv_indices, meta.kv_indptr,
                              None if decode else meta.q_indptr, scale=d ** -0.5, return_key_scores=True)
        idx = meta.kv_indices[: sum(lens)].long()
        vmax = float(cache[idx // bs, :, idx % bs, d:].abs().max())
        torch.testing.assert_close(out[:t].double(), o, rtol=2 * u, atol=2 * u * vmax)
        assert out[t:].isnan().all()  # padding rows untouched
        mass += ks.sum(dim=1)
    torch.testing.assert_close(w.score_out[:total].double(), mass, rtol=KEY_SCORE_TOL["rtol"],
                               atol=KEY_SCORE_TOL["atol"] * len(caches) * hq * max(qlens))


@cpu_engine_triton  # forces Triton on the worker's CPU tensors
def test_grown_slot_lists_plan_decode_without_logits_and_keep_the_workspace(monkeypatch):
    """Shared prefixes list more keys than the workspace's entries: decode plans on the varlen path, same result."""
    monkeypatch.setenv("VTOKEN_BACKEND", "triton")  # the GPU's plan (on CPU tensors dispatch picks the C++ kernel)
    from vtoken.integrations.vllm.attention import VTokenAttentionImpl
    from vtoken.reference.token_attention import token_attention as ref_attention

    nb, bs, h, d, hq = 4, 16, 1, 16, 2
    w, caches, shape = _scored_worker(nb, bs, h, d, hq, max_reqs=8, layers=1)
    ws, entries = w._workspace.data_ptr(), w._workspace_entries
    assert entries == nb * bs and w._workspace.numel() == shape.attention_numel(nb * bs, "cpu")
    n, prefix = 6, np.arange(40)  # 6 requests x 41 keys = 246 entries > 64 slots
    slots = np.concatenate([np.concatenate([prefix, [40 + r]]) for r in range(n)])
    reqs = _register(w, [41] * n, slots)
    meta = _meta(w, reqs, [1] * n, decode=True)
    assert w.stats["slot_list_grows"] == 1 and meta.kv_indices.numel() == 41 * n > entries
    impl = VTokenAttentionImpl(num_heads=hq, head_size=d, scale=d ** -0.5, num_kv_heads=h)
    q = torch.randn(n, hq, d, generator=torch.Generator().manual_seed(3))
    out = torch.full((n, hq, d), float("nan"))
    impl.forward(None, q, None, None, caches[0], meta, out)
    assert not meta.plan.args.decode and meta.plan.plan.logits.numel() == 1  # no [hq, entries] logits
    assert w._workspace.data_ptr() == ws and w._workspace_entries == entries  # never reallocated
    o, ks = ref_attention(q.double(), caches[0].double(), w.layout, meta.kv_indices, meta.kv_indptr, None,
                          scale=d ** -0.5, return_key_scores=True)
    u, idx = 2.0**-16, meta.kv_indices.long()  # fp32's row of tests/test_token_attention.py's tolerance table
    vmax = float(caches[0][idx // bs, :, idx % bs, d:].abs().max())
    torch.testing.assert_close(out.double(), o, rtol=2 * u, atol=2 * u * vmax)
    torch.testing.assert_close(w.score_out[: 41 * n].double(), ks.double().sum(dim=1), rtol=1e-4, atol=1e-5 * hq)


def test_fixed_slot_lists_and_workspace_are_sized_by_the_kv_cache_slots():
    """Full decode graphs: the fixed lists hold the KV cache's slots, not max_num_seqs x max_model_len."""
    from vtoken_kernels.token_attention import workspace_numel

    nb, bs, h, d, hq = 10, 16, 2, 32, 8
    logical = 256 * 131072  # vLLM's defaults: 33.5M entries
    w, _, shape = _scored_worker(nb, bs, h, d, hq, max_reqs=256, max_tokens=8192, fixed=logical, layers=1)
    slots = nb * bs
    assert w.fixed_slot_lists == w.buffers.nnz_max == w._scores.numel() == w._entry_pos.numel() == slots
    expected = workspace_numel(num_q_tokens=8192, num_q_heads=hq, nnz_max=slots, head_dim=d, max_reqs=256,
                               scores=True, device="cpu")
    assert w._workspace.numel() == expected == 1 + 8192 * hq + hq * slots  # CPU: no split partials
    assert shape.nbytes(slots, "cpu") == 12 * slots + 4 * expected
    # A tiny model's bound is the logical one.
    w2, _, _ = _scored_worker(nb, bs, h, d, hq, max_reqs=2, fixed=2 * 50, layers=1)
    assert w2.buffers.nnz_max == 100


def test_listed_capacity_and_profile_reserve_bound_the_workspace_by_the_kv_capacity(model_dir):
    """The profiling reserve covers the workspaces of the most KV tokens the free memory could hold."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vtoken.errors import InvalidArgumentError
    from vtoken.integrations.vllm.workspace import listed_capacity, reserve_bytes_for, workspace_shape
    from vtoken.integrations.vllm.config import VTokenVLLMConfig
    from vllm_sched_harness import make_scheduler

    assert listed_capacity(1 << 20, 256, 131072) == 1 << 20
    assert listed_capacity(1 << 20, 4, 1000) == 4000
    with pytest.raises(InvalidArgumentError, match="num_slots: expected an int >= 1"):
        listed_capacity(0, 1, 1)
    sched = make_scheduler(model_dir, block_size=BS, num_blocks=64, prefix_caching=True, max_num_seqs=8,
                           max_num_batched_tokens=2048, async_scheduling=False, extra=extra("vtoken"))
    cfg = sched.vllm_config
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float16)
    specs = {f"l{i}": spec for i in range(4)}
    per_token = 4 * spec.page_size_bytes // BS  # 4 layers x K and V x 2 heads x 32 x 2 B = 1 KiB
    assert per_token == 1024
    shape = workspace_shape(cfg, VTokenVLLMConfig.from_extra_config(extra("vtoken")))
    assert shape.scores and shape.max_reqs == 8 and shape.max_tokens == 2048
    max_model_len = cfg.model_config.max_model_len
    free = 200 * per_token + 1000  # room for 200 tokens
    assert reserve_bytes_for(cfg, specs, free, "cpu") == shape.nbytes(min(200, 8 * max_model_len), "cpu")
    assert reserve_bytes_for(cfg, specs, 0, "cpu") == 0


def test_profile_run_holds_the_reserve_through_the_profiling_forward(monkeypatch):
    """The plugin's profile_run hook allocates the reserve before vLLM's profile and frees it after."""
    from vtoken.integrations.vllm import plugin, workspace

    seen = []

    class Runner:
        device = torch.device("cpu")

        def profile_run(self, randomize_inputs=False):
            r = self.vtoken_profile_reserve
            seen.append(None if r is None else (r.numel(), r.dtype))

    plugin._install_profile_hook(Runner)
    monkeypatch.setattr(workspace, "profile_reserve_bytes", lambda runner: 12345)
    runner = Runner()
    runner.profile_run()
    assert seen == [(12345, torch.uint8)] and runner.vtoken_profile_reserve is None  # held by the runner, then freed
    monkeypatch.setattr(workspace, "profile_reserve_bytes", lambda runner: 0)
    Runner().profile_run()
    assert seen[-1] is None


def test_connector_refuses_full_decode_graphs_with_prefix_caching(model_dir):
    from vllm_sched_harness import make_scheduler

    with pytest.raises(ValueError, match="enable_prefix_caching: expected False with full_decode_graphs"):
        make_scheduler(model_dir, block_size=BS, num_blocks=64, prefix_caching=True, max_num_seqs=8,
                       max_num_batched_tokens=2048, async_scheduling=False,
                       extra=extra("vtoken", full_decode_graphs=True))


def _common_metadata(num_reqs: int):
    """vLLM's CommonAttentionMetadata of a decode batch of ``num_reqs`` rows (what a runner hands the builders)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.arange(num_reqs + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=torch.ones(num_reqs, dtype=torch.int32),
        num_reqs=num_reqs, num_actual_tokens=num_reqs, max_query_len=1, max_seq_len=1,
        block_table_tensor=torch.zeros(num_reqs, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(num_reqs, dtype=torch.int64),
    )


def test_connector_binds_its_worker_to_the_layers_it_registers_and_the_metadata_carries_it(model_dir):
    """register_kv_caches binds the WorkerSide to the layers' attention; their builder puts it in the metadata."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vtoken.errors import InvariantViolation
    from vtoken.integrations.vllm.attention import VTokenAttentionImpl, VTokenAttentionMetadataBuilder
    from vtoken.integrations.vllm.connector import VTokenConnector

    kvt = KVTransferConfig(kv_connector="VTokenConnector", kv_connector_module_path="vtoken.integrations.vllm.connector",
                           kv_role="kv_both", kv_connector_extra_config={"mode": "native"})
    cfg = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="float32", block_size=BS,
                     kv_transfer_config=kvt).create_engine_config()
    h, d = 2, 16
    layers = cfg.compilation_config.static_forward_context
    for i in range(2):  # the model's attention layers, as vLLM registers them when it builds the model
        layers[f"l{i}"] = SimpleNamespace(impl=VTokenAttentionImpl(num_heads=h, head_size=d, scale=1.0, num_kv_heads=h))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=h, head_size=d, dtype=torch.float32)
    builder = VTokenAttentionMetadataBuilder(spec, ["l0", "l1"], cfg, torch.device("cpu"))
    assert builder.worker is None
    meta = builder.build(0, _common_metadata(2))  # profiling: no worker yet, no KV to read
    assert meta.worker is None and meta.kv_indices is None
    conn = VTokenConnector(cfg, KVConnectorRole.WORKER)
    conn.register_kv_caches({f"l{i}": torch.zeros(8, h, BS, 2 * d) for i in range(2)})
    w = conn.worker_side
    assert builder.worker is w and all(layers[f"l{i}"].impl.worker is w for i in range(2))
    # The V1 runner's build with no row order handed over (no plugin hook) is refused, naming the hook.
    with pytest.raises(InvariantViolation, match="batch order was not published"):
        builder.build(0, _common_metadata(2))
    builder.batch_req_ids = None  # a dummy batch: the worker, no slot lists
    meta = builder.build(0, _common_metadata(2))
    assert meta.worker is w and meta.kv_indices is None and meta.req_ids is None


def test_v1_runner_hook_hands_the_row_order_to_the_builders_for_the_build_only(model_dir):
    """The plugin's hook sets each vtoken builder's batch_req_ids around a build (None in a dummy run), then unsets it."""
    from types import SimpleNamespace

    from vtoken.integrations.vllm import plugin
    from vtoken.integrations.vllm.attention import UNPUBLISHED

    sched, fw = setup(model_dir, "vtoken", n=1, v2_builder=True)
    builder = fw.builder
    seen = []

    class Runner:
        def __init__(self):
            self.attn_groups = [[SimpleNamespace(metadata_builders=[builder])]]
            self.input_batch = SimpleNamespace(req_ids=["a", "b", "c"])

        def _build_attention_metadata(self, num_tokens, num_reqs, **kw):
            seen.append(builder.batch_req_ids)

        def _dummy_run(self, num_tokens):
            self._build_attention_metadata(num_tokens, num_reqs=1)

    plugin._install_batch_order_hook(Runner)
    plugin._install_batch_order_hook(Runner)  # idempotent
    r = Runner()
    r._build_attention_metadata(4, 2)
    r._dummy_run(8)
    r._build_attention_metadata(4, num_reqs=3)
    assert seen == [["a", "b"], None, ["a", "b", "c"]]
    assert builder.batch_req_ids is UNPUBLISHED  # nothing outlives the build


def test_integrations_vllm_keeps_no_process_global_state():
    """No module of integrations/vllm holds the worker, the batch or a reserve in a module-level global."""
    import ast
    import pathlib

    import vtoken.integrations.vllm as pkg

    # NOTE: the plugin's one-shot registration flag (vLLM calls register() in every process it
    # starts) is the only name a function may rebind; it holds no worker, batch or tensor.
    rebinding_allowed = {("plugin.py", "_REGISTERED")}
    constant_calls = {"object", "getLogger", "init_logger"}  # a sentinel, the loggers
    bad = []
    for path in sorted(pathlib.Path(pkg.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            names = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     if isinstance(t, ast.Name)]
            if names == ["__all__"]:
                continue
            v = node.value
            if isinstance(v, ast.Call):
                fn = v.func.attr if isinstance(v.func, ast.Attribute) else getattr(v.func, "id", "")
                if fn not in constant_calls:
                    bad.append((path.name, names, ast.unparse(v)))  # threading.local(), Lock(), dict(), ...
            elif isinstance(v, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
                bad.append((path.name, names, ast.unparse(v)))
            elif isinstance(v, ast.Constant) and v.value is None:
                bad.append((path.name, names, "None"))  # a slot filled at run time
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                bad += [(path.name, [n], "global") for n in node.names if (path.name, n) not in rebinding_allowed]
    assert bad == []


# --------------------------------------------------------------------------- vLLM's prefix-cache reset
def test_reset_prefix_cache_succeeds_with_vtokens_stash(model_dir):
    """vLLM resets its prefix cache only with no block in use: vtoken hands its stash back for the reset and takes
    it again after (every reset failed before: the stash's blocks counted as in use)."""
    sched, fw = setup(model_dir, "vtoken", policy="h2o", policy_config=H2O, reclaim=AGGRESSIVE)
    side = side_of(sched)
    fw.run()
    held = side.alloc.held
    assert held > 0  # the stash is there when the reset comes
    assert sched.reset_prefix_cache()
    assert side.alloc.held == held and side.ledger.reserved == held
    free_plus_listed, usable = pool_accounts(sched)
    assert free_plus_listed == usable


@pytest.mark.parametrize("mode, async_scheduling", [("vtoken", False), ("naive", True)])
def test_reset_running_requests_mid_run_preempts_and_the_run_completes(model_dir, mode, async_scheduling):
    """reset_prefix_cache(reset_running_requests=True) between two steps preempts every running request (their
    lists are gone before build_meta hears of it). Synchronous: the reset succeeds. Async: a step is in flight, so
    vLLM defers the preempted blocks' free and its reset raises, after preempting; the step's output, carrying
    the workers' decisions for those requests, arrives next: the decisions are stale, not applied to a list vLLM
    no longer has (that raised InvariantViolation before). Either way every request completes and the pool
    balances."""
    sched, fw = setup(model_dir, mode, policy="h2o", policy_config=H2O, reclaim=AGGRESSIVE,
                      async_scheduling=async_scheduling, max_tokens=32)
    side = side_of(sched)
    for _ in range(200):
        fw.step()
        running = [r for r in side.table.requests() if side.table.num_tokens(r) > 0]
        if side.stats["decisions_applied"] and running and (not async_scheduling or fw.in_flight):
            break
    assert running
    stale = side.stats["stale_decisions"]
    if async_scheduling:
        with pytest.raises(RuntimeError, match="Failed to reset KV cache"):
            sched.reset_prefix_cache(reset_running_requests=True)
        assert all(r not in side.stm.req_to_blocks for r in running)
        sched.update_from_output(*fw.in_flight.pop(0))
        assert side.stats["stale_decisions"] > stale
    else:
        assert sched.reset_prefix_cache(reset_running_requests=True)
        assert all(r not in side.stm.req_to_blocks for r in running)
    fw.run()
    assert side.table.requests() == [] and not sched.has_unfinished_requests()
    free_plus_listed, usable = pool_accounts(sched)
    assert free_plus_listed == usable
