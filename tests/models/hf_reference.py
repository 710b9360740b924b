"""Our model beside transformers' on the same weights: greedy tokens and last-position logits, and the
relative error between them."""

from __future__ import annotations

import torch

from kvserve.attention.contiguous import ContiguousKVCache

NEW_TOKENS = 32


LOGITS_RTOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|, b being the reference."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


def our_last_logits(lm, ids: list[int], chunks: list[int] | None = None) -> torch.Tensor:
    """Logits at the last position after feeding ``ids`` (in one forward, or in chunks of these sizes)."""
    cache = ContiguousKVCache(lm.config.num_layers)
    sizes = chunks or [len(ids)]
    assert sum(sizes) == len(ids)
    start = 0
    hidden = None
    for size in sizes:
        x = torch.tensor(ids[start : start + size], dtype=torch.long)
        pos = torch.arange(start, start + size, dtype=torch.long)
        hidden = lm.model.forward(x, pos, cache)
        start += size
    return lm.model.compute_logits(hidden[-1:])[0]


def our_greedy(lm, ids: list[int], n: int) -> list[int]:
    """Prefill the prompt, then decode one token at a time with the same contiguous cache."""
    cache = ContiguousKVCache(lm.config.num_layers)
    hidden = lm.model.forward(torch.tensor(ids, dtype=torch.long), torch.arange(len(ids)), cache)
    out: list[int] = []
    pos = len(ids)
    for _ in range(n):
        tok = int(lm.model.compute_logits(hidden[-1:])[0].argmax())
        out.append(tok)
        hidden = lm.model.forward(torch.tensor([tok]), torch.tensor([pos]), cache)
        pos += 1
    return out


def hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
        )
    return out[0, len(ids) :].tolist()
