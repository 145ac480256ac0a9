"""The node's HTTP API (FastAPI): OpenAI-style completions with KV retention, and the KV state.

* ``POST /v1/completions`` — ``model``, ``prompt`` (text or token ids), ``max_tokens``,
  ``temperature``, ``seed``, ``stream`` (server-sent events), plus ``kv_retention``
  ``{token_ranges, decode_priority, decode_duration_s}``, ``lora_id``, ``cache_salt``. The response's
  ``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens came from the cache.
* ``GET /v1/kv/state`` — the node's ground truth, in the shapes of the events.
* ``GET /v1/kv/stats``, ``GET /v1/models``, ``GET /healthz``, ``GET /metrics`` (Prometheus).

Invalid requests get a 4xx with a message that says what is wrong; the node keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from eventbus.api import CompletionRequest
from eventbus.http import BodyLimit
from inference_node.engine import Engine, GenerationRequest, Output
from inference_node.kv.retention import KvCacheRetentionConfig, RetentionConfigError, TokenRange
from inference_node.node import Node

log = logging.getLogger("kvflow.node.server")
T = TypeVar("T")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind}})


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


def create_app(node: Node) -> FastAPI:
    engine: Engine = node.engine
    s = node.settings
    keys = {k.strip() for k in s.api_keys.get_secret_value().split(",") if k.strip()} if s.api_keys else set()
    metrics = Metrics()
    app = FastAPI(title=f"kvflow inference node {s.node_id}", version="1",
                  description="OpenAI-style completions over a priority-evicting paged KV cache.")
    app.state.node = node

    def authorize(request: Request) -> None:
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise HTTPException(401, "missing bearer API key", headers={"WWW-Authenticate": "Bearer"})
        if not any(secrets.compare_digest(token, k) for k in keys):
            raise HTTPException(401, "unknown API key", headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(authorize)]

    app.add_middleware(BodyLimit, max_bytes=s.max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors()[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        return _error(422, "; ".join(parts))

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"error": {"message": exc.detail,
                                                                             "type": "http_error"}},
                            headers=exc.headers)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        if engine.fatal is not None:
            return JSONResponse(status_code=503, content={"status": "broken", "error": str(engine.fatal)})
        return JSONResponse({"status": "ok", "node_id": s.node_id, "instance_id": node.instance_id,
                             "model": node.model.cfg.name, "device": str(node.device)})

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": node.model.cfg.name, "object": "model", "owned_by": "kvflow",
                                            "max_model_len": node.model.cfg.max_position_embeddings}]}

    async def on_engine(fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread; a crashed engine is a 503, never a hang."""
        try:
            return await asyncio.wrap_future(engine.call(fn))
        except RuntimeError as exc:
            if engine.fatal is None:
                raise
            raise HTTPException(503, str(exc)) from exc

    @app.get("/v1/kv/state", dependencies=auth)
    async def kv_state() -> Response:
        def snap() -> tuple[int, list[Any]]:
            return node.core.last_event_id, node.core.cached_blocks()

        last, blocks = await on_engine(snap)
        body = msgspec.json.encode({"node_id": s.node_id, "instance_id": node.instance_id,
                                    "last_event_id": last, "blocks": blocks})
        return Response(content=body, media_type="application/json")

    @app.get("/v1/kv/stats", dependencies=auth)
    async def kv_stats() -> dict[str, Any]:
        def collect() -> dict[str, Any]:
            core = node.core
            out: dict[str, Any] = {
                "node_id": s.node_id, "instance_id": node.instance_id,
                "blocks": {"gpu_capacity": core.config.num_gpu_blocks, "host_capacity": core.config.num_host_blocks,
                           "used": list(core.used_blocks), "cached": core.num_cached_blocks,
                           "evictable": list(core.evictable_blocks)},
                "kv": dataclasses.asdict(core.stats),
                "engine": dataclasses.asdict(engine.stats),
                "running": engine.queue_depth[0], "waiting": engine.queue_depth[1],
                "last_event_id": core.last_event_id, "pending_events": core.pending_events,
                "events_published": engine.publisher.events_sent,
            }
            if core.adaptive is not None:
                out["adaptive"] = core.adaptive.describe()
            return out

        return await on_engine(collect)

    @app.get("/metrics")
    async def prom() -> Response:
        try:
            st = await asyncio.wait_for(asyncio.wrap_future(engine.call(engine.node_stats)), 2.0)
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

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if body.model is not None and body.model not in (node.model.cfg.name, s.node_id):
            return _error(404, f"model {body.model!r} is not served here; this node serves "
                               f"{node.model.cfg.name!r}", "model_not_found")
        try:
            retention = None if body.kv_retention is None else KvCacheRetentionConfig(
                token_ranges=tuple(TokenRange(r.start, r.end, r.priority, r.duration_s)
                                   for r in body.kv_retention.token_ranges),
                decode_priority=body.kv_retention.decode_priority,
                decode_duration_s=body.kv_retention.decode_duration_s)
        except RetentionConfigError as exc:
            return _error(400, f"kv_retention: {exc}")
        if isinstance(body.prompt, str):
            prompt_ids = node.tokenizer.encode(body.prompt)
        else:
            prompt_ids = body.prompt
            bad = [t for t in prompt_ids if not 0 <= t < node.model.cfg.vocab_size]
            if bad:
                return _error(400, f"prompt token ids must be within 0..{node.model.cfg.vocab_size - 1}; "
                                   f"got {bad[:3]}")
        if not prompt_ids:
            return _error(400, "the prompt is empty")
        ctx = node.model.cfg.max_position_embeddings
        if len(prompt_ids) + body.max_tokens > ctx:
            return _error(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({body.max_tokens}) exceeds "
                               f"the context length of {ctx}", "context_length_exceeded")
        need = -(-(len(prompt_ids) + body.max_tokens) // s.block_size)
        if need > s.num_blocks:
            return _error(400, f"this request needs {need} KV blocks; the node has {s.num_blocks}")

        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        req = GenerationRequest(rid, prompt_ids, body.max_tokens, body.temperature, body.seed, retention,
                                body.lora_id, body.cache_salt, body.ignore_eos)
        handle = engine.submit(req, asyncio.get_running_loop())
        created = int(time.time())
        name = node.model.cfg.name

        def usage(done: Output) -> dict[str, Any]:
            return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                    "total_tokens": done.prompt_tokens + done.completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}

        def account(done: Output) -> None:
            metrics.requests.labels(done.finish_reason or "unknown").inc()
            metrics.prompt_tokens.inc(done.prompt_tokens)
            metrics.cached_tokens.inc(done.cached_tokens)
            metrics.completion_tokens.inc(done.completion_tokens)
            metrics.latency.observe(time.monotonic() - handle.submitted)

        if body.stream:
            async def events() -> AsyncIterator[bytes]:
                tokens: list[int] = []
                sent = ""
                first = True
                try:
                    async for out in handle:
                        if out.error:
                            yield _sse({"error": {"message": out.error, "type": "server_error"}})
                            break
                        if out.token_id is not None:
                            if first:
                                metrics.ttft.observe(time.monotonic() - handle.submitted)
                                first = False
                            tokens.append(out.token_id)
                            text = node.tokenizer.decode(tokens)
                            delta = "" if text.endswith("\ufffd") else text[len(sent):]
                            if delta:
                                sent += delta
                            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                                        "choices": [{"index": 0, "text": delta, "token_ids": [out.token_id],
                                                     "finish_reason": None, "logprobs": None}]})
                        if out.finished:
                            account(out)
                            tail = node.tokenizer.decode(tokens)[len(sent):]
                            yield _sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                                        "choices": [{"index": 0, "text": tail, "finish_reason": out.finish_reason,
                                                     "logprobs": None}], "usage": usage(out)})
                    yield b"data: [DONE]\n\n"
                finally:
                    engine.cancel(rid)  # a no-op when finished; frees the blocks after a disconnect

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"x-kvflow-node": s.node_id, "cache-control": "no-cache"})

        tokens: list[int] = []
        try:
            async for out in handle:
                if out.error:
                    return _error(503, out.error, "server_error")
                if out.token_id is not None:
                    if not tokens:
                        metrics.ttft.observe(time.monotonic() - handle.submitted)
                    tokens.append(out.token_id)
                if out.finished:
                    account(out)
                    return JSONResponse(
                        {"id": rid, "object": "text_completion", "created": created, "model": name,
                         "choices": [{"index": 0, "text": node.tokenizer.decode(tokens), "token_ids": tokens,
                                      "finish_reason": out.finish_reason, "logprobs": None}],
                         "usage": usage(out), "kvflow": {"node_id": s.node_id, "instance_id": node.instance_id}},
                        headers={"x-kvflow-node": s.node_id})
        except asyncio.CancelledError:
            engine.cancel(rid)
            raise
        return _error(500, "the request ended without output", "server_error")

    return app


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
