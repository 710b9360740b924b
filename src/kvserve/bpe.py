"""Byte-level BPE vocabularies ("gpt2" in GGUF: GPT-2, Llama 3, Qwen2, SmolLM2, ...) tokenized by our kernel.

``BpeVocabulary`` hands the file's tokens and merges, as the bytes the header keeps, to
native/bpe_tokenize.c, which splits text as the pre-tokenizer `tokenizer.ggml.pre` names
(pretokenizers.py) and merges by rank: Qwen2.5's 151k tokens and merges load in tens of milliseconds
where the `tokenizers` library, built from Python lists of them, took 0.4 s and +55 MiB. That build
(``hf_byte_level_bpe``) stays where the kernels do not load, for a split the kernel does not write out
(``PreTokenizer.kernel`` None; every named one has its kernel), and as the tests' reference for the
kernel's ids.
"""

from __future__ import annotations

import ctypes
import unicodedata
import weakref
from collections.abc import Sequence

import numpy as np

from kvserve.errors import ModelLoadError
from kvserve.lazy_torch import require
from kvserve.pretokenizers import PreTokenizer, build_normalizer, build_pre_tokenizer
from kvserve.string_array import spans
from kvserve.vocabulary import HFVocabulary, KernelVocabulary, Vocabulary

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
MAX_TEXT_BYTES = 512 << 20  # bpe_encode's bound


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                   pre: PreTokenizer) -> Vocabulary:
    """A GGUF byte-level BPE vocabulary: tokenized by our kernel, or where it does not load or does not
    write out ``pre``'s splits, by the `tokenizers` library (``hf_byte_level_bpe``)."""
    return native_bpe(tokens, merges, token_types, pre) or hf_byte_level_bpe(tokens, merges, token_types, pre)


def hf_byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                      pre: PreTokenizer) -> HFVocabulary:
    """The vocabulary as a `tokenizers` BPE, set up as the model's own tokenizer.json is: the reference the
    kernel's ids are held to."""
    require("tokenizers")
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = Tokenizer(models.BPE(vocab, merge_pairs, fuse_unk=False, byte_fallback=False,
                              ignore_merges=pre.ignore_merges))
    normalizer = build_normalizer(pre)
    if normalizer is not None:
        tk.normalizer = normalizer
    tk.pre_tokenizer = build_pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(tokens[i], special=(t == TOKEN_TYPE_CONTROL), normalized=False)
        for i, t in enumerate(token_types)
        if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tk.add_special_tokens([s for s in specials if s.special])
    tk.add_tokens([s for s in specials if not s.special])
    return HFVocabulary(tk)


def native_bpe(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], pre: PreTokenizer):
    """The vocabulary tokenized by the kernel, or None where the kernels do not load or the pre-tokenizer's
    splits are not written out in C."""
    from kvserve import native

    if pre.kernel is None or native.function("bpe_tokenize", "bpe_vocab_new") is None:
        return None
    return BpeVocabulary(tokens, merges, token_types, pre)


class BpeVocabulary(KernelVocabulary):
    """A byte-level BPE vocabulary as a ``vocabulary.Vocabulary``, with the ids and text of the `tokenizers`
    build of the same file (``hf_byte_level_bpe``). Pickles as its tokens and merges."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                 pre: PreTokenizer) -> None:
        """``tokens``, ``merges``: lists, or the GGUF header's ``StringArray``s (their bytes go to the kernel
        as they are: no Python string per token)."""
        from kvserve import native
        from kvserve.native import abi

        if len(token_types) != len(tokens):
            raise ModelLoadError(
                f"the vocabulary has {len(tokens)} tokens but {len(token_types)} token types")
        if pre.kernel is None:
            raise ValueError("the kernel does not write out this pre-tokenizer's splits")
        self._args = (tokens, merges, token_types, pre)
        self.tokens = tokens
        self._nfc = pre.nfc
        constants = abi.header().constants
        self._literal_flag = constants["BPE_LITERAL"]
        splits = np.array([constants[f"BPE_SPLIT_{name}"] for name in pre.kernel], dtype=np.int32)
        text, starts, lengths = spans(tokens)
        merge_text, merge_starts, merge_lengths = spans(merges)
        self._types = np.asarray(token_types, dtype=np.int32)
        self._max_bytes = max(int(lengths.max(initial=0)), 1)
        self._encode = native.function("bpe_tokenize", "bpe_encode")
        self._decode = native.function("bpe_tokenize", "bpe_decode")
        self._first = native.function("bpe_tokenize", "bpe_first_special")
        self._token_id = native.function("bpe_tokenize", "bpe_token_id")
        handle = native.function("bpe_tokenize", "bpe_vocab_new")(
            text, starts.ctypes.data, lengths.ctypes.data, self._types.ctypes.data, len(tokens),
            merge_text, merge_starts.ctypes.data, merge_lengths.ctypes.data, len(merges), splits.ctypes.data,
            len(splits), int(pre.ignore_merges))
        if not handle:
            raise MemoryError("no memory for the vocabulary's tables")
        self._handle = handle
        # not at exit: a daemon thread may still be encoding then (the process's end frees the tables)
        weakref.finalize(self, native.function("bpe_tokenize", "bpe_vocab_free"), handle).atexit = False

    def __reduce__(self):
        """Rebuilt where it is unpickled: by the kernel, or as the `tokenizers` build where none loads."""
        return byte_level_bpe, self._args

    def ids(self, text: str, literal: bool = False) -> list[int]:
        """ctypes lets go of the GIL for the call: a long prompt does not stall the server's event loop."""
        if self._nfc and not text.isascii():
            text = unicodedata.normalize("NFC", text)
        data = text.encode("utf-8")
        if len(data) >= MAX_TEXT_BYTES:
            raise ValueError(f"a text of {len(data)} bytes is too long to tokenize (under {MAX_TEXT_BYTES})")
        out = np.empty(len(data) + 1, dtype=np.int32)  # an id covers one byte at least
        n = self._encode(self._handle, data, len(data), self._literal_flag if literal else 0, out.ctypes.data,
                         len(out))
        if n < 0:
            raise MemoryError(f"no memory to tokenize a text of {len(data)} bytes")
        return out[:n].tolist()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The ids' bytes, with each run that is not UTF-8 replaced as the ByteLevel decoder replaces it."""
        return self._bytes_of(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def _bytes_of(self, ids: list[int], skip_special_tokens: bool) -> bytes:
        array = np.asarray(ids, dtype=np.int64)
        array = array[(array >= 0) & (array < len(self.tokens))].astype(np.int32)
        out = ctypes.create_string_buffer(len(array) * self._max_bytes + 1)
        n = self._decode(self._handle, array.ctypes.data, len(array), int(skip_special_tokens), out, len(out))
        return out.raw[:n]

    def _fragment_ids(self, text: str) -> list[int]:
        return self.ids(text)

    def _token_bytes(self, i: int) -> bytes:
        """A token as llguidance's tokenizer.json reader makes it: its bytes, and special tokens (CONTROL,
        and added ones spelled <...>) as their spelling behind a 0xFF byte, which no text holds."""
        kind = int(self._types[i])
        if kind == TOKEN_TYPE_CONTROL or (kind == TOKEN_TYPE_USER_DEFINED and self.tokens[i].startswith("<")
                                          and self.tokens[i].endswith(">")):
            return b"\xff" + self.tokens[i].encode()
        return self._bytes_of([i], False)
