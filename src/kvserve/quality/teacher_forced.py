"""Teacher-forced quality of a KV cache type against the f32 cache, on the user's own model.

The text runs through the paged engine path in chunks: every chunk's queries read the K/V of all
earlier tokens (and of the chunk itself) back from the cache under test, so the quantization error
accumulates exactly as it does in serving. Per position we compare next-token distributions with
the f32-cache run: KL divergence, top-1 agreement, and perplexity on the text's actual next tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.attention.paged import PagedAttention, PagedAttentionMetadata, SequenceSlice
from kvserve.kv.storage import PagedKVStorage
from kvserve.lazy_torch import torch
from kvserve.models.decoder import DecoderLM

BLOCK_SIZE = 16


def chunk_logprobs(model: DecoderLM, token_ids: list[int], cache_type_k: str, cache_type_v: str, chunk: int):
    """Yields (start, log-probs [n, vocab]) per chunk, predicting tokens start+1 .. start+n."""
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    storage = PagedKVStorage(model.config, num_blocks, BLOCK_SIZE, cache_type_k, model.device, cache_type_v,
                             **model.key_transforms())
    table = torch.arange(num_blocks, device=model.device)
    ids = torch.tensor(token_ids, device=model.device)
    for start in range(0, len(token_ids) - 1, chunk):
        end = min(start + chunk, len(token_ids) - 1)
        positions = torch.arange(start, end, device=model.device)
        metadata = PagedAttentionMetadata((positions.clone(),),
                                          [SequenceSlice(0, end - start, end, (table,))])
        hidden = model.forward(ids[start:end], positions, PagedAttention(storage, metadata))
        yield start, model.compute_logits(hidden).log_softmax(-1)


@dataclass(slots=True)
class QualityScores:
    kld: float  # mean KL(p_f32 || p_type) per position, nats
    top1_agreement: float  # percent of positions whose argmax matches the f32 cache's
    ppl: float  # perplexity of the text's next tokens
    num_positions: int


def reference_run(model: DecoderLM, token_ids: list[int], chunk: int) -> list[torch.Tensor]:
    return [lp for _, lp in chunk_logprobs(model, token_ids, "f32", "f32", chunk)]


def score(
    model: DecoderLM, token_ids: list[int], reference: list[torch.Tensor], cache_type_k: str,
    cache_type_v: str, chunk: int, score_from: int = 0,
) -> QualityScores:
    """Scores the positions from ``score_from`` on (every earlier one still fills the cache): llama.cpp's
    perplexity tool scores only the second half of each window, and a comparison with it must too."""
    kld_sum = agree = nll_sum = 0.0
    count = 0
    targets = torch.tensor(token_ids[1:], device=model.device)
    for (start, logprobs), ref in zip(chunk_logprobs(model, token_ids, cache_type_k, cache_type_v, chunk),
                                      reference, strict=True):
        skip = max(0, score_from - start)
        if skip >= logprobs.shape[0]:
            continue
        logprobs, ref, start = logprobs[skip:], ref[skip:], start + skip
        n = logprobs.shape[0]
        kld_sum += float((ref.exp() * (ref - logprobs)).sum())
        agree += int((ref.argmax(-1) == logprobs.argmax(-1)).sum())
        nll_sum -= float(logprobs.gather(1, targets[start : start + n, None]).sum())
        count += n
    if count == 0:
        raise ValueError(f"no position to score: {len(token_ids)} tokens, scoring from {score_from}")
    return QualityScores(kld_sum / count, 100.0 * agree / count, math.exp(nll_sum / count), count)


def pooled(parts: list[QualityScores]) -> QualityScores:
    """Scores of several windows of text as one: each mean over all their positions."""
    n = sum(p.num_positions for p in parts)
    return QualityScores(sum(p.kld * p.num_positions for p in parts) / n,
                         sum(p.top1_agreement * p.num_positions for p in parts) / n,
                         math.exp(sum(math.log(p.ppl) * p.num_positions for p in parts) / n), n)
