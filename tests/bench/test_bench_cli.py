"""``kvserve bench`` produces the documented rows, JSON and plot (speeds are not asserted: benchmarks
are not tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KEYS = {"engine", "cache_type", "prompt_len", "concurrency", "ttft_ms", "prefill_tok_s", "decode_tok_s",
        "itl_p50_ms", "itl_p99_ms", "aggregate_tok_s", "peak_rss_bytes", "kv_bytes"}


def kvserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve", *args], capture_output=True, text=True,
                          timeout=600, check=False)


@pytest.mark.slow
def test_bench_rows_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    r = kvserve("bench", "smollm2", "--prompt-lens", "16,32", "--gen", "4", "--concurrency", "1,2",
                "--cache-types", "f16,q8_0,q4_0/tq2", "--repeats", "1", "--json", str(out),
                "--plot", str(png))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 3 * 2 * 2
    assert all(KEYS <= set(row) for row in rows)
    assert {(row["cache_type"], row["prompt_len"], row["concurrency"]) for row in rows} == {
        (t, p, c) for t in ("f16", "q8_0", "q4_0/tq2") for p in (16, 32) for c in (1, 2)}
    for row in rows:
        assert row["engine"] == "kvserve" and row["decode_tok_s"] > 0 and row["ttft_ms"] > 0
        assert row["kv_baseline"] == ("" if row["cache_type"] == "f16" else "f16")
        assert (row["kv_ratio_decode"] > 0) == (row["cache_type"] != "f16")
        assert row["kv_bytes"] > 0 and row["peak_rss_bytes"] > 0 and row["bandwidth_bytes_s"] > 0
    kv_bytes = {row["cache_type"]: row["kv_bytes"] for row in rows if row["prompt_len"] == 32 and
                row["concurrency"] == 1}
    # the pair's engine held 4.5-bit keys and 2.25-bit values: a smaller pool than q8_0's, and that f16's
    assert kv_bytes["q4_0/tq2"] < kv_bytes["q8_0"] < kv_bytes["f16"]
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "roofline" in r.stdout


def test_a_bad_kv_type_fails_before_the_model_loads():
    r = kvserve("bench", "no-such-model", "--cache-types", "f16,q4_0/q3_x")
    assert r.returncode != 0
    assert "unknown KV cache type 'q3_x'" in r.stderr and "Traceback" not in r.stderr


def test_kv_pairs_name_their_sides_for_llama_cpp():
    from kvserve.benchmark.peers import ggml_pair
    from kvserve.kv.cache_types import kv_pair

    assert kv_pair(" q4_0/tq2 ") == ("q4_0", "tq2") and kv_pair("q8_0") == ("q8_0", "q8_0")
    assert ggml_pair("q8_0/q4_0") == ("q8_0", "q4_0") and ggml_pair("f16") == ("f16", "f16")
    assert ggml_pair("q4_0/tq2") is None  # llama.cpp has no tq2: the peer skips the row


def test_many_streams_are_compared_with_the_peers_stream_measured_alike():
    """Both aggregates count prefill (new tokens / wall time from the first request to the last token);
    the peer's decode rate alone (no prefill) is shown beside."""
    from kvserve.benchmark.bench_report import aggregate_ratio, bandwidth_range
    from kvserve.benchmark.measure import BenchRow

    def row(engine, concurrency, decode, aggregate, bandwidth=0.0):
        return BenchRow(engine, "f16", 128, concurrency, 100.0, 1000.0, decode, 5.0, 6.0, aggregate, 1, 1,
                        bandwidth_bytes_s=bandwidth)

    ours, peer = row("kvserve", 16, 20.0, 300.0, 3e10), row("llama.cpp", 1, 100.0, 60.0)
    assert aggregate_ratio(ours, peer) == "aggregate 5.00x llama.cpp's 1 stream (its decode alone: 3.00x)"
    batched = row("llama.cpp", 16, 10.0, 150.0)  # llama-batched-bench: its own 16 streams
    assert aggregate_ratio(ours, batched) == "aggregate 2.00x llama.cpp's 16 streams"
    assert bandwidth_range([ours, peer, row("kvserve", 1, 1.0, 1.0, 4.5e10)]) == "30.0-45.0 GB/s"


def test_kv_types_are_compared_by_the_ratios_of_each_round():
    """A KV type against the first one benched: the median of the per-round ratios (each pair run one
    after the other), not the ratio of the medians, which drift between rounds would move."""
    from types import SimpleNamespace

    from kvserve.benchmark.bench_report import kv_ratio
    from kvserve.benchmark.measure import BenchRow
    from kvserve.cli.bench import _paired_kv_ratios

    def runs(decodes):
        return [SimpleNamespace(prefill_tok_s=d * 10, decode_tok_s=d, aggregate_tok_s=d / 2) for d in decodes]

    baseline, q8 = runs([100.0, 50.0, 200.0]), runs([110.0, 50.0, 180.0])  # per round 1.1, 1.0, 0.9
    row = BenchRow("kvserve", "q8_0", 128, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1, 1)
    _paired_kv_ratios(row, q8, baseline, "f16")
    assert (row.kv_ratio_prefill, row.kv_ratio_decode, row.kv_ratio_aggregate) == (1.0, 1.0, 1.0)
    assert kv_ratio(row) == "1.00x, 1.00x, 1.00x f16"


