"""The bench table (with ratios against peers and the bandwidth roofline) and its plots."""

from __future__ import annotations

import sys

from kvserve.benchmark.measure import BenchRow
from kvserve.kv.cache_types import kv_bytes_per_token


def roofline(loaded, rows: list[BenchRow]) -> dict[int, tuple[int, float]]:
    """For each of our rows (by index): bytes read per decoded token and the fraction of the bandwidth
    roofline reached, against the bandwidth measured right after the row's runs (this machine's moves
    by up to 2x within an hour). A step reads every weight once for all streams, plus each stream's
    KV so far."""
    config = loaded.config
    weight_bytes = step_weight_bytes(loaded.model)
    out = {}
    for i, r in enumerate(rows):
        if not is_ours(r):
            continue
        context = r.prompt_len + r.gen // 2
        per_token = weight_bytes / r.concurrency + context * kv_bytes_per_token(config, r.cache_type)
        rate = r.aggregate_tok_s if r.concurrency > 1 else r.decode_tok_s
        if r.bandwidth_bytes_s > 0:
            out[i] = (int(per_token), per_token * rate / r.bandwidth_bytes_s)
    return out


def is_ours(row: BenchRow) -> bool:
    """kvserve's rows: "kvserve", or "kvserve <weights>" for a weight format other than the CPU default."""
    return row.engine.split()[0] == "kvserve"


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every projection and the output head, as the model
    holds them (f32, bf16, int8 or 4-bit: see models.linear)."""
    layers = sum(lin.nbytes for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up,
                                                                  layer.down))
    return layers + model.lm_head.nbytes


def aggregate_ratio(ours: BenchRow, peer: BenchRow) -> str:
    """Our N streams against the peer's as many (llama-batched-bench) or, where it ran one, its one stream,
    both measured alike (all new tokens / wall time from the first request to the last token, prefill
    included), and against the peer's decode alone."""
    if peer.concurrency == ours.concurrency:
        ratio = ours.aggregate_tok_s / peer.aggregate_tok_s
        return f"aggregate {ratio:.2f}x llama.cpp's {peer.concurrency} streams"
    return (f"aggregate {ours.aggregate_tok_s / peer.aggregate_tok_s:.2f}x llama.cpp's 1 stream "
            f"(its decode alone: {ours.aggregate_tok_s / peer.decode_tok_s:.2f}x)")


def bandwidth_range(rows: list[BenchRow]) -> str:
    measured = [r.bandwidth_bytes_s / 1e9 for r in rows if r.bandwidth_bytes_s > 0]
    return f"{min(measured):.1f}-{max(measured):.1f} GB/s" if measured else "not measured"


def where_it_ran(rows: list[BenchRow]) -> str:
    """The CPU, each engine's instruction-set path, the thread count: "AMD EPYC, kvserve avx2, ..."."""
    if not rows:
        return "no rows"
    paths = dict.fromkeys(f"{r.engine} {r.isa}" for r in rows if r.isa)
    return f"{rows[0].cpu}, {'; '.join(paths)}, {rows[0].threads} threads"


def kv_ratio(r: BenchRow) -> str:
    """Our row against our row of the first KV type benched (paired per round: cli/bench.py)."""
    if not r.kv_baseline:
        return ""
    return (f"{r.kv_ratio_prefill:.2f}x, {r.kv_ratio_decode:.2f}x, {r.kv_ratio_aggregate:.2f}x "
            f"{r.kv_baseline}")


def print_table(rows: list[BenchRow], roof: dict[int, tuple[int, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("engine", "KV", "prompt", "conc", "TTFT ms", "prefill tok/s", "decode tok/s",
                  "ITL p50/p99 ms", "aggr tok/s", "spread", "roofline", "vs llama.cpp (prefill, decode)",
                  "vs KV (prefill, decode, aggr)",
                  title=f"kvserve bench on {where_it_ran(rows)} (memory bandwidth beside our rows: "
                        f"{bandwidth_range(rows)})")
    peers = {(r.cache_type, r.prompt_len, r.concurrency): r for r in rows if r.engine == "llama.cpp"}
    for i, r in enumerate(rows):
        peer = peers.get((r.cache_type, r.prompt_len, 1)) if is_ours(r) and r.concurrency == 1 else None
        ratio = (f"{r.prefill_tok_s / peer.prefill_tok_s:.2f}x, {r.decode_tok_s / peer.decode_tok_s:.2f}x"
                 if peer else "")
        if is_ours(r) and r.concurrency > 1:
            alike = peers.get((r.cache_type, r.prompt_len, r.concurrency)) or peers.get(
                (r.cache_type, r.prompt_len, 1))
            ratio = aggregate_ratio(r, alike) if alike else ""
        roof_text = f"{roof[i][1] * 100:.0f}% ({roof[i][0] / 2**20:.0f} MiB/tok)" if i in roof else ""
        table.add_row(r.engine, r.cache_type, str(r.prompt_len), str(r.concurrency), f"{r.ttft_ms:.0f}",
                      f"{r.prefill_tok_s:.1f}", f"{r.decode_tok_s:.2f}",
                      f"{r.itl_p50_ms:.1f}/{r.itl_p99_ms:.1f}", f"{r.aggregate_tok_s:.1f}",
                      f"{r.spread * 100:.0f}%", roof_text, ratio, kv_ratio(r))
    Console(width=None if sys.stdout.isatty() else 200).print(table)  # files and pipes get every column


def write_plot(rows: list[BenchRow], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[tuple[str, str], list[BenchRow]] = {}
    for r in rows:
        if r.concurrency == 1:
            series.setdefault((r.engine, r.cache_type), []).append(r)
    for (engine, kv), rs in sorted(series.items()):
        rs.sort(key=lambda r: r.prompt_len)
        x = [r.prompt_len for r in rs]
        ax1.plot(x, [r.decode_tok_s for r in rs], marker="o", label=f"{engine} {kv}")
        ax2.plot(x, [r.ttft_ms for r in rs], marker="o", label=f"{engine} {kv}")
    ax1.set(xlabel="context (prompt tokens)", ylabel="decode tok/s", title="Decode speed vs context",
            xscale="log")
    ax2.set(xlabel="prompt tokens", ylabel="TTFT ms", title="Time to first token", xscale="log", yscale="log")
    lens = sorted({r.prompt_len for rs in series.values() for r in rs})
    for ax in (ax1, ax2):
        ax.minorticks_off()
        ax.set_xticks(lens, [str(n) for n in lens])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
