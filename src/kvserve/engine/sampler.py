"""Turns each ready request's logits into its next token.

Order of operations (llama.cpp and vLLM agree on it): penalties on raw logits, then temperature,
then top-k, top-p and min-p filters, then a draw from the request's own generator. Each request has
its own seeded ``torch.Generator``, so a seeded request draws the same tokens whatever shares its batch.
"""

from __future__ import annotations

import secrets
import time

import torch

from kvserve.engine.outputs import TokenLogprob
from kvserve.engine.request import Request


def apply_penalties(logits: torch.Tensor, request: Request) -> torch.Tensor:
    p = request.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long, device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
        ids, counts = torch.tensor(request.output_token_ids, device=logits.device).unique(return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
    # after the penalties, as OpenAI and llama.cpp add it: -100 bans a token, +100 all but forces it
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
        logits[ids] += torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """logits: [vocab], already divided by the temperature. Filtered entries become -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        remove[0] = False  # and the most likely one: a top_p that is 0 in float32 still leaves a token
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(0, order, remove), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def _grammar_applies(request: Request) -> bool:
    """A grammar shapes the answer, not a thought before it."""
    return request.thought is None or request.thought.answering


def _needs_penalty(p) -> bool:
    return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.logit_bias)


class Sampler:
    def __init__(self, decode_token) -> None:
        self.decode_token = decode_token  # token id -> text, for logprob records

    def sample(self, logits: torch.Tensor,
               requests: list[Request]) -> list[tuple[int | Exception, TokenLogprob | None]]:
        """logits: [len(requests), vocab] float32. A request whose draw fails gets the exception
        instead of a token, so one bad request cannot stop the batch."""
        results = []
        plain_greedy = [
            r.params.greedy and not _needs_penalty(r.params) and r.constraint is None and r.thought is None
                        for r in requests]
        # one argmax over the batch's rows (a call per row cost ~50 us at SmolLM2's 49k vocabulary)
        argmaxes = logits.argmax(-1).tolist() if sum(plain_greedy) > 1 else None
        for i, (row, request) in enumerate(zip(logits, requests, strict=True)):
            try:
                forced = None
                if request.thought is not None:
                    request.thought.update(request.output_token_ids)
                    forced = request.thought.forced()
                if forced is not None:
                    token = forced  # the thought is over its budget: its closing tokens
                elif argmaxes is not None and plain_greedy[i]:
                    token = argmaxes[i]
                else:
                    token = self._sample_one(row, request)
                if request.constraint is not None and _grammar_applies(request):
                    request.constraint.advance(token)
            except (RuntimeError, ValueError) as e:  # e.g. a distribution with no finite entry
                results.append((e, None))
                continue
            logprob = self._logprob(row, token,
                                    request.params.logprobs) if request.params.logprobs is not None else None
            results.append((token, logprob))
        return results

    def _sample_one(self, row: torch.Tensor, request: Request) -> int:
        p = request.params
        # first: penalties and filters then see only valid tokens
        if request.constraint is not None and _grammar_applies(request):
            start = time.perf_counter()
            forbidden = torch.from_numpy(request.constraint.forbidden(row.shape[-1])).to(row.device)
            request.metrics.mask_times.append(time.perf_counter() - start)
            row = row.masked_fill(forbidden, float("-inf"))
        penalized = _needs_penalty(p)
        x = apply_penalties(row.clone(), request) if penalized else row
        if p.greedy:  # only penalties can make NaN (0 * inf)
            return int(torch.argmax(torch.nan_to_num(x, nan=float("-inf")) if penalized else x))
        # extreme (valid) penalties and temperatures push logits to +-inf or NaN (0 * inf): +inf
        # becomes the largest float, so those tokens share the draw; NaN is never drawn
        x = torch.nan_to_num(x / p.temperature, nan=float("-inf"), posinf=torch.finfo(x.dtype).max)
        x = filter_logits(x, p.top_k, p.top_p, p.min_p)
        probs = x.softmax(-1)
        if request.generator is None:
            request.generator = torch.Generator(device=row.device)
            request.generator.manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
        return int(torch.multinomial(probs, 1, generator=request.generator))

    def _logprob(self, row: torch.Tensor, token: int, top_k: int) -> TokenLogprob:
        logprobs = row.log_softmax(-1)
        top = []
        if top_k > 0:
            values, ids = torch.topk(logprobs, top_k)
            top = [(int(i), self.decode_token(int(i)), float(v)) for v, i in zip(values, ids, strict=True)]
        return TokenLogprob(token, self.decode_token(token), float(logprobs[token]), top)
