"""``kvserve plan`` as a user runs it (subprocesses), plus its flag parsing and error lines in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvserve.cli.plan import parse_contexts, parse_size
from kvserve.kv.cache_types import KV_TYPES


def kvserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvserve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"},
        check=False,
    )


def _error_line(returncode: int, stderr: str) -> str:
    assert returncode == 1
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_json_with_a_context_list():
    r = kvserve("plan", "smollm2", "--json", "--ctx", "1024,8k", "--memory", "4GiB", "--max-num-seqs", "2")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["model"]["num_layers"] == 30 and plan["settings"]["memory_bytes"] == 4 << 30
    (f16,) = plan["kv_types"]
    assert f16["name"] == "f16" and f16["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert [c["ctx"] for c in f16["contexts"]] == [1024, 8192]
    assert f16["contexts"][0]["kv_bytes"] == 1024 * f16["bytes_per_token"] * 2
    assert f16["max_ctx"] == 8192  # the model's trained context fits easily in 4 GiB


def test_disk_tier_tokens_per_kv_type():
    r = kvserve("plan", "smollm2", "--json", "--ctx", "1024", "--cache-types", "f16,q8_0",
                "--kv-disk-cache-size", "1GiB")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["settings"]["disk_cache_bytes"] == 1 << 30
    f16, q8 = plan["kv_types"]
    # a block file: 16 tokens of K/V as stored plus at most 2 KiB of header and checksum
    assert f16["disk_tier"]["file_bytes"] == 16 * f16["bytes_per_token"] + 2048
    assert f16["disk_tier"]["tokens"] == (1 << 30) // f16["disk_tier"]["file_bytes"] * 16
    assert q8["disk_tier"]["tokens"] > 1.8 * f16["disk_tier"]["tokens"]
    assert "disk tier" in " ".join(plan["notes"])
    without = json.loads(kvserve("plan", "smollm2", "--json", "--ctx", "1024").stdout)
    assert without["kv_types"][0]["disk_tier"] is None


def test_all_cache_types():
    r = kvserve(
        "plan", "Llama-3.1-8B", "--cache-types", "all", "--ctx", "131072", "--memory", "28GiB", "--json"
    )
    assert r.returncode == 0, r.stderr
    types = json.loads(r.stdout)["kv_types"]
    assert [t["name"] for t in types] == list(KV_TYPES)
    by_name = {t["name"]: t for t in types}
    assert by_name["f16"]["bytes_per_token"] == 131_072 and by_name["q8_0"]["bits_per_element_k"] == 8.5
    assert by_name["f16"]["contexts"][0]["kv_bytes"] == 17_179_869_184
    # 15 GiB of weights + 16 GiB of f16 KV > 28 GiB
    assert by_name["tq2"]["max_ctx"] > by_name["f16"]["max_ctx"]
    torch_path = json.loads(kvserve("plan", "Llama-3.1-8B", "--ctx", "131072", "--attention", "torch",
                                    "--json").stdout)
    native = json.loads(kvserve("plan", "Llama-3.1-8B", "--ctx", "131072", "--attention", "native",
                                "--json").stdout)
    (t,), (n,) = ([c["activations"] for c in p["kv_types"][0]["contexts"]] for p in (torch_path, native))
    assert (t["attention_kernels"], n["attention_kernels"]) == ("torch", "native")
    assert t["attention"] > 20 * 2**30 and n["attention"] < 64 * 2**20  # the 23.6 GiB of torch tiles


def test_table():
    r = kvserve("plan", "smollm2", "--memory", "2GiB")
    assert r.returncode == 0, r.stderr
    for text in (
        "weights (as stored)",
        "KV cache",
        "activations",
        "runtime overhead",
        "total (plan)",
        "total (engine)",
        "largest context that fits in 2.00 GiB",
        "23,040",
    ):
        assert text in r.stdout, text


def test_window_group_in_the_pool_and_off_with_no_window_kv():
    args = ("plan", "Gemma-3-4B", "--ctx", "32k", "--memory", "64GiB", "--json")
    windowed, every_token = (json.loads(kvserve(*args, *flag).stdout) for flag in ((), ("--no-window-kv",)))
    (w,), (e,) = (plan["kv_types"][0]["contexts"] for plan in (windowed, every_token))
    assert w["engine_window_blocks"] == 1024 // 16 + 2 + 512 // 16 + 1 and e["engine_window_blocks"] == 0
    assert w["kv_bytes_windowed"] < w["engine_kv_pool_bytes"] < e["engine_kv_pool_bytes"] == e["kv_bytes"]
    assert w["total_bytes"] - w["engine_kv_pool_bytes"] == e["total_bytes"] - e["engine_kv_pool_bytes"]
    assert every_token["settings"]["window_kv"] is False
    assert any("--no-window-kv keeps every token in every layer" in n for n in every_token["notes"])


def test_unknown_preset_is_one_error_line():
    r = kvserve("plan", "Llama-9B")
    assert "unknown model 'Llama-9B'" in _error_line(r.returncode, r.stderr)


@pytest.mark.parametrize(
    "args, message",
    [
        (["Llama-3.1-8B", "--memory", "lots"], "--memory: not a size: 'lots'"),
        (["Llama-3.1-8B", "--memory", "0GiB"], "not a size"),
        (["Llama-3.1-8B", "-ctk", "q5_1"], "unknown KV cache type 'q5_1'"),
        (["Llama-3.1-8B", "--cache-types", "f16,int4"], "unknown KV cache type 'int4'"),
        (
            ["Llama-3.1-8B", "--cache-types", "all", "-ctv", "q4_0"],
            "--cache-types plans K and V of the same type",
        ),
        (["Llama-3.1-8B", "--ctx", "8k,lots"], "--ctx: 'lots' is not a context length"),
        (["Llama-3.1-8B", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["Llama-3.1-8B", "--dtype", "int8"], "unknown dtype 'int8'"),
        (["missing/model.gguf"], "no such file"),
        (["Llama-3.1-8B", "--kv-disk-cache-size", "lots"], "--kv-disk-cache-size: not a size"),
    ],
)
def test_bad_input_is_one_error_line(capsys, args, message):
    from kvserve.cli.main import main

    code = main(["plan", *args])
    assert message in _error_line(code, capsys.readouterr().err)


def test_sizes():
    assert parse_size("16GiB") == parse_size("16G") == parse_size("16 gib") == 16 << 30
    assert parse_size("16GB") == 16 * 10**9
    assert parse_size("1.5MiB") == 3 << 19
    assert parse_size("4096") == parse_size("4096B") == 4096


def test_contexts():
    assert parse_contexts("131072,8192,8k") == (8192, 131072)
    assert parse_contexts("128K, 32k") == (32768, 131072)
