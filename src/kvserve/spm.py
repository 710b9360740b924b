"""SentencePiece-style ("llama" in GGUF) vocabularies rebuilt as a `tokenizers` BPE.

GGUF stores pieces and scores but no merges. A BPE merge (a, b) exists wherever both halves and
their concatenation are pieces; merges are ranked by the score of the merged piece (higher first),
which reproduces SentencePiece's greedy highest-score-first merging.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

from kvserve.native import cache_root

log = logging.getLogger(__name__)

TOKEN_TYPE_NORMAL = 1
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
    from tokenizers import Tokenizer

    scores = scores if scores is not None else [-float(i) for i in range(len(tokens))]
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
