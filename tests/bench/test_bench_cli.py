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
    return subprocess.run([sys.executable, "-m", "kvserve", *args], capture_output=True, text=True, timeout=600,
                          check=False)


@pytest.mark.slow
def test_bench_rows_json_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    r = kvserve("bench", "smollm2", "--prompt-lens", "16,32", "--gen", "4", "--concurrency", "1,2",
                "--cache-types", "f16,q8_0", "--repeats", "1", "--json", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 2 * 2
    assert all(KEYS <= set(row) for row in rows)
    assert {(row["cache_type"], row["prompt_len"], row["concurrency"]) for row in rows} == {
        (t, p, c) for t in ("f16", "q8_0") for p in (16, 32) for c in (1, 2)}
    for row in rows:
        assert row["engine"] == "kvserve" and row["decode_tok_s"] > 0 and row["ttft_ms"] > 0
        assert row["kv_bytes"] > 0 and row["peak_rss_bytes"] > 0 and row["bandwidth_bytes_s"] > 0
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "roofline" in r.stdout


def test_many_streams_are_compared_with_the_peers_stream_measured_alike():
    """Both aggregates count prefill (new tokens / wall time from the first request to the last token);
    the peer's decode rate alone (no prefill) is shown beside."""
    from kvserve.benchmark.measure import BenchRow
    from kvserve.benchmark.report import aggregate_ratio, bandwidth_range

    def row(engine, concurrency, decode, aggregate, bandwidth=0.0):
        return BenchRow(engine, "f16", 128, concurrency, 100.0, 1000.0, decode, 5.0, 6.0, aggregate, 1, 1,
                        bandwidth_bytes_s=bandwidth)

    ours, peer = row("kvserve", 16, 20.0, 300.0, 3e10), row("llama.cpp", 1, 100.0, 60.0)
    assert aggregate_ratio(ours, peer) == "aggregate 5.00x llama.cpp's 1 stream (its decode alone: 3.00x)"
    assert bandwidth_range([ours, peer, row("kvserve", 1, 1.0, 1.0, 4.5e10)]) == "30.0-45.0 GB/s"


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
