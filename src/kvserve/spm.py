"""SentencePiece-style ("llama" in GGUF) vocabularies rebuilt as a `tokenizers` BPE.

GGUF stores pieces and scores but no merges. A BPE merge (a, b) exists wherever both halves and
their concatenation are pieces; merges are ranked by the score of the merged piece (higher first),
which reproduces SentencePiece's greedy highest-score-first merging.
"""

from __future__ import annotations

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


def build_spm_tokenizer(tokens: list[str], scores: list[float] | None, token_types: list[int], add_space_prefix: bool):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    scores = scores if scores is not None else [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = next((t for t, ty in zip(tokens, token_types) if t in ("<unk>",)), None)
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
