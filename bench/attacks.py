"""How a server holds up under hostile requests: while each attack runs, `/health` is polled every 20 ms
and one ordinary streamed chat runs; reported per attack: `/health` p50 / p99 / max latency, the longest
gap between the stream's chunks, and the attack's statuses.

    .venv/bin/python bench/attacks.py [--model smollm2] [--port 8790] [--soak 200]

``--soak N`` then sends N multi-MB requests (3 MB tool descriptions, 1 MB messages tokenized and refused,
2 MB JSON answers refused) and prints the server's resident size before and after (Linux).

A benchmark, not a test (the targets: `/health` p99 < 200 ms, stream gap < 300 ms): the figures are the
machine's as much as ours.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import subprocess
import sys
import threading
import time

import httpx

ASK = [{"role": "user", "content": "Hi"}]


def attacks() -> dict[str, list[tuple[str, dict]]]:
    big_tool = [{"name": "f", "description": "x " * 1_500_000, "input_schema": {"type": "object"}}]
    enum = {"type": "object", "properties": {"v": {"enum": [f"value{i}" for i in range(100_000)]}}}
    self_ref = {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}
    return {
        "3 MB Anthropic tool description": [("/v1/messages", {"model": "m", "max_tokens": 4, "messages": ASK,
                                                              "tools": big_tool})],
        "8 x 3 MB tool descriptions at once": [("/v1/messages",
                                                {"model": "m", "max_tokens": 4, "messages": ASK,
                                                                 "tools": big_tool})] * 8,
        "'word ' x 780,000 chat message": [("/v1/chat/completions",
                                            {"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": "word " * 780_000}]})],
        "1 MB message (tokenized, then refused)": [("/v1/chat/completions",
                                                    {"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": "lorem ipsum dolor " * 58_000}]})],
        "100k-value enum schema": [("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": ASK,
                                                             "response_format": {
                                                                 "type": "json_schema", "json_schema": {
                                                                 "name": "e", "schema": enum}}})],
        "self-referencing required schema": [("/api/chat", {"model": "m", "messages": ASK, "format": self_ref,
                                                             "stream": False})],
    }


class Watch:
    """/health latencies and the longest gap of a stream, while ``running``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.health: list[float] = []
        self.gap = 0.0
        self.running = True

    def poll(self) -> None:
        with httpx.Client(timeout=30) as c:
            while self.running:
                t = time.perf_counter()
                c.get(f"{self.url}/health")
                self.health.append(time.perf_counter() - t)
                time.sleep(0.02)

    def stream(self) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "Count from one to a hundred."}],
                "max_tokens": 4000, "stream": True, "temperature": 0}
        with httpx.Client(timeout=60) as c:
            while self.running:
                with c.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                    last = time.perf_counter()
                    for _ in r.iter_lines():
                        now = time.perf_counter()
                        self.gap = max(self.gap, now - last)
                        last = now
                        if not self.running:
                            break


def run(url: str, requests: list[tuple[str, dict]]) -> dict:
    watch = Watch(url)
    threads = [threading.Thread(target=watch.poll), threading.Thread(target=watch.stream)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the stream is decoding
    watch.gap = 0.0
    watch.health.clear()
    with cf.ThreadPoolExecutor(len(requests)) as pool, httpx.Client(timeout=300) as c:
        statuses = list(pool.map(lambda r: c.post(url + r[0], json=r[1]).status_code, requests))
    time.sleep(0.3)
    watch.running = False
    for t in threads:
        t.join()
    h = sorted(watch.health)
    return {"statuses": sorted(set(statuses)), "health_p50_ms": round(1000 * statistics.median(h), 1),
            "health_p99_ms": round(1000 * h[int(0.99 * (len(h) - 1))], 1),
            "health_max_ms": round(1000 * h[-1], 1), "stream_gap_ms": round(1000 * watch.gap, 1)}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def soak(url: str, pid: int, n: int) -> dict:
    kinds = [requests[0] for name, requests in attacks().items() if "8 x" not in name]
    with httpx.Client(timeout=300) as c:
        for path, body in kinds:  # each kind once: the heap's working set
            c.post(url + path, json=body)
        before = rss_mib(pid)
        statuses = set()
        for i in range(n):
            path, body = kinds[i % len(kinds)]
            statuses.add(c.post(url + path, json=body).status_code)
        time.sleep(0.5)
        after = rss_mib(pid)
    return {"soak_requests": n, "statuses": sorted(statuses), "rss_before_mib": round(before, 1),
            "rss_after_mib": round(after, 1), "growth": round(after / before - 1, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--soak", type=int, default=0, help="then N multi-MB requests, RSS before and after")
    args = p.parse_args()
    server = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", args.model, "--port", str(args.port),
                               "--served-model-name", "m", "--no-access-log"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        for name, requests in attacks().items():
            print(json.dumps({"attack": name, **run(url, requests)}), flush=True)
        if args.soak:
            print(json.dumps(soak(url, server.pid, args.soak)), flush=True)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
