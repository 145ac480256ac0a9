"""The node's Prometheus metrics (``GET /metrics``), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvflow_node_requests_total", "Completion requests", ["outcome"], registry=r)
        self.prompt_tokens = Counter("kvflow_node_prompt_tokens_total", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("kvflow_node_cached_tokens_total", "Prompt tokens served from cache", registry=r)
        self.completion_tokens = Counter("kvflow_node_completion_tokens_total", "Generated tokens", registry=r)
        self.ttft = Histogram("kvflow_node_time_to_first_token_seconds", "Submit to first token",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.latency = Histogram("kvflow_node_request_seconds", "Submit to last token",
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.kv_used = Gauge("kvflow_node_kv_blocks_used", "Occupied KV blocks", ["tier"], registry=r)
        self.kv_capacity = Gauge("kvflow_node_kv_blocks_capacity", "KV blocks", ["tier"], registry=r)
        self.running = Gauge("kvflow_node_running_requests", "Requests being decoded", registry=r)
        self.waiting = Gauge("kvflow_node_waiting_requests", "Requests waiting for admission", registry=r)
        self.events = Gauge("kvflow_node_events_published", "KV events handed to Kafka", registry=r)
        self.overflowed = Gauge("kvflow_node_events_overflowed", "KV events replaced by snapshots", registry=r)
