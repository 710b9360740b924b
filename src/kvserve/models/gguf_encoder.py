"""A BERT sentence encoder from a GGUF file: llama.cpp's ``bert`` and ``nomic-bert`` architectures, the forms
Ollama's ``all-minilm`` and ``nomic-embed-text`` ship in. The config comes from the file's metadata, the
weights under their Hugging Face names (the gguf library's tensor-name map, read backwards), the WordPiece
vocabulary back from llama.cpp's spelling of it: a word-initial piece carries a leading U+2581, a
continuation loses its ``##``, bracketed specials stay as they are.

Vectors are normalized, as llama.cpp's and Ollama's embedding endpoints return them; the pooling is the
file's ``pooling_type`` (mean or [CLS]).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvserve.errors import ModelLoadError
from kvserve.lazy_torch import require, torch
from kvserve.models.encoder_config import EncoderConfig, is_encoder_folder

PHANTOM = "\u2581"


ARCHITECTURES = ("bert", "nomic-bert")
POOLINGS = {1: "mean", 3: "last"}  # gguf.PoolingType's MEAN and LAST


def decoder_pooling(path: Path) -> str | None:
    """The pooling a decoder GGUF declares ("last" or "mean"), or None: not an embedding model."""
    from kvserve.models.gguf_header import read_gguf_header

    return header_pooling(read_gguf_header(path))


def header_pooling(header) -> str | None:
    """``decoder_pooling`` of a header already read."""
    if header.architecture in ARCHITECTURES:  # an encoder's pooling, not a decoder's
        return None
    kind = header.get(f"{header.architecture}.pooling_type")
    return POOLINGS.get(int(kind)) if kind is not None else None


def is_encoder(path: Path) -> bool:
    """A sentence encoder: an HF folder of a BERT-family model, or an encoder GGUF (``is_gguf_encoder``)."""
    return is_encoder_folder(path) if path.is_dir() else is_gguf_encoder(path)


def is_gguf_encoder(path: Path) -> bool:
    """A GGUF of sentence embeddings: a BERT, or a decoder whose metadata names a pooling
    (``decoder_encoder``)."""
    if path.suffix != ".gguf" or not path.is_file():
        return False
    from kvserve.models.gguf_header import read_gguf_header

    try:
        header = read_gguf_header(path)
    except Exception:  # noqa: BLE001 - not a GGUF file we can read: not an encoder either
        return False
    return is_encoder_header(header)


def is_encoder_header(header) -> bool:
    """``is_gguf_encoder`` of a header already read."""
    return header.architecture in ARCHITECTURES or header_pooling(header) is not None


# nomic-bert's own tensors (beside BERT's token_embd, token_types, token_embd_norm, attn_output(_norm),
# ffn_up, ffn_down, layer_output_norm): the fused q, k, v and the SwiGLU gate, by Hugging Face name
_NOMIC = {"attention.self.qkv": "attn_qkv", "intermediate.gate": "ffn_gate"}


def read_gguf_encoder(path: Path):
    """(EncoderConfig, weights by Hugging Face name, tokenizers.Tokenizer) of a ``bert`` or ``nomic-bert``
    GGUF file (nomic-bert: rotary positions, fused q/k/v, a SwiGLU feed-forward, biases optional)."""
    import gguf

    from kvserve.models.gguf_file import GGUFFile

    gf = GGUFFile(path)
    arch = gf.architecture
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: a '{arch}' GGUF, not a BERT encoder")
    nomic = arch == "nomic-bert"
    layers = int(gf.require(f"{arch}.block_count"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, layers)
    hf = _hf_names(layers, nomic)

    def gguf_name(name: str) -> str:
        tail = name.split(".", 3)[-1] if name.startswith("encoder.layer.") else ""
        if tail in _NOMIC:
            return f"blk.{name.split('.')[2]}.{_NOMIC[tail]}"
        return names.get_name(name)

    weights = _load_weights(gf, hf, gguf_name)
    missing = [n for n in hf if n + ".weight" not in weights]
    if missing:
        raise ModelLoadError(f"{path}: not a {arch} encoder's weights (no {gguf_name(missing[0])}.weight)")
    hidden = int(gf.require(f"{arch}.embedding_length"))
    _split_qkv(weights, layers if nomic else 0, hidden)
    pooling = int(gf.get(f"{arch}.pooling_type", gguf.PoolingType.MEAN))
    if pooling not in (gguf.PoolingType.MEAN, gguf.PoolingType.CLS):
        raise ModelLoadError(f"{path}: pooling type {pooling}; only mean and [CLS] pooling are supported")
    context = int(gf.require(f"{arch}.context_length"))
    config = EncoderConfig(
        vocab_size=weights["embeddings.word_embeddings.weight"].shape[0], hidden_size=hidden,
        num_layers=layers, num_heads=int(gf.require(f"{arch}.attention.head_count")),
        intermediate_size=int(gf.require(f"{arch}.feed_forward_length")), max_positions=context,
        type_vocab_size=weights["embeddings.token_type_embeddings.weight"].shape[0],
        eps=float(gf.get(f"{arch}.attention.layer_norm_epsilon", 1e-12)), max_seq_length=context,
        pooling="cls" if pooling == gguf.PoolingType.CLS else "mean", normalize=True,
        rotary_base=float(gf.get(f"{arch}.rope.freq_base", 10000.0)) if nomic else None, gated=nomic,
    )
    return config, weights, wordpiece_tokenizer(gf)


def _hf_names(layers: int, nomic: bool) -> list[str]:
    """The Hugging Face names (without .weight / .bias) an encoder of ``layers`` layers must have:
    nomic-bert has no position embeddings, and a fused q/k/v and a gate where BERT has q, k and v."""
    hf = ["embeddings.word_embeddings", "embeddings.token_type_embeddings", "embeddings.LayerNorm"]
    hf += [] if nomic else ["embeddings.position_embeddings"]
    per_layer = ["attention.output.dense", "attention.output.LayerNorm", "intermediate.dense", "output.dense",
                 "output.LayerNorm"]
    per_layer += list(_NOMIC) if nomic else ["attention.self.query", "attention.self.key",
                                             "attention.self.value"]
    return hf + [f"encoder.layer.{i}.{n}" for i in range(layers) for n in per_layer]


def _load_weights(gf, hf: list[str], gguf_name: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """Each of ``hf``'s weight and bias the file holds (under ``gguf_name``'s name), as f32 under its Hugging
    Face name; the missing ones are left out."""
    weights: dict[str, torch.Tensor] = {}
    for name in hf:
        for suffix in (".weight", ".bias"):
            if gguf_name(name) + suffix in gf.tensors:
                weights[name + suffix] = gf.load_tensor(gguf_name(name) + suffix).float()
    return weights


def _split_qkv(weights: dict[str, torch.Tensor], layers: int, hidden: int) -> None:
    """The first ``layers`` layers' fused q/k/v (weight and bias) in ``weights`` replaced by q, k and v
    under BERT's names."""
    for i in range(layers):  # q, k, v under BERT's names
        p = f"encoder.layer.{i}.attention.self."
        for suffix in (".weight", ".bias"):
            if p + "qkv" + suffix in weights:
                for part, t in zip(("query", "key", "value"), weights.pop(p + "qkv" + suffix).split(hidden),
                                   strict=True):
                    weights[p + part + suffix] = t


def wordpiece_tokenizer(gf):
    """The file's vocabulary as a ``tokenizers`` WordPiece tokenizer: BERT's normalizer (lowercased, as
    llama.cpp's WPM tokenizer reads every BERT vocabulary), its pre-tokenizer, [CLS] ... [SEP] around each
    input (and [SEP] between a pair)."""
    require("tokenizers")
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
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                      lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls[0]} $A {sep[0]}", pair=f"{cls[0]} $A {sep[0]} $B:1 {sep[0]}:1",
        special_tokens=[cls, sep])
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer
