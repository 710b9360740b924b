"""Needle in a haystack: can the model find a fact placed at some depth of a long prompt, when the
prompt lives in the cache type under test? Score = fraction of (length, depth) trials found."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.models.loader import LoadedModel

QUESTION = "\n\nQuestion: What is the secret number mentioned above?\nAnswer: The secret number is"


def build_prompt(tokenizer, filler: list[int], length: int, depth: float, number: str) -> list[int]:
    """A plain-text prompt of about ``length`` tokens with the needle sentence at ``depth`` (0..1) of
    the filler, ending in a question whose answer the model completes. Plain completion rather than
    the chat template, so that small models are measured on retrieval, not on instruction following.
    A filler shorter than the prompt is read again from its start: a 32K trial is 32K tokens long
    whatever text it is cut from."""
    needle = tokenizer.encode(f"\nThe secret number is {number}.\n", add_special=False)
    question = tokenizer.encode(QUESTION, add_special=False)
    if not filler:
        raise ValueError("the needle trials need a text of at least one token")
    body = list(itertools.islice(itertools.cycle(filler), max(length - len(needle) - len(question), 16)))
    cut = int(len(body) * depth)
    return tokenizer.encode(
        tokenizer.decode(body[:cut]) + tokenizer.decode(needle) + tokenizer.decode(body[cut:]) + QUESTION
    )


def needle_score(engine, filler: list[int], lengths: list[int], depths: list[float], seed: int = 0) -> float:
    """Runs every (length, depth) trial as one batch on ``engine``; returns the fraction found."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=12)
    trials = []
    for length in lengths:
        for depth in depths:
            number = str(rng.randrange(10000, 99999))
            prompt = build_prompt(engine.tokenizer, filler, length, depth, number)
            prompt = (
                prompt[-(engine.max_model_len - params.max_tokens) :]
                if len(prompt) >= engine.max_model_len
                else prompt
            )
            trials.append((engine.add_request(prompt, params).request_id, number))
    final = engine.run_to_completion()
    found = sum(1 for rid, number in trials if number in final[rid].text)
    return found / len(trials)


@dataclass(frozen=True, slots=True)
class Needle:
    """The needle trials of ``kvserve eval``: run by the engine as it serves (``loaded`` is the model
    with the weights the engine would choose, not the f32 weights the KLD is measured with: the
    question is whether a user of this cache type gets the fact back), on ``filler``, the whole text's
    tokens (a 32K trial needs more than one eval window), for the K/V ``pairs`` asked for (not the f32
    reference the evaluator adds: at 32K each pair is minutes of prefill)."""

    loaded: LoadedModel
    filler: list[int]
    lengths: list[int]
    pairs: frozenset[tuple[str, str]]
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)

    def score(self, cache_type_k: str, cache_type_v: str) -> float:
        trials = len(self.lengths) * len(self.depths)
        config = EngineConfig(
            model=str(self.loaded.path),
            cache=CacheConfig(num_ctx=max(self.lengths) + 64, cache_type_k=cache_type_k,
                              cache_type_v=cache_type_v),
            scheduler=SchedulerConfig(max_num_seqs=trials, max_num_batched_tokens=1024),
        )
        engine = LLMEngine(config, self.loaded)
        return needle_score(engine, self.filler, self.lengths, list(self.depths))
