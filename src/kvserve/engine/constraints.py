"""Constrained decoding: a grammar limits which tokens a request may sample next.

    Constraint("json_schema", '{"type": "object", ...}')    spec: what the client asked for
        -> TokenConstraint (one per request)               its parser state, through llguidance
             forbidden(vocab) -> bool mask for the sampler (tokens that would leave the grammar)
             advance(token)                                after each sampled token

llguidance (llama.cpp's choice too) was picked over xgrammar by measuring on our tokenizers (see
docs/server-guide.md): masks well under a millisecond with either, schema compilation 5-6x faster (agents send
new tool schemas with every request), and no dependency beyond itself. Its tokenizer tables take seconds to
build for a 262K vocabulary, so they are built once per model, on the first constrained request.

A constraint follows the request's output tokens, not its KV: preemption and recomputation leave it
as it is (the output tokens stay), so it needs nothing on resume.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "lark")


@dataclass(frozen=True, slots=True)
class Constraint:
    """``kind`` in CONSTRAINT_KINDS; ``spec`` the JSON schema (as JSON text), the regex or the Lark grammar
    (empty for json_object: any JSON object)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(
                f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Constraint:
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    def grammar(self) -> str:
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object (or true/false)")
            return LLMatcher.grammar_from_json_schema(schema, _JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        return LLMatcher.grammar_from_lark(self.spec)


# one line, with ", " and ": " as json.dumps writes it: pretty-printing costs tokens (small models
# indent deeper and deeper), and clients parse either. The separators are json.dumps' (and so the chat
# templates' tojson's) so that a call the model wrote, sent back in the next request's history, renders as the
# same text, and its cached blocks serve that request (llguidance's own default is ",", ":")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON_OPTIONS = JSON_LAYOUT


class GrammarTokenizer:
    """The model's vocabulary as llguidance sees it, built on first use (seconds for 262K tokens)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._built = None
        self._lock = threading.Lock()
        self.lock = threading.Lock()  # guards ``compiled``
        self.compiled: OrderedDict = OrderedDict()  # (kind, spec) -> a matcher at the start (``compiled``)

    def get(self):
        with self._lock:
            if self._built is None:
                tok = self.tokenizer
                eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
                self._built = tok.backend.guidance(tok.vocab_size, eos)
        return self._built


class GrammarError(ValueError):
    """A grammar that cannot be followed: refused at admission (a 400), or, found only while generating,
    the end of that request alone (``Request.error_status`` 400). The message is ours, one line: never
    the grammar library's parser state."""


def _first_line(message: str) -> str:
    return message.split("<state>")[0].strip().splitlines()[0][:300] if message.strip() else "unknown"


# JSON Schema keywords the grammar engine cannot enforce: a schema using them is refused (OpenAI's strict
# mode refuses them too), rather than followed in part
UNENFORCED_KEYWORDS = ("if", "then", "else", "not", "dependentSchemas", "dependentRequired",
                       "unevaluatedProperties", "unevaluatedItems", "contains", "minContains", "maxContains",
                       "propertyNames", "uniqueItems", "$dynamicRef", "$dynamicAnchor")
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def _reason(kind: str, error: str) -> str:
    """The grammar engine's complaint in our words: its parser positions and internal prefixes left out."""
    line = _first_line(error)
    unimplemented = _UNIMPLEMENTED.search(line)
    if unimplemented:
        keywords = unimplemented.group(1).replace('"', "")
        return f"the JSON schema uses keywords this server cannot enforce: {keywords}; leave them out"
    in_schema = "JSON schema" in line
    line = re.sub(r"^at \d+\(\d+\): (failed to compile JSON schema: )?", "", line)
    if line.startswith("Unsatisfiable schema"):
        return f"the JSON schema cannot be satisfied ({line.partition(': ')[2] or line})"
    if in_schema or line.startswith("schema "):
        return f"the JSON schema is not valid: {line}"
    return f"invalid {kind}: {line}"


PROBE_TOKENS = 4  # tokens a new grammar is followed ahead, on a copy, before the request is admitted


COMPILED_KEPT = 64  # compiled grammars kept per model: agents send the same tools with every turn
MAX_SPEC_BYTES = 1 << 20  # a grammar's text (schema, regex, Lark) beyond this is refused before compiling


def compiled(constraint: Constraint, grammar_tokenizer: GrammarTokenizer):
    """The constraint's matcher at its start, compiled and probed once (``_probe``) and kept (the last
    ``COMPILED_KEPT``): each request then takes a copy. ValueError (a 400) for a grammar that is
    invalid, too large or cannot be followed. Safe from any thread; llguidance compiles without the GIL,
    so the server compiles off its event loop (``Serving.start``)."""
    key = (constraint.kind, constraint.spec)
    cache = grammar_tokenizer.compiled
    with grammar_tokenizer.lock:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    if len(constraint.spec) > MAX_SPEC_BYTES:
        raise ValueError(
            f"the {constraint.kind.replace('_', ' ')} is {len(constraint.spec):,} bytes; at most "
                         f"{MAX_SPEC_BYTES:,} are compiled")
    from llguidance import LLMatcher

    tokenizer = grammar_tokenizer.get()
    grammar = constraint.grammar()
    kind = constraint.kind.replace("_", " ")
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(_reason(kind, error))
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(_reason(kind, matcher.get_error()))
    _probe(matcher, kind, tokenizer.vocab_size)
    with grammar_tokenizer.lock:
        cache[key] = matcher
        while len(cache) > COMPILED_KEPT:
            cache.popitem(last=False)
    return matcher


def _probe(matcher, kind: str, vocab_size: int) -> None:
    """Follows the grammar a few tokens ahead on a copy, taking the first token each step allows: a schema
    that compiles but cannot be followed (a property that requires itself without end, a constant too
    large for the lexer) fails here, at admission, rather than on the first sampled token."""
    probe = matcher.deep_copy()
    words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    for _ in range(PROBE_TOKENS):
        if probe.is_stopped():
            return
        probe.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size])
        if allowed.size == 0:
            if probe.is_accepting():
                return
            raise GrammarError(
                f"the {kind} admits no output: {_first_line(probe.get_error() or 'no token fits')}")
        if not probe.consume_token(int(allowed[0])) or probe.is_error():
            raise GrammarError(f"the {kind} cannot be followed (a property that requires itself without end, "
                               f"or a part too large for the grammar engine): "
                               f"{_first_line(probe.get_error())}")


class TokenConstraint:
    """One request's grammar state: a copy of the compiled grammar's start (``compiled``)."""

    def __init__(self, constraint: Constraint, grammar_tokenizer: GrammarTokenizer) -> None:
        self.matcher = compiled(constraint, grammar_tokenizer).deep_copy()
        self._words = np.zeros((grammar_tokenizer.get().vocab_size + 31) // 32, dtype=np.int32)

    def forbidden(self, vocab_size: int) -> np.ndarray:
        """[vocab_size] bool: the tokens that would leave the grammar (the logits' padding rows too).
        A numpy array, so that the grammar needs no tensor library; the sampler moves it where the
        logits are."""
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(~self._words.view(np.uint8), bitorder="little")
        if bits.size < vocab_size:
            bits = np.concatenate([bits, np.ones(vocab_size - bits.size, dtype=np.uint8)])
        return bits[:vocab_size].view(np.bool_)

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the output's grammar could not be followed past token {token}: "
                               f"{_first_line(self.matcher.get_error())}")

    @property
    def complete(self) -> bool:
        """The output is a whole match and nothing more may follow."""
        return self.matcher.is_stopped()
