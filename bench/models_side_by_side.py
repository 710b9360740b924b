"""Two busy models behind one server: each loaded model has its own engine thread, so two models answering
at once share the CPU as two processes would. This measures what that costs: the same streams to model A
alone, to B alone, then to both at once, each answer ``--tokens`` long (greedy, ignore_eos).

    .venv/bin/python bench/models_side_by_side.py [--models smollm2,gemma3-270m] [--streams 4] [--tokens 64]

Reports each phase's generated tokens per second, per model and in all. A benchmark, not a test: the
figures are this machine's.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from local_server import local_server  # bench/ is the script's folder: on sys.path


def ask(url: str, model: str, tokens: int, i: int) -> int:
    body = {"model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def phase(url: str, models: list[str], streams: int, tokens: int) -> dict[str, float]:
    """Generated tokens per second of each model, ``streams`` requests to each of ``models`` at once."""
    jobs = [(m, i) for m in models for i in range(streams)]
    started = time.perf_counter()
    finished: dict[str, float] = {}
    counts: dict[str, int] = dict.fromkeys(models, 0)
    lock = threading.Lock()

    def run(job):
        model, i = job
        n = ask(url, model, tokens, i)
        with lock:
            counts[model] += n
            finished[model] = time.perf_counter()

    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(run, jobs))
    wall = time.perf_counter() - started
    rates = {m: counts[m] / (finished[m] - started) for m in models}
    rates["all"] = sum(counts.values()) / wall
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,gemma3-270m")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    a, b = args.models.split(",")
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    with local_server([a, b], "-c", "512", "--max-num-seqs", str(args.streams), "--log-level",
                      "warning") as (url, _):
        for model in (a, b):  # both loaded and warm
            ask(url, model, 4, 0)
        for repeat in range(args.repeats):
            for models in ([a], [b], [a, b]):
                rates = phase(url, models, args.streams, args.tokens)
                print(f"repeat {repeat}  {'+'.join(models):28s} " + "  ".join(f"{m} {r:7.1f} tok/s"
                                                                         for m, r in rates.items()),
                                                                         flush=True)


if __name__ == "__main__":
    main()
