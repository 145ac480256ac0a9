"""Fixtures for the bridge's integration tests: topics and a database of their own with a real
materializer, an HTTP stand-in for an engine's API server (metrics, models, TensorRT-LLM's event
queue), and ``kvflow bridge`` as a real process."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvflow.bench.scratch import scratch_database
from tests.support import ServiceProcess, kafka_env, materializer, own_topics


class EngineHTTP:
    """An engine's HTTP server as the bridge reads it: ``/metrics`` (vLLM's names), ``/v1/models``,
    ``POST /reset_prefix_cache`` (counted; ``on_reset`` called) and ``POST /kv_cache_events``
    (TensorRT-LLM's: returns the queued events and drains them)."""

    def __init__(self, model: str = "engine-model", num_gpu_blocks: int = 64, block_size: int = 16) -> None:
        self.model = model
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.running = 0
        self.waiting = 0
        self.usage = 0.0
        self.up = True
        self.resets = 0
        self.on_reset: Any = None
        self.trt_events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_a: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if not engine.up:
                    self._send(503, b"{}")
                elif self.path == "/metrics":
                    self._send(200, engine.metrics().encode(), "text/plain; version=0.0.4")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"object": "list", "data": [{"id": engine.model}]}).encode())
                else:
                    self._send(404, b"{}")

            def do_POST(self) -> None:
                if self.path == "/reset_prefix_cache":
                    engine.resets += 1
                    if engine.on_reset is not None:
                        engine.on_reset()
                    self._send(200, b"{}")
                elif self.path == "/kv_cache_events":
                    with engine.lock:
                        events, engine.trt_events = engine.trt_events, []
                    self._send(200, json.dumps(events).encode())
                else:
                    self._send(404, b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.model}"'
        return (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {self.running}\n"
                f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} {self.waiting}\n"
                f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} {self.usage}\n"
                "# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{block_size="{self.block_size}",engine="0",'
                f'num_gpu_blocks="{self.num_gpu_blocks}"}} 1.0\n')

    def queue(self, *events: dict[str, Any]) -> None:
        with self.lock:
            self.trt_events.extend(events)

    def __enter__(self) -> EngineHTTP:
        self.thread.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def pipeline(kafka_bootstrap, pg_owner_url, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """Topics and a database of their own, and a materializer writing into it."""
    tmp = tmp_path_factory.mktemp("bridge")
    with own_topics(kafka_bootstrap) as kafka, scratch_database(pg_owner_url, "kvflow_bridge") as db:
        mat = materializer(kafka, db, tmp).start()
        try:
            yield {"kafka": kafka, "db": db, "tmp": tmp}
        finally:
            mat.stop()


def start_bridge(pipeline: dict[str, Any], engine: str, node_id: str, *args: str, **env: str) -> ServiceProcess:
    """``kvflow bridge ENGINE --node-id NODE ARGS…`` as a process (stopped by the test)."""
    tmp: Path = pipeline["tmp"]
    return ServiceProcess(["bridge", engine, "--node-id", node_id, *args, "--log-level", "info"],
                          {**kafka_env(pipeline["kafka"]), "KVFLOW_BRIDGE_HEARTBEAT_S": "0.5", **env},
                          tmp / f"bridge-{node_id}.log").start()
