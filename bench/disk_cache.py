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
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvserve", "serve", *args, "--port", str(self.port), "--no-access-log"]
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(log_path)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, log_path: str) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        else:
            raise RuntimeError("server not healthy after 300 s")
        self.model = httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"]

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

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


def prompt_tokens(seed: int, n: int, vocab: int = 40000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def restart(model: str, cache_type: str, workdir: str, log: str) -> dict:
    disk = tempfile.mkdtemp(dir=workdir)
    args = [model, "-c", "4224", "--max-num-seqs", "1", "--cache-type", cache_type, "--kv-disk-cache", disk]
    prompt = prompt_tokens(1, 4096)
    with Server(args, log) as server:
        cold, cached_cold = server.complete(prompt)
    with Server(args, log) as server:  # the restart
        warm, cached_warm = server.complete(prompt)
        disk_hits = server.metric("kvserve_prefix_cache_disk_hits_total")
    return {"bench": "restart", "cache_type": cache_type, "prompt_tokens": len(prompt), "ttft_cold_s": cold,
            "ttft_after_restart_s": warm, "ratio": warm / cold, "cached_cold": cached_cold,
            "cached_after_restart": cached_warm, "disk_hit_tokens": disk_hits}


def cycle(model: str, cache_type: str, workdir: str, log: str, num_prefixes: int = 8, prefix_len: int = 2048) -> dict:
    disk = tempfile.mkdtemp(dir=workdir)
    bytes_per_token = {"f16": 23040, "q8_0": 12240, "f32": 46080}.get(cache_type, 23040)  # SmolLM2
    pool = int(1.25 * (prefix_len + 64) * bytes_per_token)  # about one prefix
    args = [model, "-c", str(prefix_len + 128), "--max-num-seqs", "1", "--cache-type", cache_type,
            "--kv-cache-memory", str(pool), "--kv-disk-cache", disk]
    prefixes = [prompt_tokens(100 + i, prefix_len) for i in range(num_prefixes)]
    with Server(args, log) as server:
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

    def decode_rate(disk: str | None) -> float:
        cache = CacheConfig(num_ctx=512, cache_type_k=cache_type, disk_cache_dir=disk)
        engine = LLMEngine(EngineConfig(model, cache, SchedulerConfig(max_num_seqs=16)), loaded)
        for s in range(16):
            engine.add_request(prompt_tokens(3000 + s, 64), params)
        while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
            engine.step()  # prompts first: only decode steps are timed
        start, before = time.perf_counter(), engine.num_generated_tokens
        engine.run_to_completion()
        rate = (engine.num_generated_tokens - before) / (time.perf_counter() - start)
        engine.close()
        return rate

    off, on = [], []
    for _ in range(runs):
        off.append(decode_rate(None))
        on.append(decode_rate(tempfile.mkdtemp(dir=workdir)))
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
        log = os.path.join(workdir, "server.log")
        for cache_type in args.cache_types.split(","):
            if args.only in (None, "restart"):
                rows.append(restart(args.model, cache_type, workdir, log))
                print(json.dumps(rows[-1]), flush=True)
            if args.only in (None, "cycle"):
                rows.append(cycle(args.model, cache_type, workdir, log))
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
