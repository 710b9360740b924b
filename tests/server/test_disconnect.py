"""8 streams, 4 dropped mid-way: the dropped requests are aborted and every one of their blocks is
free again (or still held only by a survivor sharing the prefix), and the 4 others finish with
exactly the text the same requests get when nobody disconnects (greedy, f32 KV)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

NUM_STREAMS, NUM_DROPPED = 8, 4
# the streams that stay ask for more tokens than the dropped ones: they must still be generating when the
# pool is checked after the drops; the dropped ones for more than a fast CPU makes while the eight streams
# open one after another (with 32, and once with 128, a Zen 5 finished the first before the first snapshot)
DROPPED_TOKENS, SURVIVOR_TOKENS = 320, 448  # prompts of ~35 tokens: 483 of the 512 context


def max_tokens(i: int) -> int:
    return DROPPED_TOKENS if i < NUM_DROPPED else SURVIVOR_TOKENS


def body(i: int, stream: bool) -> dict:
    return {
        "model": "smollm2",
        "temperature": 0,
        "max_tokens": max_tokens(i),
        "ignore_eos": True,
        "stream": stream,
        "messages": [{"role": "user", "content": f"Story number {i}: tell me about the city number {i}."}],
    }


class SSEReader:
    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.lines = response.aiter_lines()
        self.request_id: str | None = None
        self.text = ""
        self.finish_reason = None

    async def next_chunk(self) -> dict | None:
        async for line in self.lines:
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                return None
            chunk = json.loads(line.removeprefix("data: "))
            self.request_id = f"{chunk['id']}-0"  # the engine request of choice 0
            choice = chunk["choices"][0]
            self.text += choice["delta"].get("content") or ""
            self.finish_reason = choice["finish_reason"] or self.finish_reason
            return chunk
        return None

    async def read_content(self, num_chunks: int) -> None:
        seen = 0
        while seen < num_chunks:
            chunk = await self.next_chunk()
            assert chunk is not None
            seen += bool(chunk["choices"][0]["delta"].get("content"))


def test_dropped_streams_free_their_blocks_and_the_rest_finish(idle):
    before = idle.metrics().get('kvserve_requests_total{finish_reason="abort",model="smollm2"}', 0)
    survivors = asyncio.run(_drop_half(idle))
    after = idle.metrics()
    assert after['kvserve_requests_total{finish_reason="abort",model="smollm2"}'] - before == NUM_DROPPED
    # the survivors completed exactly as the same requests do undisturbed
    references = asyncio.run(_references(idle, list(survivors)))
    for i, reader in survivors.items():
        assert reader.finish_reason == "length"
        assert reader.text == references[i]["choices"][0]["message"]["content"]
        assert references[i]["usage"]["completion_tokens"] == max_tokens(i)


async def _references(server, indices: list[int]) -> dict[int, dict]:
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:
        replies = await asyncio.gather(
            *(c.post("/v1/chat/completions", json=body(i, stream=False)) for i in indices)
        )
    return {i: r.json() for i, r in zip(indices, replies, strict=False)}


async def _drop_half(server) -> dict[int, SSEReader]:
    limits = httpx.Limits(max_connections=NUM_STREAMS * 2)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=120, limits=limits
    ) as c:
        readers = {}
        for i in range(NUM_STREAMS):
            r = await c.send(
                c.build_request("POST", "/v1/chat/completions", json=body(i, stream=True)), stream=True
            )
            assert r.status_code == 200
            readers[i] = SSEReader(r)
        for reader in readers.values():  # every stream has tokens flowing: all 8 run
            await reader.read_content(2)
        snap = (await c.get("/v1/kvserve/cache")).json()
        tables = {i: snap["requests"][r.request_id] for i, r in readers.items()}
        assert len(snap["requests"]) == NUM_STREAMS

        dropped = list(range(NUM_DROPPED))
        for i in dropped:
            await readers[i].read_content(1)
            await readers[i].response.aclose()  # the client goes away mid-stream
        snap = await _wait_for_aborts(c, {readers[i].request_id for i in dropped})

        live = snap["requests"]
        survivors = {i: readers[i] for i in range(NUM_DROPPED, NUM_STREAMS)}
        assert sorted(live) == sorted(r.request_id for r in survivors.values())  # still generating
        live_blocks = {b for table in live.values() for b in table}
        assert set(snap["held_blocks"]) == live_blocks  # no block held outside a live request
        assert snap["num_used_blocks"] == len(live_blocks)
        for i in dropped:
            still_held = set(tables[i]) & set(snap["held_blocks"])
            assert still_held <= live_blocks, (
                f"blocks of dropped stream {i} leaked: {still_held - live_blocks}"
            )
        exclusive = {b for i in dropped for b in tables[i]} - {b for i in survivors for b in tables[i]}
        assert exclusive and not exclusive & set(snap["held_blocks"])  # the dropped requests' own blocks

        for reader in survivors.values():
            while await reader.next_chunk() is not None:
                pass
            await reader.response.aclose()
        return survivors


async def _wait_for_aborts(c: httpx.AsyncClient, request_ids: set[str], timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = (await c.get("/v1/kvserve/cache")).json()
        if not request_ids & set(snap["requests"]):
            return snap
        assert time.monotonic() < deadline, f"dropped requests still in the engine: {request_ids & set(snap)}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    "path,payload",
    [
        ("/v1/chat/completions", {**body(0, stream=False), "max_tokens": 400}),
        (
            "/api/chat",
            {
                "model": "smollm2",
                "messages": [{"role": "user", "content": "Write a long story."}],
                "stream": False,
                "options": {"num_predict": 400, "temperature": 0},  # greedy: all 400 tokens, no early end
            },
        ),
    ],
)
def test_a_client_gone_before_the_answer_aborts_its_request(idle, path, payload):
    """Non-streaming requests too: the server notices the closed connection and aborts."""
    with pytest.raises(httpx.ReadTimeout), idle.client(timeout=httpx.Timeout(120, read=1.0)) as c:
        c.post(path, json=payload)
    snap = idle.wait_idle(timeout=10)  # long before 400 tokens could have been generated
    assert snap["held_blocks"] == []


def test_a_dropped_ndjson_stream_aborts_its_request(idle):
    payload = {"model": "smollm2", "prompt": "Write a long story.", "options": {"num_predict": 400}}
    with idle.client() as c, c.stream("POST", "/api/generate", json=payload) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert not json.loads(next(lines))["done"]
        assert idle.cache()["num_running"] == 1
    snap = idle.wait_idle(timeout=10)
    assert snap["held_blocks"] == []
