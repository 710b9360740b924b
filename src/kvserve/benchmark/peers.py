"""Peers run on the same workload: llama.cpp's own tools where ``bench/build_llama_cpp.sh`` built them
(``LlamaToolsRunner``), else llama.cpp through llama-cpp-python (``pip install .[peers]``, one stream).

Flash attention on; KV types f16 / q8_0 / q4_0 map onto its ggml types.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import time
from itertools import pairwise
from pathlib import Path

from kvserve.benchmark.measure import BenchRow, peak_rss_bytes, percentile, reset_peak_rss

GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type ids, as llama.cpp's type_k / type_v take them


def ggml_pair(cache_type: str) -> tuple[str, str] | None:
    """(K, V) of a KV type or "K/V" pair that llama.cpp has, or None."""
    k, _, v = cache_type.partition("/")
    v = v or k
    return (k, v) if k in GGML_TYPES and v in GGML_TYPES else None


class LlamaCppRunner:
    name = "llama.cpp"

    def __init__(self, model_path: str, threads: int) -> None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise ValueError(
                "--compare llama.cpp needs llama-cpp-python: pip install '.[peers]' "
                "(it compiles llama.cpp: about 15 minutes on 2 cores)"
            ) from None
        self.model_path = model_path
        self.threads = threads
        self._llm = None
        self._key = None

    def build(self) -> tuple[str, str]:
        """The instruction sets llama.cpp's build uses (its system info), and how it was built."""
        import llama_cpp

        info = llama_cpp.llama_print_system_info().decode(errors="replace")
        features = sorted({part.split("=")[0].split(":")[-1].strip() for part in info.split("|")
                           if part.strip().endswith("= 1")})
        return ",".join(features) or info.strip(), f"llama-cpp-python {llama_cpp.__version__}"

    def supports(self, cache_type: str, concurrency: int) -> bool:
        return ggml_pair(cache_type) is not None and concurrency == 1

    def _model(self, n_ctx: int, cache_type: str):
        from llama_cpp import Llama

        key = (n_ctx, cache_type)
        if self._key != key:
            self._llm = None  # free the old context first
            k, v = ggml_pair(cache_type)
            self._llm = Llama(model_path=self.model_path, n_ctx=n_ctx, n_threads=self.threads,
                              n_threads_batch=self.threads, n_batch=512, flash_attn=True,
                              type_k=GGML_TYPES[k], type_v=GGML_TYPES[v], verbose=False)
            self._key = key
        return self._llm

    def run(self, prompts: list[list[int]], gen: int, cache_type: str, shared_prefix=None) -> BenchRow:
        prompt = prompts[0]
        reset_peak_rss()
        llm = self._model(max(512, len(prompt) + gen + 16), cache_type)
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = llm.sample(temp=0.0)
        times = [time.perf_counter()]
        for _ in range(gen - 1):
            llm.eval([token])
            token = llm.sample(temp=0.0)
            times.append(time.perf_counter())
        ttft = times[0] - start
        itls = [b - a for a, b in pairwise(times)]
        decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        return BenchRow(self.name, cache_type, len(prompt), 1, ttft * 1e3, len(prompt) / ttft, decode,
                        percentile(itls, 0.5) * 1e3, percentile(itls, 0.99) * 1e3, gen / (times[-1] - start),
                        peak_rss_bytes(), 0, 0, gen)


LLAMA_TOOLS = ("llama-bench", "llama-batched-bench")


def llama_tools_dir(tools: tuple[str, ...] = LLAMA_TOOLS) -> Path | None:
    """Where llama.cpp's ``tools`` (by default llama-bench and llama-batched-bench) are:
    $KVSERVE_LLAMA_CPP_BIN where it is set (and nowhere else), else the build/llama.cpp/bin that
    bench/build_llama_cpp.sh writes (from the working directory or the checkout)."""
    chosen = os.environ.get("KVSERVE_LLAMA_CPP_BIN", "")
    candidates = [chosen] if chosen else [Path.cwd() / "build/llama.cpp/bin",
                                          Path(__file__).resolve().parents[3] / "build/llama.cpp/bin"]
    for folder in candidates:
        if folder and all((Path(folder) / tool).is_file() for tool in tools):
            return Path(folder)
    return None


class LlamaToolsRunner:
    """llama.cpp measured by its own tools, as its users quote it: prefill is ``llama-bench -p N`` (pp),
    decode ``llama-bench -n G -d N`` (tg with N tokens of context already in the cache), C streams
    ``llama-batched-bench -npp N -ntg G -npl C`` (C sequences decoded together: its aggregate rate, not
    one stream's). TTFT is N / pp; peak RSS the tool's."""

    name = "llama.cpp"

    def __init__(self, model_path: str, threads: int, folder: Path) -> None:
        self.model_path, self.threads, self.folder = model_path, threads, folder

    def build(self) -> tuple[str, str]:
        """Its version, and the instruction-set options its cmake cache records (bench/build_llama_cpp.sh
        keeps the cache beside bin/)."""
        out = subprocess.run([str(self.folder / "llama-bench"), "--version"], capture_output=True, text=True,
                             check=False)
        version = (out.stdout + out.stderr).strip().splitlines()
        cache = self.folder.parent / "cmake" / "CMakeCache.txt"
        options = re.findall(r"^(GGML_(?:NATIVE|AVX\w*|FMA|F16C)):BOOL=ON$", cache.read_text(),
                             re.MULTILINE) if cache.is_file() else []
        isa = ",".join(options) or "unknown"
        return isa, f"llama-bench {version[0] if version else ''} ({isa})"

    def supports(self, cache_type: str, concurrency: int) -> bool:
        return ggml_pair(cache_type) is not None

    def _tool(self, tool: str, *args: str) -> str:
        out = subprocess.run([str(self.folder / tool), "-m", self.model_path, "-t", str(self.threads), *args],
                             capture_output=True, text=True, timeout=3600, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{tool} failed: {out.stderr.strip().splitlines()[-1:]}")
        return out.stdout

    def _bench(self, cache_type: str, *args: str) -> float:
        """avg tokens/s of one llama-bench test."""
        k, v = ggml_pair(cache_type)
        out = self._tool("llama-bench", "-fa", "1", "-ctk", k, "-ctv", v, "-r", "1", "-o", "json", *args)
        return float(json.loads(out)[0]["avg_ts"])

    def run(self, prompts: list[list[int]], gen: int, cache_type: str, shared_prefix=None) -> BenchRow:
        n, streams = len(prompts[0]), len(prompts)
        if streams == 1:
            prefill = self._bench(cache_type, "-p", str(n), "-n", "0")
            decode = self._bench(cache_type, "-p", "0", "-n", str(gen), "-d", str(n))
            ttft = n / prefill
            aggregate, itl = gen / (ttft + gen / decode), 1 / decode
        else:
            k, v = ggml_pair(cache_type)
            out = self._tool("llama-batched-bench", "-fa", "on", "-ctk", k, "-ctv", v,
                             "-c", str(streams * (n + gen) + 64), "-b", "2048", "-ub", "512", "-npp", str(n),
                             "-ntg", str(gen), "-npl", str(streams), "--output-format", "jsonl")
            result = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
            prefill, ttft = result["speed_pp"], result["t_pp"]
            decode = result["speed_tg"] / streams  # one stream's share of the batch
            aggregate, itl = streams * gen / result["t"], 1 / decode
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest tool run so far
        return BenchRow(self.name, cache_type, n, streams, ttft * 1e3, prefill, decode, itl * 1e3, itl * 1e3,
                        aggregate, rss, 0, 0, gen)
