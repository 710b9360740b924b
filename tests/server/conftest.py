"""One real ``kvserve serve`` process on 127.0.0.1 for the whole session, killed at teardown.

Its settings are chosen for the tests: f32 KV (greedy output is then identical batched or alone),
8 sequences at once, at most 4 waiting, a 512-token context and a 64 KiB body limit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key-123"
NUM_CTX = 512
MAX_NUM_SEQS = 8
MAX_WAITING = 4
MAX_BODY = 64 * 1024


@dataclass
class Server:
    url: str
    api_key: str
    log: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, timeout: float | httpx.Timeout = 120) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def cache(self) -> dict:
        with self.client() as c:
            r = c.get("/v1/kvserve/cache")
            r.raise_for_status()
            return r.json()

    def metrics(self) -> dict[str, float]:
        """Prometheus samples by ``name{labels}``."""
        with self.client() as c:
            text = c.get("/metrics").text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                samples[key] = float(value)
        return samples

    def loaded_cache(self) -> dict:
        """``cache()``, the model loaded first where the server has unloaded it (a 409 there): the
        unload and its reason are written beside the server's log, for whoever wonders why."""
        with self.client() as c:
            r = c.get("/v1/kvserve/cache")
            if r.status_code == 409:
                events = c.get("/v1/kvserve/models").json()
                with open(self.log.with_name("unloads.log"), "a") as f:
                    f.write(f"{time.strftime('%H:%M:%S')} {r.text} {events}\n")
                c.post("/api/generate", json={"model": "smollm2", "prompt": ""}).raise_for_status()
                r = c.get("/v1/kvserve/cache")
            r.raise_for_status()
            return r.json()

    def wait_idle(self, timeout: float = 60) -> dict:
        """Waits until no request runs or waits; returns the cache snapshot."""
        deadline = time.monotonic() + timeout
        while True:
            snap = self.loaded_cache()
            if not snap["requests"] and snap["num_running"] == 0 and snap["num_waiting"] == 0:
                return snap
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not become idle: {snap}")
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    # exact weights on every CPU: tests here assert greedy answers (Paris, tool calls), which the
    # q4-fast that --weights auto takes on CPUs without a fused dot product can flip, as llama.cpp's do
    yield from serve(tmp_path_factory, "smollm2", "-c", str(NUM_CTX), "--max-num-seqs", str(MAX_NUM_SEQS),
                     "--max-waiting", str(MAX_WAITING), "--cache-type", "f32", "--weights", "q4",
                     "--max-body-size", str(MAX_BODY), "--embedding-model", "all-minilm")


@pytest.fixture(scope="session")
def coder(tmp_path_factory):
    """Qwen2.5-Coder-0.5B: fill-in-the-middle tokens, and the tool-call family local agents run."""
    yield from serve(tmp_path_factory, "qwen2.5-coder-0.5b", "-c", "1024", "--max-num-seqs", "4")


# `python -c` running kvserve with every `import torch` refused, as on an install without torch
WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = 'kvserve'; "
                 "runpy.run_module('kvserve', run_name='__main__')")


def serve(tmp_path_factory, model: str | list[str], *args: str, without_torch: bool = False):
    """A ``kvserve serve MODEL ARGS`` (MODEL ... for a list) on a free port with the tests' API key, until
    the generator ends; ``without_torch``: in a process that cannot import torch."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    models = [model] if isinstance(model, str) else model
    python = [sys.executable, "-c", WITHOUT_TORCH] if without_torch else [sys.executable, "-m", "kvserve"]
    cmd = [*python, "serve", *models, "--host", "127.0.0.1", "--port", str(port),
           *args, "--api-key", API_KEY, "--no-access-log"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, log)
        yield Server(url, API_KEY, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server was not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def idle(server: Server) -> Server:
    """The server, checked to hold no blocks before and after the test (no leaked requests)."""
    server.wait_idle()
    yield server
    snap = server.wait_idle()
    assert snap["held_blocks"] == [] and snap["num_free_blocks"] == snap["num_blocks"], snap
