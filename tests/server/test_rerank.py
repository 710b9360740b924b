"""``/v1/rerank`` from a cross-encoder: the scores sentence-transformers' CrossEncoder (transformers'
``BertForSequenceClassification`` and a sigmoid) gives the same pairs, best first, cut to ``top_n``, with
the documents when asked; Cohere's document objects; clear refusals. No real cross-encoder ships on PyPI:
a tiny random one with all-MiniLM-L6-v2's tokenizer stands in (its weights spread wide enough that the
scores differ)."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch

from tests.server.conftest import serve

pytestmark = pytest.mark.slow

QUERY = "what is the capital of france"
DOCUMENTS = ["Paris is the capital of France.", "The cat sleeps on the sofa.", "Berlin is in Germany.",
             "France borders Spain, and Paris lies on the Seine.", "x " * 300]  # the last one is truncated


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification

    from kvserve.models.registry import resolve

    path = tmp_path_factory.mktemp("tiny_cross_encoder")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(resolve("all-minilm") / name, path / name)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=1, initializer_range=0.4)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="module")
def reranking(tmp_path_factory, cross_encoder):
    yield from serve(tmp_path_factory, "smollm2", "-c", "256", "--rerank-model", str(cross_encoder[0]))


def _rerank(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/rerank", json={"model": "tiny_cross_encoder0", **body},
                      headers=server.headers, timeout=60)


def _reference(cross_encoder, documents: list[str]) -> list[float]:
    from transformers import AutoTokenizer

    path, model = cross_encoder
    batch = AutoTokenizer.from_pretrained(path)([QUERY] * len(documents), documents, padding=True,
                                              truncation="only_second", max_length=64, return_tensors="pt")
    with torch.no_grad():
        return torch.sigmoid(model(**batch).logits[:, 0]).tolist()


def test_scores_match_transformers_best_first(reranking, cross_encoder):
    expected = _reference(cross_encoder, DOCUMENTS)
    assert max(expected) - min(expected) > 0.1  # a model whose scores tell documents apart
    r = _rerank(reranking, query=QUERY, documents=DOCUMENTS)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    for x in results:
        assert x["relevance_score"] == pytest.approx(expected[x["index"]], abs=1e-5)
        assert "document" not in x
    assert r.json()["usage"]["total_tokens"] > 64


def test_top_n_documents_and_cohere_objects(reranking, cross_encoder):
    expected = _reference(cross_encoder, DOCUMENTS[:3])
    r = _rerank(reranking, query=QUERY, documents=[{"text": d} for d in DOCUMENTS[:3]], top_n=2,
                return_documents=True)
    results = r.json()["results"]
    best = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [x["index"] for x in results] == best
    assert [x["document"]["text"] for x in results] == [DOCUMENTS[i] for i in best]
    # llama.cpp's path answers the same
    again = httpx.post(f"{reranking.url}/rerank", json={"model": "tiny_cross_encoder0", "query": QUERY,
                       "documents": DOCUMENTS[:3], "top_n": 2}, headers=reranking.headers, timeout=60)
    assert [x["index"] for x in again.json()["results"]] == best


def test_refusals(reranking):
    assert _rerank(reranking, query=QUERY, documents=[]).status_code == 400
    assert _rerank(reranking, query=QUERY, documents=["a"], top_n=0).status_code == 400
    r = httpx.post(f"{reranking.url}/v1/rerank",
                   json={"model": "smollm2", "query": QUERY, "documents": ["a"]}, headers=reranking.headers,
                   timeout=60)
    assert r.status_code == 404 and "reranks with" in r.text
    models = httpx.get(f"{reranking.url}/v1/models", headers=reranking.headers).json()["data"]
    assert [m["id"] for m in models] == ["smollm2", "tiny_cross_encoder0"]


def test_the_flags_take_only_their_kind_of_encoder():
    from kvserve.cli.serve import _encoder

    with pytest.raises(ValueError, match="not a cross-encoder"):
        _encoder("all-minilm", "--rerank-model", rerank=True)
