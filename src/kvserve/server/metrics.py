"""Prometheus metrics: per-request latencies and token counts recorded from ``RequestOutput`` metrics,
engine state (queues, KV blocks, prefix cache, preemptions) read at scrape time.

Names follow vLLM's where one exists, with a ``kvserve_`` prefix. Everything lives in one registry
per app, so tests can build several apps in one process. A server holds several models
(``server.model_slots``): every request and engine sample carries its model's name (``model``; the router
gauges ``model_name``, as vLLM labels them), and an unloaded model's engine samples go with it.

Beside them, the gauges a router scrapes under vLLM's own names (``ROUTER_GAUGES``): the model-server
protocol of the Kubernetes Gateway API Inference Extension reads queue length, running requests and KV
cache utilization from them, so its endpoint picker balances kvserve like a vLLM server.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvserve.engine.outputs import RequestOutput
from kvserve.server.engine_view import EngineSnapshot, EngineView

# The model-server protocol's metrics, under the names its endpoint picker reads from vLLM
ROUTER_GAUGES = {
    "vllm:num_requests_waiting": "TotalQueuedRequests: requests waiting for a slot",
    "vllm:num_requests_running": "TotalRunningRequests: requests in the running batch",
    "vllm:kv_cache_usage_perc": "KVCacheUtilization: fraction of KV blocks held by requests (1 = 100%)",
    "vllm:gpu_cache_usage_perc": "KVCacheUtilization under its older name (the same value)",
}


def router_families(snapshots: list[tuple[str, EngineSnapshot]]):
    families = {name: GaugeMetricFamily(name, doc,
                                        labels=["model_name"]) for name, doc in ROUTER_GAUGES.items()}
    # the pool's shape, as labels: what a prefix-aware picker needs to mirror the cache (value 1)
    info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration",
                             labels=["model_name", "block_size", "num_gpu_blocks"])
    for model, s in snapshots:
        values = {
            "vllm:num_requests_waiting": s.num_waiting,
            "vllm:num_requests_running": s.num_running,
            "vllm:kv_cache_usage_perc": s.usage,
            "vllm:gpu_cache_usage_perc": s.usage,
        }
        for name, family in families.items():
            family.add_metric([model], values[name])
        info.add_metric([model, str(s.block_size), str(s.num_blocks)], 1)
    yield from families.values()
    yield info

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600)
MASK_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class EngineCollector(Collector):
    """Engine state as of the scrape, of each loaded model (``engines()``: (name, ``EngineView``) pairs).
    A model's numbers come from one ``EngineView.snapshot`` (taken under its engine's lock), so they are
    consistent with each other."""

    def __init__(self, engines: Callable[[], list[tuple[str, EngineView]]]) -> None:
        self.engines = engines

    def collect(self):
        snapshots = [(model, view.snapshot(with_blocks=False)) for model, view in self.engines()]
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for model, s in snapshots:
            for kind, name, doc, value in self._kvserve(s):
                if name not in families:
                    families[name] = kind(name, doc, labels=["model"])
                families[name].add_metric([model], value)
        yield from families.values()
        yield from router_families(snapshots)

    @staticmethod
    def _kvserve(s: EngineSnapshot):
        gauges = [
            ("kvserve_num_requests_running", "Requests in the running batch", s.num_running),
            ("kvserve_num_requests_waiting", "Requests waiting for a slot", s.num_waiting),
            ("kvserve_kv_cache_usage_ratio", "Fraction of KV blocks held by requests (0..1)", s.usage),
            ("kvserve_kv_cache_blocks", "KV blocks in the pool", s.num_blocks),
            ("kvserve_kv_cache_free_blocks", "KV blocks free (cached-free included)", s.num_free_blocks),
        ]
        if s.window_blocks:
            gauges += [
                ("kvserve_kv_window_blocks", "KV blocks in the sliding-window layers' pool", s.window_blocks),
                ("kvserve_kv_window_free_blocks", "Sliding-window KV blocks free (cached-free included)",
                 s.window_free_blocks),
            ]
        disk = s.disk_cache
        if disk is not None:
            gauges += [
                ("kvserve_disk_cache_blocks", "KV blocks in the disk cache directory", disk.blocks_on_disk),
                ("kvserve_disk_cache_bytes", "Bytes in the disk cache directory", disk.bytes_on_disk),
                ("kvserve_disk_cache_max_bytes", "Bytes the disk cache may hold", disk.max_bytes),
            ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily, name, doc, value
        counters = [
            (
                "kvserve_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                s.prefix_cache_queries,
            ),
            ("kvserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
            ("kvserve_num_preemptions", "Requests preempted for lack of KV blocks", s.num_preemptions),
            ("kvserve_prefix_cache_disk_hits", "Prompt tokens found in the prefix cache's disk tier",
             s.prefix_cache_disk_hits),
            ("kvserve_spec_decode_num_draft_tokens", "Speculative tokens verified", s.spec_draft_tokens),
            ("kvserve_spec_decode_num_accepted_tokens", "Speculative tokens kept", s.spec_accepted_tokens),
            ("kvserve_spec_decode_num_verify_steps", "Request-steps that verified speculative tokens",
             s.spec_verify_steps),
        ]
        if disk is not None:
            counters += [
                ("kvserve_disk_cache_written_bytes", "Bytes of KV blocks written to disk",
                 disk.bytes_written),
                ("kvserve_disk_cache_write_seconds", "Time spent writing KV blocks", disk.write_seconds),
                ("kvserve_disk_cache_read_bytes", "Bytes of KV blocks read back from disk", disk.bytes_read),
                ("kvserve_disk_cache_read_seconds", "Time spent reading KV blocks", disk.read_seconds),
                ("kvserve_disk_cache_rejected_files", "Disk cache files removed as corrupt or foreign",
                 disk.rejected_files),
                ("kvserve_disk_cache_dropped_writes", "KV blocks not written (writer behind, disk error)",
                 disk.dropped_writes),
            ]
        for name, doc, value in counters:
            yield CounterMetricFamily, name, doc, value


class ServerMetrics:
    """``engines()``: (model name, ``EngineView``) of each loaded model, read at each scrape."""

    def __init__(self, engines: Callable[[], list[tuple[str, EngineView]]]) -> None:
        disable_created_metrics()  # no *_created samples: they double the exposition for nothing
        self.registry = CollectorRegistry()
        r = self.registry

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=r)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        self.ttft = histogram("kvserve_time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = histogram("kvserve_inter_token_latency_seconds", "Time between consecutive output tokens",
                             ITL_BUCKETS)
        self.e2e = histogram("kvserve_e2e_request_latency_seconds", "Arrival to last token", E2E_BUCKETS)
        self.queue = histogram("kvserve_request_queue_time_seconds", "Arrival to first scheduled",
                               E2E_BUCKETS)
        self.prompt_tokens = counter("kvserve_prompt_tokens", "Prompt tokens of requests that started",
                                     "model")
        self.generation_tokens = counter("kvserve_generation_tokens", "Tokens generated", "model")
        self.requests = counter("kvserve_requests", "Finished requests by finish reason", "model",
                                "finish_reason")
        self.errors = counter("kvserve_request_errors", "Error responses by status code", "status")
        self.constrained = counter("kvserve_constrained_requests",
                                   "Finished requests whose output followed a grammar", "model")
        self.mask_time = histogram("kvserve_constraint_mask_seconds",
                                   "Time to compute one grammar token mask", MASK_BUCKETS)
        # the models a server holds (server/model_slots.py): which are loaded, and each load and unload
        self.model_loaded = Gauge("kvserve_model_loaded", "1 while the model is loaded", ["model"],
                                  registry=r)
        self.model_loads = counter("kvserve_model_loads", "Models loaded on demand", "model")
        self.model_unloads = counter("kvserve_model_unloads", "Models unloaded, by why: keep_alive, evicted, "
                                     "asked (keep_alive 0 on an empty request), stopping", "model", "reason")
        r.register(EngineCollector(engines))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def record_error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    def tracker(self, model: str) -> RequestTracker:
        return RequestTracker(self, model)


class RequestTracker:
    """Feeds one request's outputs into the metrics, under its model's label: tokens as they come,
    latencies at the end (aborted requests included, with finish reason "abort")."""

    def __init__(self, metrics: ServerMetrics, model: str) -> None:
        self.m = metrics
        self.model = model
        self.generation_tokens = metrics.generation_tokens.labels(model=model)  # looked up once, not a token
        self.last: RequestOutput | None = None
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        if self.last is None:
            self.m.prompt_tokens.labels(model=self.model).inc(out.metrics.num_prompt_tokens)
            if out.metrics.ttft is not None:
                self.m.ttft.labels(model=self.model).observe(out.metrics.ttft)
        self.generation_tokens.inc(len(out.new_token_ids))
        self.last = out
        if out.finished:
            self.close()

    def close(self) -> None:
        """Call once the request ends, however it ends; later calls do nothing."""
        if self.done:
            return
        self.done = True
        model = self.model
        if self.last is None:  # aborted before its first token
            self.m.requests.labels(model=model, finish_reason="abort").inc()
            return
        m = self.last.metrics
        itl = self.m.itl.labels(model=model)
        for seconds in m.itls:
            itl.observe(seconds)
        if m.constrained:
            self.m.constrained.labels(model=model).inc()
            mask_time = self.m.mask_time.labels(model=model)
            for seconds in m.mask_times:
                mask_time.observe(seconds)
        if m.queue_time is not None:
            self.m.queue.labels(model=model).observe(m.queue_time)
        e2e = (
            m.e2e_latency
            if m.e2e_latency is not None
            else (m.last_token_time or m.arrival_time) - m.arrival_time
        )
        self.m.e2e.labels(model=model).observe(e2e)
        self.m.requests.labels(model=model, finish_reason=self.last.finish_reason or "abort").inc()
