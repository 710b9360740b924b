"""Sentence embeddings from a decoder (Qwen3-Embedding and the like): a GGUF of a decoder architecture
whose metadata names a pooling (``{arch}.pooling_type``, as llama.cpp's converter writes it for embedding
models: last token or mean). The inputs are the prompts of pooling requests (``SamplingParams.pooling``) to
an engine of their own: its scheduler batches the inputs of every caller into the same chunked prefill a chat
model's prompts get, and each request ends, its KV freed, with its final-normed hidden states pooled, then
normalized here, as llama.cpp's embedding endpoint computes them. The input gets the file's end-of-text token
when its tokenizer adds one (``tokenizer.ggml.add_eos_token``: Qwen3-Embedding reads its last state there).

The same interface as ``encoder.Encoder``: ``tokenize``, ``embed``, ``config``, and ``aembed`` for callers on
an event loop; no reranking. ``DecoderEncoder.of_chat_model`` embeds through a chat model's own engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import ModelLoadError
from kvserve.lazy_torch import torch
from kvserve.models.encoder_config import EncoderConfig
from kvserve.models.gguf_encoder import header_pooling

# tokens an input may have (less where the model has fewer positions): Ollama's default context
NUM_CTX = 2048
MAX_NUM_SEQS = 32  # inputs prefilled together
CHUNK = 512  # tokens a step reads


def _own_engine(path: Path, weight_format: str, what: str, num_ctx: int):
    """An engine for a decoder read for its hidden states: the KV pool holds one input of the whole context
    and a step's chunk beside it, in f32 (each request's KV is freed when it ends). weight_format: the
    engine's (``models.linear.WEIGHT_FORMATS``): "f32" holds the file's weights as they are, "q4" in their
    file's bits. ``what`` names the model in an error."""
    from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.engine import LLMEngine
    from kvserve.kv.cache_types import kv_bytes_per_token
    from kvserve.models.loader import load_model

    loaded = load_model(str(path), weight_format=weight_format, embedding=True)
    if loaded.tokenizer is None:
        raise ModelLoadError(f"{path}: {what} needs its tokenizer")
    c = loaded.config
    ctx = min(num_ctx, c.max_position_embeddings)
    cache = CacheConfig(num_ctx=ctx, kv_cache_memory=(ctx + CHUNK + 16) * kv_bytes_per_token(c, "f32"),
                        cache_type_k="f32")
    scheduler = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=CHUNK)
    return AsyncLLMEngine(LLMEngine(EngineConfig(model=str(path), cache=cache, weights=weight_format,
                                                 scheduler=scheduler), loaded))


