"""The SentencePiece tokenizer of our kernel (spm.SpmVocabulary) against the `tokenizers` BPE that
spm.build_spm_tokenizer derives from the same vocabulary, which transformers' GGUF loader matches
(test_pretokenizers): the same ids on over a megabyte of code, prose in several scripts, emoji and odd
whitespace, special-piece strings read as pieces and as text; the same text back from any ids."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve import native
from kvserve.errors import ModelLoadError
from kvserve.models.gguf_file import GGUFFile
from kvserve.models.registry import resolve
from kvserve.spm import SpmVocabulary, build_spm_tokenizer, native_spm
from kvserve.tokenizer import Tokenizer
from kvserve.vocabulary import HFVocabulary
from tests.tokenizer.test_pretokenizers import CORPUS, spm_vocab

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    native.function("spm_tokenize", "spm_encode") is None,
    reason="the kernels do not load here (no prebuilt library, no C compiler)")

PROSE = [
    "The quick brown fox jumps over the lazy dog; naïve café, résumé, Ångström (e\u0301 vs é).",
    "Быстрая коричневая лиса прыгает через ленивую собаку. Съешь же ещё этих мягких булок.",
    "敏捷的棕色狐狸跳过了懒狗。日本語の文章です、ひらがなとカタカナ。한국어 문장입니다.",
    "الثعلب البني السريع يقفز فوق الكلب الكسول. नमस्ते दुनिया, यह परीक्षण है। Γειά σου κόσμε.",
    "Emoji 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨🚀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010FFFD \ufeff zero\u200bwidth",
    ("odd   whitespace\t\t\ttabs\r\n\r\ncrlf\n\n\n\n\n\n\n\nnewlines \u00a0nbsp \u3000ideographic"
     "  trailing   "),
]


def corpus() -> str:
    """Over a megabyte: the project's own code and docs, then the prose and specials mixed at random."""
    parts = [p.read_text() for p in sorted((ROOT / "src").rglob("*.py"))]
    parts += [p.read_text() for p in sorted((ROOT / "src").rglob("*.c"))]
    parts += [p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))]
    rng = random.Random(0)
    pieces = PROSE + ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<unk>", "<0x41>", "▁x",
                      "[multimodal]", "<pad>", "<mask>", "<unused7>", " ", "  ", "\n"]
    parts += ["".join(rng.choice(pieces) for _ in range(40)) for _ in range(600)]
    text = "".join(parts)
    assert len(text.encode()) > 1_000_000
    return text


@pytest.fixture(scope="module")
def gemma():
    gf = GGUFFile(resolve("gemma3-270m"))
    args = (gf.get("tokenizer.ggml.tokens"), gf.get("tokenizer.ggml.scores"),
            gf.get("tokenizer.ggml.token_type"), bool(gf.get("tokenizer.ggml.add_space_prefix", True)))
    return SpmVocabulary(*args), HFVocabulary(build_spm_tokenizer(*args))


@pytest.mark.parametrize("literal", [False, True])
def test_gemma_ids_equal_the_reference_on_a_megabyte(gemma, literal):
    ours, reference = gemma
    text = corpus()
    expected = reference.ids(text, literal)
    got = ours.ids(text, literal)
    assert len(got) == len(expected)
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
    assert first is None, (first, got[first - 3 : first + 3], expected[first - 3 : first + 3])
    for chunk in text.split("\n\n")[:300]:  # the same text in pieces: a segment's edges
        assert ours.ids(chunk, literal) == reference.ids(chunk, literal), chunk[:40]


