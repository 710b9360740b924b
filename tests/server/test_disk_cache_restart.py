"""A server restarted on the same ``--kv-disk-cache`` directory answers a prompt it saw before from
disk: the same greedy text, ``cached_tokens`` counting the disk hits, and the disk tier in
``/metrics`` and ``/v1/kvserve/cache``."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx

from tests.server.conftest import _wait_healthy, free_port

PROMPT = "A short history of paper: " + "papyrus, parchment, rag paper and wood pulp; " * 20


def _serve(disk, log):
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve", "serve", "smollm2", "--port", str(port), "-c", "512",
           "--max-num-seqs", "2", "--cache-type", "f32", "--kv-disk-cache", str(disk), "--no-access-log"]
    with open(log, "ab") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(proc, url, log)
    return proc, url


def _stop(proc):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled


def _ask(url):
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def _metric(url, name):
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_restarted_server_answers_from_the_disk_cache(tmp_path):
    disk, log = tmp_path / "kv", tmp_path / "server.log"
    proc, url = _serve(disk, log)
    try:
        cold = _ask(url)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        written = httpx.get(f"{url}/v1/kvserve/cache").json()["disk_cache"]
        assert written["directory"] == str(disk)
    finally:
        _stop(proc)
    prompt_tokens = cold["usage"]["prompt_tokens"]
    assert len(list(disk.rglob("*.kvb"))) >= prompt_tokens // 16  # flushed at shutdown

    proc, url = _serve(disk, log)
    try:
        warm = _ask(url)
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (prompt_tokens - 1) // 16 * 16
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert _metric(url, 'kvserve_prefix_cache_disk_hits_total{model="smollm2"}') == cached
        assert _metric(url, 'kvserve_disk_cache_read_bytes_total{model="smollm2"}') > 0
        snap = httpx.get(f"{url}/v1/kvserve/cache").json()
        assert snap["prefix_cache_disk_hits"] == cached and snap["disk_cache"]["blocks_read"] == cached // 16
        assert snap["disk_cache"]["rejected_files"] == 0
    finally:
        _stop(proc)
