"""Several models behind one server (server/model_slots.py): a model named by a request loads then, its
keep_alive unloads it, a model that does not fit the memory budget or the count evicts the least recently
used idle one, one that cannot fit alone is a 503 with the planner's numbers; /api/ps and /api/tags tell
the truth. A fake loader drives the rules; a live server with the ollama client shows them end to end."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import httpx
import ollama
import pytest

from kvserve.server import model_slots
from kvserve.server.api_errors import APIError
from kvserve.server.model_card import ModelCard
from kvserve.server.model_slots import ServedModels, keep_alive_seconds
from tests.server.conftest import serve


@pytest.mark.parametrize("value, seconds", [
    (None, 60.0), (0, 0.0), ("0", 0.0), (-1, None), ("-1", None), ("-5m", None), ("5m", 300.0),
    ("1h30m", 5400.0), ("10s", 10.0), ("1.5s", 1.5), (30, 30.0), ("250ms", 0.25), ("300", 300.0)])
def test_keep_alive_reads_ollamas_forms(value, seconds):
    assert keep_alive_seconds(value, 60.0) == seconds


def card(name: str) -> ModelCard:
    return ModelCard(name, Path(f"{name}.gguf"), "llama", 1, "Q4_0", 1, 64, 1, "cpu", 0.0, "")


class FakeEngine:
    def __init__(self) -> None:
        self.num_open_streams = 0
        self.shut = False

    def shutdown(self, reason: str = "", timeout: float | None = None) -> None:
        self.shut = True


def fake_serving(name: str) -> SimpleNamespace:
    return SimpleNamespace(card=card(name), async_engine=FakeEngine())


def models(budget=None, max_loaded=0, keep_alive=None, sizes=None, first=0) -> tuple[ServedModels, list[str]]:
    loads: list[str] = []

    def load(source: str, name: str):
        loads.append(name)
        if source == "broken":
            raise ValueError("not a GGUF file")
        return fake_serving(name)

    sizes = sizes or {"a": 100, "b": 100, "c": 100}
    others = {n: (n if n != "x" else "broken", size, card(n)) for n, size in sizes.items()}
    return ServedModels(fake_serving("main"), others, load, budget, max_loaded, keep_alive,
                        first_planned=first), loads


def test_models_load_when_named_and_evict_the_least_recently_used(monkeypatch):
    monkeypatch.setattr(model_slots, "GRACE", 0.0)
    served, loads = models(budget=350, first=100)

    async def go():
        assert (await served.serving("main")).card.name == "main" and loads == []  # loaded at start
        assert (await served.serving(None)).card.name == "main"  # no name: the default
        a = await served.serving("a:latest")
        await served.serving("b")
        assert loads == ["a", "b"] and {s.name for s in served.loaded()} == {"main", "a", "b"}
        await served.serving("a")
        await served.serving("main")  # b is now the least recently used
        await served.serving("c")  # 400 > 350: b goes, not a or main
        assert {s.name for s in served.loaded()} == {"main", "a", "c"} and loads == ["a", "b", "c"]
        assert not a.async_engine.shut
        with pytest.raises(APIError) as unknown:
            await served.serving("nope")
        assert unknown.value.status == 404 and "'main', 'a', 'b', 'c'" in unknown.value.message
        await served.stop()
        assert served.loaded() == [] and a.async_engine.shut

    asyncio.run(go())


def test_a_busy_model_is_not_evicted_and_the_count_is_kept(monkeypatch):
    monkeypatch.setattr(model_slots, "GRACE", 0.0)
    monkeypatch.setattr(model_slots, "TICK", 0.01)
    served, loads = models(max_loaded=2)

    async def go():
        a = await served.serving("a")
        main = await served.serving("main")
        a.async_engine.num_open_streams = main.async_engine.num_open_streams = 1  # a stream open on each
        waiting = asyncio.ensure_future(served.serving("b"))
        await asyncio.sleep(0.1)
        assert not waiting.done() and loads == ["a"]  # main + a loaded: b waits for one to be idle
        a.async_engine.num_open_streams = 0
        await asyncio.wait_for(waiting, 5)
        assert a.async_engine.shut and {s.name for s in served.loaded()} == {"main", "b"}

    asyncio.run(go())


def test_keep_alive_unloads_an_idle_model(monkeypatch):
    monkeypatch.setattr(model_slots, "GRACE", 0.0)
    monkeypatch.setattr(model_slots, "TICK", 0.01)
    served, _ = models(keep_alive=None)

    async def go():
        served.start()
        await served.serving("a", keep_alive="50ms")
        await served.serving("b")  # the server's default: never
        assert served.find("a").expires_at() is not None and served.find("b").expires_at() is None
        await asyncio.sleep(0.3)
        assert {s.name for s in served.loaded()} == {"main", "b"}
        assert await served.release("b") and {s.name for s in served.loaded()} == {"main"}
        first = served.find("main").serving
        # the first too
        assert await served.release("main") and served.loaded() == [] and first.async_engine.shut
        with pytest.raises(APIError) as none:
            served.shown(None)  # a view never loads a model
        assert none.value.status == 409
        assert (await served.serving(None)).card.name == "main" and served.shown(None).card.name == "main"
        assert [(e.model, e.event) for e in served.recent()] == [
            ("a", "loaded"), ("b", "loaded"), ("a", "unloaded"), ("b", "unloaded"), ("main", "unloaded"),
            ("main", "loaded")]
        assert {m.name: m.state for m in served.states()} == {"main": "loaded", "a": "unloaded",
                                                              "b": "unloaded",
                                                             "c": "unloaded"}
        await served.stop()

    asyncio.run(go())


def test_too_big_or_broken_models_are_clear_errors():
    mib = 1 << 20
    served, _ = models(budget=150 * mib, sizes={"a": 100 * mib, "big": 200 * mib, "x": 10 * mib})

    async def go():
        with pytest.raises(APIError) as big:
            await served.serving("big")
        assert (
            big.value.status == 503
            and "needs 200 MiB" in big.value.message
            and "of 150 MiB" in big.value.message
        )
        with pytest.raises(APIError) as broken:
            await served.serving("x")
        assert broken.value.status == 503 and "not a GGUF file" in broken.value.message
        assert served.find("x").serving is None

    asyncio.run(go())


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """smollm2 (loaded at start), Gemma 3 and Qwen2.5-Coder on demand, at most two loaded at once;
    all-minilm's embeddings beside them."""
    yield from serve(tmp_path_factory, ["smollm2", "gemma3-270m", "qwen2.5-coder-0.5b", "all-minilm"], "-c",
                     "512", "--max-num-seqs", "2", "--max-loaded-models", "2", "--weights", "q4")


