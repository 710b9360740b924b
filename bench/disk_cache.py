"""The prefix cache's disk tier, measured through real ``kvserve serve`` processes on loopback.

    .venv/bin/python bench/disk_cache.py [--model smollm2] [--cache-types f16,q8_0] [--json out.json]

1. Restart: a 4,096-token prompt is answered by a fresh server (cold: the whole prompt computed),
   the server is stopped (SIGTERM) and started again on the same ``--kv-disk-cache`` directory, and
   the same prompt is sent again. Reported: both TTFTs (request sent -> first token, client side) and
   their ratio, per KV type.
2. Cycle: a server whose RAM pool holds about one 2K-token prefix (``--kv-cache-memory``) is sent 8
   distinct 2K-token prefixes (each with its own short question) twice over. Reported: of the second
   cycle's prompt tokens, the share found in the cache and the share loaded from disk (the server's
   ``/metrics``), and the second cycle's TTFTs.
3. Overhead: decode tok/s of 16 streams in one engine (in this process) with the disk tier on (every
   full block written through) and off, in alternating runs; reported: the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from decode_rate import decode_rate
from local_server import local_server


class Client:
    def __init__(self, url: str) -> None:
        self.url = url
        self.model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]

    def complete(self, prompt: list[int]) -> tuple[float, int]:
        """(TTFT seconds, cached prompt tokens) of a one-token streamed completion."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        ttft, cached = None, 0
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return ttft, cached

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0


@contextmanager
def serving(model: str, args: list[str]) -> Iterator[Client]:
    """A ``kvserve serve`` process, stopped with SIGTERM at the end (its disk tier flushed, as a user's
    server's is)."""
    with local_server(model, *args) as (url, _):
        yield Client(url)


def prompt_tokens(seed: int, n: int, vocab: int = 40000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def restart(model: str, cache_type: str, workdir: str) -> dict:
    disk = tempfile.mkdtemp(dir=workdir)
    args = ["-c", "4224", "--max-num-seqs", "1", "--cache-type", cache_type, "--kv-disk-cache", disk]
    prompt = prompt_tokens(1, 4096)
    with serving(model, args) as server:
        cold, cached_cold = server.complete(prompt)
    with serving(model, args) as server:  # the restart
        warm, cached_warm = server.complete(prompt)
        disk_hits = server.metric("kvserve_prefix_cache_disk_hits_total")
    return {"bench": "restart", "cache_type": cache_type, "prompt_tokens": len(prompt), "ttft_cold_s": cold,
            "ttft_after_restart_s": warm, "ratio": warm / cold, "cached_cold": cached_cold,
            "cached_after_restart": cached_warm, "disk_hit_tokens": disk_hits}


def cycle(model: str, cache_type: str, workdir: str, num_prefixes: int = 8, prefix_len: int = 2048) -> dict:
    disk = tempfile.mkdtemp(dir=workdir)
    bytes_per_token = {"f16": 23040, "q8_0": 12240, "f32": 46080}.get(cache_type, 23040)  # SmolLM2
    pool = int(1.25 * (prefix_len + 64) * bytes_per_token)  # about one prefix
    args = ["-c", str(prefix_len + 128), "--max-num-seqs", "1", "--cache-type", cache_type,
            "--kv-cache-memory", str(pool), "--kv-disk-cache", disk]
    prefixes = [prompt_tokens(100 + i, prefix_len) for i in range(num_prefixes)]
    with serving(model, args) as server:
        for i, p in enumerate(prefixes):  # the first cycle computes them
            server.complete(p + prompt_tokens(1000 + i, 16))
        queries0 = server.metric("kvserve_prefix_cache_queries_total")
        hits0 = server.metric("kvserve_prefix_cache_hits_total")
        disk0 = server.metric("kvserve_prefix_cache_disk_hits_total")
        ttfts = []
        for i, p in enumerate(prefixes):
            ttft, _ = server.complete(p + prompt_tokens(2000 + i, 16))
            ttfts.append(ttft)
        queries = server.metric("kvserve_prefix_cache_queries_total") - queries0
        hits = server.metric("kvserve_prefix_cache_hits_total") - hits0
        disk_hits = server.metric("kvserve_prefix_cache_disk_hits_total") - disk0
    return {"bench": "cycle", "cache_type": cache_type, "prefixes": num_prefixes, "prefix_tokens": prefix_len,
            "pool_bytes": pool, "second_cycle_prompt_tokens": queries, "hit_share": hits / queries,
            "disk_share": disk_hits / queries, "ttft_median_s": statistics.median(ttfts)}


def overhead(model: str, cache_type: str, workdir: str, runs: int = 3) -> dict:
    from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.sampling_params import SamplingParams
    from kvserve.models.loader import load_model

    loaded = load_model(model, weight_format="auto")
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)

    def rate_with(disk: str | None) -> float:
        cache = CacheConfig(num_ctx=512, cache_type_k=cache_type, disk_cache_dir=disk)
        engine = LLMEngine(EngineConfig(model, cache, SchedulerConfig(max_num_seqs=16)), loaded)
        for s in range(16):
            engine.add_request(prompt_tokens(3000 + s, 64), params)
        rate, _ = decode_rate(engine)
        engine.close()
        return rate

    off, on = [], []
    for _ in range(runs):
        off.append(rate_with(None))
        on.append(rate_with(tempfile.mkdtemp(dir=workdir)))
    return {"bench": "overhead", "cache_type": cache_type, "streams": 16, "decode_tok_s_off": off,
            "decode_tok_s_on": on, "ratio": statistics.median(on) / statistics.median(off)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--cache-types", default="f16,q8_0")
    p.add_argument("--only", choices=["restart", "cycle", "overhead"], default=None)
    p.add_argument("--json", default=None, help="write the rows to this file too")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for cache_type in args.cache_types.split(","):
            if args.only in (None, "restart"):
                rows.append(restart(args.model, cache_type, workdir))
                print(json.dumps(rows[-1]), flush=True)
            if args.only in (None, "cycle"):
                rows.append(cycle(args.model, cache_type, workdir))
                print(json.dumps(rows[-1]), flush=True)
            if args.only in (None, "overhead"):
                rows.append(overhead(args.model, cache_type, workdir))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
