"""The byte-level BPE tokenizer of our kernel (bpe.BpeVocabulary) against the `tokenizers` build of the same
vocabulary (tokenizer.hf_byte_level_bpe), which matches each model's own tokenizer.json
(test_pretokenizers): the same ids on over a megabyte of code, prose in several scripts, emoji and odd
whitespace, with special strings read as tokens and as text, for the two byte-level models we ship; every
pre-tokenizer the kernel writes out on texts drawn from the characters its splits tell apart; the same
text back from any ids; the character classes as the library's regex engine has them."""

from __future__ import annotations

import bisect
import dataclasses
import pickle
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import native
from kvserve.bpe import BpeVocabulary, byte_level_bpe, hf_byte_level_bpe, native_bpe
from kvserve.errors import ModelLoadError
from kvserve.models.gguf_file import GGUFFile
from kvserve.models.registry import resolve
from kvserve.native import unicode_classes
from kvserve.pretokenizers import PRE_TOKENIZERS, pre_tokenizer_for
from kvserve.tokenizer import Tokenizer
from kvserve.vocabulary import HFVocabulary
from tests.tokenizer.test_spm_native import PROSE, assert_same_masks, corpus

pytestmark = pytest.mark.skipif(
    native.function("bpe_tokenize", "bpe_encode") is None,
    reason="the kernels do not load here (no prebuilt library, no C compiler)")

MODELS = {"smollm2": "smollm", "qwen2.5-coder-0.5b": "qwen2"}


def file_arguments(model: str, pre: str | None = None) -> tuple:
    gf = GGUFFile(resolve(model))
    return (gf.get("tokenizer.ggml.tokens"), gf.get("tokenizer.ggml.merges"),
            gf.get("tokenizer.ggml.token_type"),
            pre_tokenizer_for(pre or gf.get("tokenizer.ggml.pre"), gf.path))


@pytest.fixture(scope="module", params=list(MODELS))
def shipped(request):
    args = file_arguments(request.param)
    assert args[3] is PRE_TOKENIZERS[MODELS[request.param]]
    return BpeVocabulary(*args), hf_byte_level_bpe(*args)


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>", "<repo_name>",
            "<|file_sep|>", "<tool_call>", "</tool_call>", "<|im_start", "im_end|>"]


@pytest.mark.parametrize("literal", [False, True])
def test_shipped_ids_equal_the_reference_on_a_megabyte(shipped, literal):
    ours, reference = shipped
    rng = random.Random(2)
    text = corpus() + "".join(rng.choice(PROSE + SPECIALS + [" ", "\n", "1234567"]) for _ in range(3000))
    expected = reference.ids(text, literal)
    got = ours.ids(text, literal)
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    assert first is None and len(got) == len(expected), (first, got[first - 3 : first + 3],
                                                        expected[first - 3 : first + 3])
    for chunk in text.split("\n\n")[:300]:  # the same text in pieces: a segment's edges
        assert ours.ids(chunk, literal) == reference.ids(chunk, literal), chunk[:40]


def test_shipped_decodes_like_the_reference(shipped):
    ours, reference = shipped
    rng = random.Random(1)
    byte_ids = [i for i in range(ours.size) if len(ours.id_to_token(i)) == 1][:300]  # single bytes
    specials = [ours.token_to_id(t) for t in SPECIALS if ours.token_to_id(t) is not None]
    for _ in range(300):
        ids = [rng.choice([rng.randrange(ours.size), rng.choice(byte_ids), rng.choice(specials)])
               for _ in range(rng.randrange(0, 24))]
        ids += rng.choice([[], [ours.size + 5]])  # ids past the vocabulary are passed over
        for skip in (True, False):
            assert ours.decode(ids, skip) == reference.decode(ids, skip), ids
    text = PROSE[4] + PROSE[2]
    assert ours.decode(ours.ids(text)) == text


def test_shipped_tokens_and_specials(shipped):
    ours, reference = shipped
    for token in [*SPECIALS, "Ġthe", "Ċ", "ĠĠĠ", "not a token at all", "", "the"]:
        assert ours.token_to_id(token) == reference.token_to_id(token), token
    for i in [0, 1, 2, 100, 1000, ours.size - 1, ours.size]:
        assert ours.id_to_token(i) == reference.id_to_token(i), i
    assert ours.size == reference.size
    assert sorted(ours.specials()) == sorted(reference.specials())
    for text in ["plain", "a <|im_end|> b <|im_start|>", "<|im_star", "x<|endoftext|>", "\n\n"]:
        assert ours.first_special(text) == reference.first_special(text), text
    assert ours.max_token_bytes == reference.max_token_bytes


