"""Two SmolLM2 replicas as Ray Serve deployments on a local Ray instance, HTTP on 127.0.0.1: repeated
prefixes go to the replica that caches them, and a replica killed mid-run loses only its own requests.

One application for the module (Ray and two model loads are the slow part); the kill test runs last.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'kvserve[ray]'")
serve = pytest.importorskip("ray.serve")

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.server.app import build_app
from kvserve.server.replicas.ray_serve import build_application
from kvserve.server.server_config import ServerConfig

pytestmark = pytest.mark.slow

NUM_PREFIXES = 20
SENDS_PER_PREFIX = 3
WORDS = [
    "river",
    "stone",
    "garden",
    "window",
    "paper",
    "light",
    "signal",
    "harbor",
    "orange",
    "violet",
    "winter",
    "engine",
    "copper",
    "meadow",
    "lantern",
    "cloud",
    "silver",
    "forest",
    "bridge",
    "quiet",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replicas():
    """The URL of the app; 2 replicas of one thread each, pools that hold every prefix."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    engine = EngineConfig(
        model="smollm2",
        cache=CacheConfig(num_ctx=2048, kv_cache_memory=384 << 20, cache_type_k="f16"),
        scheduler=SchedulerConfig(max_num_seqs=4),
        num_threads=1,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_application(engine, ServerConfig("smollm2"), 2, build_app), name="kvserve",
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def prefix_text(i: int) -> str:
    """About 1K tokens, distinct from the first words on (a chain that shares no block with another)."""
    rng = random.Random(i)
    return f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(1000))


def chat(client: httpx.Client, content: str, **extra) -> dict:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0,
    } | extra
    r = client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()


def served_by(client: httpx.Client) -> dict[str, str]:
    return client.get("/v1/kvserve/replicas").json()["served_by"]


@dataclass(frozen=True)
class Send:
    prefix: int
    replica: str
    prompt_tokens: int
    cached_tokens: int


@pytest.fixture(scope="module")
def sends(replicas) -> list[Send]:
    """Each of the 20 prefixes 3 times, shuffled, one request at a time."""
    order = [(i, k) for i in range(NUM_PREFIXES) for k in range(SENDS_PER_PREFIX)]
    random.Random(0).shuffle(order)
    result = []
    with httpx.Client(base_url=replicas, timeout=300) as client:
        for i, k in order:
            out = chat(client, f"{prefix_text(i)}\nQuestion {k}: which word comes first?")
            usage = out["usage"]
            replica = served_by(client)[out["id"] + "-0"]
            result.append(
                Send(i, replica, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
            )
    return result


def holders(sends: list[Send]) -> dict[int, str]:
    """Prefix -> the replica that computed it (its first send)."""
    first: dict[int, str] = {}
    for s in sends:
        first.setdefault(s.prefix, s.replica)
    return first


def test_repeated_prefixes_go_to_the_replica_that_holds_them(sends):
    holder = holders(sends)
    seen: set[int] = set()
    repeats = hits = 0
    for s in sends:
        assert s.prompt_tokens > 1000
        if s.prefix not in seen:
            seen.add(s.prefix)
            continue
        repeats += 1
        hits += s.replica == holder[s.prefix] and s.cached_tokens > 0.9 * s.prompt_tokens
    assert repeats == NUM_PREFIXES * (SENDS_PER_PREFIX - 1)
    assert hits >= 0.9 * repeats, f"{hits} of {repeats} repeats found their prefix"
    assert len(set(holder.values())) == 2  # new prefixes spread over both replicas


def stream_chat(url: str, content: str, result: dict) -> None:
    """One streaming request; ``result`` gets its response id at the first chunk, then how it ended."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with (
            httpx.Client(base_url=url, timeout=300) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    result["end"] = "error"
                    return
                result.setdefault("id", event["id"])
                if event["choices"] and event["choices"][0]["finish_reason"]:
                    result["end"] = event["choices"][0]["finish_reason"]
    except httpx.HTTPError as e:
        result["end"] = f"transport: {e!r}"


def test_killing_a_replica_loses_only_its_requests(replicas, sends):
    """Three requests in flight on each replica (prefixes it holds, so affinity places them); one
    replica is killed: its three end with an error event, the other three finish."""
    by_replica: dict[str, list[int]] = {}
    for prefix, replica in holders(sends).items():
        by_replica.setdefault(replica, []).append(prefix)
    prefixes = [p for held in by_replica.values() for p in held[:3]]
    results = [{} for _ in prefixes]
    threads = [
        threading.Thread(target=stream_chat, args=(replicas, f"{prefix_text(p)}\nNow tell a story.", r))
        for p, r in zip(prefixes, results, strict=True)
    ]
    for t in threads:
        t.start()
    with httpx.Client(base_url=replicas, timeout=60) as client:
        deadline = time.monotonic() + 120
        ids = {}
        while len(ids) < len(results):  # every request has its first token from a replica
            assert time.monotonic() < deadline, results
            time.sleep(0.05)
            known = served_by(client)
            ids = {n: r["id"] + "-0" for n, r in enumerate(results) if r.get("id", "") + "-0" in known}
        where = {n: known[rid] for n, rid in ids.items()}
        assert len(set(where.values())) == 2, where
        victim = where[0]
        ray.kill(
            ray.get_actor(f"SERVE_REPLICA::kvserve#EngineReplica#{victim}", namespace="serve"),
            no_restart=True,
        )
        for t in threads:
            t.join(timeout=300)
        lost = {n for n, r in enumerate(results) if r.get("end") != "length"}
        assert lost == {n for n, rid in where.items() if rid == victim}, (results, where)
        assert all(results[n]["end"] == "error" for n in lost)  # a clean error event, not a cut stream

        after = chat(client, "After the kill: say one word.")  # new requests go to the survivor
        assert served_by(client)[after["id"] + "-0"] != victim

        deadline = time.monotonic() + 240  # and Ray replaces the replica
        while True:
            status = serve.status().applications["kvserve"].deployments["EngineReplica"]
            if status.replica_states.get("RUNNING", 0) == 2:
                break
            assert time.monotonic() < deadline, status
            time.sleep(1)
