"""A BERT sentence encoder from a GGUF file: llama.cpp's ``bert`` architecture, the form Ollama's
``all-minilm`` and its other BERT embedding models ship in. The config comes from the file's metadata, the
weights under their Hugging Face names (the gguf library's tensor-name map, read backwards), the WordPiece
vocabulary back from llama.cpp's spelling of it: a word-initial piece carries a leading U+2581, a
continuation loses its ``##``, bracketed specials stay as they are.

Vectors are normalized, as llama.cpp's and Ollama's embedding endpoints return them; the pooling is the
file's ``pooling_type`` (mean or [CLS]).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve.errors import ModelLoadError

PHANTOM = "\u2581"


def is_gguf_encoder(path: Path) -> bool:
    """A GGUF of sentence embeddings: a BERT, or a decoder whose metadata names a pooling
    (``decoder_encoder``)."""
    if path.suffix != ".gguf" or not path.is_file():
        return False
    from kvserve.models.decoder_encoder import decoder_pooling
    from kvserve.models.gguf_header import read_gguf_header

    try:
        return read_gguf_header(path).architecture == "bert" or decoder_pooling(path) is not None
    except Exception:  # noqa: BLE001 - not a GGUF file we can read: not an encoder either
        return False


def read_gguf_encoder(path: Path):
    """(EncoderConfig, weights by Hugging Face name, tokenizers.Tokenizer) of a ``bert`` GGUF file."""
    import gguf

    from kvserve.models.encoder import EncoderConfig
    from kvserve.models.gguf_file import GGUFFile

    gf = GGUFFile(path)
    if gf.architecture != "bert":
        raise ModelLoadError(f"{path}: a '{gf.architecture}' GGUF, not a BERT encoder")
    layers = int(gf.require("bert.block_count"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, layers)
    hf = ["embeddings.word_embeddings", "embeddings.position_embeddings", "embeddings.token_type_embeddings",
          "embeddings.LayerNorm"]
    for i in range(layers):
        p = f"encoder.layer.{i}."
        hf += [p + n for n in ("attention.self.query", "attention.self.key", "attention.self.value",
                               "attention.output.dense", "attention.output.LayerNorm", "intermediate.dense",
                               "output.dense", "output.LayerNorm")]
    weights: dict[str, torch.Tensor] = {}
    for name in hf:
        base = names.get_name(name)
        for suffix in (".weight", ".bias"):
            if base + suffix in gf.tensors:
                weights[name + suffix] = gf.load_tensor(base + suffix).float()
    missing = [n for n in hf if n + ".weight" not in weights]
    if missing:
        raise ModelLoadError(f"{path}: not a BERT encoder's weights (no {names.get_name(missing[0])}.weight)")
    pooling = int(gf.get("bert.pooling_type", gguf.PoolingType.MEAN))
    if pooling not in (gguf.PoolingType.MEAN, gguf.PoolingType.CLS):
        raise ModelLoadError(f"{path}: pooling type {pooling}; only mean and [CLS] pooling are supported")
    hidden = int(gf.require("bert.embedding_length"))
    context = int(gf.require("bert.context_length"))
    config = EncoderConfig(
        vocab_size=weights["embeddings.word_embeddings.weight"].shape[0], hidden_size=hidden, num_layers=layers,
        num_heads=int(gf.require("bert.attention.head_count")),
        intermediate_size=int(gf.require("bert.feed_forward_length")), max_positions=context,
        type_vocab_size=weights["embeddings.token_type_embeddings.weight"].shape[0],
        eps=float(gf.get("bert.attention.layer_norm_epsilon", 1e-12)), max_seq_length=context,
        pooling="cls" if pooling == gguf.PoolingType.CLS else "mean", normalize=True,
    )
    return config, weights, wordpiece_tokenizer(gf)


def wordpiece_tokenizer(gf):
    """The file's vocabulary as a ``tokenizers`` WordPiece tokenizer: BERT's normalizer (lowercased, as
    llama.cpp's WPM tokenizer reads every BERT vocabulary), its pre-tokenizer, [CLS] ... [SEP] around each
    input (and [SEP] between a pair)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    tokens = gf.require("tokenizer.ggml.tokens")
    vocab = {}
    for i, piece in enumerate(tokens):
        if piece.startswith("[") and piece.endswith("]"):
            word = piece
        elif piece.startswith(PHANTOM):
            word = piece[len(PHANTOM) :]
        else:
            word = "##" + piece
        vocab.setdefault(word, i)

    def special(key: str, fallback: str) -> tuple[str, int]:
        found = gf.get(key)
        token_id = int(found) if found is not None else vocab.get(fallback)
        if token_id is None:
            raise ModelLoadError(f"{gf.path}: no {fallback} token in its vocabulary")
        return tokens[token_id], token_id

    cls = special("tokenizer.ggml.cls_token_id", "[CLS]")
    if cls[0] != "[CLS]" and gf.get("tokenizer.ggml.bos_token_id") is not None:
        cls = special("tokenizer.ggml.bos_token_id", "[CLS]")
    sep = special("tokenizer.ggml.seperator_token_id", "[SEP]")
    unk = special("tokenizer.ggml.unknown_token_id", "[UNK]")
    tokenizer = Tokenizer(WordPiece(vocab, unk_token=unk[0], max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls[0]} $A {sep[0]}", pair=f"{cls[0]} $A {sep[0]} $B:1 {sep[0]}:1", special_tokens=[cls, sep])
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer
