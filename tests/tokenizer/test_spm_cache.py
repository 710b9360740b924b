"""SentencePiece vocabularies are rebuilt as a BPE once and kept in the cache directory (spm.py): a second
build reads the same tokenizer back, a changed vocabulary gets its own file, and a damaged cache file is
rebuilt with a warning rather than trusted or raised."""

from __future__ import annotations

import logging

from kvserve import spm

TOKENS = ["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "▁a", "ab", "abc", "▁ab",
          "▁abc"] + [f"<0x{i:02X}>" for i in range(256)]
TYPES = [2, 3, 3] + [1] * 9 + [6] * 256
SCORES = [0.0, 0.0, 0.0, -1, -2, -3, -4, -5, -6, -7, -8, -9] + [0.0] * 256


def encode(tk, text: str) -> list[int]:
    return tk.encode(text, add_special_tokens=False).ids


def test_the_built_tokenizer_is_cached_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    first = spm.build_spm_tokenizer(TOKENS, SCORES, TYPES, True)
    files = list((tmp_path / "tokenizers").glob("spm-*.json"))
    assert len(files) == 1
    monkeypatch.setattr(spm, "_build", lambda *a: (_ for _ in ()).throw(AssertionError("rebuilt")))
    second = spm.build_spm_tokenizer(TOKENS, SCORES, TYPES, True)
    assert encode(second, "abc ab a") == encode(first, "abc ab a") == [11, 10, 7]


def test_another_vocabulary_gets_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    spm.build_spm_tokenizer(TOKENS, SCORES, TYPES, True)
    spm.build_spm_tokenizer(TOKENS, [s * 2 for s in SCORES], TYPES, True)
    spm.build_spm_tokenizer(TOKENS, SCORES, TYPES, False)
    assert len(list((tmp_path / "tokenizers").glob("spm-*.json"))) == 3


def test_a_damaged_cache_file_is_rebuilt(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    expected = encode(spm.build_spm_tokenizer(TOKENS, SCORES, TYPES, True), "abc ab a")
    (cached,) = (tmp_path / "tokenizers").glob("spm-*.json")
    cached.write_text('{"model": ')
    with caplog.at_level(logging.WARNING):
        rebuilt = spm.build_spm_tokenizer(TOKENS, SCORES, TYPES, True)
    assert encode(rebuilt, "abc ab a") == expected and "rebuilding it" in caplog.text
    # rewritten whole
    assert encode(spm.build_spm_tokenizer(TOKENS, SCORES, TYPES, True), "abc ab a") == expected
