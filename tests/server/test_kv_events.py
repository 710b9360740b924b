"""``--kv-events``: a ZeroMQ subscriber on 127.0.0.1 decodes every message (vLLM's schema, through msgspec
as vLLM's own consumers decode it) and rebuilds the pool's set of cached block hashes exactly, through
shared prefixes, evictions from a small pool and a prefix-cache reset."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import zmq

from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.events import wire_hash
from kvserve.server.replicas.kv_events import KVEventPublisher
from tests.server.conftest import _wait_healthy, free_port
from tests.support import make_engine, write_tiny_llama

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


# vLLM's schema (vllm/distributed/kv_events.py), field for field
class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class Subscriber:
    """A SUB socket connected to the publisher's address (as Dynamo's relay does). The publisher binds an
    ipc:// address here, which only this machine can reach; tcp://*:PORT would bind every interface."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.endpoint = endpoint
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.batches: list[KVEventBatch] = []
        self.seqs: list[int] = []

    def connect(self) -> None:
        self.sock.connect(self.endpoint)

    def receive(self, count: int, timeout_ms: int = 10_000) -> None:
        while len(self.seqs) < count:
            assert self.sock.poll(timeout_ms), f"{len(self.seqs)} of {count} messages arrived"
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"" and len(seq) == 8
            self.seqs.append(int.from_bytes(seq, "big"))
            self.batches.append(self.decoder.decode(payload))

    def cached(self) -> set[int]:
        known: set[int] = set()
        for batch in self.batches:
            for e in batch.events:
                if isinstance(e, BlockStored):
                    assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                    known.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    assert known >= set(e.block_hashes)  # only what was stored is removed
                    known.difference_update(e.block_hashes)
                else:
                    known.clear()
        return known

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _prompt(rng: random.Random, prefix: list[int], length: int) -> list[int]:
    return prefix + [rng.randrange(3, 90) for _ in range(length)]


def test_a_subscriber_rebuilds_the_cached_set(tiny_llama, tmp_path):
    engine = make_engine(tiny_llama, num_ctx=128, max_num_seqs=2)  # 16 blocks: later prompts evict
    sub = Subscriber(f"ipc://{tmp_path}/kv-events")
    publisher = KVEventPublisher(sub.endpoint)
    sub.connect()
    try:
        assert publisher.subscribed.wait(10)
        engine.publish_kv_events(publisher)
        rng = random.Random(0)
        system = [rng.randrange(3, 90) for _ in range(2 * BS)]
        for round_ in range(3):
            for i in range(3):  # a shared prefix, and prompts of their own
                engine.add_request(_prompt(rng, system, BS * (1 + i) + 5), GREEDY)
            engine.add_request(_prompt(rng, [], 3 * BS + 1), GREEDY)
            engine.run_to_completion()
            if round_ == 1:
                engine.kv.reset_prefix_cache()
                engine.flush_kv_events()
        expected = {wire_hash(h) for h in engine.kv.full.pool.cached}
        assert len(expected) == len(engine.kv.full.pool.cached)  # no two hashes share their low 64 bits
    finally:
        publisher.close()
    try:
        sub.receive(publisher.num_published)
        assert sub.seqs == list(range(publisher.num_published))
        kinds = {type(e) for b in sub.batches for e in b.events}
        assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
        assert all(b.data_parallel_rank == 0 for b in sub.batches)
        stored = [e for b in sub.batches for e in b.events if isinstance(e, BlockStored)]
        assert {e.medium for e in stored} == {"CPU"} and {e.block_size for e in stored} == {BS}
        assert any(len(e.block_hashes) > 1 for e in stored)  # a chain's blocks in one event
        assert sub.cached() == expected and expected
    finally:
        sub.close()


def test_blocks_cached_before_the_subscription_are_sent_first(tiny_llama, tmp_path):
    engine = make_engine(tiny_llama, num_ctx=128, max_num_seqs=2)
    engine.add_request(list(range(3, 3 + 3 * BS + 2)), GREEDY)
    engine.run_to_completion()
    sub = Subscriber(f"ipc://{tmp_path}/kv-events")
    publisher = KVEventPublisher(sub.endpoint)
    sub.connect()
    try:
        assert publisher.subscribed.wait(10)
        engine.publish_kv_events(publisher)
    finally:
        publisher.close()
    try:
        sub.receive(1)
        (event,) = sub.batches[0].events
        assert isinstance(event, BlockStored) and event.parent_block_hash is None
        assert event.token_ids == list(range(3, 3 + 3 * BS))
        assert sub.cached() == {wire_hash(h) for h in engine.kv.full.pool.cached}
    finally:
        sub.close()


def test_an_endpoint_that_is_not_zeromq_is_refused():
    with pytest.raises(ValueError, match="ZeroMQ address"):
        KVEventPublisher("http://127.0.0.1:5557")


def test_kvserve_serve_publishes_with_the_flag(tmp_path):
    (tmp_path / "tiny").mkdir()
    model = write_tiny_llama(tmp_path / "tiny")
    sub = Subscriber(f"ipc://{tmp_path}/kv-events")
    port, log = free_port(), tmp_path / "server.log"
    cmd = [sys.executable, "-m", "kvserve", "serve", str(model), "--port", str(port), "-c", "128",
           "--max-num-seqs", "2", "--cache-type", "f32", "--served-model-name", "tiny", "--no-access-log",
           "--kv-events", sub.endpoint]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log)
        sub.connect()
        time.sleep(0.5)  # the subscription reaches the server's socket (a PUB drops what it sends before)
        prompt = list(range(3, 3 + 2 * BS + 3))
        for _ in range(2):
            r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                                        "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 2 * BS
        sub.receive(1)
        first = sub.batches[0].events[0]
        assert isinstance(first, BlockStored) and first.token_ids[: 2 * BS] == prompt[: 2 * BS]
        doc = httpx.get(f"{url}/openapi.json")  # a model without a tokenizer: no FIM, no thinking
        assert doc.status_code == 200 and "/infill" not in doc.json()["paths"]
        text = httpx.get(f"{url}/metrics").text
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert f'\n{name}{{model_name="tiny"}} ' in text, name
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        sub.close()
