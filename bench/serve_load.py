"""Load test for a running ``kvserve serve``: N concurrent streaming chat clients on loopback.

    .venv/bin/kvserve serve smollm2 --port 8000 &
    .venv/bin/python bench/serve_load.py --clients 32 --max-tokens 64

Every client sends its requests one after another over /v1/chat/completions with ``stream: true``
and ``ignore_eos`` (so each answer is exactly ``--max-tokens`` long). Reported: TTFT (request sent ->
first content chunk, as the client sees it: queueing included) at p50/p99, inter-chunk latency,
aggregate generated tokens per second over the whole run, and errors. The run is bounded by
``--clients x --requests`` requests and by ``--time-limit`` seconds; only loopback URLs are accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
TOPICS = ["the sea", "a mountain", "a library", "a robot", "the moon", "a garden", "a train", "a city"]


@dataclass
class Result:
    ttft: float | None = None
    chunk_gaps: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str | None = None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def one_request(client: httpx.AsyncClient, body: dict) -> Result:
    result = Result()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return result
                if chunk.get("usage"):
                    result.num_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.chunk_gaps.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def client_loop(client: httpx.AsyncClient, index: int, args: argparse.Namespace) -> list[Result]:
    results = []
    for n in range(args.requests):
        topic = TOPICS[(index + n) % len(TOPICS)]
        body = {
            "model": args.model,
            "messages": [
                {"role": "user", "content": f"Client {index}, request {n}: write a story about {topic}."}
            ],
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        results.append(await one_request(client, body))
    return results


async def wait_ready(client: httpx.AsyncClient, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"no healthy server at {client.base_url} after {seconds:.0f} s")
        await asyncio.sleep(0.5)


async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4)
    timeout = httpx.Timeout(args.time_limit)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        await wait_ready(client, args.wait)
        before = await client.get("/metrics")
        start = time.perf_counter()
        tasks = [client_loop(client, i, args) for i in range(args.clients)]
        per_client = await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.time_limit)
        wall = time.perf_counter() - start
        after = await client.get("/metrics")
    results = [r for rs in per_client for r in rs]
    return summarize(results, wall, args, _preemptions(after.text) - _preemptions(before.text))


def _preemptions(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("kvserve_num_preemptions_total "):
            return float(line.split()[1])
    return 0.0


def summarize(results: list[Result], wall: float, args: argparse.Namespace, preemptions: float) -> dict:
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttfts = [r.ttft for r in ok]
    gaps = [g for r in ok for g in r.chunk_gaps]
    tokens = sum(r.num_tokens for r in ok)
    return {
        "clients": args.clients,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:3],
        "max_tokens": args.max_tokens,
        "generated_tokens": tokens,
        "wall_s": round(wall, 2),
        "aggregate_tok_s": round(tokens / wall, 1) if wall > 0 else None,
        "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1) if ttfts else None,
        "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1) if ttfts else None,
        "ttft_max_ms": round(1000 * max(ttfts), 1) if ttfts else None,
        "chunk_gap_p50_ms": round(1000 * statistics.median(gaps), 1) if gaps else None,
        "chunk_gap_p99_ms": round(1000 * percentile(gaps, 99), 1) if gaps else None,
        "preemptions": preemptions,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--time-limit", type=float, default=600, help="give up after this many seconds")
    p.add_argument("--wait", type=float, default=120, help="seconds to wait for the server to be healthy")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if urlparse(args.url).hostname not in LOOPBACK:
        p.error("--url must be a loopback address (127.0.0.1, localhost, ::1)")
    if not (1 <= args.clients <= 256 and 1 <= args.requests <= 100 and 1 <= args.max_tokens <= 4096):
        p.error("keep it bounded: 1-256 clients, 1-100 requests each, 1-4096 max tokens")
    summary = asyncio.run(run(args))
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:>18}: {value}")
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
