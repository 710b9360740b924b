"""GGUF tokenizers against the tokenizer each model ships, on one multilingual text.

No real vocabulary is at hand, so each test trains a small one with `tokenizers`, set up as that model's
tokenizer.json is (its split regex from transformers, NFC for Qwen2, ignore_merges for Llama 3 and
tekken), writes it into a GGUF as llama.cpp's converter does (tokens, merges, token types, pre name),
and checks that kvserve's tokenizer read from the file gives the same token ids, and the same as
transformers' own GGUF loader where that loader knows the split. llama.cpp's "default" split, which no
tokenizer.json has and transformers does not know, is also checked against the `regex` module applying
llama.cpp's regex list, then the vocabulary's merges. SentencePiece vocabularies (model "llama": scores
and byte-fallback tokens, no merges) are checked against transformers' GGUF loader.
"""

from __future__ import annotations

import json
import logging
import unicodedata
from pathlib import Path

import gguf
import pytest
import regex
import transformers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

from kvserve.errors import ModelLoadError
from kvserve.models.gguf_file import GGUFFile
from kvserve.tokenizer import Tokenizer

TEXT = (
    "Hello, World! I'm here; DON'T panic, they'll say: it's 42 o'clock.\n"
    "HTTPServerError in parseJSONResponse() — naïve café, résumé (e\u0301 vs é), A\u030angström.\n"
    "你好，世界！这是一个测试。日本語のテキストです。한국어 텍스트.\n"
    "مرحبا بالعالم، هذا اختبار. नमस्ते दुनिया, यह परीक्षण है। Привет, мир!\n"
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨🚀\n"
    "Numbers: 1234567890 3.14159 1,000,000 0x1F 2024-11-24 ٣٤٥ 12abc34\n"
    "Spaces:   three,\t\ttabs,\n\n\n  newlines \r\n crlf   \n"
    "def fib(n: int) -> int:\n    if n < 2:\n        return n  # base case\n    return fib(n - 1) + fib(n - "
    "2)\n"
    "for (int i = 0; i < 10; ++i) { x[i] = y[i] * 2; }  // C++ path/to/file.py\n"
    '<div class="a">&nbsp;</div>   \n'
)
CORPUS = [TEXT, TEXT.lower(), TEXT.upper(), unicodedata.normalize("NFC", TEXT)]
EOT = "<|endoftext|>"

# llama.cpp's regex list for the "default" pre-type (llama-vocab.cpp, llm_tokenizer_bpe), applied in turn
LLAMA_CPP_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
# Texts where the default split and GPT-2's cut differently: symbol runs, contractions, digit runs.
DEFAULT_VS_GPT2 = [
    "a $+<=>^~| b; x+=1 && y<=2 || z^=3 ~ok `code`",
    "I'm sure you're right, DON'T worry, they'll see it's o'clock",
    "1234567 and 12,345,678 cost $99.95 (about 1000000)",
    "price: 42€, ٣٤٥٦ or 12abc34!?",
]


def _split(*patterns: str) -> list:
    return [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]


def _byte_level(use_regex: bool) -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


# The pre-tokenizer (and normalizer, ignore_merges) of each model family's tokenizer.json.
BYTE_LEVEL_MODELS = {
    "llama-bpe": ([*_split(GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]), _byte_level(False)], False, True),
    "qwen2": ([*_split(QWEN2_SPLIT), _byte_level(False)], True, False),
    "gpt-4o": ([*_split(GGUF_PRE_TOKENIZER_SPLITS["gpt-4o"]), _byte_level(False)], False, False),
    "tekken": ([*_split(GGUF_PRE_TOKENIZER_SPLITS["tekken"]), _byte_level(False)], False, True),
    "gpt-2": ([_byte_level(True)], False, False),
    "smollm": ([pre_tokenizers.Digits(individual_digits=True), _byte_level(True)], False, False),
    "default": ([*_split(*LLAMA_CPP_DEFAULT), _byte_level(False)], False, False),
}
# transformers' GGUF loader splits these as the model does (smollm: it does not split digits; qwen2: it
# does not NFC-normalize, so it is compared on NFC text)
TRANSFORMERS_KNOWS = ("llama-bpe", "qwen2", "gpt-4o", "tekken", "gpt-2")


