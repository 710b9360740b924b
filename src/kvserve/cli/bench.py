"""``kvserve bench``: TTFT, prefill and decode speed, ITL, aggregate throughput, memory; with peers
measured in the same run (A B A B ...), and the ratios printed."""

from __future__ import annotations

import argparse
import json
import random
import sys

from kvserve.config import WEIGHT_CHOICES
from kvserve.models.registry import DEFAULT_MODEL


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def add_parser(sub, name: str) -> None:
    p = sub.add_parser("bench", help="measure speed (and compare with peers in the same run)")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--prompt-lens", type=_ints, default=[128, 1024])
    p.add_argument("--gen", type=int, default=64, help="new tokens per request")
    p.add_argument("--cache-types", default="f16",
                   help="KV types to run in turn, e.g. f16,q8_0,q4_0/tq2 (K/V: keys and values apart)")
    p.add_argument("--concurrency", type=_ints, default=[1])
    p.add_argument("--prefix-share", type=int, default=0, help="tokens of a prefix already in the cache")
    p.add_argument("--compare", default="", help="peers to run alongside: llama.cpp")
    p.add_argument("--repeats", type=int, default=3, help="A B pairs per workload; medians are reported")
    p.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT")
    p.add_argument("--plot", default=None, metavar="OUT.png")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvserve import native
    from kvserve.benchmark.bench_report import print_table, roofline, write_plot
    from kvserve.benchmark.engine_runner import KVServeRunner
    from kvserve.benchmark.measure import measured_bandwidth, median_row
    from kvserve.kv.cache_types import kv_pair
    from kvserve.models.loader import load_model

    if args.gen < 2 or args.repeats < 1:
        raise ValueError("--gen must be >= 2 and --repeats >= 1")
    cache_types = [c.strip() for c in args.cache_types.split(",") if c.strip()]
    if not cache_types:
        raise ValueError("--cache-types is empty")
    for name in cache_types:  # a bad name fails before the model loads
        kv_pair(name)
    native.set_num_threads(args.threads)
    peers = _peers(args)
    console = Console(stderr=True)
    loaded = load_model(args.model, auto_pull=True, weight_format=args.weights)
    runners = [KVServeRunner(loaded), *peers]
    where = {r.name: r.build() for r in runners}  # (instruction-set path, build flags) of each engine
    rng = random.Random(0)
    vocab = min(loaded.config.vocab_size, 32000)
    shared = [rng.randrange(100, vocab) for _ in range(args.prefix_share)]
    rows = []
    for plen in args.prompt_lens:
        for conc in args.concurrency:
            prompts = [shared + [rng.randrange(100, vocab) for _ in range(max(1, plen - len(shared)))]
                       for _ in range(conc)]
            units = [(r, t) for t in cache_types for r in runners
                     if getattr(r, "supports", lambda *a: True)(t, conc)]
            results = _alternate(args, runners[0], units, prompts, shared, measured_bandwidth)
            for (name, cache_type), rs in results.items():
                row = median_row(rs)
                row.cpu, row.threads = native.cpu_model(), args.threads
                row.isa, row.build_flags = where[name]
                if name == runners[0].name and cache_type != cache_types[0]:
                    _paired_kv_ratios(row, rs, results[(name, cache_types[0])], cache_types[0])
                rows.append(row)
                console.print(f"{name} {cache_type} prompt {plen} x{conc}: TTFT {row.ttft_ms:.0f} ms, "
                              f"decode {row.decode_tok_s:.1f} tok/s, aggregate {row.aggregate_tok_s:.1f}")
    print_table(rows, roofline(loaded, rows))
    _write_outputs(args, rows, write_plot)
    return 0


def _alternate(args, ours, units: list, prompts: list, shared: list, measured_bandwidth) -> dict[tuple, list]:
    """One workload's rows by (engine, KV type): a warm-up, then ``args.repeats`` rounds of every unit in
    turn (A B C A B C ...), so that engines and KV types share the machine's state and drift; ours also
    measures the roofline's bandwidth."""
    ours.run([prompts[0][:16]], 2, units[0][1])  # warm-up
    results = {(r.name, t): [] for r, t in units}
    for _ in range(args.repeats):
        for r, cache_type in units:
            row = r.run(prompts, args.gen, cache_type, shared or None)
            if r is ours:  # the roofline's bandwidth, measured at the same moment
                row.bandwidth_bytes_s = measured_bandwidth()
            results[(r.name, cache_type)].append(row)
    return results


def _paired_kv_ratios(row, runs: list, baseline: list, baseline_type: str) -> None:
    """Our row of a KV type against our row of the first type asked for, as medians of the ratios of
    the runs of each round (run one after the other): drift over the rounds cancels in each pair."""
    import statistics

    def ratio(field: str) -> float:
        pairs = [getattr(a, field) / getattr(b, field) for a, b in zip(runs, baseline, strict=True)
                 if getattr(b, field) > 0]
        return statistics.median(pairs) if pairs else 0.0

    row.kv_baseline = baseline_type
    row.kv_ratio_prefill, row.kv_ratio_decode, row.kv_ratio_aggregate = (
        ratio("prefill_tok_s"), ratio("decode_tok_s"), ratio("aggregate_tok_s"))


def _write_outputs(args, rows: list, write_plot) -> None:
    """The rows as JSON (``--json``) and as a plot (``--plot``), each where asked for."""
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([r.as_dict() for r in rows], f, indent=2)
        print(f"wrote {args.json_out}", file=sys.stderr)
    if args.plot:
        write_plot(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)


def _peers(args) -> list:
    from kvserve.benchmark.peers import LlamaCppRunner, LlamaToolsRunner, llama_tools_dir
    from kvserve.models.registry import resolve

    peers = []
    for name in [p.strip() for p in args.compare.split(",") if p.strip()]:
        if name != "llama.cpp":
            raise ValueError(f"unknown peer {name!r}; supported: llama.cpp")
        path = resolve(args.model, auto_pull=True)
        if path.is_dir():
            raise ValueError("llama.cpp needs a GGUF file, not an HF folder")
        # llama.cpp's own llama-bench (bench/build_llama_cpp.sh), else llama-cpp-python
        tools = llama_tools_dir()
        peers.append(
            LlamaToolsRunner(str(path), args.threads, tools) if tools else LlamaCppRunner(
                str(path), args.threads))
    return peers
