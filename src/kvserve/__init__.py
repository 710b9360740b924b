"""kvserve: an LLM inference engine and server built around a paged, measurable KV cache.

The package's names are imported on first use, so ``kvserve --help``, ``list``, ``plan`` and
``pull`` start without loading the engine, the server or any numeric library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]

_LAZY = {
    "LLM": "kvserve.llm",
    "RequestOutput": "kvserve.engine.outputs",
    "SamplingParams": "kvserve.engine.sampling_params",
}

if TYPE_CHECKING:
    from kvserve.engine.outputs import RequestOutput
    from kvserve.engine.sampling_params import SamplingParams
    from kvserve.llm import LLM


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
