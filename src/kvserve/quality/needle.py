"""Needle in a haystack: can the model find a fact placed at some depth of a long prompt, when the
prompt lives in the cache type under test? Score = fraction of (length, depth) trials found."""

from __future__ import annotations

import random

from kvserve.engine.sampling_params import SamplingParams

QUESTION = "\n\nQuestion: What is the secret number mentioned above?\nAnswer: The secret number is"


def build_prompt(tokenizer, filler: list[int], length: int, depth: float, number: str) -> list[int]:
    """A plain-text prompt of about ``length`` tokens with the needle sentence at ``depth`` (0..1) of
    the filler, ending in a question whose answer the model completes. Plain completion rather than
    the chat template, so that small models are measured on retrieval, not on instruction following."""
    needle = tokenizer.encode(f"\nThe secret number is {number}.\n", add_special=False)
    question = tokenizer.encode(QUESTION, add_special=False)
    body = filler[: max(length - len(needle) - len(question), 16)]
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
