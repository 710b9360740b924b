"""Turns each ready request's logits into its next token, in numpy (no torch on this path).

Order of operations (llama.cpp and vLLM agree on it): penalties on raw logits, then temperature,
then top-k, top-p and min-p filters, then a draw from the request's own generator. Each request has
its own seeded ``numpy.random.Generator`` (PCG64), so a seeded request draws the same tokens whatever
shares its batch. (Until 2026-11-28 the draw was torch's ``multinomial`` on a ``torch.Generator``: a seed
gives another, equally distributed, stream since.)
"""

from __future__ import annotations

import secrets
import time

import numpy as np

from kvserve.engine.constraints import GrammarError
from kvserve.engine.outputs import TokenLogprob
from kvserve.engine.request import Request

NEG_INF = np.float32(-np.inf)


def apply_penalties(logits: np.ndarray, request: Request) -> np.ndarray:
    """``logits`` [vocab] float32, changed in place and returned."""
    p = request.params
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # +-inf, NaN: the caller cleans
        if p.repetition_penalty != 1.0:
            seen = np.fromiter(set(request.all_token_ids), dtype=np.int64)
            picked = logits[seen]
            logits[seen] = np.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
            ids, counts = np.unique(np.asarray(request.output_token_ids, dtype=np.int64), return_counts=True)
            logits[ids] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * counts.astype(
                np.float32)
        # after the penalties, as OpenAI and llama.cpp add it: -100 bans a token, +100 all but forces it
        if p.logit_bias:
            ids = np.asarray([t for t, _ in p.logit_bias], dtype=np.int64)
            # a repeated id takes its last value (not their sum), as OpenAI's dict and the torch sampler did
            logits[ids] += np.asarray([b for _, b in p.logit_bias], dtype=np.float32)
    return logits


def kept_tokens(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray | None:
    """Ids of the tokens the top-k, top-p and min-p filters keep (in no order), or None for every token.
    ``logits`` [vocab] float32, already divided by the temperature, finite or -inf. Works on the kept
    ids alone after each filter: a 150k vocabulary is exponentiated once, and sorted only as far as the
    top-p cut needs."""
    n = logits.shape[-1]
    ids = None
    if 0 < top_k < n:
        kth = np.partition(logits, n - top_k)[n - top_k]
        ids = np.flatnonzero(logits >= kth)  # ties with the k-th largest stay, as a mask would keep them
    if top_p < 1.0:
        values = logits if ids is None else logits[ids]
        cut = _top_p_kept(values, top_p)
        ids = cut if ids is None else ids[cut]
    if min_p > 0.0:  # p < min_p * p_max, in logits; a token on the bound within float32 rounding stays
        values = logits if ids is None else logits[ids]
        keep = values.astype(np.float64) >= np.float64(values.max()) + np.log(min_p) - 1e-6
        ids = np.flatnonzero(keep) if ids is None else ids[keep]
    return ids


def _top_p_kept(values: np.ndarray, top_p: float) -> np.ndarray:
    """Indices into ``values`` (logits) of the smallest most-likely set whose probability reaches
    ``top_p``: the token that crosses it kept, and always the most likely one. Sorts only as many of the
    largest as it needs, 64 first."""
    with np.errstate(invalid="ignore", over="ignore"):  # float32 in [0, 1]: the unnormalized probabilities
        weights = np.exp(values - values.max())
    target = top_p * weights.sum(dtype=np.float64)
    n = len(weights)
    k = min(n, 64)
    while True:
        top = np.argpartition(-weights, k - 1)[:k] if k < n else np.arange(n)
        top = top[np.argsort(-weights[top], kind="stable")]
        before = np.cumsum(weights[top], dtype=np.float64) - weights[top]  # the mass ahead of each
        cut = int(np.searchsorted(before >= target, True))  # the first whose predecessors reach top_p
        if cut < k or k == n:
            return top[: max(cut, 1)]
        k = min(n, k * 8)


def filter_logits(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """logits: [vocab], already divided by the temperature; a copy with the filtered entries at -inf."""
    ids = kept_tokens(logits, top_k, top_p, min_p)
    if ids is None:
        return logits.copy()
    out = np.full_like(logits, NEG_INF)
    out[ids] = logits[ids]
    return out


def _grammar_applies(request: Request) -> bool:
    """A grammar shapes the answer, not a thought before it."""
    return request.thought is None or request.thought.answering


def _needs_penalty(p) -> bool:
    return bool(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.logit_bias)


class Sampler:
    def __init__(self, decode_token) -> None:
        self.decode_token = decode_token  # token id -> text, for logprob records

    def sample(self, logits, requests: list[Request]) -> list[tuple[int | Exception, TokenLogprob | None]]:
        """logits: [len(requests), vocab] float32, anything numpy reads without a copy (a CPU tensor). A
        request whose draw fails gets the exception instead of a token, so one bad request cannot stop
        the batch."""
        logits = np.asarray(logits, dtype=np.float32)
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

    def _sample_one(self, row: np.ndarray, request: Request) -> int:
        p = request.params
        # first: penalties and filters then see only valid tokens
        if request.constraint is not None and _grammar_applies(request):
            start = time.perf_counter()
            forbidden = request.constraint.forbidden(row.shape[-1])
            request.metrics.mask_times.append(time.perf_counter() - start)
            row = np.where(forbidden, NEG_INF, row)
        penalized = _needs_penalty(p)
        x = apply_penalties(row.copy(), request) if penalized else row
        if p.greedy:  # only penalties can make NaN (0 * inf)
            return int(np.argmax(np.nan_to_num(x, nan=-np.inf) if penalized else x))
        # extreme (valid) penalties and temperatures push logits to +-inf or NaN (0 * inf): +inf
        # becomes the largest float, so those tokens share the draw; NaN is never drawn
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            x = np.nan_to_num((x / np.float32(p.temperature)).astype(np.float32), nan=-np.inf,
                              posinf=np.finfo(np.float32).max, neginf=-np.inf)
        if not np.isfinite(x.max()):
            if request.constraint is not None and _grammar_applies(request):
                raise GrammarError("the output's grammar allows no token here")
            raise ValueError("no token has a finite logit")
        ids = kept_tokens(x, p.top_k, p.top_p, p.min_p)
        values = x if ids is None else x[ids]
        if request.generator is None:
            # a negative seed (the APIs take -2**63 ..) is the same seed modulo 2**64, as torch took it
            seed = p.seed % 2**64 if p.seed is not None else secrets.randbits(63)
            request.generator = np.random.default_rng(seed)
        with np.errstate(invalid="ignore", over="ignore"):  # +-max float32 both present: inf - inf
            cumulative = np.cumsum(np.exp(values - values.max()), dtype=np.float64)
        # the first whose cumulative mass passes the draw: a token of probability 0 is never it
        pick = int(np.searchsorted(cumulative, request.generator.random() * cumulative[-1], side="right"))
        pick = min(pick, len(values) - 1)
        return pick if ids is None else int(ids[pick])

    def _logprob(self, row: np.ndarray, token: int, top_k: int) -> TokenLogprob:
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            shifted = row.astype(np.float64) - np.max(row)
            logprobs = shifted - np.log(np.exp(shifted).sum())
        top = []
        if top_k > 0:
            ids = np.argpartition(-logprobs, min(top_k, len(logprobs) - 1))[:top_k]
            ids = ids[np.argsort(-logprobs[ids], kind="stable")]
            top = [(int(i), self.decode_token(int(i)), float(logprobs[i])) for i in ids]
        return TokenLogprob(token, self.decode_token(token), float(logprobs[token]), top)
