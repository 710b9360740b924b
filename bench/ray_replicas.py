"""Engine replicas under Ray Serve: what a second replica and prefix-affinity routing are worth.

    .venv/bin/python bench/ray_replicas.py --duration 60 --json ray_replicas.json

For each setup (1 replica routed by prefix, 2 by prefix, 2 at random) it starts a local Ray instance
(HTTP on 127.0.0.1), sends every document once (untimed, all at once, routed as the setup routes),
runs ``--streams`` streaming chat clients for ``--duration`` seconds and stops Ray. Every replica has one
thread and the same KV pool (``--pool``), so two replicas have twice the compute and twice the cache. Each
request is one of ``--prefixes`` long documents (shared by many requests, as a RAG corpus or long system
prompts are) plus its own question; which document is random per request, the same sequence for every setup.
Reported per setup: aggregate generated tokens per second, the share of prompt tokens served from the prefix
cache, TTFT p50 / p90.

The pool holds about half the documents: routed by prefix, each replica keeps its half; routed at
random, each replica sees every document and evicts what the other half pushes out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import socket
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass

import httpx

WORDS = [
    "river",
    "stone",
    "garden",
    "window",
    "paper",
    "light",
    "signal",
    "harbor",
    "orange",
    "violet",
    "winter",
    "engine",
    "copper",
    "meadow",
    "lantern",
    "cloud",
    "silver",
    "forest",
    "bridge",
    "quiet",
]


@dataclass
class Outcome:
    setup: str
    num_replicas: int
    policy: str
    num_requests: int
    num_errors: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    cached_share: float  # prompt tokens found in the prefix cache / prompt tokens
    ttft_p50_s: float
    ttft_p90_s: float


def document(i: int, num_words: int) -> str:
    rng = random.Random(i)
    return f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(num_words))


async def one_request(
    client: httpx.AsyncClient, content: str, max_tokens: int
) -> tuple[float | None, int, int, int]:
    """(TTFT, generated tokens, prompt tokens, cached tokens); TTFT None on an error."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, ttft, usage = time.perf_counter(), None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return None, 0, 0, 0
            if chunk.get("usage"):
                usage = chunk["usage"]
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
    if usage is None:
        return None, 0, 0, 0
    return (
        ttft,
        usage["completion_tokens"],
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
    )


async def load(url: str, args: argparse.Namespace) -> tuple[list, float]:
    docs = [document(i, args.prefix_words) for i in range(args.prefixes)]
    results: list = []

    async def stream(index: int) -> None:
        rng = random.Random(index)  # the same documents in the same order for every setup
        n = 0
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            while time.perf_counter() < deadline:
                content = f"{docs[rng.randrange(len(docs))]}\nClient {index}, question {n}: summarize it."
                try:
                    results.append(await one_request(client, content, args.max_tokens))
                except httpx.HTTPError:
                    results.append((None, 0, 0, 0))
                n += 1

    # every document computed once, untimed
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(one_request(client, f"{doc}\nWarm-up: summarize it.", 1) for doc in docs))
    deadline = time.perf_counter() + args.duration
    start = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(args.streams)))
    return results, time.perf_counter() - start


def run_setup(num_replicas: int, policy: str, args: argparse.Namespace) -> Outcome:
    import ray
    from ray import serve

    from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvserve.server.app import build_app
    from kvserve.server.replicas.ray_serve import build_application
    from kvserve.server.server_config import ServerConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=num_replicas, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = EngineConfig(
            model=args.model,
            cache=CacheConfig(num_ctx=4096, kv_cache_memory=args.pool, cache_type_k="f16"),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs),
            num_threads=1,
        )
        serve.run(
            build_application(engine, ServerConfig("smollm2"), num_replicas, build_app, policy=policy),
            name="kvserve",
            route_prefix="/",
        )
        results, seconds = asyncio.run(load(f"http://127.0.0.1:{port}", args))
    finally:
        serve.shutdown()
        ray.shutdown()
    ok = [r for r in results if r[0] is not None]
    ttfts = sorted(r[0] for r in ok)
    generated = sum(r[1] for r in ok)
    prompt, cached = sum(r[2] for r in ok), sum(r[3] for r in ok)
    return Outcome(
        setup=f"{num_replicas} replica{'s' if num_replicas > 1 else ''}, {policy}",
        num_replicas=num_replicas,
        policy=policy,
        num_requests=len(results),
        num_errors=len(results) - len(ok),
        generated_tokens=generated,
        seconds=round(seconds, 1),
        tokens_per_s=round(generated / seconds, 1),
        cached_share=round(cached / prompt, 3) if prompt else 0.0,
        ttft_p50_s=round(statistics.median(ttfts), 2) if ttfts else float("nan"),
        ttft_p90_s=round(ttfts[int(0.9 * (len(ttfts) - 1))], 2) if ttfts else float("nan"),
    )


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    from kvserve.cli.options import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--setups", default="1:prefix,2:prefix,2:random", help="REPLICAS:POLICY, comma-separated")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prefixes", type=int, default=16, help="distinct documents")
    p.add_argument("--prefix-words", type=int, default=1000, help="words per document (about as many tokens)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests one replica runs at once")
    p.add_argument(
        "--pool",
        type=parse_bytes,
        default=240 << 20,
        help="KV pool per replica (240MiB of f16: ~10.9K SmolLM2 tokens)",
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per setup")
    p.add_argument("--json", default=None, help="write the outcomes here")
    args = p.parse_args()
    outcomes = []
    for setup in args.setups.split(","):
        replicas, policy = setup.split(":")
        outcomes.append(run_setup(int(replicas), policy, args))
        print(outcomes[-1], flush=True)
    cpu = cpu_model()
    print(
        f"\n{args.model}, {args.streams} streams, {args.prefixes} documents of ~{args.prefix_words} tokens, "
        f"{args.max_tokens} tokens each, {args.duration:.0f} s per setup; {cpu}"
    )
    print(
        f"{'setup':<22} {'tok/s':>7} {'cached':>7} {'TTFT p50':>9} {'p90':>6} {'requests':>9} {'errors':>7}"
    )
    for o in outcomes:
        print(
            f"{o.setup:<22} {o.tokens_per_s:>7.1f} {o.cached_share:>7.1%} {o.ttft_p50_s:>8.2f}s "
            f"{o.ttft_p90_s:>5.2f}s "
            f"{o.num_requests:>9} {o.num_errors:>7}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"cpu": cpu, "args": vars(args), "outcomes": [asdict(o) for o in outcomes]}, f, indent=2
            )


if __name__ == "__main__":
    main()
