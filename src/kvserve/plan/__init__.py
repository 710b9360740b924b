"""Know before you OOM: plan a model's memory (weights, KV cache, activations, overhead) from its
header, config or a preset, without loading a weight.

Names are imported on first use: ``kvserve plan --help`` lists the presets without reading numpy or gguf.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_LAZY = {
    "KV_TYPES": "kvserve.kv.cache_types",
    "KVType": "kvserve.kv.cache_types",
    "kv_bytes_per_token": "kvserve.kv.cache_types",
    "kv_type": "kvserve.kv.cache_types",
    "Plan": "kvserve.plan.planner",
    "PlanSettings": "kvserve.plan.planner",
    "make_plan": "kvserve.plan.planner",
    "planned_kv_pool_bytes": "kvserve.plan.planner",
    "ModelSpec": "kvserve.plan.model_spec",
    "resolve_model": "kvserve.plan.model_spec",
}

__all__ = [
    "KV_TYPES",
    "KVType",
    "ModelSpec",
    "Plan",
    "PlanSettings",
    "kv_bytes_per_token",
    "kv_type",
    "make_plan",
    "planned_kv_pool_bytes",
    "resolve_model",
]

if TYPE_CHECKING:
    from kvserve.kv.cache_types import KV_TYPES, KVType, kv_bytes_per_token, kv_type
    from kvserve.plan.model_spec import ModelSpec, resolve_model
    from kvserve.plan.planner import Plan, PlanSettings, make_plan, planned_kv_pool_bytes


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvserve.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
