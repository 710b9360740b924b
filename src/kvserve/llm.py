"""The Python API: ``LLM(model).generate(prompts, params)`` and a streaming iterator."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams


class LLM:
    """Example::

        llm = LLM("smollm2", num_ctx=2048)
        [out] = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
        print(out.text, out.metrics.decode_tok_s)
    """

    def __init__(
        self,
        model: str = "smollm2",
        *,
        num_ctx: int = 4096,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 512,
        block_size: int = 16,
        cache_type_k: str = "f32",
        cache_type_v: str | None = None,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        device: str = "auto",
        weights: str = "auto",
        auto_pull: bool = False,
    ) -> None:
        config = EngineConfig(
            model=model,
            cache=CacheConfig(block_size, num_ctx, kv_cache_memory, enable_prefix_caching, cache_type_k,
                              cache_type_v),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens),
            device=device,
            weights=weights,
        )
        self.engine = LLMEngine.from_config(config, auto_pull=auto_pull)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs all prompts together (continuous batching); returns final outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts but {len(params_list)} sampling params; give one per prompt")
        ids = [self.engine.add_request(p, sp).request_id for p, sp in zip(prompts, params_list, strict=True)]
        final = self.engine.run_to_completion()
        return [final[i] for i in ids]

    def stream(self, prompt: str | list[int],
               params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields an output per generated token; stopping early aborts the request."""
        request = self.engine.add_request(prompt, params)
        done = False
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id == request.request_id:
                        done = output.finished
                        yield output
                if done:
                    return
        finally:
            if not done:
                self.engine.abort_request(request.request_id)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.encode_chat(messages)
        return self.generate(prompt, params)[0]
