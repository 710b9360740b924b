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
    ("def celsius_to_fahrenheit(c):\n    ",
     "\n\n\nfor c in (0, 37, 100):\n    print(celsius_to_fahrenheit(c))\n"),
]


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
        openai = _post(coder, "/v1/completions",
                       {"model": "qwen2.5-coder-0.5b", "prompt": prefix, "suffix": suffix,
                                                  "max_tokens": 96, "temperature": 0}).json()
        middle = openai["choices"][0]["text"]
        _parses(prefix, middle, suffix)
        ollama = _post(coder, "/api/generate",
                       {"model": "qwen2.5-coder-0.5b", "prompt": prefix, "suffix": suffix,
                                               "stream": False,
                                               "options": {"temperature": 0, "num_predict": 96}})
        assert ollama.json()["response"] == middle
        infill = _post(coder, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 96,
                                          "temperature": 0, "n_indent": _indent(prefix)}).json()
        assert infill["content"] == middle


def test_infill_streams_and_reads_other_files(coder):
    extra = [{"filename": "units.py", "text": "FACTOR = 1.8\nOFFSET = 32\n"}]
    prefix, suffix = PAIRS[9]
    with httpx.stream("POST", f"{coder.url}/infill", headers=coder.headers, timeout=300,
                      json={"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra,
                            "n_predict": 64, "temperature": 0, "stream": True, "n_indent": 4}) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    pieces = [json.loads(e[6:]) for e in events]
    assert pieces[-1]["stop"] and len(pieces) > 2
    _parses(prefix, "".join(p["content"] for p in pieces), suffix)


# llama.vim's and llama.vscode's bodies as those plugins build them (their ring-buffer update asks for no
# tokens: the prompt is read into the cache)
LLAMA_VIM = {"input_prefix": "def mean(numbers):\n", "input_suffix": "\n\nprint(mean([1, 2]))\n",
             "input_extra": [{"text": "TOTAL = 0\n", "time": [1764300000, 1234], "filename": "util.py"}],
             "prompt": "    ", "n_predict": 32, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
             "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
             "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "response_fields": [
                 "content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                 "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                 "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                 "tokens_cached"]}
LLAMA_VIM_RING = {"input_prefix": "", "input_suffix": "", "prompt": "", "n_predict": 0, "temperature": 0.0,
                  "input_extra": [{"text": "TOTAL = 0\n", "time": [1764300000, 1234], "filename": "util.py"}],
                  "stream": False, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1,
                  "t_max_predict_ms": 1, "response_fields": [""]}
LLAMA_VSCODE = {"input_prefix": "def mean(numbers):\n", "input_suffix": "\n", "prompt": "    ",
                "input_extra": [{"text": "TOTAL = 0\n", "time": 1764300000, "filename": "util.py"}],
                "n_predict": 32, "top_k": 40, "top_p": 0.99, "stream": False,
                "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4,
                "t_max_prompt_ms": 500, "t_max_predict_ms": 2500}
LLAMA_VSCODE_RING = {"input_prefix": "", "input_suffix": "", "prompt": "", "n_predict": 0, "samplers": [],
                     "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1,
                     "input_extra": [{"text": "TOTAL = 0\n", "time": 1764300000, "filename": "util.py"}]}


@pytest.fixture(scope="module")
def editor(tmp_path_factory):
    """SmolLM2 first (no FIM tokens), the coder second: a body naming no model goes to the coder."""
    yield from serve(tmp_path_factory, ["smollm2", "qwen2.5-coder-0.5b"], "-c", "1024", "--max-num-seqs", "2")


def test_the_editor_plugins_bodies_are_answered(editor):
    r = _post(editor, "/infill", LLAMA_VIM)
    assert r.status_code == 200, r.text
    assert set(r.json()) == set(LLAMA_VIM["response_fields"])  # only those, nested ones under their path
    assert (
        r.json()["timings/predicted_n"] <= 32 and r.json()["tokens_cached"] > r.json()["timings/prompt_n"] > 0
    )
    r = _post(editor, "/infill", LLAMA_VSCODE)
    assert r.status_code == 200 and r.json()["model"] == "qwen2.5-coder-0.5b" and "content" in r.json()
    for ring in (LLAMA_VIM_RING, LLAMA_VSCODE_RING):
        r = _post(editor, "/infill", ring)
        assert r.status_code == 200, r.text
        assert r.json().get("content", "") == ""  # the prompt is read, nothing is generated
    r = _post(editor, "/infill", {**LLAMA_VSCODE, "n_predict": 0})
    assert r.json()["tokens_predicted"] == 0
    r = _post(editor, "/infill", {**LLAMA_VSCODE, "samplers": ["top_k", "magic"]})
    assert r.status_code == 400 and "magic" in r.text
    r = _post(editor, "/infill", {**LLAMA_VSCODE, "lora": [{"id": 0, "scale": 0.5}]})
    # it would change the answer, and there are no adapters here
    assert r.status_code == 400 and "lora" in r.text


def test_t_max_predict_ms_ends_a_middle_at_a_line_end(editor):
    body = {"input_prefix": "def numbers():\n    return [\n", "input_suffix": "    ]\n",
            "prompt": "        1,\n", "n_predict": 200, "temperature": 0, "t_max_predict_ms": 1, "stop": []}
    r = _post(editor, "/infill", body).json()
    assert r["stop_type"] == "limit" and "\n" in r["content"] and r["tokens_predicted"] < 200
    r = _post(editor, "/infill", {**body, "stream": True})
    final = json.loads([line for line in r.text.splitlines() if line.startswith("data: ")][-1][6:])
    assert final["stop_type"] == "limit"


def test_ollama_show_says_the_files_mix_and_insert(editor):
    r = _post(editor, "/api/show", {"model": "qwen2.5-coder-0.5b"}).json()
    assert r["details"]["quantization_level"] == "Q4_K_M" and "insert" in r["capabilities"]
    r = _post(editor, "/api/show", {"model": "smollm2"}).json()
    assert r["details"]["quantization_level"] == "Q4_1" and "insert" not in r["capabilities"]


def test_a_model_without_fim_tokens_is_a_400(idle):
    assert _post(idle, "/infill", {"input_prefix": "def f():\n    ", "input_suffix": "\n"}).status_code == 400
    r = _post(idle, "/v1/completions",
              {"model": "smollm2", "prompt": "def f():", "suffix": "\n", "max_tokens": 4})
    assert r.status_code == 400 and "fill-in-the-middle" in r.text
    r = _post(idle, "/api/generate",
              {"model": "smollm2", "prompt": "def f():", "suffix": "x", "stream": False})
    assert r.status_code == 400


def test_tokenize_and_detokenize(idle):
    ids = _post(idle, "/tokenize", {"content": "Hello world"}).json()["tokens"]
    assert _post(idle, "/detokenize", {"tokens": ids}).json()["content"] == "Hello world"
    pieces = _post(idle, "/tokenize", {"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == "Hello world"
    assert _post(idle, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert _post(idle, "/tokenize", {"content": 3}).status_code == 400
