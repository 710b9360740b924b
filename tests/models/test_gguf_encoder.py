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

from kvserve.models.encoder import Encoder, length_batches
from kvserve.models.gguf_encoder import is_encoder
from kvserve.models.registry import resolve

TEXTS = ["Hello, World!", "The café's naïve résumé costs $3.50.", "tokenization of unbelievably long words",
         "a", "Mixed CASE and 12345 numbers; punctuation?!", " ".join(["word"] * 70)]


def phantom(token: str) -> str:
    """llama.cpp's convert_hf_to_gguf spelling of a WordPiece token."""
    if token.startswith("[") and token.endswith("]"):
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def bert_writer(path, arch: str, vocab: list[str], pooling: gguf.PoolingType, context: int, hidden: int,
                ff: int, layers: int, heads: int, eps: float) -> gguf.GGUFWriter:
    """A GGUF writer holding an encoder's metadata and WordPiece vocabulary as llama.cpp's converter writes
    them; the caller adds the tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in ((w.add_context_length, context), (w.add_embedding_length, hidden),
                       (w.add_block_count, layers), (w.add_feed_forward_length, ff),
                       (w.add_head_count, heads), (w.add_layer_norm_eps, eps),
                       (w.add_causal_attention, False), (w.add_pooling_type, pooling),
                       (w.add_token_type_count, 2)):
        add(value)
    w.add_tokenizer_model("bert")
    w.add_token_list([phantom(t) for t in vocab])
    w.add_token_types([3 if t.startswith("[") and t.endswith("]") else 1 for t in vocab])
    for add, token in ((w.add_sep_token_id, "[SEP]"), (w.add_unk_token_id, "[UNK]"),
                       (w.add_pad_token_id, "[PAD]")):
        add(vocab.index(token))
    return w


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_bert_gguf(path, model, vocab: list[str], pooling: gguf.PoolingType) -> None:
    c = model.config
    w = bert_writer(path, "bert", vocab, pooling, c.max_position_embeddings, c.hidden_size,
                    c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.layer_norm_eps)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue
        base, suffix = name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.float().numpy())
    finish(w)


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
    model = BertModel(BertConfig(vocab_size=len(vocab), hidden_size=8, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=16, max_position_embeddings=16),
                                 add_pooling_layer=False)
    path = tmp_path / "embed.gguf"
    write_bert_gguf(path, model, vocab, gguf.PoolingType.MEAN)
    args = SimpleNamespace(models=["smollm2", str(path), "gemma3-270m"], embedding_model=None,
                           rerank_model=None)
    _encoders_among_models(args)
    assert args.models == ["smollm2", "gemma3-270m"] and args.embedding_model == str(path)
    assert Encoder(path, "embed").tokenize(["hellos"]) == [[2, 4, 5, 3]]


def write_nomic_gguf(path, vocab: list[str], hidden=32, layers=2, heads=4, ff=48, seed=0) -> None:
    """A random nomic-bert as llama.cpp's converter writes nomic-embed-text: fused q/k/v, a SwiGLU
    feed-forward, rotary positions, no biases in the projections."""
    g = np.random.default_rng(seed)

    def rnd(*shape, scale=0.2):
        return (g.standard_normal(shape) * scale).astype(np.float32)

    w = bert_writer(path, "nomic-bert", vocab, gguf.PoolingType.MEAN, 128, hidden, ff, layers, heads, 1e-12)
    w.add_rope_freq_base(1000.0)
    w.add_tensor("token_embd.weight", rnd(len(vocab), hidden, scale=1.0))
    w.add_tensor("token_types.weight", rnd(2, hidden))
    w.add_tensor("token_embd_norm.weight", 1 + rnd(hidden))
    w.add_tensor("token_embd_norm.bias", rnd(hidden))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_qkv.weight", rnd(3 * hidden, hidden))
        w.add_tensor(p + "attn_output.weight", rnd(hidden, hidden))
        w.add_tensor(p + "attn_output_norm.weight", 1 + rnd(hidden))
        w.add_tensor(p + "attn_output_norm.bias", rnd(hidden))
        w.add_tensor(p + "ffn_up.weight", rnd(ff, hidden))
        w.add_tensor(p + "ffn_gate.weight", rnd(ff, hidden))
        w.add_tensor(p + "ffn_down.weight", rnd(hidden, ff))
        w.add_tensor(p + "layer_output_norm.weight", 1 + rnd(hidden))
        w.add_tensor(p + "layer_output_norm.bias", rnd(hidden))
    finish(w)


@pytest.mark.parametrize("arch", ["bert", "nomic-bert"])
def test_a_gguf_encoder_embeds_as_llama_cpp(tmp_path, folder, arch):
    """llama.cpp itself (llama-cpp-python, the same file): the same token ids and vectors (cosine >= 0.99999)
    for BERT and for nomic-bert (nomic-embed-text's form: rotary positions, SwiGLU), which transformers has
    no class for."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import BertConfig, BertModel

    vocab_map = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    vocab = sorted(vocab_map, key=vocab_map.get)
    path = tmp_path / f"tiny-{arch}.gguf"
    if arch == "bert":
        torch.manual_seed(0)
        model = BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=128),
                                     add_pooling_layer=False)
        write_bert_gguf(path, model.eval(), vocab, gguf.PoolingType.MEAN)
    else:
        write_nomic_gguf(path, vocab)
    ours = Encoder(path, arch)
    assert ours.config.gated == (arch == "nomic-bert")
    theirs = llama_cpp.Llama(model_path=str(path), embedding=True, pooling_type=int(gguf.PoolingType.MEAN),
                             n_ctx=128, verbose=False)
    for text in TEXTS[:5]:
        ids = ours.tokenize([text])[0]
        assert ids == theirs.tokenize(text.encode(), add_bos=True, special=False), text
        cosine = torch.nn.functional.cosine_similarity(ours.embed([ids])[0], torch.tensor(theirs.embed(text)),
                                                       dim=0)
        assert float(cosine) >= 0.99999, (text, float(cosine))


