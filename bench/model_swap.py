"""Several models within a memory budget: a server whose ``--max-memory`` holds its first model and one of
two others (as ``kvserve plan`` counts them) answers requests that alternate between those two, each
answer evicting the least recently used (the idle first model too) and loading the other; the server's
resident size is sampled throughout.

    .venv/bin/python bench/model_swap.py [--first smollm2] [--pair gemma3-270m,qwen2.5-coder-0.5b] [--rounds
    6]

Reports each request's time (a load's included), whether each succeeded, and the peak RSS (VmHWM) against
the budget. Linux only (/proc). A benchmark, not a test: the figures are this machine's.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from types import SimpleNamespace

import httpx
from local_server import local_server  # bench/ is the script's folder: on sys.path


def planned(model: str, ctx: int, seqs: int, with_runtime: bool) -> int:
    from kvserve.cli.serve import planned_bytes

    args = SimpleNamespace(cache_type="f16", cache_type_k=None, cache_type_v=None, num_ctx=ctx,
                           max_num_seqs=seqs, max_num_batched_tokens=512, block_size=16, weights="auto",
                           no_window_kv=False)
    return planned_bytes(args, model, with_runtime)


def rss(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--first", default="smollm2")
    p.add_argument("--pair", default="gemma3-270m,qwen2.5-coder-0.5b")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--ctx", type=int, default=512)
    args = p.parse_args()
    pair = args.pair.split(",")
    seqs = 2
    budget = planned(args.first, args.ctx, seqs, True) + max(planned(m, args.ctx, seqs, False) for m in pair)
    budget = int(budget * 1.02)  # room for one of the pair, not both
    os.environ["OMP_NUM_THREADS"] = "2"
    flags = ["-c", str(args.ctx), "--max-num-seqs", str(seqs), "--max-memory", str(budget), "--log-level",
             "warning"]
    with local_server([args.first, *pair], *flags) as (url, pid):
        peak, done = [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss(pid, "VmRSS"))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        print(f"budget {budget / 2**20:.0f} MiB (first {args.first}, then one of {', '.join(pair)})")
        failures = 0
        for i in range(args.rounds):
            model = pair[i % 2]
            started = time.perf_counter()
            r = httpx.post(f"{url}/api/chat", timeout=600, json={
                "model": model, "stream": False, "options": {"num_predict": 8},
                "messages": [{"role": "user", "content": "Name a colour."}]})
            took = time.perf_counter() - started
            loaded = [m["model"] for m in httpx.get(f"{url}/api/ps").json()["models"]]
            failures += r.status_code != 200
            print(f"{model:<22} {r.status_code} {took:6.2f} s   loaded: {', '.join(loaded)}")
        done.set()
        sampler.join()
        hwm = rss(pid, "VmHWM")
        print(
            f"failures {failures}; peak RSS sampled {peak[0] / 2**20:.0f} MiB, VmHWM {hwm / 2**20:.0f} MiB, "
              f"budget {budget / 2**20:.0f} MiB: {hwm / budget:.3f} of it")


if __name__ == "__main__":
    main()
