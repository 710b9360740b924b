"""Flags shared by the commands that build an engine, mapped 1:1 onto ``EngineConfig``."""

from __future__ import annotations

import argparse
import sys

from kvserve.config import WEIGHT_CHOICES, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from kvserve.kv.cache_types import KV_TYPES
from kvserve.models.registry import DEFAULT_MODEL

CACHE_TYPES = (*KV_TYPES, "auto")


def parse_bytes(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (use e.g. 512MiB, 2GiB or a byte count)"
        ) from None


def add_engine_args(p: argparse.ArgumentParser, max_num_seqs: int) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("-c", "--num-ctx", type=int, default=4096, help="context length per sequence (tokens)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="size the KV pool by bytes instead of --num-ctx x --max-num-seqs (e.g. 1GiB), "
                        "or 'auto': that pool if this machine's free memory holds it, else as much as fits")
    g.add_argument("--cache-type", default="f16", choices=CACHE_TYPES,
                   help="KV cache type of K and V (f16); 'auto' picks the best measured type that fits")
    g.add_argument("-ctk", "--cache-type-k", default=None, choices=CACHE_TYPES, help="KV cache type of K")
    g.add_argument("-ctv", "--cache-type-v", default=None, choices=CACHE_TYPES, help="KV cache type of V")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    g.add_argument("--no-window-kv", action="store_true",
                   help="sliding-window layers keep every token like the others (default: only their window, "
                        "in a pool of their own)")
    g.add_argument("--kv-disk-cache", nargs="?", const="default", default=None, metavar="DIR",
                   help="keep every full KV block on disk too, so prefixes survive eviction and restarts "
                        "(default DIR: ~/.cache/kvserve/kv-blocks)")
    g.add_argument("--kv-disk-cache-size", type=parse_bytes, default=8 << 30, metavar="SIZE",
                   help="bytes the disk cache may hold; least recently used blocks go first (8GiB)")
    g.add_argument("--prompt-cache", default=None, metavar="FILE",
                   help="load a prompt cache (kvserve cache save) into the prefix cache at start")
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="requests run at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    g.add_argument("--max-waiting", type=int, default=256, help="waiting requests; more are refused")
    g.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                   help="weight format of the matrix multiplies: q4 (4-bit GGUF tensors kept 4-bit, exact "
                        "activations: KLD 1e-6 vs f32 on SmolLM2), q4-fast (int8 activations as llama.cpp's: "
                        "faster batches and prefill, KLD 0.002), int8, bf16, f32 (the exact reference); "
                        "auto = q4 for a GGUF on CPU, else f32")
    g.add_argument("--context-overflow", default=None, choices=["error", "shift"],
                   help="a conversation that outgrows --num-ctx: 'shift' keeps the first --num-keep tokens "
                        "and "
                        "drops the older half of the rest (kvserve run's chat), 'error' ends it (the default "
                        "elsewhere)")
    g.add_argument("--num-keep", type=int, default=4, help="tokens a context shift keeps at the start (4)")
    g.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="speculative decoding: 'ngram' proposes the tokens that followed the context's last "
                        "tokens where they occurred before (prompt lookup); 'draft' the guesses of "
                        "--draft-model; "
                        "the same output, faster where the guesses are often right")
    g.add_argument("--draft-model", default=None,
                   help="a smaller model with the same tokenizer whose greedy guesses are verified "
                        "(implies --speculative draft)")
    g.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="drafts verified per step at most (4)")
    g.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest n-gram matched (2)")
    g.add_argument("--prompt-lookup-max", type=int, default=4, help="longest n-gram matched (4)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    g.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: torch's choice)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    for name in ("num_ctx", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.kv_disk_cache_size == "auto" or args.kv_disk_cache_size < 1:
        raise ValueError("--kv-disk-cache-size must be a positive size, e.g. 20GiB")
    disk_dir = args.kv_disk_cache
    if disk_dir == "default":
        from kvserve.kv.disk_tier import default_cache_dir

        disk_dir = str(default_cache_dir())
    cache_type_k = args.cache_type_k or args.cache_type
    cache_type_v = args.cache_type_v or args.cache_type
    kv_cache_memory = args.kv_cache_memory
    if "auto" in (cache_type_k, cache_type_v) or kv_cache_memory == "auto":
        from kvserve.plan.auto import resolve_auto

        auto = resolve_auto(args.model or DEFAULT_MODEL, args.num_ctx, args.max_num_seqs, args.block_size,
                            args.max_num_batched_tokens, "float32", cache_type_k, cache_type_v,
                            kv_cache_memory, not args.no_window_kv)
        cache_type_k, cache_type_v, kv_cache_memory = (
            auto.cache_type_k,
            auto.cache_type_v,
            auto.kv_cache_memory,
        )
        print(auto.message, file=sys.stderr)
    return EngineConfig(
        model=args.model or DEFAULT_MODEL,
        cache=CacheConfig(
            block_size=args.block_size,
            num_ctx=args.num_ctx,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=not args.no_prefix_caching,
            cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
            disk_cache_dir=disk_dir,
            disk_cache_size=args.kv_disk_cache_size,
            window_kv=not args.no_window_kv,
        ),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_waiting=args.max_waiting,
                                  context_overflow=args.context_overflow or "error", num_keep=args.num_keep),
        speculative=SpeculativeConfig(args.speculative or ("draft" if args.draft_model else None),
                                      args.num_speculative_tokens, args.prompt_lookup_min,
                                      args.prompt_lookup_max, args.draft_model),
        device=args.device,
        weights=args.weights,
        num_threads=args.threads,
    )


def load_engine(args: argparse.Namespace):
    """Build the engine with a progress bar on stderr while the weights load, then load
    ``--prompt-cache``."""
    engine = _build_engine(args)
    if args.prompt_cache:
        from kvserve.kv.prompt_cache import load_prompt_cache

        tokens, _ = load_prompt_cache(engine.cache, args.prompt_cache)
        print(f"prompt cache {args.prompt_cache}: {tokens} tokens in the prefix cache", file=sys.stderr)
    return engine


def _build_engine(args: argparse.Namespace):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvserve.engine.engine import LLMEngine

    config = engine_config(args)
    if not sys.stderr.isatty():
        return LLMEngine.from_config(config, auto_pull=True)
    with Progress(TextColumn("loading {task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), transient=True,
                  console=_stderr_console()) as progress:
        task = progress.add_task(config.model, total=None)

        def on_tensor(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        return LLMEngine.from_config(config, progress=on_tensor, auto_pull=True)


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)
