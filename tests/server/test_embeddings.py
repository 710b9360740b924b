"""Sentence embeddings from all-MiniLM-L6-v2 beside the chat model, through the official OpenAI and Ollama
clients: the same vectors as sentence-transformers computes (cosine >= 0.9999 on 240 sentences), base64
and shortened vectors, token-id inputs, Ollama's batch and legacy routes, and clear refusals."""

from __future__ import annotations

import base64
import itertools

import numpy as np
import ollama
import openai
import pytest

pytestmark = pytest.mark.slow

SUBJECTS = ["The cat", "A young engineer", "My grandmother", "The old ship", "A quiet city", "The river",
            "Our team", "The orchestra", "A tired runner", "The library"]
VERBS = ["sleeps near", "talks about", "dreams of", "walks toward", "writes to", "waits for"]
OBJECTS = ["the mountains.", "a broken clock.", "the first snow of winter.", "an unfinished poem."]
SENTENCES = [" ".join(p) for p in itertools.product(SUBJECTS, VERBS, OBJECTS)]  # 240


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    from kvserve.models.registry import resolve

    return SentenceTransformer(str(resolve("all-minilm")), device="cpu")


def test_openai_embeddings_match_sentence_transformers(idle, reference):
    client = openai.OpenAI(base_url=f"{idle.url}/v1", api_key=idle.api_key, max_retries=0)
    ours = []
    for i in range(0, len(SENTENCES), 80):
        r = client.embeddings.create(model="all-minilm", input=SENTENCES[i : i + 80])
        assert [d.index for d in r.data] == list(range(len(r.data)))
        ours += [d.embedding for d in r.data]
    ours = np.array(ours)
    theirs = reference.encode(SENTENCES, normalize_embeddings=False)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.9999, cosine.min()
    assert ours.shape == (240, 384) and np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)  # normalized


def test_the_embedding_model_is_listed(idle):
    client = openai.OpenAI(base_url=f"{idle.url}/v1", api_key=idle.api_key, max_retries=0)
    assert [m.id for m in client.models.list()] == ["smollm2", "all-minilm"]
    assert client.models.retrieve("all-minilm").max_model_len == 256


def test_base64_dimensions_and_token_ids(idle):
    client = openai.OpenAI(base_url=f"{idle.url}/v1", api_key=idle.api_key, max_retries=0)
    floats = client.embeddings.create(model="all-minilm", input="Hello world").data[0].embedding
    raw = client.with_raw_response.embeddings.create(model="all-minilm", input="Hello world",
                                                     encoding_format="base64").http_response.json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, floats, atol=1e-7)
    short = np.array(client.embeddings.create(model="all-minilm", input="Hello world",
                                              dimensions=64).data[0].embedding)
    assert short.shape == (64,) and np.isclose(np.linalg.norm(short), 1, atol=1e-5)
    assert np.allclose(short, np.array(floats[:64]) / np.linalg.norm(floats[:64]), atol=1e-6)
    ids = [101, 7592, 2088, 102]  # [CLS] hello world [SEP] in the model's vocabulary
    by_ids = client.embeddings.create(model="all-minilm", input=[ids]).data[0].embedding
    assert np.allclose(by_ids, floats, atol=1e-5)
    for bad in ({"model": "llama3", "input": "x"}, {"model": "all-minilm", "input": ""},
                {"model": "all-minilm",
                "input": [[10**9]]}, {"model": "all-minilm", "input": "x", "dimensions": 1000}):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)):
            client.embeddings.create(**bad)


def test_ollama_embed_and_the_older_route(idle):
    client = ollama.Client(host=idle.url, headers=idle.headers)
    r = client.embed(model="all-minilm", input=["Hello world", "The cat sleeps near the mountains."])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 384 and r.prompt_eval_count > 4
    legacy = client.embeddings(model="all-minilm", prompt="Hello world")
    assert np.allclose(legacy.embedding, r.embeddings[0], atol=1e-6)
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="all-minilm", input="word " * 400, truncate=False)
    assert e.value.status_code == 400 and "truncate" in e.value.error
    # cut at 256 tokens
    assert len(client.embed(model="all-minilm", input="word " * 400).embeddings[0]) == 384
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="nomic-embed-text", input="x")
    assert e.value.status_code == 404


def test_a_chat_model_embeds_through_its_engine(idle, smollm2_q4):
    """As Ollama and llama.cpp's server do: the mean of the chat model's final hidden states, normalized; the
    same bits as the model's pooling requests in an engine of its own (the server's runs q4, f32 KV)."""
    import torch

    from kvserve.engine.sampling_params import SamplingParams
    from tests.support import make_engine

    texts = ["Hello world", "The cat sleeps near the mountains."]
    client = ollama.Client(host=idle.url, headers=idle.headers)
    got = np.array(client.embed(model="smollm2", input=texts).embeddings)
    openai_client = openai.OpenAI(base_url=f"{idle.url}/v1", api_key=idle.api_key)
    same = [d.embedding for d in openai_client.embeddings.create(model="smollm2", input=texts).data]
    assert got.shape == (2, 576) and np.array_equal(np.array(same), got)
    engine = make_engine(smollm2_q4)
    tokenizer = smollm2_q4.tokenizer
    requests = [engine.add_request(tokenizer.encode(t), SamplingParams(pooling="mean")) for t in texts]
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.embedding for o in engine.step() if o.finished}
    expected = torch.nn.functional.normalize(torch.stack([done[r.request_id] for r in requests]), dim=-1)
    assert np.allclose(got, expected.numpy(), atol=1e-6)
    # nothing the tokenizer keeps: EOS alone
    [dropped] = client.embed(model="smollm2", input="\x13").embeddings
    assert len(dropped) == 576 and np.isclose(np.linalg.norm(dropped), 1, atol=1e-5)


def test_an_encoder_is_not_a_model_to_chat_with():
    from kvserve.errors import ModelLoadError
    from kvserve.models.loader import load_model

    with pytest.raises(ModelLoadError, match="kvserve serve MODEL all-minilm"):
        load_model("all-minilm")


MIXED = ["Hi.", *(" ".join(["word"] * n) + "." for n in (90, 3, 40, 7, 150)), SENTENCES[5], "ok"] * 5


def test_inputs_of_mixed_lengths_come_back_in_order(idle, reference):
    """One request of short and long inputs: batched by length (real tokens alone through the
    projections, padding only in attention), each vector back at its input's index."""
    client = openai.OpenAI(base_url=f"{idle.url}/v1", api_key=idle.api_key, max_retries=0)
    ours = np.array([d.embedding for d in client.embeddings.create(model="all-minilm", input=MIXED).data])
    theirs = reference.encode(MIXED, normalize_embeddings=False)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.9999, cosine.min()


def test_int8_projections_stay_close(reference):
    """--embedding-weights int8: the projections' weights rounded to int8 per 32 (measured cosine >= 0.99973
    on bench/embed_throughput.py's sentences)."""
    from kvserve.models.encoder import Encoder, length_batches
    from kvserve.models.registry import resolve

    encoder = Encoder(resolve("all-minilm"), "all-minilm", "int8")
    ids = encoder.tokenize(MIXED)
    ours = np.zeros((len(ids), 384), dtype=np.float32)
    for batch in length_batches(ids, 32):
        ours[batch] = encoder.embed([ids[i] for i in batch]).numpy()
    theirs = reference.encode(MIXED, normalize_embeddings=False)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert 0.999 <= cosine.min() < 0.99999, cosine.min()  # close, and not the f32 path by mistake