def nomic_reference(path, ids: list[int]) -> torch.Tensor:
    """nomic-bert's forward for one input, written out from llama.cpp's graph (bert.cpp) with the gguf
    library reading the file: rotary positions as complex rotations of each head's halves, q/k/v from the
    fused tensor, SwiGLU, post-norms; mean pooling, normalized."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    t = {x.name: torch.from_numpy(np.array(x.data, dtype=np.float32)) for x in reader.tensors}

    def field(key: str):
        return reader.fields[key].parts[reader.fields[key].data[0]][0]

    hidden, heads = int(field("nomic-bert.embedding_length")), int(field("nomic-bert.attention.head_count"))
    layers, base, eps = int(field("nomic-bert.block_count")), float(field("nomic-bert.rope.freq_base")), 1e-12
    d = hidden // heads

    def norm(x, name):
        return torch.nn.functional.layer_norm(x, (hidden,), t[name + ".weight"], t[name + ".bias"], eps)

    x = norm(t["token_embd.weight"][ids] + t["token_types.weight"][0], "token_embd_norm")
    n = len(ids)
    angles = torch.arange(n, dtype=torch.float64)[:,
                                                  None] / base ** (
                                                      torch.arange(0, d, 2, dtype=torch.float64) / d)
    turn = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)[:, None, :]  # [n, 1, d / 2]

    def rope(v):  # [n, heads, d]: pairs (i, i + d/2) rotated as complex numbers
        z = torch.complex(v[..., : d // 2], v[..., d // 2 :]) * turn
        return torch.cat([z.real, z.imag], -1)

    for i in range(layers):
        p = f"blk.{i}."
        q, k, v = (x @ t[p + "attn_qkv.weight"].T).view(n, 3, heads, d).unbind(1)
        q, k = rope(q), rope(k)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d**0.5, -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, hidden) @ t[p + "attn_output.weight"].T
        x = norm(x + o, p + "attn_output_norm")
        f = torch.nn.functional.silu(x @ t[p + "ffn_gate.weight"].T) * (x @ t[p + "ffn_up.weight"].T)
        x = norm(x + f @ t[p + "ffn_down.weight"].T, p + "layer_output_norm")
    return torch.nn.functional.normalize(x.mean(0), dim=0)


def test_nomic_bert_matches_its_graph_written_out(tmp_path, folder):
    """Without llama.cpp at hand (the test above needs the peer): the same vectors as nomic-bert's graph
    written out independently of models/encoder.py (a batch of mixed lengths, so padding is exercised)."""
    vocab_map = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    path = tmp_path / "tiny-nomic.gguf"
    write_nomic_gguf(path, sorted(vocab_map, key=vocab_map.get))
    ours = Encoder(path, "nomic")
    ids = ours.tokenize(TEXTS)
    vectors = ours.embed(ids)
    for i, row in enumerate(ids):
        assert float(torch.dot(vectors[i], nomic_reference(path, row))) >= 0.99999, TEXTS[i]
