"""A decoder GGUF as the server's embedding model (Qwen3-Embedding's form) and another as its reranker
(Qwen3-Reranker's yes/no judging), both tiny random Qwen3s: what ``/v1/embeddings``, ``/api/embed`` and
``/v1/rerank`` answer, with many clients at once (their inputs batched by each model's engine), is what
the same model computes in-process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import gguf
import httpx
import pytest
import torch

from kvserve.embedding.encoders import open_encoder
from tests.models.arch_builders import build_hf_model, write_gguf
from tests.server.conftest import serve

pytestmark = pytest.mark.slow

TEXTS = ["Hello, world!", "a", "The first snow of winter fell on the mountains.", "x" * 60,
         "Paris is in France."]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("decoders")
    embed = write_gguf(folder / "qwen3-embed.gguf", build_hf_model("qwen3"), "qwen3",
                       pooling=gguf.PoolingType.LAST)
    judge = write_gguf(folder / "qwen3-judge.gguf", build_hf_model("qwen3"), "qwen3")
    return embed, judge


@pytest.fixture(scope="module")
def server(tmp_path_factory, models):
    embed, judge = models
    yield from serve(tmp_path_factory, "smollm2", "-c", "256", "--embedding-model", str(embed),
                     "--rerank-model", str(judge))


def test_many_clients_get_what_the_model_computes(server, models):
    embed, judge = models
    encoder = open_encoder(embed, "qwen3-embed")
    expected = encoder.embed(encoder.tokenize(TEXTS))
    encoder.close()

    def ask(k: int) -> torch.Tensor:  # the texts rotated by k, each client its own order
        r = httpx.post(f"{server.url}/v1/embeddings", headers=server.headers, timeout=60,
                       json={"model": "qwen3-embed", "input": TEXTS[k:] + TEXTS[:k]})
        assert r.status_code == 200, r.text
        return torch.tensor([d["embedding"] for d in r.json()["data"]])

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, [i % len(TEXTS) for i in range(8)]))
    for i, rows in enumerate(answers):
        torch.testing.assert_close(rows, expected.roll(-(i % len(TEXTS)), 0), atol=1e-5, rtol=0)
    ollama = httpx.post(f"{server.url}/api/embed", headers=server.headers, timeout=60,
                        json={"model": "qwen3-embed", "input": TEXTS[:2]}).json()
    torch.testing.assert_close(torch.tensor(ollama["embeddings"]), expected[:2], atol=1e-5, rtol=0)

    reranker = open_encoder(judge, "qwen3-judge", rerank=True)
    scores = reranker.score(reranker.tokenize_pairs("capital of France?", TEXTS)).tolist()
    reranker.close()
    r = httpx.post(f"{server.url}/v1/rerank", headers=server.headers, timeout=60,
                   json={"model": "qwen3-judge", "query": "capital of France?", "documents": TEXTS})
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert got.keys() == set(range(len(TEXTS)))
    for i, score in enumerate(scores):
        assert abs(got[i] - score) < 1e-5
