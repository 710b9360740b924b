"""``/metrics`` in Prometheus text format, fed by real requests."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

EXPECTED = {
    "kvserve_time_to_first_token_seconds": "histogram",
    "kvserve_inter_token_latency_seconds": "histogram",
    "kvserve_e2e_request_latency_seconds": "histogram",
    "kvserve_request_queue_time_seconds": "histogram",
    "kvserve_prompt_tokens": "counter",
    "kvserve_generation_tokens": "counter",
    "kvserve_requests": "counter",
    "kvserve_request_errors": "counter",
    "kvserve_num_requests_running": "gauge",
    "kvserve_num_requests_waiting": "gauge",
    "kvserve_kv_cache_usage_ratio": "gauge",
    "kvserve_kv_cache_blocks": "gauge",
    "kvserve_kv_cache_free_blocks": "gauge",
    "kvserve_prefix_cache_queries": "counter",
    "kvserve_prefix_cache_hits": "counter",
    "kvserve_num_preemptions": "counter",
    "kvserve_constrained_requests": "counter",
    "kvserve_constraint_mask_seconds": "histogram",
    # the Gateway API Inference Extension's model-server protocol, under vLLM's names
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
}


def test_metrics_follow_requests(idle):
    before = idle.metrics()
    prompt = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Count to ten, slowly."}],
        "temperature": 0,
        "max_tokens": 5,
        "ignore_eos": True,
    }
    with idle.client() as c:
        first = c.post("/v1/chat/completions", json=prompt).json()
        c.post("/v1/chat/completions", json=prompt)  # same prompt: prefix cache hits
        c.post("/v1/chat/completions", json={**prompt, "model": "nope"})  # a 404
        text = c.get("/metrics")
    assert text.headers["content-type"].startswith("text/plain")
    families = {f.name: f.type for f in text_string_to_metric_families(text.text)}
    for name, kind in EXPECTED.items():
        assert families.get(name) == kind, name
    after = idle.metrics()

    def grew(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    m = '{model="smollm2"}'  # request and engine samples carry the model's name

    assert grew("kvserve_time_to_first_token_seconds_count" + m) == 2
    assert grew("kvserve_inter_token_latency_seconds_count" + m) == 2 * 4  # 5 tokens: 4 gaps each
    assert grew("kvserve_e2e_request_latency_seconds_count" + m) == 2
    assert grew("kvserve_generation_tokens_total" + m) == 10
    assert grew("kvserve_prompt_tokens_total" + m) == 2 * first["usage"]["prompt_tokens"]
    assert grew('kvserve_requests_total{finish_reason="length",model="smollm2"}') == 2
    assert grew('kvserve_request_errors_total{status="404"}') == 1
    assert grew("kvserve_prefix_cache_hits_total" + m) >= 16
    assert grew("kvserve_prefix_cache_queries_total" + m) == 2 * first["usage"]["prompt_tokens"]
    assert after["kvserve_kv_cache_blocks" + m] == 256 and after["kvserve_kv_cache_usage_ratio" + m] == 0
    assert after["kvserve_num_requests_running" + m] == 0 and after["kvserve_num_requests_waiting" + m] == 0
    assert after['vllm:num_requests_running{model_name="smollm2"}'] == 0


def test_constrained_requests_and_their_mask_times_are_counted(idle):
    before = idle.metrics()
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "A colour?"}], "max_tokens": 6,
            "temperature": 0, "response_format": {"type": "json_object"}}
    with idle.client() as c:
        answer = c.post("/v1/chat/completions", json=body).json()
        c.post("/v1/chat/completions", json={**body, "response_format": {"type": "text"}})
    after = idle.metrics()
    constrained, count = (
        'kvserve_constrained_requests_total{model="smollm2"}',
        'kvserve_constraint_mask_seconds_count{model="smollm2"}',
    )
    assert after[constrained] - before.get(constrained, 0) == 1
    masks = after[count] - before.get(count, 0)
    assert masks == answer["usage"]["completion_tokens"]  # one mask a sampled token
