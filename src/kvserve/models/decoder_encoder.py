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
from kvserve.models.encoder_config import EncoderConfig
from kvserve.models.gguf_encoder import decoder_pooling


class _Decoder:
    """A decoder GGUF read for what its last hidden states say, not to chat with: the engine's loader and
    tokenizer, one forward per input over a throwaway contiguous KV cache."""

    def __init__(self, path: Path, name: str, weight_format: str, what: str, pooling: str, normalize: bool,
                 num_labels: int) -> None:
        """weight_format: the engine's (``models.linear.WEIGHT_FORMATS``): "f32" holds the file's weights
        as they are, "q4" in their file's bits. ``what`` names the model in an error."""
        from kvserve.models.loader import load_model

        self.path, self.name = path, name
        self.loaded = load_model(str(path), weight_format=weight_format, embedding=True)
        if self.loaded.tokenizer is None:
            raise ModelLoadError(f"{path}: {what} needs its tokenizer")
        c = self.loaded.config
        self.config = EncoderConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_layers, num_heads=c.num_heads,
            intermediate_size=c.intermediate_size, max_positions=c.max_position_embeddings, type_vocab_size=0,
            eps=c.rms_norm_eps, max_seq_length=c.max_position_embeddings, pooling=pooling, normalize=normalize,
            num_labels=num_labels)

    def _hidden(self, ids: list[int]) -> torch.Tensor:
        """The final-normed hidden states [len(ids), hidden] of one input."""
        from kvserve.attention.contiguous import ContiguousKVCache

        model, n = self.loaded.model, len(ids)
        return model.forward(torch.tensor(ids, device=model.device), torch.arange(n, device=model.device),
                             ContiguousKVCache(len(model.layers)))


class DecoderEncoder(_Decoder):
    def __init__(self, path: Path, name: str, weight_format: str = "f32") -> None:
        from kvserve.models.gguf_header import read_gguf_header

        pooling = decoder_pooling(path)
        if pooling is None:
            raise ModelLoadError(f"{path}: a decoder without a pooling type is not an embedding model")
        super().__init__(path, name, weight_format, "an embedding model", pooling, True, 0)
        self.add_eos = bool(read_gguf_header(path).get("tokenizer.ggml.add_eos_token", False))

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
        pooled = []
        for ids in batch:
            hidden = self._hidden(ids).float()
            pooled.append(hidden[-1] if self.config.pooling == "last" else hidden.mean(0))
        return torch.nn.functional.normalize(torch.stack(pooled).cpu(), dim=-1)


# Qwen3-Reranker's prompt (its model card's): the query and document judged, the answer "yes" or "no"
RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                 'Note that the answer can only be "yes" or "no".')
RERANK_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
RERANK_PROMPT = ("<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n<Instruct>: {instruct}\n<Query>: {query}\n"
                 "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


class DecoderReranker(_Decoder):
    """An LLM-style reranker (Qwen3-Reranker): a decoder reads the query and a document in its judging
    prompt, and the relevance is P(yes) against P(no) at the answer's first token, the softmax of those
    two logits (as vLLM and the model card compute it). Any decoder GGUF works the same way; those trained
    for it answer meaningfully. Same interface as a cross-encoder ``Encoder``: ``tokenize_pairs``,
    ``score``, ``config``."""

    def __init__(self, path: Path, name: str, weight_format: str = "f32") -> None:
        super().__init__(path, name, weight_format, "a reranker", "last", False, 2)
        self.yes, self.no = (self.loaded.tokenizer.encode(w, add_special=False)[0] for w in ("yes", "no"))

    def tokenize_pairs(self, query: str, documents: list[str]) -> list[tuple[list[int], list[int]]]:
        """(ids, []) of each document in the judging prompt; a prompt over the model's context loses the end
        of its document (the prompt's closing kept)."""
        tokenizer, most = self.loaded.tokenizer, self.config.max_seq_length
        head, tail = RERANK_PROMPT.split("{document}")
        before = tokenizer.encode(head.format(system=RERANK_SYSTEM, instruct=RERANK_INSTRUCT, query=query))
        after = tokenizer.encode(tail, add_special=False)
        room = most - len(before) - len(after)
        if room < 1:
            raise ValueError(f"the query is {len(before)} tokens in its prompt; this model reads at most {most}")
        return [(before + tokenizer.encode(d, add_special=False)[:room] + after, []) for d in documents]

    @torch.inference_mode()
    def score(self, pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        """[len(pairs)] P(yes) of each prompt against P(no), in [0, 1]."""
        scores = []
        for ids, _ in pairs:
            logits = self.loaded.model.compute_logits(self._hidden(ids)[-1:])[0]
            scores.append(torch.stack([logits[self.no], logits[self.yes]]).softmax(0)[1])
        return torch.stack(scores).cpu()
