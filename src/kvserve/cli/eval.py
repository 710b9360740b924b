"""``kvserve eval [MODEL] --cache-types f16,q8_0,q4_0,tq4,tq3``: what each KV cache type costs in quality."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from kvserve.models.registry import DEFAULT_MODEL


def add_parser(sub, name: str) -> None:
    p = sub.add_parser("eval", help="measure the quality cost of KV cache types on your model")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--cache-types", default="f16,q8_0,fp8,q4_0,tq4,tq3,tq2",
                   help="comma-separated types; K/V pairs as K/V, e.g. q8_0/tq3 (default: %(default)s)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: Python's pydoc topics)")
    p.add_argument("--ctx", type=int, default=2048, help="tokens of text, teacher-forced (default 2048)")
    p.add_argument("--windows", type=int, default=1,
                   help="consecutive windows of --ctx tokens, each from an empty cache, scores pooled "
                        "(less noise in top-1 at the same context; default 1)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk size (default 256)")
    p.add_argument("--needle-lengths", default="512,1024",
                   help="context lengths of the needle-in-a-haystack trials (3 depths each, the whole "
                        "text as filler, the served weights); 'none' to skip")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT",
                   help="write the rows as JSON to OUT")
    p.add_argument("--compare", choices=["llama.cpp"], default=None,
                   help="also measure llama.cpp's KV types (those in --cache-types it has) with its own "
                        "llama-perplexity --kl-divergence (built by `make llama-cpp`) on the same GGUF file "
                        "and tokens; both sides then score the second half of each window, as llama.cpp does")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: all cores)")
    p.add_argument("--device", default="auto")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvserve.models.loader import load_model
    from kvserve.quality.evaluate import evaluate, parse_type_pairs
    from kvserve.quality.needle import Needle
    from kvserve.quality.text import load_text, token_windows

    pairs = parse_type_pairs(args.cache_types)
    asked = frozenset(pairs)
    if ("f32", "f32") not in pairs:
        pairs.insert(0, ("f32", "f32"))
    ours = _ours(pairs, args.compare is not None)
    if args.ctx < 32:
        raise ValueError("--ctx must be at least 32 tokens")
    if args.windows < 1:
        raise ValueError("--windows must be at least 1")
    lengths = [] if args.needle_lengths == "none" else [int(x) for x in args.needle_lengths.split(",") if x]
    text = load_text(args.text)
    console = Console(stderr=True)
    with console.status(f"loading {args.model}"):
        loaded = load_model(args.model, args.device, auto_pull=True)
    if loaded.tokenizer is None:
        raise ValueError("this model has no tokenizer; kvserve eval needs one")
    peer = _llama_perplexity(args, Path(loaded.path)) if args.compare else None
    needle = None
    if lengths:
        with console.status(f"loading {args.model} with its served weights for the needle trials"):
            served = load_model(args.model, args.device, weight_format="auto")
        needle = Needle(served, served.tokenizer.encode(text, add_special=False), lengths,
                        frozenset(p for p in asked if p in ours))

    def show(r) -> None:  # as each row ends: a 32K needle run is most of an hour a pair
        found = "" if r.needle is None else f", needle {r.needle:.2f}"
        console.print(f"  {'llama.cpp ' if r.engine != 'kvserve' else ''}{r.cache_type_k}/{r.cache_type_v}: "
                      f"KLD {r.kld:.5f}{found}")

    with tempfile.TemporaryDirectory(prefix="kvserve-eval-") as work:
        if peer is not None:
            token_ids = peer.reference_tokens(loaded.tokenizer, text, args.ctx, args.windows, Path(work))
        else:
            token_ids = token_windows(loaded.tokenizer, text, args.ctx, args.windows)
        console.print(f"teacher-forcing {args.windows} x {args.ctx} tokens per cache type; "
                      f"needle lengths {lengths or 'skipped'}")
        rows = evaluate(loaded, token_ids, ours, args.chunk, needle, on_row=show, windows=args.windows,
                         score_from=args.ctx // 2 if peer is not None else 0)
        if peer is not None:
            rows += peer.rows(pairs, Path(work), args.ctx, on_row=show)
    Console().print(_table(rows, loaded.path.name, args.windows, peer is not None))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([r.as_dict() for r in rows], f, indent=2)
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


def _ours(pairs: list[tuple[str, str]], compare: bool) -> list[tuple[str, str]]:
    """The pairs kvserve runs: with --compare llama.cpp, types only llama.cpp has (q4_1, q5_0, iq4_nl ...)
    are its rows alone; a name neither knows is an error."""
    from kvserve.kv.cache_types import KV_TYPES
    from kvserve.quality.llama_cpp import GGML_KV_BITS

    if not compare:
        return pairs
    for k, v in pairs:
        for name in (k, v):
            if name not in KV_TYPES and name not in GGML_KV_BITS:
                raise ValueError(f"unknown KV cache type {name!r}: neither kvserve nor llama.cpp has it")
    return [(k, v) for k, v in pairs if k in KV_TYPES and v in KV_TYPES]


def _llama_perplexity(args: argparse.Namespace, path: Path):
    from kvserve.benchmark.peers import llama_tools_dir
    from kvserve.quality.llama_cpp import LlamaPerplexity

    folder = llama_tools_dir(("llama-perplexity",))
    if folder is None:
        raise ValueError("--compare llama.cpp needs llama.cpp's llama-perplexity: build it with "
                         "`make llama-cpp` (or point KVSERVE_LLAMA_CPP_BIN at a folder that has it)")
    if (args.ctx - 1 - args.ctx // 2) * args.windows < 100:
        raise ValueError("llama-perplexity prints no statistics under 100 scored positions: "
                         "raise --ctx or --windows (it scores the second half of each window)")
    if path.suffix != ".gguf":
        raise ValueError(f"--compare llama.cpp needs a GGUF file; {args.model} is not one")
    return LlamaPerplexity(folder, path, args.threads or os.cpu_count() or 1)


def _table(rows, name: str, windows: int, compare: bool):
    from rich.table import Table

    by_window = ["top-1 % by window"] if windows > 1 else []
    engine = ["engine"] if compare else []
    scored = " (second half of each window scored, as llama.cpp does)" if compare else ""
    table = Table(*engine, "K", "V", "bits/elem", "KLD", "top-1 %", *by_window, "PPL", "ΔPPL", "needle",
                  title=f"KV cache quality: {name}{scored}")
    for r in rows:
        windows_cell = [" ".join(f"{t:.1f}" for t in r.top1_by_window) if r.top1_by_window else "-"]
        table.add_row(*([r.engine] if compare else []), r.cache_type_k, r.cache_type_v,
                      f"{r.bits_per_element:.2f}", f"{r.kld:.5f}", f"{r.top1_agreement:.2f}",
                      *(windows_cell if windows > 1 else []), f"{r.ppl:.3f}", f"{r.delta_ppl:+.3f}",
                      "-" if r.needle is None else f"{r.needle:.2f}")
    return table
