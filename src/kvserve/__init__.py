"""kvserve: an LLM inference engine and server built around a paged, measurable KV cache."""

from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: loading torch is not free
        from kvserve.llm import LLM

        return LLM
    raise AttributeError(name)
