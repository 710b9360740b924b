"""The web page's pool frames (``pool_view``) and their stream (``pool_stream``), on the tiny model's
real engine: exact block codes and request tables through a request's life, a shared prefix and the
prefix cache; one sampler for any number of subscribers."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.web.pool_stream import PoolStream
from kvserve.server.web.pool_view import PoolView, block_codes
from tests.support import make_engine

BS = 16


class CountingLock:
    """The engine lock, counting how often it is taken."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.taken = 0

    def __enter__(self):
        self.lock.acquire()
        self.taken += 1

    def __exit__(self, *exc):
        self.lock.release()


def _view(engine) -> PoolView:
    async_engine = SimpleNamespace(engine=engine, lock=CountingLock(), num_pending_adds=0, dead_error=None)
    return PoolView(async_engine, "tiny")


def test_block_codes():
    # free, cached-free, in use by 1, 2, 9, then 10 and more
    assert block_codes([0, -1, 1, 2, 9, 10, 37]) == ".c129++"


def test_a_frame_follows_requests_through_their_blocks(tiny_llama, check_no_leaks):
    engine = make_engine(tiny_llama, num_ctx=64, max_num_seqs=4, block_size=BS)  # 16 blocks
    check_no_leaks.append(engine)
    view = _view(engine)
    frame = view.frame()
    assert frame.blocks == "." * 16 and frame.num_free_blocks == 16 and frame.requests == []
    assert (frame.block_size, frame.num_blocks, frame.max_model_len) == (BS, 16, 64)
    assert frame.kv_pool_bytes == 16 * BS * frame.kv_bytes_per_token == engine.kv_pool_bytes

    prompt = list(range(3, 43))  # 40 tokens: two full blocks and a partial one
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = engine.add_request(prompt, params, "a")
    frame = view.frame()
    assert [(r.id, r.status, r.blocks) for r in frame.requests] == [("a", "waiting", [])]
    assert frame.num_waiting == 1 and frame.num_running == 0

    engine.step()  # A's prefill
    frame = view.frame()
    assert frame.blocks == "111" + "." * 13
    [ra] = frame.requests
    assert (ra.status, ra.blocks, ra.num_tokens, ra.num_computed_tokens) == ("running", [0, 1, 2], 41, 40)
    assert (ra.max_tokens, ra.num_prompt_tokens, ra.num_cached_tokens) == (44, 40, 0)
    assert ra.kv_bytes == 3 * BS * frame.kv_bytes_per_token
    assert (
        frame.num_used_blocks == 3
        and frame.usage == 3 / 16
        and frame.num_generated_tokens == a.num_tokens - 40
    )

    engine.add_request(prompt[:32] + [90] * 8, params, "b")  # the same two full blocks first
    engine.step()
    frame = view.frame()
    rb = next(r for r in frame.requests if r.id == "b")
    assert rb.blocks[:2] == [0, 1] and rb.num_cached_tokens == 32
    assert frame.blocks[:4] == "2211" and frame.num_shared_blocks == 2
    assert frame.prefix_cache_queries == 80 and frame.prefix_cache_hits == 32

    engine.run_to_completion()
    frame = view.frame()
    # full blocks keep their prefix hash when freed; partial ones are plain free
    assert frame.blocks == "cc.." + "." * 12 and frame.requests == []
    assert (frame.num_free_blocks, frame.num_cached_free_blocks, frame.num_used_blocks) == (16, 2, 0)
    assert view.async_engine.lock.taken == 5  # once a frame


def test_a_frame_is_valid_json_of_its_schema(tiny_llama):
    engine = make_engine(tiny_llama, num_ctx=64, max_num_seqs=2, block_size=BS)
    engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=2), "r")
    engine.step()
    frame = _view(engine).frame()
    data = json.loads(frame.encode())
    assert data == json.loads(json.dumps(frame.to_json()))
    assert data["requests"][0]["id"] == "r" and len(data["blocks"]) == data["num_blocks"]
    engine.run_to_completion()


class FakeView:
    """Frames numbered by the call that made them; the engine stops at frame ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.calls = 0
        self.stop_at = stop_at

    def frame(self):
        self.calls += 1
        n = self.calls
        return SimpleNamespace(encode=lambda: json.dumps({"n": n}).encode(), engine_alive=n != self.stop_at)


def test_every_subscriber_shares_one_sampler():
    async def main():
        view = FakeView()
        stream = PoolStream(view, interval=0.01)

        async def read(count: int) -> list[bytes]:
            return [frame async for frame in stream.frames(count)]

        a, b = await asyncio.gather(read(5), read(5))
        numbers = [[json.loads(f)["n"] for f in frames] for frames in (a, b)]
        for ns in numbers:
            assert ns == sorted(set(ns)) and len(ns) == 5  # newest frames, none twice
        # a frame both saw was taken and encoded once
        common = set(numbers[0]) & set(numbers[1])
        assert common
        for n in common:
            assert a[numbers[0].index(n)] is b[numbers[1].index(n)]
        assert view.calls <= max(numbers[0][-1], numbers[1][-1]) + 1
        await asyncio.sleep(0.05)
        assert stream._sampler.done()  # nobody watches: the engine is left alone
        calls = view.calls
        await asyncio.sleep(0.05)
        assert view.calls == calls
        assert len([f async for f in stream.frames(2)]) == 2  # a new subscriber starts it again

    asyncio.run(main())


def test_the_stream_ends_when_the_engine_stops():
    async def main():
        stream = PoolStream(FakeView(stop_at=3), interval=0.001)
        frames = [json.loads(f)["n"] async for f in stream.frames()]
        assert frames[-1] == 3  # the engine's last frame, then the end

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_failing_view_ends_every_stream(caplog):
    class Broken:
        def frame(self):
            raise RuntimeError("a bug")

    async def main():
        return [f async for f in PoolStream(Broken(), interval=0.001).frames()]

    assert asyncio.run(asyncio.wait_for(main(), 30)) == []  # ended, not hung
    assert "the KV pool view failed" in caplog.text
