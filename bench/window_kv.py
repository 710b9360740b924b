"""Gemma 3's sliding layers keeping only their window, at a long context: the KV bytes the pool holds
against the windowed formula, and greedy output against an engine whose every layer keeps every token.

One sequence (f32 KV, one-call decode) reads a prompt of ``--prompt`` tokens (the package's own source
files, as text) and generates ``--generate`` tokens greedily, so it ends at prompt + generate tokens
of context. Reported for the windowed engine: the bytes its requests hold in both pools at the end,
the pool it allocated, and the formula's bytes:

    global layers x context + sliding layers x (window + one block), x bytes per token per layer

then the same run with ``window_kv=False`` and whether the two generations are the same tokens.

    .venv/bin/python bench/window_kv.py [--prompt 24576] [--generate 8192] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvserve
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.cache_types import kv_bytes_per_token_per_layer
from kvserve.models.loader import load_model


def source_text(num_tokens: int, tokenizer) -> list[int]:
    files = sorted(Path(kvserve.__file__).parent.rglob("*.py"))
    ids: list[int] = []
    for path in files:
        ids += tokenizer.encode(f"# {path.name}\n{path.read_text()}\n")
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise SystemExit(f"the package's sources hold {len(ids)} tokens, fewer than {num_tokens}")


def run(loaded, prompt: list[int], generate: int, window_kv: bool) -> dict:
    bs = 16
    ctx = len(prompt) + generate
    config = EngineConfig(model=str(loaded.path),
                          cache=CacheConfig(bs, ctx, None, True, "f32", window_kv=window_kv),
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512))
    engine = LLMEngine(config, loaded)
    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=generate, ignore_eos=True))
    start = time.perf_counter()
    held = {}
    while engine.has_unfinished_requests():
        engine.step()
        if not request.is_finished:  # what it holds after its last step before it ends (and frees all)
            held = {
                "full_blocks": len(engine.kv.block_ids(request.request_id)),
                "window_blocks": sum(1 for table in engine.kv.kv_group_block_ids(request.request_id)[1:]
                                     for b in table if b),
                "computed": request.num_computed_tokens,
            }
    storage = engine.storage
    held_bytes = held["full_blocks"] * storage.kv_group_bytes_per_block(0) + (
        held["window_blocks"] * storage.kv_group_bytes_per_block(1) if storage.windowed else 0)
    return {"window_kv": window_kv, "seconds": round(time.perf_counter() - start, 1),
            "tokens": request.output_token_ids, "held_bytes": held_bytes, "pool_bytes": storage.nbytes,
            **held, "window_pool_blocks": storage.kv_group_blocks[1] if storage.windowed else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=24576)
    p.add_argument("--generate", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("gemma3-270m", weight_format="q4")
    cfg = loaded.config
    prompt = source_text(args.prompt, loaded.tokenizer)
    ctx = len(prompt) + args.generate
    sliding = sum(1 for i in range(cfg.num_layers) if cfg.is_sliding(i))
    per_layer_token = kv_bytes_per_token_per_layer(cfg, "f32")
    windowed = run(loaded, prompt, args.generate, True)
    at = windowed["computed"]  # the context the held blocks were counted at
    formula = per_layer_token * ((cfg.num_layers - sliding) * at + sliding * (cfg.sliding_window + 16))
    full = run(loaded, prompt, args.generate, False)
    report = {
        "context": ctx, "counted_at": at, "formula_bytes": formula,
        "held_bytes": windowed["held_bytes"], "held_over_formula": round(windowed["held_bytes"] / formula, 4),
        "pool_bytes": windowed["pool_bytes"], "pool_over_formula": round(windowed["pool_bytes"] / formula, 4),
        "every_token_pool_bytes": full["pool_bytes"],
        "window_pool_blocks": windowed["window_pool_blocks"], "window_blocks_held": windowed["window_blocks"],
        "full_blocks_held": windowed["full_blocks"],
        "generated": len(windowed["tokens"]), "same_tokens": windowed["tokens"] == full["tokens"],
        "first_difference": next(
            (i for i, (a, b) in enumerate(zip(windowed["tokens"], full["tokens"], strict=False)) if a != b),
            None),
        "seconds": {"windowed": windowed["seconds"], "every_token": full["seconds"]},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
