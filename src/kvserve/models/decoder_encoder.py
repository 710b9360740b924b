"""Sentence embeddings from a decoder (Qwen3-Embedding and the like): a GGUF of a decoder architecture
whose metadata names a pooling (``{arch}.pooling_type``, as llama.cpp's converter writes it for embedding
models: last token or mean). Each input is read in one forward of the model (``DecoderLM.forward``, the
engine's own kernels) over a throwaway contiguous KV cache, its final-normed hidden states pooled and
normalized, as llama.cpp's embedding endpoint computes them. The input gets the file's end-of-text token
when its tokenizer adds one (``tokenizer.ggml.add_eos_token``: Qwen3-Embedding reads its last state there).

The same interface as ``encoder.Encoder``: ``tokenize``, ``embed``, ``config``; no reranking.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve.errors import ModelLoadError

POOLINGS = {1: "mean", 3: "last"}  # gguf.PoolingType's MEAN and LAST


def decoder_pooling(path: Path) -> str | None:
    """The pooling a decoder GGUF declares ("last" or "mean"), or None: not an embedding model."""
    from kvserve.models.gguf_header import read_gguf_header

    header = read_gguf_header(path)
    kind = header.get(f"{header.architecture}.pooling_type")
    return POOLINGS.get(int(kind)) if kind is not None else None


class DecoderEncoder:
    def __init__(self, path: Path, name: str, weight_format: str = "f32") -> None:
        """weight_format: the engine's (``models.linear.WEIGHT_FORMATS``): "f32" holds the file's weights
        as they are, "q4" in their file's bits."""
        from kvserve.models.encoder import EncoderConfig
        from kvserve.models.gguf_file import GGUFFile
        from kvserve.models.loader import load_model

        pooling = decoder_pooling(path)
        if pooling is None:
            raise ModelLoadError(f"{path}: a decoder without a pooling type is not an embedding model")
        self.path, self.name = path, name
        self.loaded = load_model(str(path), weight_format=weight_format, embedding=True)
        if self.loaded.tokenizer is None:
            raise ModelLoadError(f"{path}: an embedding model needs its tokenizer")
        c = self.loaded.config
        self.add_eos = bool(GGUFFile(path).get("tokenizer.ggml.add_eos_token", False))
        self.config = EncoderConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_layers, num_heads=c.num_heads,
            intermediate_size=c.intermediate_size, max_positions=c.max_position_embeddings, type_vocab_size=0,
            eps=c.rms_norm_eps, max_seq_length=c.max_position_embeddings, pooling=pooling, normalize=True)

    def tokenize(self, texts: list[str], truncate: bool = True) -> list[list[int]]:
        """Each text's ids (with BOS and EOS as the file's tokenizer adds them); ValueError for one over the
        model's context unless ``truncate`` (then cut there, its end-of-text token kept)."""
        tokenizer, most = self.loaded.tokenizer, self.config.max_seq_length
        eos = tokenizer.eos_token_ids[:1] if self.add_eos else []
        out = []
        for text in texts:
            ids = tokenizer.encode(text) + eos
            if len(ids) > most:
                if not truncate:
                    raise ValueError(f"an input is {len(ids)} tokens; this model reads at most {most} "
                                     "(send truncate: true to cut it)")
                ids = ids[: most - len(eos)] + eos
            out.append(ids)
        return out

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """[len(batch), hidden] float32: each input's pooled final hidden state, normalized."""
        from kvserve.attention.contiguous import ContiguousKVCache

        model = self.loaded.model
        pooled = []
        for ids in batch:
            n = len(ids)
            hidden = model.forward(torch.tensor(ids, device=model.device), torch.arange(n, device=model.device),
                                   ContiguousKVCache(len(model.layers))).float()
            pooled.append(hidden[-1] if self.config.pooling == "last" else hidden.mean(0))
        return torch.nn.functional.normalize(torch.stack(pooled).cpu(), dim=-1)
