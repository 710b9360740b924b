"""Which encoder a path holds, opened: a BERT (an HF folder, or a ``bert`` / ``nomic-bert`` GGUF), a decoder
GGUF that names a pooling (sentence embeddings), or for reranking any other decoder GGUF (yes/no judging).
The one place above the three encoder classes that chooses between them."""

from __future__ import annotations

from pathlib import Path

from kvserve.embedding.decoder_encoder import DecoderEncoder, DecoderReranker
from kvserve.models.encoder import Encoder
from kvserve.models.gguf_encoder import decoder_pooling, is_encoder


def open_encoder(path: Path, name: str, weight_format: str = "f32", rerank: bool = False):
    """The encoder at ``path``: ``Encoder``, ``DecoderEncoder``, or with ``rerank`` a decoder GGUF that is no
    embedding model as ``DecoderReranker``. For the decoders weight_format "int8" is the engine's "q4":
    their file's bits."""
    decoder_format = "q4" if weight_format == "int8" else "f32"
    if path.suffix == ".gguf" and decoder_pooling(path) is not None:
        return DecoderEncoder(path, name, decoder_format)
    if rerank and path.suffix == ".gguf" and not is_encoder(path):
        return DecoderReranker(path, name, decoder_format)
    return Encoder(path, name, weight_format)
