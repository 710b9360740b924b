"""``kvserve plan MODEL``: weights, KV cache, activations and overhead at each context length, and the
largest context that fits in memory, from the model's header, config or a preset (no weight load)."""

from __future__ import annotations

import argparse
import json
import re

from kvserve.models.registry import DEFAULT_MODEL

DEFAULT_CONTEXTS = (4096, 8192, 32768, 131072)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)b?|b?)\s*$", re.IGNORECASE)
_CTX = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([km]?)\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def add_parser(sub, name: str) -> None:
    from kvserve.plan.presets import PRESETS

    p = sub.add_parser(
        "plan",
        help="plan memory: weights, KV cache per context, largest context that fits",
        description="Plan a model's memory without loading it. MODEL: a .gguf file, a registry name, "
        "an HF folder or config.json, or a preset: " + ", ".join(PRESETS),
    )
    p.add_argument(
        "model", nargs="?", default=DEFAULT_MODEL, help="GGUF file, registry name, HF folder or preset"
    )
    p.add_argument(
        "-c",
        "--ctx",
        "--num-ctx",
        dest="ctx",
        default=None,
        help="context lengths, comma-separated: 8192,32768 or 8k,128k (default: 4k, 8k, 32k, 128k up "
        "to the model's trained context)",
    )
    p.add_argument("-ctk", "--cache-type-k", default=None, help="KV cache type of K (f16)")
    p.add_argument("-ctv", "--cache-type-v", default=None, help="KV cache type of V (f16)")
    p.add_argument("--cache-type", default=None, help="KV cache type of K and V")
    p.add_argument("--cache-types", default=None, help="compare types: 'all' or a list such as f16,q8_0,tq3")
    p.add_argument("--max-num-seqs", type=int, default=1, help="sequences held at once (1)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens computed per step (512)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    p.add_argument("--no-window-kv", action="store_true",
                   help="plan sliding-window layers keeping every token, as the engine's --no-window-kv")
    p.add_argument(
        "--dtype", default="float32", help="compute dtype the engine dequantizes weights to (float32)"
    )
    p.add_argument("--weights", default="auto", choices=["auto", "q4", "q4-fast", "int8", "bf16", "f32"],
                   help="the engine's weight format (auto: q4 for a GGUF, as the engine on a CPU)")
    p.add_argument(
        "--memory", default=None, help="memory to fit in, e.g. 16GiB or 16GB (default: available now)"
    )
    p.add_argument("--attention", default="auto", choices=["auto", "native", "torch"],
                   help="the attention kernels to plan for: auto = the native ones where they build here "
                        "(they read K/V in place), torch = torch's path (gathers K/V, scores per query tile)")
    p.add_argument("--kv-disk-cache-size", default=None,
                   help="plan the prefix cache's disk tier too: tokens a directory of this size holds (e.g. "
                        "20GiB)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(handler=run)


def parse_size(text: str, flag: str = "--memory") -> int:
    """``16GiB`` and ``16G`` are binary (16 x 2^30), ``16GB`` decimal (16 x 10^9), a bare number bytes."""
    m = _SIZE.match(text)
    value = 0
    if m:
        number, unit, binary = float(m.group(1)), (m.group(2) or "").lower(), m.group(3)
        decimal = unit and not binary and text.strip().lower().endswith("b")
        value = int(number * (1000 if decimal else 1024) ** _POWERS.get(unit, 0))
    if value < 1:
        raise ValueError(f"{flag}: not a size: {text!r} (use e.g. 16GiB, 16GB, 512MiB or a byte count)")
    return value


def parse_contexts(text: str) -> tuple[int, ...]:
    """``8192,32768`` or ``8k,128k`` (k = 1024 tokens): sorted, without repeats."""
    out = set()
    for part in text.split(","):
        m = _CTX.match(part)
        value = int(float(m.group(1)) * 1024 ** {"k": 1, "m": 2}.get(m.group(2).lower(), 0)) if m else 0
        if value < 1:
            raise ValueError(
                f"--ctx: {part.strip()!r} is not a context length (use e.g. 8192,32768 or 8k,128k)"
            )
        out.add(value)
    return tuple(sorted(out))


def kv_type_pairs(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    from kvserve.kv.cache_types import KV_TYPES, kv_type

    if args.cache_types is not None:
        if args.cache_type_k or args.cache_type_v or args.cache_type:
            raise ValueError("--cache-types plans K and V of the same type; drop --cache-type(-k/-v)")
        names = (
            list(KV_TYPES)
            if args.cache_types.strip() == "all"
            else [n.strip() for n in args.cache_types.split(",") if n.strip()]
        )
        if not names:
            raise ValueError("--cache-types: give 'all' or a list such as f16,q8_0")
        return tuple(dict.fromkeys((kv_type(n).name,) * 2 for n in names))
    k = args.cache_type_k or args.cache_type or "f16"
    v = args.cache_type_v or args.cache_type or "f16"
    return ((kv_type(k).name, kv_type(v).name),)


def default_contexts(max_position_embeddings: int) -> tuple[int, ...]:
    return tuple(
        sorted({c for c in DEFAULT_CONTEXTS if c < max_position_embeddings} | {max_position_embeddings})
    )


def run(args: argparse.Namespace) -> int:
    from kvserve.plan.model_spec import resolve_model
    from kvserve.plan.plan_report import render, to_json
    from kvserve.plan.planner import PlanSettings, available_memory, make_plan

    pairs = kv_type_pairs(args)  # check every flag before reading the model
    contexts = parse_contexts(args.ctx) if args.ctx is not None else None
    memory, memory_source = (parse_size(args.memory), "--memory") if args.memory else available_memory()
    spec = resolve_model(args.model)
    settings = PlanSettings(
        contexts=contexts or default_contexts(spec.config.max_position_embeddings),
        kv_types=pairs,
        memory=memory,
        memory_source=memory_source,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        dtype=args.dtype,
        weights=args.weights,
        window_kv=not args.no_window_kv,
        attention=args.attention,
        disk_cache_bytes=parse_size(args.kv_disk_cache_size,
                                    "--kv-disk-cache-size") if args.kv_disk_cache_size else None,
    )
    plan = make_plan(spec, settings)
    if args.json:
        print(json.dumps(to_json(plan), indent=2))
    else:
        from rich.console import Console

        render(plan, Console())
    return 0