@pytest.mark.parametrize("model", list(MODELS))
def test_the_shipped_tokenizers_are_the_kernels(model):
    tok = Tokenizer.from_gguf(GGUFFile(resolve(model)))
    assert isinstance(tok.backend, BpeVocabulary)


# --- every split the kernel writes out, on the real SmolLM2 vocabulary ------------------------------------

KERNEL_PRES = sorted({spec.kernel + (spec.nfc, spec.ignore_merges): name
                      for name, spec in PRE_TOKENIZERS.items() if spec.kernel is not None}.values())


@pytest.fixture(scope="module", params=KERNEL_PRES)
def split_pair(request):
    args = file_arguments("smollm2", request.param)
    return BpeVocabulary(*args), hf_byte_level_bpe(*args)


def byte_alphabet() -> list[str]:
    """GPT-2's byte alphabet: the character each byte is spelled with."""
    prints = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = iter(range(256, 512))
    return [chr(b) if b in prints else chr(next(others)) for b in range(256)]


@pytest.fixture(scope="module")
def every_pair():
    """A vocabulary where every two bytes merge (in a seeded order): the ids tell each piece's edges
    apart, so equal ids mean equal splits."""
    alphabet = byte_alphabet()
    pairs = [(a, b) for a in alphabet for b in alphabet]
    random.Random(4).shuffle(pairs)
    specials = ["<|endoftext|>", "<|im_start|>"]
    tokens = [*alphabet, *(a + b for a, b in pairs), *specials]
    types = [1] * (len(tokens) - 2) + [3, 3]
    merges = [f"{a} {b}" for a, b in pairs]
    return {name: (BpeVocabulary(tokens, merges, types, PRE_TOKENIZERS[name]),
                   hf_byte_level_bpe(tokens, merges, types, PRE_TOKENIZERS[name])) for name in KERNEL_PRES}


# The characters the splits tell apart: letters of each case (and ſ, which folds to s in (?i:'s), the
# Kelvin sign), contractions, digits (ASCII, Arabic-Indic, a fraction, a Roman numeral, a Unicode 16 digit),
# white space that \s is (no-break, ideographic, line separator, NEL, VT, FF) and one it is not (\x1c),
# line breaks, the symbols llama.cpp's default split runs together, punctuation, combining marks, letters
# newer than Python's Unicode, emoji, and special-token strings.
PARTS = ["a", "Z", "é", "ſ", "\u212a", "ß", "İ", "Ǆ", "ǅ", "'", "’", "s", "S", "t", "re", "VE", "ll",
         "LL", "d", "m", "0", "7", "123", "٣", "½", "Ⅻ", "\U00010d40", " ", "  ", "\t", "\n", "\r", "\r\n",
         "\u00a0", "\u3000", "\u2028", "\u0085", "\x0b", "\x0c", "\x1c", "$", "+", "<", "=", ">", "^", "~",
         "|", "!", ".", ",", "-", "_", "(", "…", "«", "\u0301", "e\u0301", "A\u030a", "\u1c89", "中", "😀",
         "👍🏽", "<|endoftext|>", "<|im_start|>", "hello", "HTTPServer", "don't", "I'M"]


@pytest.mark.parametrize("pre", KERNEL_PRES)
@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(PARTS), max_size=40).map("".join), literal=st.booleans())
def test_every_split_matches_the_reference(every_pair, pre, text, literal):
    ours, reference = every_pair[pre]
    assert ours.ids(text, literal) == reference.ids(text, literal)


