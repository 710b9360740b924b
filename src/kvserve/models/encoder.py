"""Sentence embeddings from a BERT-family encoder in a Hugging Face folder, as sentence-transformers
computes them: the folder's ``modules.json`` says the pipeline (the transformer, a pooling, a
normalization), ``1_Pooling/config.json`` the pooling (mean over the real tokens, or the [CLS] token),
``sentence_bert_config.json`` the longest input. all-MiniLM-L6-v2 (Ollama's ``all-minilm``) is the one
the registry ships.

A cross-encoder (``BertForSequenceClassification``: a reranker such as ms-marco-MiniLM) reads a query and
a document as one input, [CLS] query [SEP] document [SEP], the document's tokens of the second token type,
and its classifier over the pooled [CLS] gives the pair's relevance (``score``), as sentence-transformers'
``CrossEncoder.predict`` computes it: the sigmoid of a single logit, or the last class's probability.

Unlike the decoders, an encoder reads every token of its input at once in both directions and keeps no
KV cache: a batch is padded, masked and run through in one call (torch, float32), off the engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

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
        eps=c.get("layer_norm_eps", 1e-12), max_seq_length=min(st.get("max_seq_length", 512), c["max_position_embeddings"]),
        pooling=mode, normalize=any(m.get("type", "").endswith("Normalize") for m in modules),
        num_labels=len(c.get("id2label", {0: ""})) if any(
            a.endswith("ForSequenceClassification") for a in c.get("architectures", [])) else 0,
    )


def _json(path: Path, default):
    return json.loads(path.read_text()) if path.is_file() else default


class Encoder:
    """The model and its tokenizer: ``embed(texts)`` -> (vectors [n, dimensions], tokens per text)."""

    def __init__(self, path: Path, name: str) -> None:
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        self.path, self.name = path, name
        self.config = read_encoder_config(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path}: no safetensors weights")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update({k.removeprefix("bert."): v.float() for k, v in load_file(str(f)).items()})
        self.w = weights
        needed = ["embeddings.word_embeddings.weight", "encoder.layer.0.attention.self.query.weight"]
        if self.config.num_labels:
            needed += ["pooler.dense.weight", "classifier.weight"]
        missing = [k for k in needed if k not in weights]
        if missing:
            raise ModelLoadError(f"{path}: not a BERT encoder's weights (missing {missing[0]})")
        # no truncation or padding set on the shared tokenizer: requests in other threads use it at once
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()

    def tokenize(self, texts: list[str], truncate: bool = True) -> list[list[int]]:
        """Each text's token ids ([CLS] ... [SEP]); ValueError for one over the longest input unless
        ``truncate`` (then its words are cut there and [SEP] kept, as sentence-transformers cuts it)."""
        most = self.config.max_seq_length
        ids = [e.ids for e in self.tokenizer.encode_batch(texts)]
        longest = max((len(i) for i in ids), default=0)
        if longest > most and not truncate:
            raise ValueError(f"an input is {longest} tokens; this model reads at most {most} "
                             "(send truncate: true to cut it)")
        return [i if len(i) <= most else [*i[: most - 1], i[-1]] for i in ids]

    def tokenize_pairs(self, query: str, documents: list[str]) -> list[tuple[list[int], list[int]]]:
        """(token ids, token types) of each [CLS] query [SEP] document [SEP]; a pair over the longest input
        loses the end of its document (the [SEP] kept), as a cross-encoder's tokenizer truncates it."""
        most = self.config.max_seq_length
        pairs = []
        for e in self.tokenizer.encode_batch([(query, d) for d in documents]):
            ids, types = e.ids, e.type_ids
            if len(ids) > most:
                first = types.index(1) if 1 in types else len(ids)
                if first + 1 >= most:
                    raise ValueError(f"the query is {first} tokens; this model reads at most {most} with a document")
                ids, types = [*ids[: most - 1], ids[-1]], [*types[: most - 1], types[-1]]
            pairs.append((ids, types))
        return pairs

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """[len(batch), dimensions] float32, pooled (and normalized) as the folder says."""
        x, mask = self._hidden(batch, None)
        if self.config.pooling == "cls":
            pooled = x[:, 0]
        else:
            weights = mask[..., None].float()
            pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1) if self.config.normalize else pooled

    @torch.inference_mode()
    def score(self, pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        """[len(pairs)] relevance in [0, 1] of each (ids, types) pair (``tokenize_pairs``), by a cross-encoder."""
        x, _ = self._hidden([ids for ids, _ in pairs], [types for _, types in pairs])
        pooled = torch.tanh(self._linear(x[:, 0], "pooler.dense"))
        logits = self._linear(pooled, "classifier")
        return torch.sigmoid(logits[:, 0]) if logits.shape[1] == 1 else logits.softmax(-1)[:, -1]

    def _hidden(self, batch: list[list[int]], types: list[list[int]] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's hidden states [n, length, hidden] of the padded batch, and its mask."""
        c, w = self.config, self.w
        n, length = len(batch), max(len(ids) for ids in batch)
        ids = torch.zeros(n, length, dtype=torch.long)
        kinds = torch.zeros(n, length, dtype=torch.long)
        mask = torch.zeros(n, length, dtype=torch.bool)
        for i, row in enumerate(batch):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = True
            if types is not None:
                kinds[i, : len(row)] = torch.tensor(types[i])
        positions = torch.arange(length)
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][positions]
             + w["embeddings.token_type_embeddings.weight"][kinds])
        x = self._norm(x, "embeddings.LayerNorm")
        bias = torch.zeros(n, 1, 1, length).masked_fill(~mask[:, None, None, :], float("-inf"))
        heads, head_dim = c.num_heads, c.hidden_size // c.num_heads
        for i in range(c.num_layers):
            p = f"encoder.layer.{i}."

            def split(t: torch.Tensor) -> torch.Tensor:
                return t.view(n, length, heads, head_dim).transpose(1, 2)

            q, k, v = (split(self._linear(x, p + f"attention.self.{name}")) for name in ("query", "key", "value"))
            scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + bias
            attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, length, c.hidden_size)
            x = self._norm(x + self._linear(attended, p + "attention.output.dense"), p + "attention.output.LayerNorm")
            inner = torch.nn.functional.gelu(self._linear(x, p + "intermediate.dense"))  # BERT's exact (erf) GELU
            x = self._norm(x + self._linear(inner, p + "output.dense"), p + "output.LayerNorm")
        return x, mask

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"],
                                              self.config.eps)
