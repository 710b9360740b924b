"""Code completion between a prefix and a suffix with Qwen2.5-Coder-0.5B's fill-in-the-middle tokens,
through llama.cpp's ``/infill``, OpenAI completions' ``suffix`` and Ollama's ``suffix``: the middle the model
writes makes the file parse, on ten functions written for this test (not from any training set we know).
A model without FIM tokens (SmolLM2) is a 400 on each."""

from __future__ import annotations

import ast
import json

import httpx
import pytest

from tests.server.conftest import serve

pytestmark = pytest.mark.slow

# (prefix, suffix): the body of a function is missing, its signature and what follows are given
PAIRS = [
    ("def clamp(value, low, high):\n    ", "\n\n\nprint(clamp(5, 0, 3))\n"),
    ("def count_vowels(text):\n    ", "\n\n\nassert count_vowels('banana') == 3\n"),
    ("def is_palindrome(word):\n    ", "\n\n\nprint(is_palindrome('level'))\n"),
    ("def mean(numbers):\n    if not numbers:\n        return 0.0\n    ", "\n\n\nprint(mean([1, 2, 3]))\n"),
    ("def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n        ", "\n    return out\n"),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
     "\n\n    def pop(self):\n        return self.items.pop()\n"),
    ("def word_lengths(sentence):\n    ", "\n\n\nprint(word_lengths('a bb ccc'))\n"),
    ("import json\n\n\ndef load_config(path):\n    with open(path) as f:\n        ",
     "\n\n\nconfig = load_config('settings.json')\n"),
    ("def merge_dicts(a, b):\n    result = dict(a)\n    ", "\n    return result\n"),
    ("def celsius_to_fahrenheit(c):\n    ", "\n\n\nfor c in (0, 37, 100):\n    print(celsius_to_fahrenheit(c))\n"),
]


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    yield from serve(tmp_path_factory, "qwen2.5-coder-0.5b", "-c", "1024", "--max-num-seqs", "4")


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=300)


def _parses(prefix: str, middle: str, suffix: str) -> None:
    source = prefix + middle + suffix
    try:
        ast.parse(source)
    except SyntaxError as e:
        raise AssertionError(f"the filled file does not parse ({e}):\n{source}") from None


def _indent(prefix: str) -> int:
    line = prefix.rsplit("\n", 1)[-1]
    return len(line) - len(line.lstrip(" "))


def test_the_document_offers_fill_in_the_middle(coder):
    doc = httpx.get(f"{coder.url}/openapi.json", headers=coder.headers).json()
    assert "/infill" in doc["paths"]
    assert doc["components"]["schemas"]["GenerateRequest"]["properties"]["suffix"]["anyOf"] == [
        {"type": "string"}, {"type": "null"}]
    tokens = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert tokens["maximum"] == 151935  # Qwen2.5's embedding rows, more than its tokenizer's ids


def test_infill_middles_parse(coder):
    # as editors ask (llama.vscode sends the hole's indentation as n_indent): this instruct model often
    # writes on past the hole, into calls of the function, until a line indented less ends the middle
    ended = []
    for prefix, suffix in PAIRS:
        r = _post(coder, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 96,
                                     "temperature": 0, "n_indent": _indent(prefix)})
        assert r.status_code == 200, r.text
        body = r.json()
        ended.append(body["stop_type"])
        _parses(prefix, body["content"], suffix)
    assert ended.count("limit") <= 2, ended  # a middle cut off by n_predict must still have parsed


def test_suffix_on_openai_and_ollama_parses_and_is_the_same_middle(coder):
    # no n_indent on these APIs: the middle ends at the hole's own indentation (the prefix's last line)
    for prefix, suffix in PAIRS:
        openai = _post(coder, "/v1/completions", {"model": "qwen2.5-coder-0.5b", "prompt": prefix, "suffix": suffix,
                                                  "max_tokens": 96, "temperature": 0}).json()
        middle = openai["choices"][0]["text"]
        _parses(prefix, middle, suffix)
        ollama = _post(coder, "/api/generate", {"model": "qwen2.5-coder-0.5b", "prompt": prefix, "suffix": suffix,
                                               "stream": False, "options": {"temperature": 0, "num_predict": 96}})
        assert ollama.json()["response"] == middle
        infill = _post(coder, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 96,
                                          "temperature": 0, "n_indent": _indent(prefix)}).json()
        assert infill["content"] == middle


def test_infill_streams_and_reads_other_files(coder):
    extra = [{"filename": "units.py", "text": "FACTOR = 1.8\nOFFSET = 32\n"}]
    prefix, suffix = PAIRS[9]
    with httpx.stream("POST", f"{coder.url}/infill", headers=coder.headers, timeout=300,
                      json={"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "n_predict": 64,
                            "temperature": 0, "stream": True, "n_indent": 4}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    pieces = [json.loads(e[6:]) for e in events]
    assert pieces[-1]["stop"] and len(pieces) > 2
    _parses(prefix, "".join(p["content"] for p in pieces), suffix)


def test_a_model_without_fim_tokens_is_a_400(idle):
    assert _post(idle, "/infill", {"input_prefix": "def f():\n    ", "input_suffix": "\n"}).status_code == 400
    r = _post(idle, "/v1/completions", {"model": "smollm2", "prompt": "def f():", "suffix": "\n", "max_tokens": 4})
    assert r.status_code == 400 and "fill-in-the-middle" in r.text
    r = _post(idle, "/api/generate", {"model": "smollm2", "prompt": "def f():", "suffix": "x", "stream": False})
    assert r.status_code == 400


def test_tokenize_and_detokenize(idle):
    ids = _post(idle, "/tokenize", {"content": "Hello world"}).json()["tokens"]
    assert _post(idle, "/detokenize", {"tokens": ids}).json()["content"] == "Hello world"
    pieces = _post(idle, "/tokenize", {"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == "Hello world"
    assert _post(idle, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert _post(idle, "/tokenize", {"content": 3}).status_code == 400
