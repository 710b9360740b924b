"""The workload through kvserve's own engine."""

from __future__ import annotations

import time

from kvserve import native
from kvserve.benchmark.measure import BenchRow, peak_rss_bytes, percentile, reset_peak_rss
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.kv.cache_types import kv_pair
from kvserve.models.linear import CPU_GGUF_FORMAT


class KVServeRunner:
    def __init__(self, loaded) -> None:
        self.loaded = loaded
        weights = loaded.model.weight_format
        # "kvserve" for the default (what auto chose, or q4 named): the format then shows in the build column
        self.name = "kvserve" if loaded.weights_why or weights == CPU_GGUF_FORMAT else f"kvserve {weights}"

    def build(self) -> tuple[str, str]:
        """The C kernels' instruction-set path, and the compiler flags with the weight format (and why
        ``auto`` chose it); "torch" where the kernels are off."""
        path = native.kernel_path()
        choice = native.choices().get("int4_matmul")
        isa = None if choice is None or choice.isa == "native" else choice.isa
        flags = "" if path == "torch" else " ".join(native.build_flags("int4_matmul", isa))
        if choice is not None and choice.how == "prebuilt":
            flags = f"prebuilt: {flags}"
        why = f" ({self.loaded.weights_why})" if self.loaded.weights_why else ""
        return path, f"{flags}; weights {self.loaded.model.weight_format}{why}"

    def run(self, prompts: list[list[int]], gen: int, cache_type: str,
            shared_prefix: list[int] | None = None) -> BenchRow:
        num_ctx = max(len(p) for p in prompts) + gen + 16
        k, v = kv_pair(cache_type)  # "q4_0/tq2": K and V apart
        reset_peak_rss()
        engine = LLMEngine(
            EngineConfig(model=str(self.loaded.path),
                         cache=CacheConfig(num_ctx=num_ctx, cache_type_k=k, cache_type_v=v),
                         scheduler=SchedulerConfig(max_num_seqs=len(prompts))),
            self.loaded,
        )
        params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
        if shared_prefix:  # a first request puts the shared prefix into the prefix cache
            engine.add_request(shared_prefix + [prompts[0][-1]], SamplingParams(temperature=0, max_tokens=1))
            engine.run_to_completion()
        start = time.perf_counter()
        ids = [engine.add_request(p, params).request_id for p in prompts]
        final = engine.run_to_completion()
        wall = time.perf_counter() - start
        outs = [final[i] for i in ids]
        m = outs[0].metrics
        itls = [x for o in outs for x in o.metrics.itls]
        return BenchRow(
            engine=self.name,
            cache_type=cache_type,
            prompt_len=len(prompts[0]),
            concurrency=len(prompts),
            ttft_ms=m.ttft * 1e3,
            prefill_tok_s=m.prefill_tok_s or 0.0,
            decode_tok_s=m.decode_tok_s or 0.0,
            itl_p50_ms=percentile(itls, 0.5) * 1e3,
            itl_p99_ms=percentile(itls, 0.99) * 1e3,
            aggregate_tok_s=sum(len(o.token_ids) for o in outs) / wall,
            peak_rss_bytes=peak_rss_bytes(),
            kv_bytes=engine.kv_pool_bytes,
            cached_prompt_tokens=m.num_cached_tokens,
            gen=gen,
        )
