"""Detokenizes new tokens, applies stop strings and builds ``RequestOutput`` records.

Streamed text never contains a stop string, nor a broken UTF-8 character: text that could still
become the start of a stop string is held back until the next token settles it.
"""

from __future__ import annotations

from kvserve.engine.outputs import RequestOutput
from kvserve.engine.request import Request, RequestStatus
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer


def dedent_at(text: str, n_indent: int) -> int | None:
    """Where ``text`` leaves an indented hole: the start of its first line after the first that is indented
    less than ``n_indent`` (a line counts once it has a character other than indentation); None while it
    has not."""
    start = text.find("\n") + 1
    while start:
        end = text.find("\n", start)
        line = text[start:] if end < 0 else text[start:end]
        body = line.lstrip(" \t")
        if body and len(line) - len(body) < n_indent:
            return start
        start = end + 1 if end >= 0 else 0
    return None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class RequestTextState:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.text = ""  # final text so far (stop strings cut off)
        self.emitted = 0  # characters of ``text`` already handed out
        self.num_emitted_tokens = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestTextState] = {}

    def add(self, request: Request) -> None:
        if self.tokenizer is not None:
            self.states[request.request_id] = RequestTextState(self.tokenizer)

    def process(self, request: Request) -> RequestOutput:
        """Call after a token was appended (and the stop-token check ran), or when a request ends."""
        state = self.states.get(request.request_id)
        new_ids = request.output_token_ids[state.num_emitted_tokens :] if state else request.output_token_ids[
            -1:]
        delta = ""
        if state is not None:
            self._advance_text(request, state, new_ids)
            safe = len(state.text)
            if not request.is_finished:
                safe -= _held_back(state.text, request.params.stop)
                if request.params.stop_at_dedent and "\n" in state.text:
                    tail = state.text.rsplit("\n", 1)[1]
                    if not tail.strip():  # a line begun: its indentation is not known yet
                        safe = min(safe, len(state.text) - len(tail))
            delta = state.text[state.emitted : safe]
            state.emitted = max(state.emitted, safe)
            state.num_emitted_tokens = len(request.output_token_ids)
        if request.is_finished:
            self.states.pop(request.request_id, None)
        logprobs = request.logprobs
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            text=state.text if state else "",
            delta_text=delta,
            token_ids=list(request.output_token_ids),
            new_token_ids=list(new_ids),
            finished=request.is_finished,
            finish_reason=request.status.value if request.is_finished else None,
            metrics=request.metrics.snapshot(),
            stop_reason=request.stop_reason,
            logprobs=list(logprobs) if logprobs is not None else None,
            new_logprobs=logprobs[-len(new_ids):] if logprobs and new_ids else (
                [] if logprobs is not None else None),
            error=request.error,
            error_status=request.error_status,
            embedding=request.embedding,
        )

    def _advance_text(self, request: Request, state: RequestTextState, new_ids: list[int]) -> None:
        before = len(state.text)
        piece = state.detokenizer.add(new_ids) if new_ids else ""
        if request.is_finished:
            piece += state.detokenizer.flush()
        state.text += piece
        dedent = request.params.stop_at_dedent
        if dedent and request.status is not RequestStatus.FINISHED_ABORTED:
            cut = dedent_at(state.text, dedent)
            if cut is not None:
                state.text = state.text[:cut]
                request.status = RequestStatus.FINISHED_STOPPED
                return
        stops = request.params.stop
        if not stops or request.status is RequestStatus.FINISHED_ABORTED:
            return
        search_from = max(0, before - max(len(s) for s in stops) + 1)
        found = [(state.text.find(s, search_from), s) for s in stops]
        found = [(i, s) for i, s in found if i >= 0]
        if found:
            index, stop = min(found)
            state.text = state.text[: index + (len(stop) if request.params.include_stop_str_in_output else 0)]
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop
