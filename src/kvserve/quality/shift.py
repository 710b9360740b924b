"""Teacher-forced perplexity of a text longer than the context, read the way context shift serves a long
chat: the context fills, its first ``num_keep`` tokens stay and the newer half of the rest carries on
(``scheduler.shifted_context``, the engine's own rule), and the text goes on from there.

The engine's tokens after a shift are the same bits as a fresh request started from the shifted tokens
(tests/engine/test_context_shift.py), so each stretch between two shifts is scored here as such a
request: its shifted context, then the text's next tokens until the context is full again. The
reference is the last complete stretch's tokens read in a fresh context: the text's first token, then
the text just before the stretch (a full window from position 0). The history is nearly the same, so
the two agree unless the shift broke the context (the kept start's positions, the carried keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.engine.scheduler import shifted_context
from kvserve.lazy_torch import torch
from kvserve.models.decoder import DecoderLM
from kvserve.quality.teacher_forced import chunk_logprobs


@dataclass(slots=True)
class ShiftScores:
    shifts: int
    ppl_shifted: float  # the last stretch's tokens after the shifts
    ppl_fresh: float  # the same tokens in a fresh context
    last_stretch: int  # tokens in it

    @property
    def ratio(self) -> float:
        return self.ppl_shifted / self.ppl_fresh


def _nll(model: DecoderLM, context: list[int], scored_from: int, chunk: int) -> list[float]:
    """Negative log-likelihoods of context[scored_from:] each given the tokens before it (f32 KV)."""
    targets = torch.tensor(context[1:])
    out = []
    for start, logprobs in chunk_logprobs(model, context, "f32", "f32", chunk):
        nll = -logprobs.gather(1, targets[start : start + logprobs.shape[0], None]).squeeze(1)
        out += [float(v) for v in nll]
    return out[scored_from - 1 :]


def shift_scores(model: DecoderLM, token_ids: list[int], num_ctx: int, num_keep: int,
                 chunk: int = 256) -> ShiftScores:
    """token_ids: the text (longer than num_ctx). Reads it through successive shifts of a num_ctx context."""
    context, position, shifts, stretch = list(token_ids[:num_ctx]), num_ctx, 0, 0
    stretch_nll: list[float] = []
    while True:
        shifted = shifted_context(context, num_keep, num_ctx)
        take = num_ctx - len(shifted)
        if position + take > len(token_ids):  # only complete stretches
            break
        context, shifts, stretch = shifted + token_ids[position : position + take], shifts + 1, take
        stretch_nll = _nll(model, context, len(shifted), chunk)
        position += take
    if not shifts:
        raise ValueError("the text must fill the context and one stretch after a shift")
    # a fresh request: the text's first token (its BOS: Gemma reads a context without it far worse), then the
    # text just before the stretch and the stretch
    fresh = token_ids[:1] + token_ids[position - num_ctx + 1 : position]
    fresh_nll = _nll(model, fresh, num_ctx - stretch, chunk)
    mean = lambda nll: math.exp(sum(nll) / len(nll))
    return ShiftScores(shifts, mean(stretch_nll), mean(fresh_nll), len(stretch_nll))
