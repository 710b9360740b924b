"""What a sentence encoder is, read without loading it: its ``EncoderConfig`` from a Hugging Face folder's
``config.json`` and sentence-transformers' files (``modules.json``, the pooling's config,
``sentence_bert_config.json``), and whether a folder holds one. Below the encoders themselves
(``encoder``, ``gguf_encoder``, ``decoder_encoder``), which all describe a model by it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import ModelLoadError

ENCODER_TYPES = ("bert",)


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    eps: float
    max_seq_length: int  # longer inputs are cut here (sentence-transformers' truncation)
    pooling: str  # "mean" or "cls"
    normalize: bool
    num_labels: int = 0  # a cross-encoder's classes (a reranker); 0: a sentence-embedding model
    # nomic-bert: rotary positions (half-split) instead of position embeddings
    rotary_base: float | None = None
    gated: bool = False  # nomic-bert: a SwiGLU feed-forward (down(silu(gate) * up)) instead of GELU

    @property
    def dimensions(self) -> int:
        return self.hidden_size


def is_encoder_folder(path: Path) -> bool:
    """An HF folder holding a BERT-family encoder (sentence embeddings), not a decoder to chat with."""
    try:
        return json.loads((path / "config.json").read_text()).get("model_type") in ENCODER_TYPES
    except (OSError, ValueError):
        return False


def read_encoder_config(path: Path) -> EncoderConfig:
    c = json.loads((path / "config.json").read_text())
    modules = _json(path / "modules.json", [])
    pooling_dir = next((m["path"] for m in modules if m.get("type", "").endswith("Pooling")), "1_Pooling")
    pooling = _json(path / pooling_dir / "config.json", {"pooling_mode_mean_tokens": True})
    if pooling.get("pooling_mode_cls_token"):
        mode = "cls"
    elif pooling.get("pooling_mode_mean_tokens", True):
        mode = "mean"
    else:
        raise ModelLoadError(f"{path}: only mean and [CLS] pooling are supported, not {pooling}")
    st = _json(path / "sentence_bert_config.json", {})
    return EncoderConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"],
        num_heads=c["num_attention_heads"], intermediate_size=c["intermediate_size"],
        max_positions=c["max_position_embeddings"], type_vocab_size=c.get("type_vocab_size", 2),
        eps=c.get("layer_norm_eps", 1e-12),
        max_seq_length=min(st.get("max_seq_length", 512), c["max_position_embeddings"]), pooling=mode,
        normalize=any(m.get("type", "").endswith("Normalize") for m in modules),
        num_labels=len(c.get("id2label", {0: ""})) if any(
            a.endswith("ForSequenceClassification") for a in c.get("architectures", [])) else 0,
    )


def _json(path: Path, default):
    return json.loads(path.read_text()) if path.is_file() else default


