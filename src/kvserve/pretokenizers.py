"""How a byte-level BPE vocabulary cuts text into words before merging, by `tokenizer.ggml.pre`.

A GGUF names its pre-tokenizer instead of storing it; the name is llama.cpp's (`llama-vocab.cpp`,
`convert_hf_to_gguf.py`). The regexes below are the ones in each model's own tokenizer.json, and for
"default" llama.cpp's own: merges learned over one split give other tokens over another, so a wrong or
unknown name is an error, never a silent fallback. A file with no name at all is read as llama.cpp reads
it, with "default" and a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvserve.errors import ModelLoadError

log = logging.getLogger(__name__)

# GPT-2's split, which `ByteLevel(use_regex=True)` applies itself.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3 (tiktoken's cl100k): digits in runs of up to three.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: the same, but every digit alone.
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o (tiktoken's o200k; Phi-4-mini, Llama 4): words split at lower-to-upper case changes, combining
# marks part of a word, contractions kept on their word.
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken (Mistral Nemo, Ministral): GPT-4o's case split, digits alone, no contractions.
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's "default" (files that name it, and those that name no split), four splits in turn: runs
# of punctuation and of the ASCII symbols $+<=>^~| first, so GPT-2's contractions never match ("I'm" is
# I ' m); then GPT-2's split; then digit runs apart from the space before them; then ASCII digits cut
# in threes from the left ("1234" is 123 4).
_DEFAULT = (r"[\p{P}$+<=>^~|]+", _GPT2, r"\p{N}+", r"[0-9]{3}")


@dataclass(frozen=True)
class PreTokenizer:
    """splits: regexes applied in turn, each cutting the pieces the one before left (a match and the
    text between matches both become pieces). nfc: the text is NFC-normalized first, as the model's
    own tokenizer does. ignore_merges: a piece that is itself a token is that token, whatever the merges
    would build (tiktoken's rule). add_bos: llama.cpp's default for a BOS when the file does not say.
    kernel: the same splits as native/bpe_tokenize.c writes them out (its BPE_SPLIT_<name>s), or None
    where it does not (the `tokenizers` library then tokenizes)."""

    splits: tuple[str, ...]
    nfc: bool = False
    ignore_merges: bool = False
    add_bos: bool = False
    kernel: tuple[str, ...] | None = None


_GPT2_SPLIT = PreTokenizer((_GPT2,), kernel=("GPT2",))
_DEFAULT_SPLIT = PreTokenizer(_DEFAULT, kernel=("PUNCTUATION", "GPT2", "DIGITS", "THREE_DIGITS"))
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2), kernel=("DIGIT", "GPT2"))
_LLAMA3_SPLIT = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True, kernel=("LLAMA3",))
_QWEN2_SPLIT = PreTokenizer((_QWEN2,), nfc=True, kernel=("QWEN2",))
_GPT4O_SPLIT = PreTokenizer((_GPT4O,), kernel=("GPT4O",))

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    # llama.cpp's own split, not GPT-2's (transformers' GGUF loader knows neither name)
    "default": _DEFAULT_SPLIT,
    "gpt-2": _GPT2_SPLIT,
    "phi-2": _GPT2_SPLIT,
    "mpt": _GPT2_SPLIT,
    "olmo": _GPT2_SPLIT,  # OLMo, OLMoE
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,  # Granite 3
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "dbrx": PreTokenizer((_LLAMA3,), kernel=("LLAMA3",)),  # cl100k vocabularies
    "smaug-bpe": PreTokenizer((_LLAMA3,), kernel=("LLAMA3",)),
    "qwen2": _QWEN2_SPLIT,  # Qwen2, 2.5, 3, 3-MoE
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True, kernel=("TEKKEN",)),
}


def pre_tokenizer_for(pre: str | None, source: object) -> PreTokenizer:
    """The split `tokenizer.ggml.pre` names; "default" when the key is missing or empty, as in llama.cpp;
    ModelLoadError for a name we do not know."""
    if not pre:
        # llama.cpp loads such a file too, but warns: the model was most likely trained on another split
        log.warning("%s: no pre-tokenizer type (tokenizer.ggml.pre), using 'default'; token ids may differ "
                    "from the model's own tokenizer, consider converting the model again", source)
        pre = "default"
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise ModelLoadError(
            f"{source}: pre-tokenizer '{pre}' (tokenizer.ggml.pre) is not supported, and another split "
            f"would give the model tokens it was not trained on; supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return spec


def build_pre_tokenizer(spec: PreTokenizer):
    """The `tokenizers` pre-tokenizer of ``spec``: its splits, then bytes mapped to GPT-2's alphabet."""
    from tokenizers import Regex, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in spec.splits]
    return pre_tokenizers.Sequence([*splits,
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_normalizer(spec: PreTokenizer):
    from tokenizers import normalizers

    return normalizers.NFC() if spec.nfc else None