def loaded(client: ollama.Client) -> list[str]:
    """The chat models loaded (all-minilm, the embedding model, is always)."""
    models = sorted(m.model for m in client.ps().models)
    assert models[0] == "all-minilm:latest"
    return models[1:]


def frames_of(c: httpx.Client, model: str):
    with c.stream("GET", "/v1/kvserve/cache/stream", params={"model": model, "max_events": 1}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line[6:])


def test_the_ollama_client_alternates_models_and_ps_tells_the_truth(three):
    client = ollama.Client(host=three.url, headers=three.headers)
    assert sorted(m.model for m in client.list().models) == ["all-minilm:latest", "gemma3-270m:latest",
                                                             "qwen2.5-coder-0.5b:latest", "smollm2:latest"]
    qwen = client.show("qwen2.5-coder-0.5b")  # from its file: showing does not load (nor evict)
    assert qwen.modelinfo["qwen2.context_length"] == 32768 and "im_start" in qwen.template
    assert loaded(client) == ["smollm2:latest"]
    shown = client.show("all-minilm")
    assert shown.capabilities == ["embedding"] and shown.details.family == "bert"
    assert shown.modelinfo["bert.embedding_length"] == 384
    assert loaded(client) == ["smollm2:latest"]
    # at most two: qwen evicts gemma, then gemma the least recently used, smollm2 (the first is a model like
    # any)
    generated: dict[str, int] = {}
    for model in ("gemma3-270m", "smollm2", "qwen2.5-coder-0.5b", "gemma3-270m"):
        reply = client.chat(model, [{"role": "user", "content": "Say hi."}], options={"num_predict": 3})
        assert reply.model == model and reply.message.content
        generated[model] = generated.get(model, 0) + reply.eval_count
        assert model.split(":")[0] in " ".join(loaded(client)) and len(loaded(client)) <= 2
    assert loaded(client) == ["gemma3-270m:latest", "qwen2.5-coder-0.5b:latest"]
    forever = next(m for m in client.ps().models if m.model == "qwen2.5-coder-0.5b:latest")
    assert forever.expires_at.year == 9999 and forever.size > 0
    with three.client() as c:
        samples = three.metrics()
        # each model's requests under its name; each loaded model's pool, and no pool of an unloaded one
        for model, count in generated.items():  # sampled answers may end early: what each one said it made
            assert samples[f'kvserve_generation_tokens_total{{model="{model}"}}'] == count, model
        assert sum(v for k, v in samples.items()
                   if k.startswith("kvserve_requests_total{") and 'model="qwen2.5-coder-0.5b"' in k) == 1
        assert 'kvserve_kv_cache_blocks{model="qwen2.5-coder-0.5b"}' in samples
        assert 'vllm:num_requests_running{model_name="gemma3-270m"}' in samples
        assert not any('model="smollm2"' in k for k in samples if k.startswith("kvserve_kv_cache"))
        assert c.get("/v1/kvserve/cache", params={"model": "qwen2.5-coder-0.5b"}).status_code == 200
        gone = c.get("/v1/kvserve/cache", params={"model": "smollm2"})
        assert gone.status_code == 409 and "not loaded" in gone.json()["error"]["message"]
        assert c.get("/v1/kvserve/cache", params={"model": "nope"}).status_code == 404
        frame = next(frames_of(c, "gemma3-270m"))
        assert frame["model"] == "gemma3-270m" and frame["num_blocks"] == c.get(
            "/v1/kvserve/cache", params={"model": "gemma3-270m"}).json()["num_blocks"]
        assert {m["name"]: m["state"] for m in frame["models"]} == {
            "smollm2": "unloaded", "gemma3-270m": "loaded", "qwen2.5-coder-0.5b": "loaded"}
        assert [(e["model"], e["event"]) for e in frame["model_events"]][-3:] == [
            ("qwen2.5-coder-0.5b", "loaded"), ("smollm2", "unloaded"), ("gemma3-270m", "loaded")]
        assert c.get("/health").json() == {"status": "ok", "model": "smollm2",
                                           "loaded": ["gemma3-270m", "qwen2.5-coder-0.5b"]}
        listed = c.get("/v1/kvserve/models").json()  # the same, without a loaded model's stream
        assert [(m["name"], m["state"]) for m in listed["models"]] == [
            (m["name"], m["state"]) for m in frame["models"]]
        assert listed["events"][-1]["model"] == "gemma3-270m" and listed["events"][-1]["event"] == "loaded"
    top = subprocess.run([sys.executable, "-m", "kvserve", "top", three.url, "--api-key", three.api_key,
                          "--once", "--model", "qwen2.5-coder-0.5b"], capture_output=True, text=True,
                          timeout=120,
                         env={**os.environ, "COLUMNS": "160"}, check=False)
    assert top.returncode == 0, top.stderr
    assert "○ smollm2 (unloaded" in top.stdout and "● qwen2.5-coder-0.5b (loaded" in top.stdout
    assert "smollm2 unloaded evicted to make room for 'gemma3-270m'" in top.stdout
    client.generate("gemma3-270m", "Hi", options={"num_predict": 2}, keep_alive=0)
    deadline = time.monotonic() + 10
    while loaded(client) != ["qwen2.5-coder-0.5b:latest"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert loaded(client) == ["qwen2.5-coder-0.5b:latest"]
    ids = [m["id"] for m in httpx.get(f"{three.url}/v1/models", headers=three.headers).json()["data"]]
    assert ids[:3] == ["smollm2", "gemma3-270m", "qwen2.5-coder-0.5b"]
    r = httpx.post(f"{three.url}/v1/chat/completions", headers=three.headers,  # the first, loaded again
                   json={"model": "smollm2", "messages": [{"role": "user", "content": "1+1="}],
                         "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "smollm2"
    unloaded = client.generate("qwen2.5-coder-0.5b", "", keep_alive=0)
    assert unloaded.done_reason == "unload" and loaded(client) == ["smollm2:latest"]
    metrics = httpx.get(f"{three.url}/metrics", headers=three.headers).text
    assert 'kvserve_model_loads_total{model="gemma3-270m"} 2.0' in metrics
    # loaded again (at start is not counted)
    assert 'kvserve_model_loads_total{model="smollm2"} 1.0' in metrics
    assert 'kvserve_model_unloads_total{model="gemma3-270m",reason="evicted"} 1.0' in metrics
    assert 'kvserve_model_unloads_total{model="smollm2",reason="evicted"} 1.0' in metrics
    assert 'kvserve_model_unloads_total{model="qwen2.5-coder-0.5b",reason="asked"} 1.0' in metrics
    assert (
        'kvserve_model_loaded{model="smollm2"} 1.0' in metrics
        and 'kvserve_model_loaded{model="gemma3-270m"} 0.0' in metrics
    )
    vectors = client.embed("all-minilm", ["a red apple", "a green pear"]).embeddings  # named among the models
    assert len(vectors) == 2 and len(vectors[0]) == 384


def test_the_memory_budget_leaves_the_embedding_models_their_share():
    """--max-memory is the whole server's: what the embedding and rerank models took, loaded for good,
    comes off it."""
    from kvserve.cli.main import build_parser
    from kvserve.cli.serve import _served_models, planned_bytes
    from kvserve.plan.planner import RUNTIME_OVERHEAD_BYTES
    from kvserve.server.server_config import ServerConfig

    mib = 1 << 20
    beside = 90 * mib  # all-minilm's weights, as f32

    def args(budget: int):
        return build_parser().parse_args(["serve", "smollm2", "gemma3-270m", "-c", "512", "--max-memory",
                                          str(budget)])

    first = planned_bytes(args(1), "smollm2")
    just_enough = first + RUNTIME_OVERHEAD_BYTES + beside + mib
    make = _served_models(args(just_enough), ["gemma3-270m"], ServerConfig(model_name="smollm2"), beside)
    class FirstServing:  # weakly referable, unlike a SimpleNamespace
        card, metrics, config = card("smollm2"), None, None
        async_engine = FakeEngine()

    first_serving = FirstServing()
    served = make(first_serving)
    assert served.budget == first + mib
    # once unloaded, nothing the server keeps (its loader included) holds the first model
    gone = weakref.ref(first_serving)
    del first_serving
    asyncio.run(served.unload(served.slots[0], "asked"))
    assert gone() is None
    with pytest.raises(ValueError, match="embedding and rerank models"):
        _served_models(args(just_enough - 2 * mib), ["gemma3-270m"], ServerConfig(model_name="smollm2"),
                       beside)
