"""Know before you OOM: plan a model's memory (weights, KV cache, activations, overhead) from its
header, config or a preset, without loading a weight."""

from kvserve.kv.kv_types import KV_TYPES, KVType, kv_bytes_per_token, kv_type
from kvserve.plan.planner import Plan, PlanSettings, make_plan, planned_kv_pool_bytes
from kvserve.plan.source import ModelSpec, resolve_model

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
