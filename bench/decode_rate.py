"""Decode speed of an engine's requests, for the benchmark scripts."""

from __future__ import annotations

import time


def decode_rate(engine) -> tuple[float, dict]:
    """Runs the engine's requests to the end: the steps until every prompt is computed untimed, the rest
    timed. Returns (generated tokens per second while decoding, the final outputs by request id)."""
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    start, before = time.perf_counter(), engine.num_generated_tokens
    done = engine.run_to_completion()
    return (engine.num_generated_tokens - before) / (time.perf_counter() - start), done
