"""SentencePiece-style ("llama" in GGUF) vocabularies: tokenized by our kernel, or as a `tokenizers` BPE.

GGUF stores pieces and scores but no merges. A BPE merge (a, b) exists wherever both halves and
their concatenation are pieces; merges are ranked by the score of the merged piece (higher first),
which reproduces SentencePiece's greedy highest-score-first merging.

``SpmVocabulary`` looks each merge up when it is needed, in C (native/spm_tokenize.c) over one hash
table of the pieces: Gemma 3's 262k pieces load in tens of milliseconds. ``build_spm_tokenizer`` derives
every merge for the `tokenizers` library (seconds for Gemma 3, cached on disk): the path where the kernels
do not load, and the tests' reference for the kernel's ids.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from collections.abc import Sequence

import numpy as np

from kvserve.errors import ModelLoadError
from kvserve.lazy_torch import require
from kvserve.native import cache_root
from kvserve.string_array import spans
from kvserve.vocabulary import KernelVocabulary

log = logging.getLogger(__name__)

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6


def derive_merges(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    vocab = {t: i for i, t in enumerate(tokens) if token_types[i] == TOKEN_TYPE_NORMAL}
    ranked = []
    for piece, piece_id in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            left_id, right_id = vocab.get(left), vocab.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-scores[piece_id], piece_id, left_id, right_id, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


CACHE_FORMAT = 1  # bump when build_spm_tokenizer changes what it builds


def build_spm_tokenizer(tokens: list[str], scores: list[float] | None, token_types: list[int],
                        add_space_prefix: bool):
    """The vocabulary as a `tokenizers` BPE; kept in the cache directory under a digest of everything it is
    built from, since deriving the merges of a large vocabulary takes seconds (Gemma 3's 262k pieces: ~2 s
    of a 3 s load) and reading the built tokenizer back ~0.2. A cache file that does not read is rebuilt."""
    require("tokenizers")
    from tokenizers import Tokenizer

    tokens = list(tokens)  # the header's StringArray too
    token_types = list(token_types)  # and its array.array
    scores = list(scores) if scores is not None else [-float(i) for i in range(len(tokens))]
    digest = hashlib.sha256(json.dumps([CACHE_FORMAT, tokens, scores, token_types,
                                        add_space_prefix]).encode()).hexdigest()
    path = cache_root() / "tokenizers" / f"spm-{digest[:32]}.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001  (the library raises bare Exceptions): build it again
            log.warning("tokenizer cache %s does not read (%s): rebuilding it", path, e)
    tk = _build(tokens, scores, token_types, add_space_prefix)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        tk.save(str(partial))
        os.replace(partial, path)
    except OSError:  # a read-only cache: build it every time
        pass
    return tk


def _build(tokens: list[str], scores: list[float], token_types: list[int], add_space_prefix: bool):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    unk = next((t for t, ty in zip(tokens, token_types, strict=False) if t in ("<unk>",)), None)
    tk = Tokenizer(models.BPE(vocab, derive_merges(tokens, scores, token_types), unk_token=unk, fuse_unk=True,
                              byte_fallback=True))
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tk.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, ty in enumerate(token_types) if ty == TOKEN_TYPE_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i, ty in enumerate(token_types) if ty == TOKEN_TYPE_USER_DEFINED]
    tk.add_special_tokens(specials)
    tk.add_tokens(user)
    return tk


MAX_TEXT_BYTES = 512 << 20  # spm_encode's bound


def native_spm(tokens: list[str], scores: list[float] | None, token_types: list[int], add_space_prefix: bool):
    """The vocabulary tokenized by the kernel, or None where the kernels do not load."""
    from kvserve import native

    if native.function("spm_tokenize", "spm_vocab_new") is None:
        return None
    return SpmVocabulary(tokens, scores, token_types, add_space_prefix)


def spm_vocabulary(tokens: Sequence[str], scores: list[float] | None, token_types: list[int],
                   add_space_prefix: bool):
    """The vocabulary as a ``vocabulary.Vocabulary``: tokenized by the kernel, or where it does not load by
    the `tokenizers` BPE that ``build_spm_tokenizer`` derives."""
    from kvserve.vocabulary import HFVocabulary

    args = (tokens, scores, token_types, add_space_prefix)
    return native_spm(*args) or HFVocabulary(build_spm_tokenizer(*args))


class SpmVocabulary(KernelVocabulary):
    """A SentencePiece vocabulary as a ``vocabulary.Vocabulary``, tokenized by native/spm_tokenize.c with
    the ids of ``build_spm_tokenizer``'s `tokenizers` BPE, and decoded as its decoders do (▁ as a space,
    <0xXX> pieces as bytes, a byte run that is no UTF-8 as one U+FFFD per byte). Pickles as its pieces."""

    def __init__(self, tokens: Sequence[str], scores: list[float] | None, token_types: list[int],
                 add_space_prefix: bool) -> None:
        """``tokens``: the pieces, a list or the GGUF header's ``StringArray`` (whose bytes go to the kernel
        as they are: no Python string per piece)."""
        from kvserve import native
        from kvserve.native import abi

        self._args = (tokens, scores, token_types, add_space_prefix)
        self.tokens = tokens
        for name, values in (("scores", scores), ("token types", token_types)):
            if values is not None and len(values) != len(tokens):
                raise ModelLoadError(f"the vocabulary has {len(tokens)} pieces but {len(values)} {name}")
        text, starts, lengths = spans(tokens)
        self._types = np.asarray(token_types, dtype=np.int32)
        score_array = None if scores is None else np.asarray(scores, dtype=np.float32)
        self._max_bytes = max(int(lengths.max(initial=0)), 1)
        self._encode = native.function("spm_tokenize", "spm_encode")
        self._literal_flag, self._no_prefix_flag = (abi.header().constants[c] for c in ("SPM_LITERAL",
                                                                                          "SPM_NO_PREFIX"))
        self._first = native.function("spm_tokenize", "spm_first_special")
        self._token_id = native.function("spm_tokenize", "spm_piece_id")
        handle = native.function("spm_tokenize", "spm_vocab_new")(
            text, starts.ctypes.data, lengths.ctypes.data, self._types.ctypes.data,
            None if score_array is None else score_array.ctypes.data, len(tokens), int(add_space_prefix))
        if not handle:
            raise MemoryError("no memory for the vocabulary's table")
        self._handle = handle
        # not at exit: a daemon thread may still be encoding then (the process's end frees the table)
        weakref.finalize(self, native.function("spm_tokenize", "spm_vocab_free"), handle).atexit = False
        self._special = (self._types == TOKEN_TYPE_CONTROL).tolist()
        self._bytes = self._byte_pieces()

    def _byte_pieces(self) -> dict[int, int]:
        """id -> byte of the pieces the decoder reads as a byte: <0xXX>, either case of hex digit, looked up
        in the table rather than by decoding every piece (a string held by two ids counts for its last)."""
        found = {}
        for b in range(256):
            high, low = f"{b:02X}"
            for name in {f"<0x{h}{lo}>" for h in (high, high.lower()) for lo in (low, low.lower())}:
                token_id = self.token_to_id(name)
                if token_id is not None:
                    found[token_id] = b
        return found

    def __reduce__(self):
        """Rebuilt where it is unpickled: by the kernel, or as the `tokenizers` build where none loads."""
        return spm_vocabulary, self._args

    def ids(self, text: str, literal: bool = False, prefix: bool = True) -> list[int]:
        """ctypes lets go of the GIL for the call: a long prompt does not stall the server's event loop.
        ``prefix=False``: no space prefix, for a fragment from inside a text."""
        data = text.encode("utf-8")
        if len(data) >= MAX_TEXT_BYTES:
            raise ValueError(f"a text of {len(data)} bytes is too long to tokenize (under {MAX_TEXT_BYTES})")
        out = np.empty(4 * len(data) + 3, dtype=np.int32)  # the most ids a text can give (spm_encode)
        flags = (self._literal_flag if literal else 0) | (0 if prefix else self._no_prefix_flag)
        n = self._encode(self._handle, data, len(data), flags, out.ctypes.data, len(out))
        if n < 0:
            raise MemoryError(f"no memory to tokenize a text of {len(data)} bytes")
        return out[:n].tolist()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        run = bytearray()
        tokens, special, byte_of, n = self.tokens, self._special, self._bytes, len(self.tokens)
        for i in ids:
            if not 0 <= i < n or (skip_special_tokens and special[i]):
                continue
            b = byte_of.get(i)
            if b is not None:
                run.append(b)
                continue
            if run:
                parts.append(_bytes_text(run))
                run.clear()
            parts.append(tokens[i].replace("\u2581", " "))
        if run:
            parts.append(_bytes_text(run))
        return "".join(parts)

    def _fragment_ids(self, text: str) -> list[int]:
        """llguidance tokenizes pieces of text it has already placed: no space prefix (its reader of a
        tokenizer.json takes the prefix normalizer away likewise)."""
        return self.ids(text, prefix=False)

    def _token_bytes(self, i: int) -> bytes:
        """A piece as llguidance's llama.cpp reader makes it: its text with ▁ as a space, a <0xXX> piece its
        byte, and special pieces (CONTROL, UNKNOWN, and USER_DEFINED ones spelled <...>) behind a 0xFF
        byte, which no text holds."""
        b = self._bytes.get(i)
        if b is not None:
            return bytes([b])
        text, kind = self.tokens[i], int(self._types[i])
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN) or (
                kind == TOKEN_TYPE_USER_DEFINED and text.startswith("<") and text.endswith(">")):
            return b"\xff" + text.encode()
        return text.replace("\u2581", " ").encode()


def _bytes_text(run: bytearray) -> str:
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)
