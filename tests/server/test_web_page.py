"""The web page's routes on the live server: / is the page to a browser and plain text to other clients,
self-contained under a strict Content-Security-Policy; the pool stream needs the key, refuses bad
parameters with 400 and sends frames of its documented shape that agree with /v1/kvserve/cache."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading

import httpx
import pytest
from pydantic import TypeAdapter

from kvserve.server.web.pool_view import PoolFrame
from tests.server.conftest import Server

pytestmark = pytest.mark.slow


def _frames(server: Server, max_events: int) -> list[dict]:
    with (
        server.client() as c,
        c.stream("GET", "/v1/kvserve/cache/stream", params={"max_events": max_events}) as r,
    ):
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e.removeprefix("data: ")) for e in events]


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def test_the_root_is_the_page_to_a_browser_and_plain_text_to_others(server: Server):
    plain = httpx.get(server.url + "/")
    assert plain.status_code == 200 and plain.text == "kvserve is running"
    page = httpx.get(server.url + "/", headers={"Accept": "text/html,application/xhtml+xml"})  # no key needed
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    [script] = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    [style] = re.findall(r"<style>(.*?)</style>", html, re.DOTALL)
    policy = page.headers["content-security-policy"]
    assert f"script-src {_sha256(script)};" in policy and f"style-src {_sha256(style)};" in policy
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing from elsewhere


def test_the_pool_stream_needs_the_key_and_refuses_bad_parameters(server: Server):
    url = server.url + "/v1/kvserve/cache/stream"
    r = httpx.get(url, params={"max_events": 1})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    for bad in ("0", "-3", "many", "1.5"):
        r = httpx.get(url, params={"max_events": bad}, headers=server.headers)
        assert r.status_code == 400, (bad, r.text)
        assert (
            r.json()["error"]["type"] == "invalid_request_error"
            and "max_events" in r.json()["error"]["message"]
        )


def test_frames_have_their_schema_and_agree_with_the_cache_endpoint(idle: Server):
    frames = _frames(idle, 2)
    assert len(frames) == 2 and frames[1]["time"] > frames[0]["time"]
    adapter = TypeAdapter(PoolFrame)
    for frame in frames:
        adapter.validate_python(frame)  # extra fields are refused too
        assert set(frame["blocks"]) <= set(".c123456789+") and len(frame["blocks"]) == frame["num_blocks"]
        assert frame["requests"] == [] and frame["num_used_blocks"] == 0 and frame["engine_alive"]

    started, stop = threading.Event(), threading.Event()

    def generate() -> None:
        body = {
            "model": "smollm2",
            "prompt": "Once upon a time",
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
        }
        with idle.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    return

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        assert started.wait(60)
        [frame] = _frames(idle, 1)
        snapshot = idle.cache()
    finally:
        stop.set()
        thread.join(60)
    [request] = frame["requests"]
    table = snapshot["requests"][request["id"]]
    assert request["blocks"] == table[: len(request["blocks"])]  # block tables only grow
    # the blocks hold the computed tokens; the newest sampled token gets its slot in the next step
    assert (
        request["status"] == "running"
        and 0 < request["num_computed_tokens"] <= len(request["blocks"]) * frame["block_size"]
        and request["num_tokens"] <= request["num_computed_tokens"] + 1
    )
    for block in request["blocks"]:
        assert frame["blocks"][block] == "1"
    assert frame["num_used_blocks"] == len(request["blocks"]) and frame["num_running"] == 1