def test_gemma_decodes_like_the_reference(gemma):
    ours, reference = gemma
    rng = random.Random(1)
    byte_ids = [ours.token_to_id(f"<0x{b:02X}>") for b in (0xE2, 0x96, 0x81, 0xF0, 0x9F, 0x41)]
    specials = [ours.token_to_id(t) for t in ("<start_of_turn>", "<eos>", "<unk>", "\n\n")]
    for _ in range(300):
        ids = [rng.choice([rng.randrange(ours.size), rng.choice(byte_ids), rng.choice(specials)])
               for _ in range(rng.randrange(0, 24))]
        ids += rng.choice([[], [ours.size + 5]])  # ids past the vocabulary are passed over
        for skip in (True, False):
            assert ours.decode(ids, skip) == reference.decode(ids, skip), ids
    text = PROSE[4] + PROSE[2]
    assert ours.decode(ours.ids(text)) == " " * bool(ours.ids("x")[0] == ours.token_to_id("▁x")) + text


def test_gemma_pieces_and_specials(gemma):
    ours, reference = gemma
    for piece in ["<start_of_turn>", "▁the", "<0x0A>", "\n\n\n", "not a piece at all", "", "<unused99>"]:
        assert ours.token_to_id(piece) == reference.token_to_id(piece), piece
    for i in [0, 1, 2, 3, 105, 106, 1000, ours.size - 1, ours.size]:
        assert ours.id_to_token(i) == reference.id_to_token(i), i
    assert ours.size == reference.size
    assert sorted(ours.specials()) == sorted(reference.specials())
    for text in ["plain", "a <end_of_turn> b <start_of_turn>", "<start_of_tur", "x<eos>", "\n\n"]:
        assert ours.first_special(text) == reference.first_special(text), text
    assert ours.max_token_bytes == reference.max_token_bytes


def test_the_gemma_tokenizer_is_the_kernels():
    tok = Tokenizer.from_gguf(GGUFFile(resolve("gemma3-270m")))
    assert isinstance(tok.backend, SpmVocabulary)


# --- small vocabularies: every branch the large one may not reach ---------------------------------------

SPECIALS = ["<unk>", "<s>", "</s>"]


def vocabulary(*, byte_pieces: bool = True, unk: bool = True, scores: bool = True, user: str = "<|tool|>"):
    """The tests' trained SentencePiece-style pieces (no emoji, few characters: the rest falls back),
    as a GGUF stores them: specials, byte pieces, a user-defined piece, the pieces with falling scores."""
    pieces = spm_vocab()
    specials = SPECIALS if unk else SPECIALS[1:]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)] if byte_pieces else []
    tokens = [*specials, *bytes_, user, "<s>x", *pieces]  # "<s>x": a control piece inside a longer added one
    types = [2 if t == "<unk>" else 3 for t in specials] + [6] * len(bytes_) + [4, 4] + [1] * len(pieces)
    values = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    return tokens, (values if scores else None), types


