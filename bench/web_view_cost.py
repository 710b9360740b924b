"""What the web page's live pool view costs the engine (a benchmark, not a test).

    .venv/bin/python bench/web_view_cost.py [--model smollm2] [--streams 16] [--max-tokens 64] [--pairs 12]

1. Through a server (its own, on a free loopback port; f16 KV, 16 sequences of 512 tokens): decode
   throughput of ``--streams`` concurrent streaming chat requests (``ignore_eos``, so each is exactly
   ``--max-tokens`` long) without and with a ``/v1/kvserve/cache/stream`` subscriber reading every frame,
   in alternating runs (A B, then B A, ...). Decode throughput = the sum over streams of (tokens - 1) /
   (last token - first token). Reported: each run, the medians and the median of the pairs' ratios.
   Before that, the server's own CPU time (Linux /proc) while idle, with and without a subscriber: what
   sampling, encoding and sending the frames cost in all.
2. In-process, the same engine with ``--streams`` requests decoding: how long one frame holds the engine
   lock (``PoolView.frame``, median of 200) against a decode step (median of 20), and the share of the
   time that four frames a second hold it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
from pathlib import Path

import httpx
from local_server import local_server

TOPICS = ["the sea", "a mountain", "a library", "a robot", "the moon", "a garden", "a train", "a city"]


async def one_stream(client: httpx.AsyncClient, i: int, max_tokens: int) -> float:
    """This stream's decode rate, tokens per second."""
    body = {"model": "smollm2", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "messages": [{"role": "user",
                          "content": f"Stream {i}: write a story about {TOPICS[i % len(TOPICS)]}."}]}
    first = last = None
    count = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                last = time.perf_counter()
                first = first or last
                count += 1
    return (count - 1) / (last - first)


async def watch(url: str, stop: asyncio.Event) -> int:
    frames = 0
    async with httpx.AsyncClient(base_url=url, timeout=None) as c, c.stream(
        "GET", "/v1/kvserve/cache/stream") as r:
        async for line in r.aiter_lines():
            frames += line.startswith("data: ")
            if stop.is_set():
                return frames
    return frames


async def run(url: str, streams: int, max_tokens: int, with_view: bool) -> tuple[float, int]:
    """(decode tok/s summed over the streams, frames the subscriber read)."""
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(watch(url, stop)) if with_view else None
    if watcher is not None:
        await asyncio.sleep(0.5)  # subscribed before the streams start
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        rates = await asyncio.gather(*(one_stream(client, i, max_tokens) for i in range(streams)))
    frames = 0
    if watcher is not None:
        stop.set()
        frames = await watcher
    return sum(rates), frames


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def idle_cpu(url: str, pid: int, with_view: bool, seconds: float) -> float:
    """Server CPU seconds per second while no request runs."""
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(watch(url, stop)) if with_view else None
    await asyncio.sleep(1)
    start, used = time.perf_counter(), cpu_seconds(pid)
    await asyncio.sleep(seconds)
    rate = (cpu_seconds(pid) - used) / (time.perf_counter() - start)
    if watcher is not None:
        stop.set()
        await watcher
    return rate


def through_server(args: argparse.Namespace) -> None:
    flags = ("-c", "512", "--max-num-seqs", str(args.streams), "--cache-type", "f16")
    with local_server(args.model, *flags) as (url, pid):
        asyncio.run(run(url, args.streams, 16, False))  # warm-up: kernels built, prompts cached
        idle = {False: [], True: []}
        for view in (False, True, False, True):
            idle[view].append(asyncio.run(idle_cpu(url, pid, view, 10)))
        without, with_view = statistics.median(idle[False]), statistics.median(idle[True])
        print(
            f"idle server CPU: {without * 1e3:.1f} ms/s without a subscriber, {with_view * 1e3:.1f} ms/s "
            f"with one: "
              f"the view costs {(with_view - without) * 1e3:.1f} ms of CPU a second", flush=True)
        without, with_view, ratios = [], [], []
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            result = {}
            for view in order:
                rate, frames = asyncio.run(run(url, args.streams, args.max_tokens, view))
                result[view] = rate
                print(f"pair {pair + 1}: {'with' if view else 'without'} view {rate:7.1f} tok/s"
                      + (f" ({frames} frames)" if view else ""), flush=True)
            without.append(result[False])
            with_view.append(result[True])
            ratios.append(result[True] / result[False])
    print(f"decode tok/s at {args.streams} streams, median of {args.pairs}: without view "
          f"{statistics.median(without):.1f}, with view {statistics.median(with_view):.1f}; "
          f"with / without: median {statistics.median(ratios):.4f} (pairs "
          f"{min(ratios):.3f}-{max(ratios):.3f})")


class TimedLock:
    """The engine lock, recording how long each hold lasts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: list[float] = []

    def __enter__(self) -> None:
        self.lock.acquire()
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.held.append(time.perf_counter() - self.start)
        self.lock.release()


def in_process(args: argparse.Namespace) -> None:
    from types import SimpleNamespace

    from kvserve.cli.main import build_parser
    from kvserve.cli.options import engine_config
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.sampling_params import SamplingParams
    from kvserve.server.web.pool_view import PoolView

    flags = ["serve", args.model, "-c", "512", "--max-num-seqs", str(args.streams), "--cache-type", "f16"]
    engine = LLMEngine.from_config(engine_config(build_parser().parse_args(flags)), auto_pull=True)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"Stream {i}: write a story about {TOPICS[i % len(TOPICS)]}.", params)
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    lock = TimedLock()
    view = PoolView(SimpleNamespace(engine=engine, lock=lock, num_pending_adds=0, dead_error=None), "m")

    def median_time(fn, n: int) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    step = median_time(engine.step, 20)
    lock.held.clear()
    whole = median_time(lambda: view.frame().encode(), 200)
    held = statistics.median(lock.held)
    print(f"in-process, {args.streams} requests decoding, {engine.kv.num_blocks} blocks: decode step "
          f"{step * 1e3:.1f} ms; a frame holds the engine lock {held * 1e6:.0f} us ({whole * 1e6:.0f} us "
          f"with "
          f"the rest, outside the lock); 4 frames/s hold it {4 * held * 100:.3f}% of the time")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pairs", type=int, default=12)
    args = p.parse_args()
    through_server(args)
    in_process(args)


if __name__ == "__main__":
    main()