# Where a split's edge is easy to get wrong: each after a letter or two of context (the ids of a vocabulary
# where every two bytes merge differ for most wrong edges, not for all: hence the runs of variants).
EDGES = [*(f"x'\u017f{c}" for c in "abcdefghij"), *(f"x'\u212a{c}" for c in "abcdefghij"),
         *(f"x'\u00df{c}" for c in "abcdefghij"), *(f"{c}'LL{c}" for c in "abcde"), "'re'VE'd'M'T'S",
         *(f"{c}{w}{c}" for c in "ab" for w in ["  ", " \n\n  ", " \r\n\t ", "\u00a0", " \u00a0", "\x1c",
                                               "\u2028 ", "\x0b\x0c", "\u0085"]),
         "1234567", "\u0663\u0664\u0665\u0666\u0667", "12\u00bd3\u216b", "$+<=>^~|x", "a.,;!?b", " ...\n\nx",
         "e\u0301x", "A\u030angstr\u00f6m", "\u1c89\u1c8aab", "\U00010d40\U00010d41x", "HTTPServerError",
         "<|im_start|>user\n", " <|endoftext|> ", *(f"{c}.//\n/{c}" for c in "abcde"), "path/to/file.py\n",
         *(f"{c}\u0301{c}" for c in "aB.  "), " \u0301abc", "\u0301\u0302Xy", "DON'T can'T",
         "camelCaseJSONParser"]


@pytest.mark.parametrize("pre", KERNEL_PRES)
def test_every_split_at_its_edges(every_pair, pre):
    ours, reference = every_pair[pre]
    for text in EDGES:
        for literal in (False, True):
            assert ours.ids(text, literal) == reference.ids(text, literal), (text, literal)


def test_every_split_on_the_corpus(split_pair):
    ours, reference = split_pair
    text = "\n".join(PROSE) + corpus()[:200_000]
    assert ours.ids(text) == reference.ids(text)


def test_character_classes_are_the_regex_engines():
    """unicode_classes.h against the `tokenizers` regex engine, on every code point below U+3000 and a
    seeded sample of the rest (all of them take the generator ~15 s)."""
    header = unicode_classes.HEADER.read_text()

    def array(name: str) -> list[int]:
        values = re.search(name + r"\[UC_RUNS\] = \{(.*?)\}", header, re.DOTALL)[1]
        return [int(x) for x in values.split(",") if x.strip()]

    starts, bits = array("UC_RUN_START"), array("UC_RUN_BITS")
    rng = random.Random(3)
    sample = [c for c in range(0x3000) if not 0xD800 <= c < 0xE000]
    sample += rng.sample(unicode_classes.CODE_POINTS[0x3000:], 40_000)
    for bit, pattern in unicode_classes.CLASSES.items():
        expected = unicode_classes.matched(pattern, sample)
        got = {c for c in sample if bits[bisect.bisect_right(starts, c) - 1] & bit}
        assert got == expected, (pattern, sorted(got ^ expected)[:10])


# --- the edges ---------------------------------------------------------------------------------------------

def test_it_pickles_as_its_tokens(split_pair):
    ours, _ = split_pair
    again = pickle.loads(pickle.dumps(ours))
    assert isinstance(again, BpeVocabulary) and again.ids(PROSE[0]) == ours.ids(PROSE[0])


def test_every_named_split_is_written_out_and_one_that_is_not_goes_to_the_library():
    assert all(spec.kernel is not None for spec in PRE_TOKENIZERS.values())
    tokens, merges, types, pre = file_arguments("smollm2")
    unwritten = dataclasses.replace(pre, kernel=None)
    assert native_bpe(tokens, merges, types, unwritten) is None
    library = byte_level_bpe(tokens, merges, types, unwritten)
    assert isinstance(library, HFVocabulary) and library.ids(PROSE[0]) == BpeVocabulary(
        tokens, merges, types, pre).ids(PROSE[0])


def test_without_the_kernels_the_library_stands_in(no_kernels):
    args = file_arguments("smollm2")
    assert native_bpe(*args) is None
    tok = Tokenizer.from_gguf(GGUFFile(resolve("smollm2")))
    assert isinstance(tok.backend, HFVocabulary)
    assert tok.encode(PROSE[0]) == hf_byte_level_bpe(*args).ids(PROSE[0])


def test_a_vocabulary_whose_arrays_disagree_is_refused():
    tokens, merges, types, pre = file_arguments("smollm2")
    with pytest.raises(ModelLoadError, match="token types"):
        BpeVocabulary(tokens, merges, list(types)[:10], pre)


def test_llguidance_reads_the_same_vocabulary():
    args = file_arguments("smollm2")
    ours, reference = BpeVocabulary(*args), hf_byte_level_bpe(*args)
    assert_same_masks(ours, reference, ours.token_to_id("<|endoftext|>"), r"(the|a) [a-z]{1,12}( é中)?\n", 10)
