"""``kvserve eval [MODEL] --cache-types f16,q8_0,q4_0,tq4,tq3``: what each KV cache type costs in quality."""

from __future__ import annotations

import argparse
import json
import sys

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
                   help="context lengths of the needle-in-a-haystack trials; 'none' to skip")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT",
                   help="write the rows as JSON to OUT")
    p.add_argument("--device", default="auto")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvserve.models.loader import load_model
    from kvserve.quality.evaluate import evaluate, parse_type_pairs
    from kvserve.quality.text import load_text

    pairs = parse_type_pairs(args.cache_types)
    if ("f32", "f32") not in pairs:
        pairs.insert(0, ("f32", "f32"))
    if args.ctx < 32:
        raise ValueError("--ctx must be at least 32 tokens")
    lengths = [] if args.needle_lengths == "none" else [int(x) for x in args.needle_lengths.split(",") if x]
    text = load_text(args.text)
    console = Console(stderr=True)
    with console.status(f"loading {args.model}"):
        loaded = load_model(args.model, args.device, auto_pull=True)
    if loaded.tokenizer is None:
        raise ValueError("this model has no tokenizer; kvserve eval needs one")
    if args.windows < 1:
        raise ValueError("--windows must be at least 1")
    want = args.ctx * args.windows
    token_ids = loaded.tokenizer.encode(text)[:want]
    if len(token_ids) < want:
        raise ValueError(f"the text has only {len(token_ids)} tokens; lower --ctx or --windows, "
                         "or give a longer --text")
    console.print(f"teacher-forcing {args.windows} x {args.ctx} tokens per cache type; "
                  f"needle lengths {lengths or 'skipped'}")
    rows = evaluate(loaded, token_ids, pairs, args.chunk, lengths,
                    on_row=lambda r: console.print(f"  {r.cache_type_k}/{r.cache_type_v}: KLD {r.kld:.5f}"),
                    windows=args.windows)
    by_window = ["top-1 % by window"] if args.windows > 1 else []
    table = Table("K", "V", "bits/elem", "KLD", "top-1 %", *by_window, "PPL", "ΔPPL", "needle",
                  title=f"KV cache quality: {loaded.path.name}")
    for r in rows:
        table.add_row(r.cache_type_k, r.cache_type_v, f"{r.bits_per_element:.2f}", f"{r.kld:.5f}",
                      f"{r.top1_agreement:.2f}",
                      *([" ".join(f"{t:.1f}" for t in r.top1_by_window)] if args.windows > 1 else []),
                      f"{r.ppl:.3f}", f"{r.delta_ppl:+.3f}",
                      "-" if r.needle is None else f"{r.needle:.2f}")
    Console().print(table)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([r.as_dict() for r in rows], f, indent=2)
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0
