"""Peers run on the same workload: llama.cpp through llama-cpp-python (``pip install .[peers]``).

llama.cpp runs one stream (rows with concurrency > 1 are ours only); greedy decoding; flash attention on;
KV types f16 / q8_0 / q4_0 map onto its ggml types.
"""

from __future__ import annotations

import time
from itertools import pairwise

from kvserve.benchmark.measure import BenchRow, peak_rss_bytes, percentile, reset_peak_rss

GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type ids, as llama.cpp's type_k / type_v take them


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
        return cache_type in GGML_TYPES and concurrency == 1

    def _model(self, n_ctx: int, cache_type: str):
        from llama_cpp import Llama

        key = (n_ctx, cache_type)
        if self._key != key:
            self._llm = None  # free the old context first
            self._llm = Llama(model_path=self.model_path, n_ctx=n_ctx, n_threads=self.threads,
                              n_threads_batch=self.threads, n_batch=512, flash_attn=True,
                              type_k=GGML_TYPES[cache_type], type_v=GGML_TYPES[cache_type], verbose=False)
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
