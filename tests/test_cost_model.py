"""The H200 roofline step model (vtoken.experiments.cost_model), checked against hand computations."""
from __future__ import annotations

import doctest

import pytest

from vtoken.errors import InvalidArgumentError
from vtoken.experiments import cost_model
from vtoken.errors import InvalidTypeError
from vtoken.experiments.cost_model import H200Roofline, ModelShape, ModeledClock


def test_the_shapes_have_their_published_parameter_counts():
    assert ModelShape.llama_8b().params == 8_030_261_248  # Llama-3-8B: 8.03B
    assert ModelShape.mistral_7b().params == 7_241_732_096  # Mistral-7B: 7.24B
    assert ModelShape.llama_8b().kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, bf16: 128 KiB


def test_a_step_is_the_longer_of_memory_and_compute_plus_the_overhead():
    m = ModelShape("toy", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                   head_dim=4, vocab_size=10)
    layer = 8 * 2 * 4 + 2 * 8 * 1 * 4 + 2 * 4 * 8 + 3 * 8 * 16 + 2 * 8
    assert m.layer_params == layer and m.matmul_params == 2 * layer + 80 and m.weight_bytes == (2 * layer + 88) * 2
    r = H200Roofline(hbm_bandwidth=1000.0, flops_rate=1e6, mfu=0.5, step_overhead=0.25)
    # decode, two requests of 3 and 5 live tokens (new one included): memory-bound here
    nbytes = m.weight_bytes + m.kv_bytes_per_token * (3 + 5)
    flops = 2 * m.matmul_params * 2 + 4 * 2 * 2 * 4 * (3 + 5)
    assert r.decode_seconds(m, [3, 5]) == pytest.approx(max(nbytes / 1000, flops / 5e5) + 0.25, rel=1e-12)
    # prefill: 4 new tokens after 2 live ones attend 4 * 2 + 10 pairs; compute-bound at a slow rate
    slow = H200Roofline(hbm_bandwidth=1e12, flops_rate=10.0, mfu=1.0, step_overhead=0.0)
    flops = 2 * m.matmul_params * 4 + 4 * 2 * 2 * 4 * (8 + 10)
    assert slow.prefill_seconds(m, [(2, 4)]) == pytest.approx(flops / 10.0, rel=1e-12)
    assert r.step_seconds(m, new_tokens=0, kv_tokens_read=0, attended_pairs=0) == 0.0  # no work, no step


def test_on_an_h200_a_bigger_decode_batch_is_nearly_free():
    m, r = ModelShape.llama_8b(), H200Roofline()
    one, many = r.decode_seconds(m, [1024]), r.decode_seconds(m, [1024] * 32)
    assert many < 1.5 * one  # 32x the requests, weights read once: memory-bound on the weights


@pytest.mark.parametrize("kw, match", [
    (dict(hbm_bandwidth=0), "hbm_bandwidth"), (dict(mfu=1.5), "mfu"), (dict(step_overhead=-1.0), "step_overhead"),
    (dict(flops_rate=True), "flops_rate"),
])
def test_bad_parameters_are_refused_by_name(kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        H200Roofline(**kw)
    with pytest.raises(InvalidArgumentError, match="num_heads"):
        ModelShape("bad", 1, 8, 8, 3, 2, 4, 10)


TOY = ModelShape("toy", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                 head_dim=4, vocab_size=10)


def test_a_mixed_step_is_one_roofline_over_every_request():
    r = H200Roofline(hbm_bandwidth=1000.0, flops_rate=1e6, mfu=0.5, step_overhead=0.25)
    # a chunk of 4 new tokens after 6 live ones, and two decodes attending 9 and 2 tokens before theirs
    got = r.batch_seconds(TOY, [6, 9, 2], [4, 1, 1])
    pairs = (4 * 6 + 4 * 5 // 2) + (9 + 1) + (2 + 1)
    want = r.step_seconds(TOY, new_tokens=6, kv_tokens_read=6 + 9 + 2, attended_pairs=pairs)
    assert got == want
    assert r.batch_seconds(TOY, [9, 2], [1, 1]) == r.decode_seconds(TOY, [10, 3])
    assert r.batch_seconds(TOY, [6, 0], [4, 3]) == r.prefill_seconds(TOY, [(6, 4), (0, 3)])
    assert r.batch_seconds(TOY, [], []) == 0.0  # no request, no step


def test_kv_blocks_is_what_vllm_leaves_for_the_cache():
    r = H200Roofline(hbm_bytes=1e6)
    weights = TOY.params * 2
    per_block = TOY.kv_bytes_per_token * 4
    assert r.kv_blocks(TOY, 4, memory_utilization=0.5) == int((0.5e6 - weights) // per_block)
    assert H200Roofline().kv_blocks(ModelShape.llama_8b(), 16) == int((0.9 * 141e9 - 8_030_261_248 * 2) // 2**21)


@pytest.mark.parametrize("call, err, match", [
    (lambda r: r.batch_seconds(TOY, [1, 2], [1]), InvalidArgumentError, "new"),
    (lambda r: r.batch_seconds(TOY, [1], [0]), InvalidArgumentError, "new"),
    (lambda r: r.batch_seconds(TOY, [-1], [1]), InvalidArgumentError, "past"),
    (lambda r: r.decode_seconds(TOY, [0]), InvalidArgumentError, "live_tokens"),
    (lambda r: r.kv_blocks(TOY, 4, memory_utilization=0.0), InvalidArgumentError, "memory_utilization"),
    (lambda r: r.kv_blocks(ModelShape.llama_8b(), 16, memory_utilization=0.1), InvalidArgumentError,
     "memory_utilization"),
    (lambda r: r.kv_blocks(TOY, 0), InvalidArgumentError, "block_size"),
    (lambda r: ModeledClock("llama"), InvalidTypeError, "shape"),
    (lambda r: ModeledClock(TOY, roofline={}), InvalidTypeError, "roofline"),
])
def test_bad_step_arguments_are_refused_by_name(call, err, match):
    with pytest.raises(err, match=match):
        call(H200Roofline())


def test_a_modeled_clock_adds_up_its_steps():
    r = H200Roofline(hbm_bandwidth=1000.0, flops_rate=1e6, mfu=0.5, step_overhead=0.25)
    clock = ModeledClock(TOY, r)
    steps = [([0, 0], [3, 5]), ([3, 5], [1, 1]), ([4, 6], [1, 1])]
    dts = [clock.advance(p, n) for p, n in steps]
    assert dts == [r.batch_seconds(TOY, p, n) for p, n in steps]
    assert clock.now == dts[0] + dts[1] + dts[2] and clock.steps == 3


def test_docstring_example_runs():
    failures, _ = doctest.testmod(cost_model)
    assert failures == 0
