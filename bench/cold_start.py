"""Cold start to the first token, and the process's peak RSS, beside llama.cpp's on the same file
(page cache warm: each command runs once untimed first; then the two alternate, medians reported):

    .venv/bin/python bench/cold_start.py [--models smollm2,gemma3-270m,qwen2.5-coder-0.5b] [--runs 3]

ours:      kvserve run MODEL "Hi" -n 1 --temperature 0 --json   (interpreter start, imports, load, answer)
llama.cpp: llama-bench -m FILE -p 0 -n 1 -r 1 --no-warmup       (load, context, one generated token;
           built by bench/build_llama_cpp.sh)
llama-cpp-python: python -c "Llama(FILE)('Hi', max_tokens=1)"    (a Python process, as ours is; where
installed) Peak RSS is the child's (wait4's ru_maxrss); the weights column is the engine's own count of what
it holds (kvserve plan's q4 weights), and "load peak" the load's growth over the bare process
(bench/load_memory.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON_PEER = ("import sys; from llama_cpp import Llama; "
               "Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, verbose=False)('Hi', max_tokens=1)")


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one run of cmd."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed")
    return elapsed, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,gemma3-270m,qwen2.5-coder-0.5b")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from kvserve.benchmark.peers import llama_tools_dir
    from kvserve.models.registry import resolve
    from kvserve.plan.model_spec import held_bytes, resolve_model

    tools = llama_tools_dir()
    kvserve = str(Path(sys.executable).with_name("kvserve"))
    print(
        "| model | file | weights held | ours: first token | llama.cpp | ratio | llama-cpp-python | ratio | "
          "ours: peak RSS | llama.cpp |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        path = resolve(model, auto_pull=True)
        commands = {"ours": [kvserve, "run", model, "Hi", "-n", "1", "--temperature", "0", "--json"]}
        if tools:
            commands["llama.cpp"] = [str(tools / "llama-bench"), "-m", str(path), "-p", "0", "-n", "1", "-r",
                                     "1", "--no-warmup", "-t", "2"]
        if importlib.util.find_spec("llama_cpp"):
            commands["llama-cpp-python"] = [sys.executable, "-c", PYTHON_PEER, str(path)]
        for cmd in commands.values():
            timed(cmd)  # page cache warm
        results = {name: [timed(cmd) for _ in range(args.runs)] for name, cmd in commands.items()}
        secs = {name: statistics.median(r[0] for r in rs) for name, rs in results.items()}
        rss = {name: max(r[1] for r in rs) for name, rs in results.items()}
        held = held_bytes(resolve_model(model).tensors, "q4")
        ours, peer = secs["ours"], secs.get("llama.cpp")
        peer_cells = (f"{peer:.2f} s | {ours / peer:.2f}x" if peer else "- | -")
        py = secs.get("llama-cpp-python")
        peer_cells += f" | {py:.2f} s | {ours / py:.2f}x" if py else " | - | -"
        peer_rss = f"{rss['llama.cpp'] / 2**20:.0f} MiB" if peer else "-"
        print(
            f"| {model} | {path.stat().st_size / 2**20:.0f} MiB | {held / 2**20:.0f} MiB | {ours:.2f} s | "
            f"{peer_cells} | "
              f"{rss['ours'] / 2**20:.0f} MiB | {peer_rss} |")


if __name__ == "__main__":
    main()