def test_peak_rss_is_the_rows_own(monkeypatch):
    """A row's peak is VmHWM after writing "5" to /proc/self/clear_refs (which resets it); where /proc
    cannot be read, getrusage's peak. What the kernel does with the reset is the machine's business
    (``bench/load_memory.py`` prints real figures): this checks our side of it."""
    import io

    from kvserve.benchmark import measure

    written: dict[str, str] = {}

    class Recording(io.StringIO):
        def __init__(self, path):
            super().__init__()
            self.path = path

        def close(self):
            written[self.path] = self.getvalue()
            super().close()

    def fake_open(path, mode="r"):
        if "w" in mode:
            return Recording(path)
        return io.StringIO("Name:\tpython\nVmHWM:\t  123456 kB\nVmRSS:\t 1000 kB\n")

    monkeypatch.setattr(measure, "open", fake_open, raising=False)
    measure.reset_peak_rss()
    assert written == {"/proc/self/clear_refs": "5"}
    assert measure.peak_rss_bytes() == 123456 * 1024

    def no_proc(path, mode="r"):
        raise OSError("no /proc here")

    monkeypatch.setattr(measure, "open", no_proc, raising=False)
    measure.reset_peak_rss()  # quietly nothing
    monkeypatch.setattr(measure.resource, "getrusage", lambda who: type("R", (), {"ru_maxrss": 77})())
    assert measure.peak_rss_bytes() == 77 * 1024


def test_bench_rejects_unknown_peers_and_bad_lists():
    r = kvserve("bench", "smollm2", "--compare", "vllm")
    assert r.returncode == 1 and "unknown peer 'vllm'" in r.stderr
    r = kvserve("bench", "smollm2", "--prompt-lens", "0,12")
    assert r.returncode == 2 and "positive integers" in r.stderr


FAKE_BENCH = """#!/usr/bin/env python3
import json, sys
a = sys.argv
open(sys.argv[0] + ".calls", "a").write(" ".join(a[1:]) + "\\n")
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
print(json.dumps([{"n_prompt": p, "n_gen": n, "avg_ts": 400.0 if p else 50.0}]))
"""
FAKE_BATCHED = """#!/usr/bin/env python3
import json, sys
open(sys.argv[0] + ".calls", "a").write(" ".join(sys.argv[1:]) + "\\n")
print("some log line")
print(json.dumps({"pp": 128, "tg": 64, "pl": 16, "t_pp": 2.0, "speed_pp": 1024.0, "t_tg": 4.0,
                  "speed_tg": 256.0, "t": 6.0}))
"""


def test_llama_cpps_own_tools_are_read_as_its_users_quote_them(tmp_path, monkeypatch):
    """Prefill from llama-bench's pp, decode from its tg at the prompt's depth, many streams from
    llama-batched-bench (aggregate: all streams' new tokens over its whole run): fake tools that print
    the tools' JSON and note their arguments."""
    from kvserve.benchmark.peers import LlamaToolsRunner, llama_tools_dir

    for name, text in (("llama-bench", FAKE_BENCH), ("llama-batched-bench", FAKE_BATCHED)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("KVSERVE_LLAMA_CPP_BIN", str(tmp_path))
    assert llama_tools_dir() == tmp_path
    assert llama_tools_dir(("llama-perplexity",)) is None  # the variable names the one folder looked in
    runner = LlamaToolsRunner("model.gguf", 2, tmp_path)
    one = runner.run([[1] * 512], 64, "q8_0")
    assert (one.prefill_tok_s, one.decode_tok_s, one.ttft_ms) == (400.0, 50.0, 1280.0)
    calls = (tmp_path / "llama-bench.calls").read_text().splitlines()
    assert "-p 512 -n 0" in calls[0] and "-p 0 -n 64 -d 512" in calls[1]
    assert all("-m model.gguf -t 2" in c and "-ctk q8_0 -ctv q8_0" in c and "-fa 1" in c for c in calls)
    many = runner.run([[1] * 128] * 16, 64, "f16")
    assert many.concurrency == 16 and many.aggregate_tok_s == 16 * 64 / 6.0 and many.decode_tok_s == 16.0
    assert "-npp 128 -ntg 64 -npl 16" in (tmp_path / "llama-batched-bench.calls").read_text()
