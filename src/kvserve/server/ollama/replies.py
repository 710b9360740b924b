"""Ollama's reply objects built from ``RequestOutput``s: the lines of a streamed ``/api/generate`` or
``/api/chat`` reply and the last one with its timings (nanoseconds, as Ollama reports them)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from kvserve.engine.outputs import RequestOutput, TokenLogprob
from kvserve.server.api_errors import generation_error
from kvserve.server.thinking import Thinking
from kvserve.server.tools import Calls, ToolCall, parse_calls


def now_stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def iso_stamp(unix_time: float) -> str:
    return datetime.fromtimestamp(unix_time, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _logprobs(entries: list[TokenLogprob] | None) -> list[dict] | None:
    if entries is None:
        return None
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for _, t, lp in e.top],
        }
        for e in entries
    ]


def _timings(out: RequestOutput, received: float) -> dict:
    """Nanoseconds, as Ollama reports them. load: request received -> handed to the engine (the model
    is loaded at startup); prompt_eval: first scheduled -> first token; eval: first -> last token."""
    m = out.metrics
    end = m.finished_time or time.perf_counter()
    first_token = m.first_token_time or end

    def ns(seconds: float) -> int:
        return max(0, int(seconds * 1e9))

    return {
        "total_duration": ns(end - received),
        "load_duration": ns(m.arrival_time - received),
        "prompt_eval_count": m.num_prompt_tokens,
        "prompt_eval_duration": ns(first_token - (m.first_scheduled_time or m.arrival_time)),
        "eval_count": m.num_generation_tokens,
        "eval_duration": ns(m.decode_time),
    }


def _done_reason(out: RequestOutput) -> str:
    if out.finish_reason == "error":
        raise generation_error(out)
    return "length" if out.finish_reason == "length" else "stop"


class Reply:
    """Builds the objects of one /api/generate or /api/chat reply."""

    def __init__(self, model: str, chat: bool, received: float, want_logprobs: bool,
                 tools_on: Calls | None = None, thinking: Thinking | None = None) -> None:
        self.model = model
        self.chat = chat
        self.received = received
        self.want_logprobs = want_logprobs
        self.tools_on = tools_on  # an answer may be tool calls (chat with tools)
        self.thinking = thinking  # a reasoning model's thought, sent as "thinking"

    def split(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        """(the thought, the answer's text, its calls)."""
        thought, answer = self.thinking.split(text) if self.thinking is not None else (None, text)
        answer, calls = parse_calls(answer, self.tools_on) if self.tools_on else (answer, [])
        return thought, answer, calls

    def part(self, text: str, out: RequestOutput | None = None, done: bool = False,
             thought: str | None = None) -> dict:
        obj: dict = {"model": self.model, "created_at": now_stamp()}
        if self.chat:
            obj["message"] = {"role": "assistant", "content": text}
            if thought:
                obj["message"]["thinking"] = thought
        else:
            obj["response"] = text
            if thought:
                obj["thinking"] = thought
        obj["done"] = done
        if self.want_logprobs and out is not None and not done:
            obj["logprobs"] = _logprobs(out.new_logprobs)
        return obj

    def final(self, out: RequestOutput, text: str = "", calls: list[ToolCall] | None = None,
              thought: str | None = None) -> dict:
        obj = self.part(text, out, done=True, thought=thought)
        if calls:
            obj["message"]["tool_calls"] = [
                {"id": c.id, "function": {"index": i, "name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(calls)
            ]
        obj["done_reason"] = _done_reason(out)
        if not self.chat:
            obj["context"] = list(out.prompt_token_ids) + list(out.token_ids)
        if self.want_logprobs and text:
            obj["logprobs"] = _logprobs(out.logprobs)
        return obj | _timings(out, self.received)