def train_byte_level(pre: str, corpus: list[str] = CORPUS) -> HFTokenizer:
    steps, nfc, ignore_merges = BYTE_LEVEL_MODELS[pre]
    tk = HFTokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[EOT],
        show_progress=False,
    )
    tk.train_from_iterator(corpus, trainer)
    return tk


def write_bpe_gguf(path: Path, tk: HFTokenizer, pre: str | None) -> Path:
    """The vocabulary as llama.cpp's converter writes a byte-level BPE one; no add_bos key, so the
    pre-type's default applies. ``pre`` None: no tokenizer.ggml.pre key, as in older files."""
    model = json.loads(tk.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t == EOT else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in model["merges"]])
    w.add_bos_token_id(tokens.index(EOT))
    w.add_eos_token_id(tokens.index(EOT))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """pre name -> (reference tokenizer, GGUF path)."""
    root = tmp_path_factory.mktemp("bpe")
    out = {}
    for pre in BYTE_LEVEL_MODELS:
        # the default vocabulary also learns the texts it is compared on, so that their pieces are merged
        tk = train_byte_level(pre, CORPUS + DEFAULT_VS_GPT2 if pre == "default" else CORPUS)
        (root / pre).mkdir()
        out[pre] = tk, write_bpe_gguf(root / pre / "tok.gguf", tk, pre)
    return out


def ours(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(path))


