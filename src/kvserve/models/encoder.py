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
KV cache: a batch runs through in one call, off the engine; its real tokens alone through the projections
(f32, or int8 groups through ``models.linear``'s integer kernels: ``ENCODER_WEIGHTS``), padded
and masked only for attention (torch's fused ``scaled_dot_product_attention``, float32).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvserve.errors import ModelLoadError
from kvserve.lazy_torch import inference_mode, require, torch
from kvserve.models.encoder_config import read_encoder_config

# f32: sentence-transformers' vectors (cosine 1.000000 on bench/embed_throughput.py's 512 sentences);
# int8: ~1.9x faster again, cosine down to 0.99973 there (the weights rounded to int8 per 32)
ENCODER_WEIGHTS = ("f32", "int8")


def _weight_format(weights: str) -> str:
    if weights not in ENCODER_WEIGHTS:
        raise ValueError(f"encoder weights must be one of {', '.join(ENCODER_WEIGHTS)}, got {weights!r}")
    return weights


def length_batches(inputs: list[list[int]], size: int) -> list[list[int]]:
    """The inputs' indices in batches of ``size``, by length: each batch pads to its longest, so inputs of
    like lengths together pad least (sentence-transformers sorts ``encode``'s inputs the same way)."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    return [order[i : i + size] for i in range(0, len(order), size)]


def _read_folder(path: Path):
    """(EncoderConfig, weights by name, tokenizers.Tokenizer) of a Hugging Face folder."""
    for backend in ("torch", "safetensors", "tokenizers"):
        require(backend)
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update({k.removeprefix("bert."): v.float() for k, v in load_file(str(f)).items()})
    return read_encoder_config(path), weights, Tokenizer.from_file(str(path / "tokenizer.json"))


def _rotary(positions: torch.Tensor, head_dim: int, base: float):
    """A function rotating [tokens, heads * head_dim] by each token's position, half-split (NeoX's,
    llama.cpp's for nomic-bert)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        heads = t.view(t.shape[0], -1, head_dim)
        a, b = heads[..., : head_dim // 2], heads[..., head_dim // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).view(t.shape)

    return rotate


class Encoder:
    """The model and its tokenizer: ``embed(texts)`` -> (vectors [n, dimensions], tokens per text)."""

    def __init__(self, path: Path, name: str, weight_format: str = "f32") -> None:
        """weight_format: "f32", or "int8" (the projections' weights rounded to int8 per 32, the native
        kernels' exact integer sums over them: faster, a little further from sentence-transformers)."""
        from kvserve.models.gguf_encoder import read_gguf_encoder

        self.path, self.name = path, name
        if path.suffix == ".gguf":
            self.config, weights, self.tokenizer = read_gguf_encoder(path)
        else:
            self.config, weights, self.tokenizer = _read_folder(path)
        self.w = weights
        needed = ["embeddings.word_embeddings.weight", "encoder.layer.0.attention.self.query.weight"]
        if self.config.num_labels:
            needed += ["pooler.dense.weight", "classifier.weight"]
        missing = [k for k in needed if k not in weights]
        if missing:
            raise ModelLoadError(f"{path}: not a BERT encoder's weights (missing {missing[0]})")
        self.weights = _weight_format(weight_format)
        self.num_parameters = sum(t.numel() for t in weights.values())
        self.linears = self._projections()
        # no truncation or padding set on the shared tokenizer: requests in other threads use it at once
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()

    def _projections(self) -> dict:
        """Every projection as ``models.linear`` holds it in ``self.weights``'s format: int8 groups (exact
        integer sums over the weights rounded to int8 per 32, our native kernels) or f32. A layer's query,
        key and value are one projection; so are a gated feed-forward's gate and up. Their weights leave
        ``self.w``: each is held once, by its linear."""
        from kvserve.models.linear import make_linear

        w, cpu = self.w, torch.device("cpu")

        def fused(names: list[str]):  # the parts leave ``self.w``: the linear holds their weights now
            biases = [w.pop(n + ".bias", None) for n in names]
            bias = torch.cat(biases) if all(b is not None for b in biases) else None
            return make_linear(torch.cat([w.pop(n + ".weight") for n in names]), bias, self.weights, cpu,
                               torch.float32)

        names = ["pooler.dense", "classifier"] if self.config.num_labels else []
        linears = {}
        for i in range(self.config.num_layers):
            p = f"encoder.layer.{i}."
            linears[p + "attention.self.qkv"] = fused(
                [p + f"attention.self.{n}" for n in ("query", "key", "value")])
            if self.config.gated:
                linears[p + "intermediate.dense"] = fused([p + "intermediate.gate", p + "intermediate.dense"])
            else:
                names.append(p + "intermediate.dense")
            names += [p + "attention.output.dense", p + "output.dense"]
        for name in names:
            linears[name] = make_linear(w.pop(name + ".weight"), w.pop(name + ".bias", None), self.weights,
                                        cpu, torch.float32)
        return linears

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
                    raise ValueError(
                        f"the query is {first} tokens; this model reads at most {most} with a document")
                ids, types = [*ids[: most - 1], ids[-1]], [*types[: most - 1], types[-1]]
            pairs.append((ids, types))
        return pairs

    async def aembed(self, batch: list[list[int]]) -> torch.Tensor:
        """``embed`` in a worker thread (torch computes without the GIL), for callers on an event loop."""
        return await asyncio.to_thread(self.embed, batch)

    async def ascore(self, pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        return await asyncio.to_thread(self.score, pairs)

    @inference_mode
    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """[len(batch), dimensions] float32, pooled (and normalized) as the folder says."""
        x, mask = self._hidden(batch, None)
        if self.config.pooling == "cls":
            pooled = x[:, 0]
        else:
            weights = mask[..., None].float()
            pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1) if self.config.normalize else pooled

    @inference_mode
    def score(self, pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        """[len(pairs)] relevance in [0, 1] of each (ids, types) pair (``tokenize_pairs``), by a
        cross-encoder."""
        x, _ = self._hidden([ids for ids, _ in pairs], [types for _, types in pairs])
        pooled = torch.tanh(self._linear(x[:, 0], "pooler.dense"))
        logits = self._linear(pooled, "classifier")
        return torch.sigmoid(logits[:, 0]) if logits.shape[1] == 1 else logits.softmax(-1)[:, -1]

    def _hidden(self, batch: list[list[int]], types: list[list[int]] | None) -> tuple[
        torch.Tensor, torch.Tensor]:
        """The last layer's hidden states [n, length, hidden] of the padded batch, and its mask. Only the
        real tokens go through the projections (a batch's padding costs attention alone)."""
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
        real = mask.view(-1).nonzero().squeeze(1)  # the real tokens' places in the padded [n * length]
        positions = torch.arange(length).repeat(n)[real]
        flat_ids, flat_kinds = ids.view(-1)[real], kinds.view(-1)[real]
        x = w["embeddings.word_embeddings.weight"][flat_ids] + w["embeddings.token_type_embeddings.weight"][
            flat_kinds]
        if c.rotary_base is None:
            x = x + w["embeddings.position_embeddings.weight"][positions]  # [tokens, hidden]
            rotate = None
        else:
            rotate = _rotary(positions, c.hidden_size // c.num_heads, c.rotary_base)
        x = self._norm(x, "embeddings.LayerNorm")
        keys = mask[:, None, None, :]  # each query attends to its input's real tokens
        heads, head_dim = c.num_heads, c.hidden_size // c.num_heads

        def padded(t: torch.Tensor) -> torch.Tensor:  # [tokens, hidden] -> [n, heads, length, head_dim]
            out = t.new_zeros(n * length, t.shape[1])
            out[real] = t
            return out.view(n, length, heads, head_dim).transpose(1, 2)

        for i in range(c.num_layers):
            p = f"encoder.layer.{i}."
            q, k, v = self._linear(x, p + "attention.self.qkv").split(c.hidden_size, dim=-1)
            if rotate is not None:
                q, k = rotate(q), rotate(k)
            q, k, v = padded(q), padded(k), padded(v)
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keys)
            attended = attended.transpose(1, 2).reshape(n * length, c.hidden_size)[real]
            x = self._norm(x + self._linear(attended, p + "attention.output.dense"),
                           p + "attention.output.LayerNorm")
            if c.gated:  # nomic-bert: down(silu(gate) * up)
                gate, up = self._linear(x, p + "intermediate.dense").chunk(2, dim=-1)
                inner = torch.nn.functional.silu(gate) * up
            else:
                # BERT's exact (erf) GELU
                inner = torch.nn.functional.gelu(self._linear(x, p + "intermediate.dense"))
            x = self._norm(x + self._linear(inner, p + "output.dense"), p + "output.LayerNorm")
        out = x.new_zeros(n * length, c.hidden_size)
        out[real] = x
        return out.view(n, length, c.hidden_size), mask

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.linears[name](x)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"],
                                              self.w[name + ".bias"], self.config.eps)