VARIANTS = {  # name: (vocabulary's arguments, space prefix)
    "prefix": ({}, True),
    "no prefix": ({}, False),
    "no byte pieces": ({"byte_pieces": False}, True),
    "no byte pieces, no unk": ({"byte_pieces": False, "unk": False}, True),
    "no scores": ({"scores": False}, True),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def small(request, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("KVSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    kwargs, prefix = VARIANTS[request.param]
    tokens, scores, types = vocabulary(**kwargs)
    args = (tokens, scores, types, prefix)
    return SpmVocabulary(*args), HFVocabulary(build_spm_tokenizer(*args))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


ALPHABET = st.sampled_from(["a", "b", "e", "th", "the", "in", " ", "  ", "\t", "\n", "é", "中", "😀", "<s>",
                            "</s>", "<s>x", "<|tool|>", "<unk>", "▁", "<0x41>", "<", "|", "x"])


@given(st.lists(ALPHABET, max_size=30).map("".join), st.booleans())
def test_small_vocabularies_match_the_reference(small, text, literal):
    ours, reference = small
    assert ours.ids(text, literal) == reference.ids(text, literal)


def test_small_vocabularies_on_the_corpus(small):
    ours, reference = small
    for text in CORPUS:
        for literal in (False, True):
            assert ours.ids(text, literal) == reference.ids(text, literal)
        assert ours.decode(ours.ids(text)) == reference.decode(reference.ids(text))


def test_it_pickles_as_its_pieces(small):
    ours, _ = small
    again = pickle.loads(pickle.dumps(ours))
    assert again.ids(CORPUS[0]) == ours.ids(CORPUS[0]) and again.size == ours.size


def test_without_the_kernels_the_tokenizers_build_stands_in(no_kernels, tmp_path, monkeypatch):
    from tests.tokenizer.test_pretokenizers import write_spm_gguf

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    tokens, scores, types = vocabulary()
    assert native_spm(tokens, scores, types, True) is None
    tok = Tokenizer.from_gguf(GGUFFile(write_spm_gguf(tmp_path / "t.gguf", "llama")))
    assert isinstance(tok.backend, HFVocabulary) and tok.encode(CORPUS[0])[:2] != []


def assert_same_masks(ours, reference, eos: int, pattern: str, steps: int) -> None:
    """A grammar's token masks from our vocabulary equal those from the reference's tokenizer.json, step by
    step along one path the grammar allows (the highest allowed id each time)."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_regex(pattern)
    matchers = [LLMatcher(v.guidance(v.size, eos), grammar, log_level=0) for v in (ours, reference)]
    for _ in range(steps):
        masks = [bytes(m.compute_logit_bias()) for m in matchers]
        assert masks[0] == masks[1]
        allowed = [i for i, bias in enumerate(masks[0]) if bias]
        assert allowed
        if matchers[0].is_accepting():
            break
        for m in matchers:
            assert m.consume_token(allowed[-1])


def test_llguidance_reads_the_same_vocabulary(small):
    ours, reference = small
    assert_same_masks(ours, reference, ours.token_to_id("</s>"), r"(the|a) [a-z]{1,12}( é中)?", 8)


def few_pieces(pieces: list[str], byte_values: list[int]) -> tuple:
    """A vocabulary of <unk>, the byte pieces of ``byte_values`` and ``pieces`` (scores falling)."""
    tokens = ["<unk>", *(f"<0x{b:02X}>" for b in byte_values), *pieces]
    types = [2] + [6] * len(byte_values) + [1] * len(pieces)
    return tokens, [0.0] * (1 + len(byte_values)) + [-float(i) for i in range(len(pieces))], types


@pytest.mark.parametrize(("pieces", "byte_values", "texts"), [
    # no "▁" piece: the prefix and each space fall back to three byte pieces (more ids than input bytes)
    (["a"], list(range(256)), ["a", " ", "a a", "  a  ", " " * 40, "a" * 7]),
    # an unknown run waits while characters fall back to bytes, and fuses across them
    (["▁", "a", "b"], [0xC3, 0xA9], ["中éa", "中é中", "é中é中a", "中中éb", "a中"]),
])
def test_vocabularies_that_lack_pieces(pieces, byte_values, texts, monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    tokens, scores, types = few_pieces(pieces, byte_values)
    ours, reference = SpmVocabulary(tokens, scores, types, True), HFVocabulary(
        build_spm_tokenizer(tokens, scores, types, True))
    for text in texts:
        assert ours.ids(text) == reference.ids(text), text


def test_a_vocabulary_whose_arrays_disagree_is_refused():
    tokens, scores, types = few_pieces(["a", "b", "ab"], [])
    with pytest.raises(ModelLoadError, match="4 pieces but 1 scores"):
        SpmVocabulary(tokens, scores[:1], types, True)
    with pytest.raises(ModelLoadError, match="4 pieces but 3 token types"):
        SpmVocabulary(tokens, scores, types[:3], True)


def test_unpickled_where_the_kernels_do_not_load_it_is_the_tokenizers_build(small, no_kernels, tmp_path,
                                                                               monkeypatch):
    ours, reference = small
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    again = pickle.loads(pickle.dumps(ours))
    assert isinstance(again, HFVocabulary) and again.ids(CORPUS[0]) == reference.ids(CORPUS[0])
