"""vLLM's OpenAI-compatible server with vtoken's connector, end to end, driven by the ``openai`` client.

On vtoken's export of SmolLM2-135M-Instruct (CPU, eager), h2o at ratio 0.5,
sink 4, window 32. One vtoken server serves most tests, one naive server
the equality check (each start takes 1-3 min on a 2-core machine):

- chat completions and streaming (the streamed text is the whole reply's);
- 16 concurrent requests (AsyncOpenAI), all complete, batched together;
- a client that disconnects mid-stream: vLLM aborts the request and the
  KV pool returns to its starting usage (vllm:kv_cache_usage_perc, which
  counts vtoken's headroom stash as used: it is taken at the first step);
- naive == vtoken texts at temperature 0 without memory pressure;
- a bad ``kv_connector_extra_config`` fails the server at startup (when vLLM
  builds its config, before any weight is loaded), naming the key.

The servers run with vtoken's debug checks off, as deployed (the e2e tests
run them).
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from vtoken.integrations.vllm import vllm_available

VLLM_OK, VLLM_WHY = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_OK, reason=f"needs vllm 0.32: {VLLM_WHY}")]

START_TIMEOUT = 600  # s; a start takes 1-3 min on the loaded 2-core dev machine
H2O = {"policy": "h2o", "policy_config": {"budget": 0.5, "window": 32, "sink": 4}}
CHATS = [
    "What is the capital of Japan?",
    "List three tips for staying focused while studying.",
    "Tell a short story about a robot who learns to paint.",
    "Explain in two sentences why the sky is blue.",
]
NAME = "smollm2"


@pytest.fixture(scope="module")
def smollm2_dir():
    pytest.importorskip("gguf")
    pytest.importorskip("openai")
    from vtoken.checkpoints.loader import exported_dir

    return exported_dir("smollm2")


def _serve(model_dir, extra):
    from vllm_server_helper import Server, free_port, server_command, server_env

    port = free_port()
    # NOTE: vtoken's debug checks off, as deployed (the e2e tests run them): each start and
    # step is several times slower with them on this 2-core machine.
    server = Server(server_command(model_dir, port, extra=extra, served_name=NAME), port,
                    env={**server_env(), "VTOKEN_DEBUG_INVARIANTS": "0"})
    try:
        server.wait_ready(START_TIMEOUT)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def vtoken_server(smollm2_dir):
    server = _serve(smollm2_dir, {"mode": "vtoken", **H2O})
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(vtoken_server):
    from openai import OpenAI

    return OpenAI(base_url=vtoken_server.base_url + "/v1", api_key="unused", timeout=300, max_retries=0)


def _chat(client, text, max_tokens=24, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}],
                                          temperature=0.0, max_tokens=max_tokens, **kw)


def _texts(base_url):
    from openai import OpenAI

    c = OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=300, max_retries=0)
    # One at a time: the same batches in both servers, so the same arithmetic.
    return [_chat(c, t, max_tokens=48).choices[0].message.content for t in CHATS]


def _wait_idle(server, timeout=120.0) -> dict:
    from vllm_server_helper import metric

    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:num_requests_waiting") == 0:
            return m
        assert time.monotonic() < deadline, f"requests still running after {timeout} s"
        time.sleep(0.5)


def test_chat_completion(client):
    r = _chat(client, CHATS[0])
    assert r.choices[0].finish_reason in ("stop", "length")
    assert "Tokyo" in r.choices[0].message.content, r.choices[0].message.content
    assert r.usage.completion_tokens > 0


def test_streaming_gives_the_whole_reply(client):
    whole = _chat(client, CHATS[3]).choices[0].message.content
    parts = []
    for chunk in _chat(client, CHATS[3], stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    assert len(parts) > 1
    assert "".join(parts) == whole


def test_16_concurrent_requests_all_complete_batched(vtoken_server):
    from openai import AsyncOpenAI
    from vllm_server_helper import metric

    n, max_tokens = 16, 16
    peak = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            peak.append(metric(vtoken_server.metrics(), "vllm:num_requests_running"))
            time.sleep(0.2)

    async def main():
        c = AsyncOpenAI(base_url=vtoken_server.base_url + "/v1", api_key="unused", timeout=600, max_retries=0)
        reqs = [c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                                          temperature=0.0, max_tokens=max_tokens, extra_body={"ignore_eos": True})
                for i in range(n)]
        return await asyncio.gather(*reqs)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        outs = asyncio.run(main())
    finally:
        stop.set()
        poller.join(10)
    assert len(outs) == n
    assert all(o.usage.completion_tokens == max_tokens and o.choices[0].finish_reason == "length" for o in outs)
    assert max(peak) > 1  # served together, not one after another
    _wait_idle(vtoken_server)


MAX_LONG = 900  # far more than the client waits for (prompt + MAX_LONG within max_model_len 1024)


def _finished(m) -> float:
    from vllm_server_helper import metric

    return sum(metric(m, "vllm:request_success_total", finished_reason=r)
               for r in ("stop", "length", "abort", "error", "repetition"))


def test_client_disconnect_mid_stream_aborts_and_leaks_no_block(client, vtoken_server):
    from vllm_server_helper import metric

    _chat(client, CHATS[0], max_tokens=4)  # the first step takes vtoken's headroom stash: start after it
    start = _wait_idle(vtoken_server)
    usage0 = metric(start, "vllm:kv_cache_usage_perc")
    tokens0 = metric(start, "vllm:generation_tokens_total")
    finished0 = _finished(start)
    stream = _chat(client, CHATS[2], max_tokens=MAX_LONG, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 8:
            break
    during = vtoken_server.metrics()
    stream.close()  # the client goes away mid-stream
    assert metric(during, "vllm:num_requests_running") == 1
    assert metric(during, "vllm:kv_cache_usage_perc") > usage0  # the request holds blocks
    end = _wait_idle(vtoken_server)
    # Aborted: it stopped far short of its max_tokens, and no request finished (vLLM 0.32 counts
    # no "abort" in vllm:request_success_total for a client disconnect).
    assert 8 <= metric(end, "vllm:generation_tokens_total") - tokens0 < MAX_LONG
    assert _finished(end) == finished0
    assert metric(end, "vllm:kv_cache_usage_perc") == usage0


@pytest.fixture(scope="module")
def vtoken_texts(vtoken_server):
    return _texts(vtoken_server.base_url)


def test_naive_and_vtoken_servers_give_the_same_texts(smollm2_dir, vtoken_texts):
    server = _serve(smollm2_dir, {"mode": "naive", **H2O})
    try:
        naive = _texts(server.base_url)
    finally:
        server.stop()
    assert all(naive)
    assert naive == vtoken_texts


BAD = {
    "unknown key": ({"mode": "vtoken", **H2O, "bogus_key": 1}, "bogus_key"),
    "unknown policy": ({"mode": "vtoken", "policy": "no_such_policy"}, "no_such_policy"),
    "budget 1.5": ({"mode": "vtoken", "policy": "h2o", "policy_config": {"budget": 1.5}}, "budget"),
}


@pytest.fixture(scope="module")
def bad_starts(smollm2_dir):
    """The three bad configs' servers, started together; each must exit by itself."""
    from vllm_server_helper import Server, free_port, server_command

    servers = {}
    try:
        for label, (extra, _) in BAD.items():
            port = free_port()
            servers[label] = Server(server_command(smollm2_dir, port, extra=extra, served_name=NAME), port)
        out = {}
        for label, s in servers.items():
            rc = s.wait_exit(START_TIMEOUT)
            out[label] = (rc, s.log_tail(20000))
        return out
    finally:
        for s in servers.values():
            s.stop()


@pytest.mark.parametrize("label", list(BAD))
def test_bad_extra_config_fails_at_startup_naming_the_key(bad_starts, label):
    rc, log = bad_starts[label]
    key = BAD[label][1]
    assert rc != 0, log
    assert "InvalidArgumentError" in log and key in log, log
    # Refused when vLLM builds its config: no engine was started, no weight loaded.
    assert "Loading weights took" not in log and "EngineCore" not in log, log
