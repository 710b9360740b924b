"""Constrained decoding: a grammar limits which tokens a request may sample next.

    Constraint("json_schema", '{"type": "object", ...}')    spec: what the client asked for
        -> TokenConstraint (one per request)               its parser state, through llguidance
             forbidden(vocab) -> bool mask for the sampler (tokens that would leave the grammar)
             advance(token)                                after each sampled token

llguidance (llama.cpp's choice too) was picked over xgrammar by measuring on our tokenizers (see
docs/serving.md): masks well under a millisecond with either, schema compilation 5-6x faster (agents send new
tool schemas with every request), and no dependency beyond itself. Its tokenizer tables take seconds to
build for a 262K vocabulary, so they are built once per model, on the first constrained request.

A constraint follows the request's output tokens, not its KV: preemption and recomputation leave it
as it is (the output tokens stay), so it needs nothing on resume.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

KINDS = ("json_object", "json_schema", "regex", "lark")


@dataclass(frozen=True, slots=True)
class Constraint:
    """``kind`` in KINDS; ``spec`` the JSON schema (as JSON text), the regex or the Lark grammar
    (empty for json_object: any JSON object)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

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
# indent deeper and deeper), and clients parse either
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarTokenizer:
    """The model's vocabulary as llguidance sees it, built on first use (seconds for 262K tokens)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._built = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._built is None:
                from llguidance import LLTokenizer

                tok = self.tokenizer
                eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
                self._built = LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=eos)
        return self._built


class TokenConstraint:
    """One request's grammar state."""

    def __init__(self, constraint: Constraint, grammar_tokenizer: GrammarTokenizer) -> None:
        from llguidance import LLMatcher

        tokenizer = grammar_tokenizer.get()
        grammar = constraint.grammar()
        error = LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise ValueError(f"invalid {constraint.kind.replace('_', ' ')}: {error}")
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"invalid {constraint.kind.replace('_', ' ')}: {self.matcher.get_error()}")
        self._words = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)

    def forbidden(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[vocab_size] bool: the tokens that would leave the grammar (the logits' padding rows too)."""
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(~self._words.view(np.uint8), bitorder="little")
        if bits.size < vocab_size:
            bits = np.concatenate([bits, np.ones(vocab_size - bits.size, dtype=np.uint8)])
        return torch.from_numpy(bits[:vocab_size].view(np.bool_)).to(device)

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} does not fit the constraint: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The output is a whole match and nothing more may follow."""
        return self.matcher.is_stopped()