def transformers_from_gguf(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("pre", list(BYTE_LEVEL_MODELS))
def test_byte_level_matches_the_models_tokenizer(byte_level, pre):
    ref, path = byte_level[pre]
    tok = ours(path)
    text = TEXT + EOT + " after the special token"
    expected = ref.encode(text).ids
    assert tok.encode(text, add_special=False) == expected
    assert expected.count(ref.token_to_id(EOT)) == 1
    shown = unicodedata.normalize("NFC", TEXT) if pre == "qwen2" else TEXT
    assert tok.decode(tok.encode(TEXT, add_special=False)) == shown
    if pre in TRANSFORMERS_KNOWS:
        hf = transformers_from_gguf(path)
        assert hf.encode(shown, add_special_tokens=False) == tok.encode(shown, add_special=False)


def test_qwen2_matches_transformers_qwen2_tokenizer(byte_level):
    """Qwen2's own tokenizer class (NFC, then its split), built from the same vocabulary and merges."""
    ref, path = byte_level["qwen2"]
    model = json.loads(ref.to_str())["model"]
    qwen = transformers.Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    assert ours(path).encode(TEXT, add_special=False) == qwen.encode(TEXT, add_special_tokens=False)
    assert TEXT != unicodedata.normalize("NFC", TEXT)  # the text does test the normalization


def test_the_text_tells_every_split_apart(byte_level, tmp_path):
    """Of any two pre names, reading one's vocabulary under the other's name gives other ids, one way
    round or both (a vocabulary learned over single digits has no digit runs to tell smollm's split from
    GPT-2's, nor tekken's from gpt-4o's, which differ only in digits and apostrophes): the text is one
    on which a wrong choice shows."""
    same = set()
    for pre, (ref, _) in byte_level.items():
        expected = ref.encode(TEXT).ids
        for other in BYTE_LEVEL_MODELS:
            if other != pre:
                path = write_bpe_gguf(tmp_path / f"{pre}-as-{other}.gguf", ref, other)
                if ours(path).encode(TEXT, add_special=False) == expected:
                    same.add((pre, other))
    assert not [pair for pair in same if pair[::-1] in same]
    assert same == {("tekken", "gpt-4o"), ("smollm", "gpt-2")}


def test_bos_default_follows_the_pre_type(byte_level):
    """A file without tokenizer.ggml.add_bos_token: llama.cpp adds BOS for Llama 3 and tekken vocabularies."""
    assert ours(byte_level["llama-bpe"][1]).add_bos and ours(byte_level["tekken"][1]).add_bos
    assert not ours(byte_level["qwen2"][1]).add_bos and not ours(byte_level["gpt-4o"][1]).add_bos


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the others for U+0100 onwards."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    unprintable = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(unprintable)) for b in range(256)}


BYTE_CHARS = _gpt2_byte_chars()


def regex_split(text: str, patterns) -> list[str]:
    """Each pattern cuts every piece the one before left; a match and the text between matches are
    both pieces (llama.cpp's unicode_regex_split)."""
    pieces = [text]
    for pattern in patterns:
        pieces = [part for piece in pieces for part in _cut(piece, pattern)]
    return pieces


def _cut(piece: str, pattern: str) -> list[str]:
    parts, at = [], 0
    for m in regex.finditer(pattern, piece):
        parts += [piece[at : m.start()], m.group()]
        at = m.end()
    return [p for p in [*parts, piece[at:]] if p]


def reference_ids(tk: HFTokenizer, text: str, patterns) -> list[int]:
    """The vocabulary's merges applied to each piece of the regex split, in GPT-2's byte alphabet."""
    ids = []
    for piece in regex_split(text, patterns):
        ids += [t.id for t in tk.model.tokenize("".join(BYTE_CHARS[b] for b in piece.encode()))]
    return ids


@pytest.fixture(scope="module")
def gpt2_merges():
    """A vocabulary learned over GPT-2's split, texts included: it has merges across the default split's
    cuts (" $", "'m", " 1"), so only the default split itself gives the reference's ids."""
    return train_byte_level("gpt-2", CORPUS + DEFAULT_VS_GPT2)


@pytest.mark.parametrize("vocab", ["learned over the default split", "learned over GPT-2's"])
def test_default_is_llama_cpps_regex_list(byte_level, gpt2_merges, tmp_path, caplog, vocab):
    ref = byte_level["default"][0] if vocab == "learned over the default split" else gpt2_merges
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        tok = ours(write_bpe_gguf(tmp_path / "tok.gguf", ref, "default"))
    assert not caplog.records  # a file that names "default" is read without a warning
    for text in [TEXT, *DEFAULT_VS_GPT2]:
        assert tok.encode(text, add_special=False) == reference_ids(ref, text, LLAMA_CPP_DEFAULT), text[:20]


def test_default_is_not_gpt2s_split(gpt2_merges, tmp_path):
    """On each of these texts the two splits cut differently, and a vocabulary read as "default" gives
    other ids than read as "gpt-2": GPT-2's split in place of the default one fails the test above."""
    as_default = ours(write_bpe_gguf(tmp_path / "as-default.gguf", gpt2_merges, "default"))
    as_gpt2 = ours(write_bpe_gguf(tmp_path / "as-gpt2.gguf", gpt2_merges, "gpt-2"))
    gpt2_split = LLAMA_CPP_DEFAULT[1]
    for text in DEFAULT_VS_GPT2:
        assert regex_split(text, LLAMA_CPP_DEFAULT) != regex_split(text, [gpt2_split]), text[:20]
        assert as_default.encode(text, add_special=False) != as_gpt2.encode(
            text, add_special=False), text[:20]
    assert regex_split("I'm 1234 $+<=>^~|", LLAMA_CPP_DEFAULT) == ["I", "'", "m", " ", "123", "4", " ",
                                                                   "$+<=>^~|"]


def test_missing_pre_is_default_with_a_warning(byte_level, tmp_path, caplog):
    """llama.cpp reads a BPE file without tokenizer.ggml.pre as "default", warning that its split may
    not be the model's."""
    ref, _ = byte_level["default"]
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        tok = ours(write_bpe_gguf(tmp_path / "no-pre.gguf", ref, None))
    assert "no pre-tokenizer type (tokenizer.ggml.pre), using 'default'" in caplog.text
    for text in [TEXT, *DEFAULT_VS_GPT2]:
        assert tok.encode(text, add_special=False) == reference_ids(ref, text, LLAMA_CPP_DEFAULT), text[:20]
    assert not tok.add_bos  # the default pre-type adds no BOS unless the file asks


def _tiny_merges_gguf(path: Path, pre: str) -> Path:
    # "abc" is a token, but BPE never builds it from "a bc": only ab + c would
    tokens = ["a", "b", "c", "bc", "ab", "abc"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(["b c", "a b", "ab c"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre, expected",
                         [("llama-bpe", [5]), ("tekken", [5]), ("qwen2", [0, 3]), ("gpt-4o", [0, 3])])
def test_ignore_merges(tmp_path, pre, expected):
    """Llama 3 and tekken take a word that is a token whole (tiktoken's rule, ignore_merges in their
    tokenizer.json); the others merge."""
    path = _tiny_merges_gguf(tmp_path / "t.gguf", pre)
    assert ours(path).encode("abc", add_special=False) == expected
    ref = HFTokenizer(models.BPE({t: i for i, t in enumerate(["a", "b", "c", "bc", "ab", "abc"])},
                                 [("b", "c"), ("a", "b"), ("ab", "c")], ignore_merges=expected == [5]))
    assert ref.encode("abc").ids == expected


def test_unknown_pre_type_is_an_error(tmp_path):
    path = _tiny_merges_gguf(tmp_path / "t.gguf", "made-up-pre")
    with pytest.raises(ModelLoadError,
                       match=r"pre-tokenizer 'made-up-pre' \(tokenizer.ggml.pre\) is not supported"):
        ours(path)


# --- SentencePiece ("llama" model) ------------------------------------------------------------------------

SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
USER_DEFINED = "<|tool|>"


def spm_vocab() -> list[str]:
    """Pieces of a SentencePiece-style BPE (words start with ▁), without the emoji and too few characters
    for the rest of the text, so that those fall back to bytes, plus runs of ▁ as Llama's vocabulary has."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tk.train_from_iterator(CORPUS,
                           trainers.BpeTrainer(vocab_size=700, limit_alphabet=150, show_progress=False))
    vocab = tk.get_vocab()
    pieces = [p for p in sorted(vocab, key=vocab.get) if not any(ord(c) >= 0x1F000 for c in p)]
    return ["▁▁", "▁▁▁▁", *pieces]


def write_spm_gguf(path: Path, arch: str) -> Path:
    pieces = spm_vocab()
    tokens = [*SPM_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), USER_DEFINED, *pieces]
    types = [2, 3, 3, *[6] * 256, 4, *[1] * len(pieces)]
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """arch -> GGUF path; phi3's is read by transformers as SentencePiece does (the space prefix from a
    normalizer), llama's through its Metaspace pre-tokenizer."""
    return {arch: write_spm_gguf(tmp_path_factory.mktemp(f"spm-{arch}") / "tok.gguf",
                                 arch) for arch in ("phi3", "llama")}


def test_spm_matches_transformers(spm):
    tok, hf = ours(spm["phi3"]), transformers_from_gguf(spm["phi3"])
    for text in [TEXT, "  two leading spaces",
                 f"{TEXT}</s>text after a control token {USER_DEFINED} and more"]:
        ids = tok.encode(text, add_special=False)
        assert ids == hf.encode(text, add_special_tokens=False), text[:20]
    ids = tok.encode(TEXT, add_special=False)
    assert tok.id_to_token(ids[0]).startswith("▁Hello")
    assert tok.decode(ids) == " " + TEXT  # the dummy prefix's space stays
    assert "<0xF0>" in {tok.id_to_token(i) for i in ids}  # emoji fall back to their bytes
    assert tok.encode("x")[0] == 1  # BOS by default for SentencePiece vocabularies


def test_spm_under_llama_arch(spm):
    """transformers reads a llama file's vocabulary with Metaspace, which differs from SentencePiece
    only on text that starts with a space; elsewhere the ids agree."""
    tok, hf = ours(spm["llama"]), transformers_from_gguf(spm["llama"])
    assert tok.encode(TEXT, add_special=False) == hf.encode(TEXT, add_special_tokens=False)
    assert [tok.id_to_token(i) for i in tok.encode("  hi", add_special=False)][:2] == ["▁▁", "▁h"]
