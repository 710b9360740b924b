"""What a tokenizer needs of a vocabulary: text to ids, ids to text, pieces by name, and the special pieces.

Two kinds stand behind it: a GGUF vocabulary tokenized by one of our kernels straight from the file's
arrays (``KernelVocabulary``: ``spm.SpmVocabulary``, ``bpe.BpeVocabulary``), and ``HFVocabulary``, a
`tokenizers` library tokenizer (HF folders' tokenizer.json, and GGUF vocabularies where the kernels do not
load).
``Tokenizer`` (tokenizer.py) holds one and asks only these calls of it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Protocol


class Vocabulary(Protocol):
    @property
    def size(self) -> int:
        """The number of ids, added pieces included."""

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of one piece as the vocabulary spells it (at least 1)."""

    def ids(self, text: str, literal: bool = False) -> list[int]:
        """``text``'s ids; ``literal``: special-piece strings in it stay text (a message's content)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def specials(self) -> list[str]:
        """The special pieces' strings (control tokens: turn markers, end of text, ...)."""

    def first_special(self, text: str) -> str | None:
        """The first special piece's string found in ``text``, None where there is none."""

    def guidance(self, n_vocab: int, eos_token: int | None):
        """This vocabulary as llguidance's ``LLTokenizer`` (constrained decoding)."""


class HFVocabulary:
    """A `tokenizers.Tokenizer` as a ``Vocabulary``. Pickles (Ray Serve replicas hand it over) without its
    lock and its lazily made copies."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._literal = None  # a copy that reads special-piece strings as plain text
        self._special_pattern: re.Pattern | None = None

    def __getstate__(self) -> dict:
        return {"tokenizer": self.tokenizer}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["tokenizer"])

    @property
    def size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        return max([len(t.encode()) for t in self.tokenizer.get_vocab()] + [1])

    def ids(self, text: str, literal: bool = False) -> list[int]:
        """Through the batch call, which releases the GIL while Rust works (a single encode holds it: a
        3 MB prompt stalled the server's event loop for 2 s)."""
        backend = self._literal_copy() if literal else self.tokenizer
        return backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def specials(self) -> list[str]:
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]

    def first_special(self, text: str) -> str | None:
        if self._special_pattern is None:
            alternatives = sorted(self.specials(), key=len, reverse=True) or ["(?!)"]
            self._special_pattern = re.compile("|".join(map(re.escape, alternatives)))
        found = self._special_pattern.search(text)
        return None if found is None else found.group()

    def guidance(self, n_vocab: int, eos_token: int | None):
        from llguidance import LLTokenizer

        return LLTokenizer(self.tokenizer.to_str(), n_vocab=n_vocab, eos_token=eos_token)

    def _literal_copy(self):
        with self._lock:
            if self._literal is None:
                from tokenizers import Tokenizer as HFTokenizer

                literal = HFTokenizer.from_str(self.tokenizer.to_str())
                literal.encode_special_tokens = True
                self._literal = literal
        return self._literal


TOKEN_TYPE_CONTROL = 3  # GGUF's tokenizer.ggml.token_type of a special (control) piece


class KernelVocabulary:
    """What the vocabularies our tokenizer kernels read have in common (``spm.SpmVocabulary``,
    ``bpe.BpeVocabulary``): the file's tokens (a list, or the header's ``StringArray``), their types, the
    kernel's tables behind ``_handle``, and the lookups every kernel has: a token by its spelling
    (``_token_id``), the first special string in a text (``_first``). A subclass sets those, encodes and
    decodes, and says each token's bytes as llguidance reads them (``_token_bytes``) and how llguidance's
    fragments of text are tokenized (``_fragment_ids``)."""

    tokens: Sequence[str]

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def max_token_bytes(self) -> int:
        return self._max_bytes

    def token_to_id(self, token: str) -> int | None:
        data = token.encode("utf-8", "surrogatepass")
        found = self._token_id(self._handle, data, len(data))
        return None if found < 0 else found

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokens[token_id] if 0 <= token_id < len(self.tokens) else None

    def special_ids(self) -> list[int]:
        import numpy as np

        return [int(i) for i in np.flatnonzero(np.asarray(self._types) == TOKEN_TYPE_CONTROL)]

    def specials(self) -> list[str]:
        return [self.tokens[i] for i in self.special_ids()]

    def first_special(self, text: str) -> str | None:
        import ctypes

        data = text.encode("utf-8", "surrogatepass")  # a lone surrogate is refused later, with its place
        length = ctypes.c_int64(0)
        at = self._first(self._handle, data, len(data), ctypes.addressof(length))
        return None if at < 0 else data[at : at + length.value].decode("utf-8", errors="replace")

    def guidance(self, n_vocab: int, eos_token: int | None):
        """llguidance's tokenizer from the tokens' bytes (``_token_bytes``)."""
        from llguidance import LLTokenizer, TokenizerWrapper

        return LLTokenizer(TokenizerWrapper(_GuidanceEncoder(self, eos_token)), n_vocab=n_vocab,
                           eos_token=eos_token)


class _GuidanceEncoder:
    """What llguidance's TokenizerWrapper reads: the tokens' bytes, the special ids, a call from bytes to
    ids."""

    def __init__(self, vocab: KernelVocabulary, eos_token: int | None) -> None:
        self.vocab = vocab
        self.eos_token_id = eos_token
        self.bos_token_id = None
        self.tokens = [vocab._token_bytes(i) for i in range(vocab.size)]
        self.special_token_ids = vocab.special_ids()

    def __call__(self, text: bytes) -> list[int]:
        return self.vocab._fragment_ids(text.decode("utf-8", errors="replace"))
