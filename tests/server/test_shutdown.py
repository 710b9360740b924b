"""SIGTERM while answers stream: every stream ends with a final error event (SSE: an error object,
then [DONE]; NDJSON: an "error" line), the process exits by itself, and nothing is logged as a
traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx

from tests.server.conftest import _wait_healthy, free_port


def _start(tmp_path) -> tuple[subprocess.Popen, str, object]:
    port = free_port()
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "kvserve", "serve", "smollm2", "--port", str(port), "-c", "512",
           "--max-num-seqs", "4", "--no-access-log"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(proc, url, log)
    return proc, url, log


def _read_stream(url: str, path: str, body: dict, started: threading.Event, lines: list[str]) -> None:
    with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", path, json=body) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()


def test_sigterm_ends_every_stream_with_a_final_error_event(tmp_path):
    proc, url, log = _start(tmp_path)
    try:
        long = {"temperature": 0.8, "seed": 1, "max_tokens": 400, "stream": True}
        openai_lines: list[str] = []
        ollama_lines: list[str] = []
        started = [threading.Event(), threading.Event()]
        readers = [
            threading.Thread(target=_read_stream, args=(url, "/v1/completions", {
                "model": "smollm2", "prompt": "Once upon a time", "ignore_eos": True, **long}, started[0],
                openai_lines)),
            threading.Thread(target=_read_stream, args=(url, "/api/generate", {
                "model": "smollm2", "prompt": "Tell a long story",
                "options": {"num_predict": 400, "seed": 1}},
                started[1], ollama_lines)),
        ]
        for t in readers:
            t.start()
        assert all(e.wait(60) for e in started), "the streams did not start"
        proc.send_signal(signal.SIGTERM)
        for t in readers:
            t.join(30)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert openai_lines[-1] == "data: [DONE]"
    error = json.loads(openai_lines[-2].removeprefix("data: "))
    assert "shutting down" in error["error"]["message"], openai_lines[-3:]
    last = json.loads(ollama_lines[-1])
    assert "shutting down" in last["error"], ollama_lines[-3:]
    assert len(openai_lines) < 300 and not any('"done":true' in line for line in ollama_lines)  # cut short
    assert "Traceback" not in log.read_text()
