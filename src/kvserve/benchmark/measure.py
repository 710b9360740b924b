"""One benchmark row: a workload (prompt length, new tokens, concurrency, KV type) and what it measured.

Prefill tok/s = prompt tokens / TTFT. Decode tok/s = (new tokens - 1) / (last token - first token).
Aggregate tok/s = all new tokens / wall time from the first request to the last token.
"""

from __future__ import annotations

import resource
import statistics
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class BenchRow:
    engine: str
    cache_type: str
    prompt_len: int
    concurrency: int
    ttft_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    aggregate_tok_s: float
    peak_rss_bytes: int
    kv_bytes: int
    cached_prompt_tokens: int = 0
    gen: int = 0
    repeats: int = 1
    spread: float = 0.0  # (max - min) / median of the decode tok/s over the repeats
    bandwidth_bytes_s: float = 0.0  # memory read bandwidth measured right after each of our runs (roofline)
    # where it ran: the CPU, the kernels' instruction-set path (llama.cpp: its build's features), threads,
    # flags
    cpu: str = ""
    isa: str = ""
    threads: int = 0
    build_flags: str = ""
    # against our row of another KV type, same workload: medians of the per-round ratios (cli/bench.py)
    kv_baseline: str = ""
    kv_ratio_prefill: float = 0.0
    kv_ratio_decode: float = 0.0
    kv_ratio_aggregate: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def reset_peak_rss() -> None:
    """Start a row's peak at the current resident memory (Linux: "5" to /proc/self/clear_refs resets
    VmHWM), so a row does not carry an earlier row's peak, nor the bandwidth probe's 512 MiB."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """Peak resident memory since reset_peak_rss (VmHWM); where that cannot be read, the process's
    peak so far (getrusage; Linux reports KiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def median_row(rows: list[BenchRow]) -> BenchRow:
    """Each numeric field's median over repeats of one workload; ``spread`` says how much decode moved."""
    first = rows[0]
    out = BenchRow(**first.as_dict())
    for name in ("ttft_ms", "prefill_tok_s", "decode_tok_s", "itl_p50_ms", "itl_p99_ms", "aggregate_tok_s",
                 "bandwidth_bytes_s"):
        setattr(out, name, statistics.median(getattr(r, name) for r in rows))
    out.peak_rss_bytes = max(r.peak_rss_bytes for r in rows)
    out.repeats = len(rows)
    decode = [r.decode_tok_s for r in rows]
    out.spread = (max(decode) - min(decode)) / out.decode_tok_s if out.decode_tok_s else 0.0
    return out


def measured_bandwidth(num_bytes: int = 512 << 20) -> float:
    """Memory read bandwidth in bytes/s: the best of a few sums over an array larger than any cache, a
    slice per kernel thread summed at once (numpy's sum lets go of the GIL), as the kernels read weights."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from kvserve import native

    x = np.ones(num_bytes // 4, dtype=np.float32)
    slices = np.array_split(x, max(1, native.num_threads()))
    best = float("inf")
    with ThreadPoolExecutor(len(slices)) as pool:
        for _ in range(5):
            start = time.perf_counter()
            list(pool.map(np.sum, slices))
            best = min(best, time.perf_counter() - start)
    return num_bytes / best
