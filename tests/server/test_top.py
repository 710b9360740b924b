"""``kvserve top``: a running server's pool in the terminal, from the same stream as the web page."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rich.console import Console

from kvserve.cli.top import Rates, pool_grid, render
from tests.server.conftest import MAX_NUM_SEQS, NUM_CTX, Server, free_port


def kvserve_top(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvserve", "top", *args, "--once"]
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)


def frame(blocks: str, requests: list[dict] | None = None, generated: int = 0, time: float = 0.0) -> dict:
    used = sum(c not in ".c" for c in blocks)
    return {
        "time": time,
        "model": "m",
        "block_size": 4,
        "num_blocks": len(blocks),
        "max_model_len": 64,
        "cache_type_k": "q8_0",
        "cache_type_v": "f16",
        "kv_bytes_per_token": 2048,
        "kv_pool_bytes": 1 << 20,
        "blocks": blocks,
        "num_free_blocks": len(blocks) - used,
        "num_cached_free_blocks": blocks.count("c"),
        "num_used_blocks": used,
        "num_shared_blocks": sum(c in "23456789+" for c in blocks),
        "usage": used / len(blocks),
        "num_running": len(requests or []),
        "num_waiting": 0,
        "prefix_cache_queries": 40,
        "prefix_cache_hits": 10,
        "num_preemptions": 3,
        "num_generated_tokens": generated,
        "num_prompt_tokens": 40,
        "engine_alive": True,
        "requests": requests or [],
    }


def text(renderable, width: int = 100) -> str:
    console = Console(width=width, record=True, force_terminal=False)
    console.print(renderable)
    return console.export_text()


def test_render_draws_each_block_and_the_numbers():
    request = {
        "id": "r1",
        "status": "running",
        "blocks": [2, 3],
        "num_tokens": 6,
        "max_tokens": 64,
        "num_prompt_tokens": 5,
        "num_cached_tokens": 0,
        "num_computed_tokens": 5,
        "kv_bytes": 8 * 2048,
    }
    out = text(render(frame(".c12+.", [request]), [5.0, 10.0], width=20))
    assert "·■█2+·" in out  # free, cached, in use, shared by 2, by 10 or more
    assert "blocks 3/6 in use (50%), 2 shared, 1 cached" in out and "prefix hits 25.0%" in out
    # free blocks (3 x 4 tokens) plus the running request's unfilled slots (2 x 4 - 6)
    assert "room before a preemption 14 tokens" in out and "preemptions 3" in out
    assert "KV q8_0/f16, 2.0 KiB/token, pool 1.0 MiB" in out and "10 tok/s" in out
    assert "r1" in out and "6 / 64" in out


def test_render_lists_every_model_and_the_last_loads():
    models = [{"name": "m", "state": "loaded", "planned_bytes": 300 << 20, "expires_at": 130.0},
              {"name": "other", "state": "unloaded", "planned_bytes": 0, "expires_at": None}]
    events = [{"time": 100.0, "model": "other", "event": "unloaded",
               "detail": "evicted to make room for 'm'"}]
    out = text(render({**frame("..", time=100.0), "models": models, "model_events": events}, [], width=20),
               120)
    assert "● m (loaded 300 MiB, unloads in 30 s)" in out and "○ other (unloaded)" in out
    assert "other unloaded evicted to make room for 'm'" in out


def test_a_large_pool_draws_the_busiest_block_of_each_cell():
    # 16 rows of one cell hold 32 blocks: two blocks a cell
    grid = text(pool_grid(frame(".." + "c." + "1c" + "3." + "." * 24), width=1), 20).split()
    assert grid == ["·", "■", "█", "3"] + ["·"] * 12


def test_rates_are_over_the_last_second():
    rates = Rates()
    assert rates.add(frame(".", generated=0, time=10.0)) == []
    assert rates.add(frame(".", generated=50, time=10.5)) == [100.0]
    assert rates.add(frame(".", generated=100, time=11.0)) == [100.0, 100.0]
    assert rates.add(frame(".", generated=100, time=12.1))[-1] == 0.0  # a second without tokens


@pytest.mark.slow
def test_top_reads_a_running_server(idle: Server):
    r = kvserve_top(idle.url, "--api-key", idle.api_key)
    assert r.returncode == 0, r.stderr
    num_blocks = NUM_CTX // 16 * MAX_NUM_SEQS
    assert f"blocks 0/{num_blocks} in use" in r.stdout and "KV f32" in r.stdout
    refused = kvserve_top(idle.url)
    assert refused.returncode == 1 and "needs its API key" in refused.stderr
    nobody = kvserve_top(f"http://127.0.0.1:{free_port()}", "--api-key", "x")
    assert nobody.returncode == 1 and "cannot reach" in nobody.stderr and "Traceback" not in nobody.stderr
