"""The ``kvserve`` command as a user runs it: real subprocesses, real model file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve import native


def kvserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.slow
def test_run_answers_paris_with_json_stats():
    # exact weights: auto's q4-fast (CPUs without a fused dot product) answers as llama.cpp does (L'Étoile...)
    r = kvserve("run", "smollm2", "What is the capital of France?", "--temperature", "0", "--json", "-c",
                "1024", "--weights", "q4")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)  # stdout is exactly one JSON object
    assert "Paris" in record["text"]
    for key in ("text", "prompt_tokens", "completion_tokens", "ttft_ms", "prefill_tok_s", "decode_tok_s",
                "kv_bytes"):
        assert key in record
    assert record["completion_tokens"] >= 2 and record["ttft_ms"] > 0
    # KV bytes in use: every token's K and V in every layer at the cache type's width (f16 by default)
    assert record["kv_bytes"] == (record["prompt_tokens"] + record["completion_tokens"]) * 2 * 30 * 3 * 64 * 2
    assert record["weights"] == "q4" and record["weights_why"] == "" and record["kernels"] == native.isa()


def test_run_says_what_auto_weights_chose_and_why():
    from kvserve.models.registry import resolve
    from kvserve.models.weight_choice import choose

    r = kvserve("run", "smollm2", "Hi", "-n", "2", "--json", "-c", "256")
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    expected = choose(resolve("smollm2"), "cpu", native.kernel_path())
    assert (record["weights"], record["weights_why"]) == (expected.format, expected.why)
    assert record["kernels"] == native.isa()


def test_run_names_a_bad_kvserve_isa_in_one_line(monkeypatch):
    monkeypatch.setenv("KVSERVE_ISA", "avx3")
    r = kvserve("run", "smollm2", "Hi", "--max-tokens", "2", "--json")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "KVSERVE_ISA='avx3': use one of native, avx512vnni, avxvnni, avx2, neon, portable" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("k,v,bits", [("q8_0", "q8_0", 8.5 + 8.5), ("tq3", "q4_0", 3.25 + 4.5)])
def test_run_reports_kv_bytes_per_token_of_the_cache_types(k, v, bits):
    r = kvserve("run", "smollm2", "Hi", "--temperature", "0", "--max-tokens", "2", "--json", "-c", "256",
                "-ctk", k, "-ctv", v)
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert (record["cache_type_k"], record["cache_type_v"]) == (k, v)
    # layers x kv_heads x head_dim x (K + V bits)
    assert record["kv_bytes_per_token"] == 30 * 3 * 64 * bits / 8


@pytest.mark.slow
def test_run_streams_text_then_stats_line_and_reads_stdin():
    r = kvserve("run", "smollm2", "--temperature", "0", "--max-tokens", "8", "-c", "512", stdin="Say hello.")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "TTFT" in r.stderr and "decode" in r.stderr and "tok/s" in r.stderr


def _error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "notes.gguf"
    f.write_text("hello")
    assert "not a GGUF file" in _error_line(kvserve("run", str(f), "hi"))


def test_truncated_gguf(tmp_path):
    from kvserve.models.registry import resolve

    src = resolve("smollm2")
    f = tmp_path / "cut.gguf"
    with open(src, "rb") as a, open(f, "wb") as b:
        b.write(a.read(300_000))
    assert "truncated" in _error_line(kvserve("run", str(f), "hi"))


def test_missing_model_and_unknown_name(tmp_path):
    assert "no such file" in _error_line(kvserve("run", str(tmp_path / "nope.gguf"), "hi"))
    assert "unknown model" in _error_line(kvserve("pull", "no-such-model"))


def test_bad_flag_values():
    assert "--num-ctx" in _error_line(kvserve("run", "smollm2", "hi", "--num-ctx", "0"))


def test_list_shows_registry():
    r = kvserve("list")
    assert r.returncode == 0 and "smollm2" in r.stdout and "gemma3-270m" in r.stdout
    gemma = next(line for line in r.stdout.splitlines() if "gemma3-270m" in line)
    assert " base " in gemma and "give it text to continue" in r.stdout


@pytest.mark.slow
def test_a_chat_prompt_to_a_base_model_warns_and_raw_text_does_not():
    """Gemma 3 270M is the pretrained model: its file has no chat template, so a chat gets a guessed
    format (and is echoed); a model with its own template, or --raw, gets no warning."""
    chat = kvserve("run", "gemma3-270m", "Hi", "-n", "2", "--temperature", "0")
    assert chat.returncode == 0, chat.stderr
    assert "gemma3-270m has no chat template in its file" in chat.stderr and "--raw" in chat.stderr
    raw = kvserve("run", "gemma3-270m", "The sky is", "-n", "2", "--temperature", "0", "--raw")
    assert raw.returncode == 0 and "chat template" not in raw.stderr
    own = kvserve("run", "smollm2", "Hi", "-n", "2", "--temperature", "0")
    assert own.returncode == 0 and "chat template" not in own.stderr


def test_cache_save_info_and_run_with_the_prompt_cache(tmp_path):
    prompt = "Paper was made from rags before wood pulp. " * 12
    (tmp_path / "prompt.txt").write_text(prompt)
    out = tmp_path / "s.kvc"
    r = kvserve("cache", "save", "smollm2", "--prompt-file", str(tmp_path / "prompt.txt"), "-o", str(out),
                "--cache-type", "q8_0", "-c", "512")
    assert r.returncode == 0, r.stderr
    info = json.loads(kvserve("cache", "info", str(out), "--json").stdout)
    assert info["cache_type_k"] == info["cache_type_v"] == "q8_0" and info["tokens"] % 16 == 0 and info[
        "tokens"] > 100
    r = kvserve("run", "smollm2", prompt + "Paper", "--prompt-cache", str(out), "--cache-type", "q8_0", "-c",
                "512", "--raw", "--json", "-n", "4", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cached_prompt_tokens"] == info["tokens"]
    r = kvserve("run", "smollm2", "Hi", "--prompt-cache", str(out), "--json", "-n", "2")  # f16: another setup
    assert r.returncode == 1 and "Traceback" not in r.stderr and "another engine setup" in r.stderr
    r = kvserve("cache", "info", str(tmp_path / "prompt.txt"))
    assert r.returncode == 1 and "not a usable prompt cache" in r.stderr


def test_run_with_speculative_decoding_gives_the_same_text():
    prompt = "One block, two blocks, three blocks, four blocks. " * 6 + "One block,"
    common = ["run", "smollm2", prompt, "--raw", "--json", "-n", "24", "--temperature", "0", "-c", "512"]
    plain = kvserve(*common)
    fast = kvserve(*common, "--speculative", "ngram", "--num-speculative-tokens", "6")
    assert plain.returncode == 0 and fast.returncode == 0, plain.stderr + fast.stderr
    a, b = json.loads(plain.stdout), json.loads(fast.stdout)
    assert a["text"] == b["text"] and a["draft_tokens"] == 0
    assert b["accepted_draft_tokens"] > 0 and b["draft_tokens"] >= b["accepted_draft_tokens"]
    bad = kvserve("run", "smollm2", "Hi", "--speculative", "ngram", "--num-speculative-tokens", "0")
    assert bad.returncode == 1 and "--num-speculative-tokens must be >= 1" in bad.stderr
