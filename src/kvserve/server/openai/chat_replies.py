"""OpenAI response objects built from ``RequestOutput``s: chunks, final objects, logprobs and usage."""

from __future__ import annotations

from kvserve import __version__
from kvserve.engine.outputs import RequestOutput, TokenLogprob
from kvserve.server.api_errors import generation_error

SYSTEM_FINGERPRINT = f"kvserve-{__version__}"


def finish_reason(out: RequestOutput) -> str:
    if out.finish_reason == "error":
        raise generation_error(out)
    return "length" if out.finish_reason == "length" else "stop"


def usage(num_prompt_tokens: int, num_cached_tokens: int, finals: list[RequestOutput]) -> dict:
    """Usage of one request: each prompt counted once, every choice's completion counted."""
    completion = sum(out.metrics.num_generation_tokens for out in finals)
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def prompt_usage(per_prompt: list[list[RequestOutput]]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) over prompts, each prompt's outputs in one list. A
    prompt's cached count is the least any of its choices got: that much was served from cache
    for every choice."""
    prompt = sum(len(g[0].prompt_token_ids) for g in per_prompt if g)
    cached = sum(min(out.metrics.num_cached_tokens for out in g) for g in per_prompt if g)
    return prompt, cached


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict | None:
    if entries is None:
        return None
    content = [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": _token_bytes(e.token),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": _token_bytes(t)} for _, t, lp in e.top],
        }
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[TokenLogprob] | None, text_offset: int, num_top: int) -> dict | None:
    """The legacy shape: parallel lists, ``text_offset`` counting characters from ``text_offset``."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t: lp for _, t, lp in e.top} for e in entries] if num_top > 0 else None,
        "text_offset": offsets,
    }


class ChunkMaker:
    """Builds one response's objects: every chunk shares id, created and model."""

    def __init__(self, response_id: str, created: int, model: str, obj: str, include_usage: bool) -> None:
        self.base = {
            "id": response_id,
            "object": obj,
            "created": created,
            "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        self.include_usage = include_usage

    def chunk(self, choices: list[dict], usage_record: dict | None = None) -> dict:
        out = {**self.base, "choices": choices}
        if self.include_usage:
            out["usage"] = usage_record  # null on every chunk but the last, as OpenAI sends it
        return out

    def final(self, obj: str, choices: list[dict], usage_record: dict) -> dict:
        """The whole (non-streamed) response, as object ``obj``."""
        return {**self.base, "object": obj, "choices": choices, "usage": usage_record}
