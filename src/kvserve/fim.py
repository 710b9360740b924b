"""Fill in the middle: code models' prefix / suffix / middle tokens, found by name, and the prompt they
are trained on (prefix-suffix-middle, other files first), as llama.cpp's ``/infill`` writes it.

GGUF files seldom carry ``tokenizer.ggml.fim_*_token_id``, so each family's spelling is looked up in the
vocabulary. A middle ends at the model's end of text, its file separator, or (``hole_indent``) before a line
indented less than the hole.
"""

from __future__ import annotations

from dataclasses import dataclass

# (prefix, suffix, middle, file separator or None) as each code-model family spells them
FIM_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"),  # Qwen2.5-Coder, CodeGemma
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"),  # StarCoder, Granite
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None),  # DeepSeek-Coder
    ("▁<PRE>", "▁<SUF>", "▁<MID>", None),  # Code Llama
)
# tokens that end a filled middle besides the model's end of sequence
FIM_ENDS = ("<|endoftext|>", "<|file_sep|>", "<|fim_pad|>", "<|repo_name|>", "<file_sep>", "<EOT>", "▁<EOT>")


def hole_indent(prefix: str) -> int:
    """The indentation of the line a fill-in-the-middle hole opens on: a middle that writes a line indented
    less has left the hole (a function's body, a loop's), as editors tell llama.cpp with ``n_indent``."""
    line = prefix.rsplit("\n", 1)[-1]
    return len(line) - len(line.lstrip(" \t"))


@dataclass(frozen=True, slots=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    file_sep: int | None
    ends: tuple[int, ...]


def find_fim_tokens(backend, eos_token_ids: list[int]) -> FimTokens | None:
    """The vocabulary's FIM tokens (``backend``: a ``vocabulary.Vocabulary``); None for a model without."""
    for names in FIM_SPELLINGS:
        ids = [backend.token_to_id(n) if n else None for n in names]
        if None not in ids[:3]:
            ends = {backend.token_to_id(n) for n in FIM_ENDS} - {None}
            return FimTokens(ids[0], ids[1], ids[2], ids[3], tuple(sorted(ends | set(eos_token_ids))))
    return None


def file_has_fim_tokens(path, header_bytes: int) -> bool:
    """Whether a GGUF file's vocabulary has a family's FIM tokens, read from the first ``header_bytes`` of the
    file (its header: the vocabulary is stored there, each token a length-prefixed string) without decoding
    the vocabulary."""
    with open(path, "rb") as f:
        header = f.read(header_bytes)

    def stored(name: str) -> bool:
        data = name.encode()
        return len(data).to_bytes(8, "little") + data in header

    return any(all(stored(n) for n in names[:3]) for names in FIM_SPELLINGS)


def fim_prompt(tokenizer, prefix: str, suffix: str, extra: list[tuple[str, str]],
               middle: str = "") -> list[int]:
    """Prefix-suffix-middle as the code models are trained: other files first (``extra``: (file name,
    text), each after the file separator where the model has one), then the prefix, the suffix and the
    start of the middle. ValueError without FIM tokens."""
    fim = tokenizer.fim
    if fim is None:
        raise ValueError(
            "this model has no fill-in-the-middle tokens (a code model such as Qwen2.5-Coder has)")
    ids: list[int] = []
    for name, text in extra:
        if fim.file_sep is not None:
            ids += [fim.file_sep, *tokenizer.encode(f"{name}\n{text}", add_special=False)]
        else:
            ids += tokenizer.encode(text, add_special=False)
    ids += [fim.prefix, *tokenizer.encode(prefix, add_special=False), fim.suffix,
            *tokenizer.encode(suffix, add_special=False), fim.middle,
            *tokenizer.encode(middle, add_special=False)]
    return tokenizer._with_bos(ids, True)
