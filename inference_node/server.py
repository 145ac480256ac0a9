"""The node's HTTP API (FastAPI): OpenAI-style completions with KV retention, and the KV state.

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` — OpenAI's bodies (``openai_api.schemas``:
  the standard sampling parameters, ``n``, ``stop``, ``logprobs``, streaming with
  ``stream_options``), plus ``kv_retention`` ``{token_ranges, decode_priority, decode_duration_s}``,
  ``lora_id``, ``cache_salt``. The response's ``usage.prompt_tokens_details.cached_tokens`` says how
  many prompt tokens came from the cache (:mod:`inference_node.completions`).
* ``GET /v1/chat/template`` — the chat template the node renders chats with, and its version.
* ``GET /v1/kv/state`` — the node's ground truth, in the shapes of the events.
* ``GET /v1/kv/stats``, ``GET /v1/models``, ``GET /healthz``, ``GET /metrics`` (Prometheus).

Invalid requests get a 4xx with a message that says what is wrong; the node keeps serving.
This module assembles the app and holds the small endpoints; what they share is
:mod:`inference_node.deps`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference_node import completions
from inference_node.deps import authorized, error, metrics_of, node_of, on_engine
from inference_node.metrics import Metrics
from inference_node.node import Node
from openai_api.http import BodyLimit

router = APIRouter()


def create_app(node: Node) -> FastAPI:
    """The node's app: its state (the node, the metrics, the API keys) on ``app.state``."""
    s = node.settings
    app = FastAPI(title=f"kvflow inference node {s.node_id}", version="1",
                  description="OpenAI-style completions over a priority-evicting paged KV cache.")
    app.state.node = node
    app.state.metrics = Metrics()
    app.state.api_keys = frozenset(
        k.strip() for k in s.api_keys.get_secret_value().split(",") if k.strip()) if s.api_keys else frozenset()
    app.add_middleware(BodyLimit, max_bytes=s.max_request_bytes)
    app.exception_handler(RequestValidationError)(_on_invalid)
    app.exception_handler(StarletteHTTPException)(_on_http)  # the framework's own 404 and 405 too
    app.include_router(router)
    app.include_router(completions.router)
    return app


async def _on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return error(422, "; ".join(parts))


async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail
    if not isinstance(exc, HTTPException) and exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    elif not isinstance(exc, HTTPException) and exc.status_code == 405:
        message = f"method not allowed: {request.method} {request.url.path}"
    return JSONResponse(status_code=exc.status_code, headers=exc.headers, content={"error": {
        "message": message, "type": "not_found" if exc.status_code == 404 else "http_error", "param": None,
        "code": None}})


@router.get("/healthz")
async def healthz(request: Request) -> JSONResponse:
    node = node_of(request)
    if node.engine.fatal is not None:
        return JSONResponse(status_code=503, content={"status": "broken", "error": str(node.engine.fatal)})
    return JSONResponse({"status": "ok", "node_id": node.settings.node_id, "instance_id": node.instance_id,
                         "model": node.model.cfg.name, "device": str(node.device)})


@router.get("/v1/models", dependencies=authorized)
async def models(request: Request) -> dict[str, Any]:
    cfg = node_of(request).model.cfg
    return {"object": "list", "data": [{"id": cfg.name, "object": "model", "owned_by": "kvflow",
                                        "max_model_len": cfg.max_position_embeddings}]}


@router.get("/v1/kv/state", dependencies=authorized)
async def kv_state(request: Request) -> Response:
    node = node_of(request)

    def snap() -> tuple[int, list[Any]]:
        return node.core.last_event_id, node.core.cached_blocks()

    last, blocks = await on_engine(node, snap)
    body = msgspec.json.encode({"node_id": node.settings.node_id, "instance_id": node.instance_id,
                                "last_event_id": last, "blocks": blocks})
    return Response(content=body, media_type="application/json")


@router.get("/v1/kv/stats", dependencies=authorized)
async def kv_stats(request: Request) -> dict[str, Any]:
    node = node_of(request)

    def collect() -> dict[str, Any]:
        core, engine = node.core, node.engine
        out: dict[str, Any] = {
            "node_id": node.settings.node_id, "instance_id": node.instance_id,
            "blocks": {"gpu_capacity": core.config.num_gpu_blocks, "host_capacity": core.config.num_host_blocks,
                       "used": list(core.used_blocks), "cached": core.num_cached_blocks,
                       "evictable": list(core.evictable_blocks)},
            "kv": dataclasses.asdict(core.stats),
            "engine": dataclasses.asdict(engine.stats),
            "running": engine.queue_depth[0], "waiting": engine.queue_depth[1],
            "last_event_id": core.last_event_id, "pending_events": core.pending_events,
            "events_published": engine.publisher.events_sent,
            "policy": core.policy.name,
        }
        learned = core.policy.describe()
        if learned is not None:
            out[core.policy.name] = learned
        return out

    return await on_engine(node, collect)


@router.get("/metrics")
async def prom(request: Request) -> Response:
    node = node_of(request)
    metrics = metrics_of(request)
    try:
        st = await asyncio.wait_for(asyncio.wrap_future(node.engine.call(node.engine.node_stats)), 2.0)
        metrics.kv_used.labels("gpu").set(st.used[0])
        metrics.kv_used.labels("host").set(st.used[1])
        metrics.kv_capacity.labels("gpu").set(st.capacity[0])
        metrics.kv_capacity.labels("host").set(st.capacity[1])
        metrics.running.set(st.active_requests)
        metrics.waiting.set(st.queued_requests)
        metrics.events.set(st.counters.events_published)
        metrics.overflowed.set(st.counters.events_overflowed)
    except TimeoutError:
        pass
    return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")
