"""Calls read back out of an answer, whole or while it streams, and the answers whose calls a client may
send back (``WrittenCalls``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvserve.server.tools.call_formats import HERMES, CallFormat
from kvserve.server.tools.definitions import Tool, ToolCall


class WrittenCalls:
    """The answers whose calls a client may send back, as the model wrote them (the last ``capacity``).

    An agent's next request holds the call it got (and its result); rendered by the chat template, the call
    is the family's canonical form, which differs from what the model wrote when it wrote a bare call, put
    other spaces in its JSON or cut it into other tokens. The answer's own text rendered in its place makes
    the next prompt begin with the very tokens the cache holds from this answer, so only the result and what
    follows are computed. Only an echo whose calls and text are the ones parsed from that answer is
    replaced."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[str, str, list[ToolCall]]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(call_id: str) -> str:
        """A call's id without the prefix each API gives it (``call_``, ``toolu_``, ``fc_``)."""
        prefix, _, rest = call_id.partition("_")
        return rest if prefix in ("call", "toolu", "fc") and rest else call_id

    def remember(self, written: str, text: str, calls: list[ToolCall]) -> None:
        with self._lock:
            for call in calls:
                self._items[self.key(call.id)] = (written, text, calls)
                self._items.move_to_end(self.key(call.id))
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def written(self, message: dict[str, Any]) -> str | None:
        """The text the model wrote for an assistant turn of calls, when the turn echoes that answer whole."""
        echoed = message.get("tool_calls") or []
        with self._lock:
            found = self._items.get(self.key(echoed[0].id)) if echoed else None
        if found is None:
            return None
        written, text, calls = found
        same_calls = [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in echoed]
        return written if same_calls and (message.get("content") or "").strip() == text.strip() else None


@dataclass(frozen=True, slots=True)
class Calls:
    """What an answer's calls are read against: the model family's format and the tools offered; ``written``
    keeps each answer that held calls (``WrittenCalls``)."""

    fmt: CallFormat
    tools: list[Tool]
    written: WrittenCalls | None = None


def parse_calls(text: str, calls: Calls | None = None) -> tuple[str, list[ToolCall]]:
    """(the text that is not calls, the calls) as the model family writes them (Hermes by default). Call it
    on an answer's final text: an answer with calls is remembered (``Calls.written``)."""
    if calls is None:
        return HERMES.parse(text)
    rest, found = calls.fmt.parse(text, calls.tools)
    if found and calls.written is not None and calls.fmt.text_holds_calls:
        calls.written.remember(text, rest, found)
    return rest, found


def text_to_stream(holding: bool, out, calls: Calls | None = None) -> tuple[bool, str]:
    """(still holding, text to send now) for one output of a streamed answer that may be calls: the
    answer is held while it is empty or may still become a call (a call can only come first, see
    ``call_constraint``); once it is text, what was held goes out, then each delta as it comes."""
    if not holding:
        return False, out.delta_text
    if out.text and not (calls.fmt if calls is not None else HERMES).may_start(out.text):
        return False, out.text
    return True, ""