class _Decoder:
    """A decoder read for what its last hidden states say: the engine's tokenizer and scheduler, each input a
    pooling request to ``engine`` (its own, or a chat model's: ``owns_engine`` says whether closing stops
    it)."""

    def __init__(self, engine, name: str, pooling: str, normalize: bool, num_labels: int,
                 owns_engine: bool) -> None:
        loaded = engine.engine.loaded
        self.path, self.name = Path(loaded.path), name
        self.engine, self.loaded, self.pooling, self._owns_engine = engine, loaded, pooling, owns_engine
        c = loaded.config
        self.config = EncoderConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_layers,
            num_heads=c.num_heads, intermediate_size=c.intermediate_size,
            max_positions=c.max_position_embeddings, type_vocab_size=0, eps=c.rms_norm_eps,
            max_seq_length=engine.engine.max_model_len, pooling=pooling, normalize=normalize,
            num_labels=num_labels)

    async def _pooled(self, batch: list[list[int]], pooling: str) -> torch.Tensor:
        """[len(batch), ...] each input's pooled final state (or last logits), as many in the engine at once
        as it runs."""
        params = SamplingParams(pooling=pooling, max_tokens=1)

        async def one(ids: list[int]) -> torch.Tensor:
            async for out in self.engine.generate(ids, params):
                if out.finished:
                    if out.error is not None or out.embedding is None:
                        raise RuntimeError(out.error or f"the request ended ({out.finish_reason}) unread")
                    return out.embedding
            raise RuntimeError("the engine ended the request unread")

        # in waves the scheduler runs at once: a chat model's engine may take fewer than a batch (its queue
        # is for its chat requests)
        wave = self.engine.engine.config.scheduler.max_num_seqs
        pooled = []
        for i in range(0, len(batch), wave):
            try:
                # one failing cancels the others: their requests abort
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(one(ids)) for ids in batch[i : i + wave]]
            except ExceptionGroup as failed:  # the first failure, as one request would raise it (the task
                # group has cancelled this task to stop the others: a cancellation check here would
                # mistake that for the caller's)
                raise failed.exceptions[0] from None
            pooled += [t.result() for t in tasks]
        return torch.stack(pooled)

    def _run(self, batch: list[list[int]], pooling: str) -> torch.Tensor:
        """``_pooled`` from a thread without an event loop (a worker thread, a script)."""
        return asyncio.run(self._pooled(batch, pooling))

    def close(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()


class DecoderEncoder(_Decoder):
    def __init__(self, path: Path, name: str, weight_format: str = "f32", num_ctx: int = NUM_CTX) -> None:
        from kvserve.models.gguf_header import read_gguf_header

        header = read_gguf_header(path)
        pooling = header_pooling(header)
        if pooling is None:
            raise ModelLoadError(f"{path}: a decoder without a pooling type is not an embedding model")
        super().__init__(_own_engine(path, weight_format, "an embedding model", num_ctx), name, pooling, True,
                         0, True)
        self.add_eos = bool(header.get("tokenizer.ggml.add_eos_token", False))

    @classmethod
    def of_chat_model(cls, engine, name: str) -> DecoderEncoder:
        """A chat model's own embeddings, through its engine (Ollama and llama.cpp's server embed with any
        model): the mean of the prompt's final hidden states, normalized, the tokenizer's BOS as it adds
        it."""
        self = cls.__new__(cls)
        _Decoder.__init__(self, engine, name, "mean", True, 0, False)
        self.add_eos = False
        return self

    def tokenize(self, texts: list[str], truncate: bool = True) -> list[list[int]]:
        """Each text's ids (with BOS and EOS as the file's tokenizer adds them); ValueError for one over the
        model's context unless ``truncate`` (then cut there, its end-of-text token kept)."""
        tokenizer, most = self.loaded.tokenizer, self.config.max_seq_length
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: send token ids")
        eos = tokenizer.eos_token_ids[:1] if self.add_eos else []
        out = []
        for text in texts:
            # a text of nothing the tokenizer keeps (control characters) reads as the end-of-text token alone
            ids = (tokenizer.encode(text) + eos) or tokenizer.eos_token_ids[:1]
            if len(ids) > most:
                if not truncate:
                    raise ValueError(f"an input is {len(ids)} tokens; this model reads at most {most} "
                                     "(send truncate: true to cut it)")
                ids = ids[: most - len(eos)] + eos
            out.append(ids)
        return out

    async def aembed(self, batch: list[list[int]]) -> torch.Tensor:
        """[len(batch), hidden] float32: each input's pooled final hidden state, normalized."""
        return torch.nn.functional.normalize(await self._pooled(batch, self.pooling), dim=-1)

    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        return torch.nn.functional.normalize(self._run(batch, self.pooling), dim=-1)


# Qwen3-Reranker's prompt (its model card's): the query and document judged, the answer "yes" or "no"
RERANK_SYSTEM = (
    'Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                 'Note that the answer can only be "yes" or "no".')
RERANK_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
RERANK_PROMPT = (
    "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n<Instruct>: {instruct}\n<Query>: {query}\n"
                 "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


class DecoderReranker(_Decoder):
    """An LLM-style reranker (Qwen3-Reranker): a decoder reads the query and a document in its judging
    prompt, and the relevance is P(yes) against P(no) at the answer's first token, the softmax of those
    two logits (as vLLM and the model card compute it). Any decoder GGUF works the same way; those trained
    for it answer meaningfully. Same interface as a cross-encoder ``Encoder``: ``tokenize_pairs``,
    ``score``, ``config``."""

    def __init__(self, path: Path, name: str, weight_format: str = "f32", num_ctx: int = NUM_CTX) -> None:
        super().__init__(_own_engine(path, weight_format, "a reranker", num_ctx), name, "last", False, 2,
                         True)
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
            raise ValueError(
                f"the query is {len(before)} tokens in its prompt; this model reads at most {most}")
        return [(before + tokenizer.encode(d, add_special=False)[:room] + after, []) for d in documents]

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, [self.no, self.yes]].softmax(-1)[:, 1]

    async def ascore(self, pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        """[len(pairs)] P(yes) of each prompt against P(no), in [0, 1]."""
        return self._scores(await self._pooled([ids for ids, _ in pairs], "logits"))

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        return self._scores(self._run([ids for ids, _ in pairs], "logits"))
