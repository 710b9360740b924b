"""Sentence embeddings from a decoder GGUF that names a pooling (Qwen3-Embedding's form): a tiny random
Qwen3 written as llama.cpp's converter writes an embedding model embeds as transformers' Qwen3Model
computes (its final-normed last hidden state, or their mean, normalized), the end-of-text token appended
as the file says; it is an encoder to ``kvserve serve`` and not a model to chat with."""

from __future__ import annotations

import gguf
import pytest
import torch

from kvserve.embedding.encoders import open_encoder
from kvserve.errors import ModelLoadError
from kvserve.models.encoder import length_batches
from kvserve.models.gguf_encoder import is_encoder
from tests.models.arch_builders import build_hf_model, write_gguf

TEXTS = ["Hello, world!", "a", "The first snow of winter fell on the mountains.", "x" * 60]


@pytest.mark.parametrize("pooling", [gguf.PoolingType.LAST, gguf.PoolingType.MEAN])
def test_a_decoder_embeds_as_transformers(tmp_path, pooling):
    hf = build_hf_model("qwen3")
    path = write_gguf(tmp_path / "embed.gguf", hf, "qwen3", pooling=pooling)
    assert is_encoder(path)
    encoder = open_encoder(path, "embed")
    ids = encoder.tokenize(TEXTS)
    assert all(row[-1] == 2 for row in ids)  # the end-of-text token the file adds
    ours = torch.zeros(len(ids), encoder.config.dimensions)
    for batch in length_batches(ids, 2):
        ours[batch] = encoder.embed([ids[i] for i in batch])
    with torch.no_grad():
        for i, row in enumerate(ids):
            hidden = hf.model(torch.tensor([row])).last_hidden_state[0]
            pooled = hidden[-1] if pooling == gguf.PoolingType.LAST else hidden.mean(0)
            expected = torch.nn.functional.normalize(pooled, dim=-1)
            assert float(torch.dot(ours[i], expected)) >= 0.99999, TEXTS[i]
    with pytest.raises(ValueError, match="at most"):
        encoder.tokenize(["y" * 600], truncate=False)
    assert len(encoder.tokenize(["y" * 600])[0]) == encoder.config.max_seq_length


def test_an_embedding_decoder_is_not_a_chat_model(tmp_path):
    from kvserve.models.loader import load_model

    path = write_gguf(tmp_path / "embed.gguf", build_hf_model("qwen3"), "qwen3",
                      pooling=gguf.PoolingType.LAST)
    with pytest.raises(ModelLoadError, match="sentence embeddings"):
        load_model(str(path))
    plain = write_gguf(tmp_path / "chat.gguf", build_hf_model("qwen3"), "qwen3")
    assert not is_encoder(plain)


def test_serve_takes_it_as_the_embedding_model(tmp_path):
    from types import SimpleNamespace

    from kvserve.cli.serve import _encoder, _encoders_among_models
    from kvserve.embedding.decoder_encoder import DecoderEncoder

    path = write_gguf(tmp_path / "qwen3-embed.gguf", build_hf_model("qwen3"), "qwen3",
                      pooling=gguf.PoolingType.LAST)
    args = SimpleNamespace(models=["smollm2", str(path)], embedding_model=None, rerank_model=None)
    _encoders_among_models(args)
    assert args.models == ["smollm2"] and args.embedding_model == str(path)
    encoder = _encoder(args.embedding_model, "--embedding-model", False)
    assert isinstance(encoder, DecoderEncoder) and encoder.name == "qwen3-embed"


def test_a_decoder_reranks_by_its_yes_and_no_logits(tmp_path):
    """--rerank-model a decoder GGUF: each document in Qwen3-Reranker's judging prompt, the relevance the
    softmax of the 'yes' and 'no' logits at the answer's first token, as transformers' logits give it."""
    from kvserve.embedding.decoder_encoder import DecoderReranker

    hf = build_hf_model("qwen3")
    path = write_gguf(tmp_path / "judge.gguf", hf, "qwen3")
    reranker = open_encoder(path, "judge", rerank=True)
    assert isinstance(reranker, DecoderReranker) and reranker.config.num_labels
    documents = ["Paris is the capital of France.", "Bananas are yellow.", "d" * 900]
    pairs = reranker.tokenize_pairs("capital of France?", documents)
    assert len(pairs[2][0]) == reranker.config.max_seq_length  # cut to the context, the prompt's end kept
    ours = reranker.score(pairs)
    with torch.no_grad():
        for i, (ids, _) in enumerate(pairs):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            expected = torch.stack([logits[reranker.no], logits[reranker.yes]]).softmax(0)[1]
            assert abs(float(ours[i]) - float(expected)) < 1e-5
    assert 0 <= float(ours.min()) and float(ours.max()) <= 1


def test_inputs_of_many_callers_share_the_engines_steps(tmp_path):
    """Each input is a pooling request to the encoder's engine: callers' inputs are prefilled in the same
    steps, each gets what it gets alone, and no KV block stays held."""
    import asyncio

    path = write_gguf(tmp_path / "embed.gguf", build_hf_model("qwen3"), "qwen3",
                      pooling=gguf.PoolingType.MEAN)
    encoder = open_encoder(path, "embed")
    engine = encoder.engine.engine
    scheduled: list[int] = []
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        scheduled.append(len(out.scheduled))
        return out

    engine.scheduler.schedule = counting
    batches = [encoder.tokenize(TEXTS[i:] + TEXTS[:i]) for i in range(3)]
    alone = [encoder.embed(batch) for batch in batches]
    assert max(scheduled) == len(TEXTS)
    scheduled.clear()

    async def together():
        with encoder.engine.lock:  # the engine waits between steps until every caller's inputs are in
            running = asyncio.gather(*(encoder.aembed(batch) for batch in batches))
            await asyncio.sleep(0.2)
        return await running

    for got, expected in zip(asyncio.run(together()), alone, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert max(scheduled) > len(TEXTS)  # several callers' inputs in one step
    assert engine.kv.full.pool.num_free_blocks == engine.kv.num_blocks
    encoder.close()
