"""A BERT encoder from a GGUF file as llama.cpp writes one (``bert`` architecture, tensors by the gguf
library's name map, the WordPiece vocabulary in phantom-space spelling): a tiny random BertModel with
all-MiniLM-L6-v2's vocabulary, written that way, tokenizes as the original tokenizer does and embeds as
transformers computes (mean or [CLS] pooling, normalized, as llama.cpp returns vectors)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from kvserve.models.encoder import Encoder, is_encoder, length_batches
from kvserve.models.registry import resolve

TEXTS = ["Hello, World!", "The café's naïve résumé costs $3.50.", "tokenization of unbelievably long words",
         "a", "Mixed CASE and 12345 numbers; punctuation?!", " ".join(["word"] * 70)]


def phantom(token: str) -> str:
    """llama.cpp's convert_hf_to_gguf spelling of a WordPiece token."""
    if token.startswith("[") and token.endswith("]"):
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def write_bert_gguf(path, model, vocab: list[str], pooling: gguf.PoolingType) -> None:
    c = model.config
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_eps(c.layer_norm_eps)
    w.add_causal_attention(False)
    w.add_pooling_type(pooling)
    w.add_tokenizer_model("bert")
    w.add_token_list([phantom(t) for t in vocab])
    w.add_token_types([3 if t.startswith("[") and t.endswith("]") else 1 for t in vocab])
    w.add_token_type_count(c.type_vocab_size)
    w.add_sep_token_id(vocab.index("[SEP]"))
    w.add_unk_token_id(vocab.index("[UNK]"))
    w.add_pad_token_id(vocab.index("[PAD]"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue
        base, suffix = name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def folder():
    return resolve("all-minilm")


@pytest.mark.parametrize("pooling", [gguf.PoolingType.MEAN, gguf.PoolingType.CLS])
def test_a_bert_gguf_embeds_as_transformers(tmp_path, folder, pooling):
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertModel

    vocab_map = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    vocab = sorted(vocab_map, key=vocab_map.get)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128)
    model = BertModel(config, add_pooling_layer=False).eval()
    path = tmp_path / "tiny-bert.gguf"
    write_bert_gguf(path, model, vocab, pooling)
    assert is_encoder(path)
    encoder = Encoder(path, "tiny-bert")
    original = Tokenizer.from_file(str(folder / "tokenizer.json"))
    original.no_truncation()
    original.no_padding()
    ids = encoder.tokenize(TEXTS)
    assert ids == [e.ids for e in original.encode_batch(TEXTS)]
    ours = torch.zeros(len(ids), 32)
    for batch in length_batches(ids, 4):
        ours[batch] = encoder.embed([ids[i] for i in batch])
    with torch.no_grad():
        for i, row in enumerate(ids):
            hidden = model(torch.tensor([row])).last_hidden_state[0]
            pooled = hidden.mean(0) if pooling == gguf.PoolingType.MEAN else hidden[0]
            expected = torch.nn.functional.normalize(pooled, dim=-1)
            assert float(torch.dot(ours[i], expected)) >= 0.99999, TEXTS[i]
    assert np.allclose(ours.norm(dim=-1).numpy(), 1, atol=1e-5)


def test_a_chat_model_gguf_is_not_an_encoder():
    assert not is_encoder(resolve("smollm2"))


def test_serve_takes_a_bert_gguf_among_its_models_as_the_embedding_model(tmp_path, folder):
    from types import SimpleNamespace

    from transformers import BertConfig, BertModel

    from kvserve.cli.serve import _encoders_among_models

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "##s"]
    model = BertModel(BertConfig(vocab_size=len(vocab), hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=16, max_position_embeddings=16), add_pooling_layer=False)
    path = tmp_path / "embed.gguf"
    write_bert_gguf(path, model, vocab, gguf.PoolingType.MEAN)
    args = SimpleNamespace(models=["smollm2", str(path), "gemma3-270m"], embedding_model=None, rerank_model=None)
    _encoders_among_models(args)
    assert args.models == ["smollm2", "gemma3-270m"] and args.embedding_model == str(path)
    assert Encoder(path, "embed").tokenize(["hellos"]) == [[2, 4, 5, 3]]
