"""Start vLLM's OpenAI-compatible server (the CPU build) as a subprocess; read its /metrics.

Used by ``tests/test_vllm_server.py`` and ``bench/bench_serve.py``. The CPU
build's ``vllm`` console script cannot run (it asks for the "vllm"
distribution), so the server starts from its module,
``python -m vllm.entrypoints.openai.api_server``.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

CONNECTOR = {"kv_connector": "VTokenConnector", "kv_connector_module_path": "vtoken.integrations.vllm.connector",
             "kv_role": "kv_both"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model_dir: str, port: int, *, extra: dict | None, block_size: int = 32, num_blocks: int = 128,
                   max_model_len: int = 1024, max_num_seqs: int = 32, served_name: str = "model") -> list[str]:
    """The server's argv; ``extra`` is the connector's ``kv_connector_extra_config`` (None: no connector)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
           # CPU: no compilation (it takes minutes), CPU_ATTN needs blocks of a multiple of 32 tokens.
           "--enforce-eager", "-O0", "--dtype", "float32", "--seed", "0", "--block-size", str(block_size),
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           # The same KV budget in every mode: num_blocks blocks (the byte size only has to hold them).
           "--num-gpu-blocks-override", str(num_blocks), "--kv-cache-memory-bytes", str(256 << 20),
           "--disable-uvicorn-access-log"]
    if extra is not None:
        cmd += ["--kv-transfer-config", json.dumps({**CONNECTOR, "kv_connector_extra_config": extra})]
    return cmd


def server_env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the CPU build has no Triton backend: vtoken's CPU ops run inside vLLM
    env.setdefault("VTOKEN_DEBUG_INVARIANTS", "0")
    return env


class Server:
    """One server process (its own process group); ``stop()`` ends it and its engine core."""

    def __init__(self, cmd: list[str], port: int, env: dict | None = None):
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm_server_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env or server_env(),
                                     start_new_session=True)

    def log_tail(self, n: int = 6000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-n:]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"vLLM server not ready after {timeout} s:\n{self.log_tail()}")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()

    def metrics(self) -> dict:
        return read_metrics(self.base_url)


def read_metrics(base_url: str) -> dict:
    """The vllm:* samples of /metrics: ``{"name{labels}": value}`` plus ``{"name": value}`` for single samples."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
        name = key.split("{", 1)[0]
        out[name] = float(value) if name not in out else out[name]
    return out


def metric(m: dict, name: str, **labels) -> float:
    """One sample of ``name`` whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    hits = [v for k, v in m.items() if k.split("{", 1)[0] == name and all(w in k for w in want) and "{" in k]
    if len(hits) != 1:
        raise KeyError(f"{name} {labels}: {len(hits)} samples")
    return hits[0]
