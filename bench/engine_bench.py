"""Engine measurements for the closing notes: load time, one stream, 16 streams vs one by one, and a
shared 1,000-token prefix served from the prefix cache. Ratios are taken within one run.

    .venv/bin/python bench/engine_bench.py [--model smollm2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.models.loader import load_model


def engine_for(loaded, max_num_seqs: int, num_ctx: int, cache_type: str = "f16") -> LLMEngine:
    config = EngineConfig(model=str(loaded.path), cache=CacheConfig(num_ctx=num_ctx, cache_type_k=cache_type),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
    return LLMEngine(config, loaded)


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    ids = [engine.add_request(p, params).request_id for p in prompts]
    final = engine.run_to_completion()
    return time.perf_counter() - start, [final[i] for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--gen", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    rng = random.Random(0)
    text_ids = loaded.tokenizer.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 400))
    params = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    report: dict = {"model": args.model, "load_seconds": round(loaded.load_seconds, 2),
                    "threads": args.threads}

    one = engine_for(loaded, 1, 1024)
    run_all(one, [text_ids[:128]], params)  # warm-up
    one.kv.reset_prefix_cache()  # measure a cold prompt, not a prefix-cache hit
    _, [single] = run_all(one, [text_ids[:128]], params)
    m = single.metrics
    report["single_128"] = {"ttft_ms": round(m.ttft * 1e3, 1), "prefill_tok_s": round(m.prefill_tok_s, 1),
                            "decode_tok_s": round(m.decode_tok_s, 2),
                            "itl_p50_ms": round(statistics.median(m.itls) * 1e3, 2)}

    prompts = [text_ids[o : o + 64] for o in (rng.randrange(0, 2000) for _ in range(args.streams))]
    one.kv.reset_prefix_cache()
    t_seq = sum(run_all(one, [p], params)[0] for p in prompts)
    many = engine_for(loaded, args.streams, 512)
    t_conc, outs = run_all(many, prompts, params)
    total = sum(len(o.token_ids) for o in outs)
    report["concurrency"] = {"streams": args.streams, "tokens": total,
                             "one_by_one_tok_s": round(total / t_seq, 2),
                             "concurrent_tok_s": round(total / t_conc, 2), "ratio": round(t_seq / t_conc, 2)}

    prefix = [rng.randrange(100, 40000) for _ in range(1000)]
    shared = engine_for(loaded, 2, 1100)
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    _, [cold] = run_all(shared, [prefix + [11, 12]], short)
    _, [hot] = run_all(shared, [prefix + [21, 22, 23]], short)
    report["shared_prefix_1000"] = {"cold_ttft_ms": round(cold.metrics.ttft * 1e3, 1),
                                    "warm_ttft_ms": round(hot.metrics.ttft * 1e3, 1),
                                    "warm_cached_tokens": hot.metrics.num_cached_tokens,
                                    "warm_over_cold": round(hot.metrics.ttft / cold.metrics.ttft, 3)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
