"""The routing API (FastAPI): decide, explain, proxy; nodes and stats; a live dashboard.

Routes only parse, query and format: the decision is :func:`routing_api.scoring.decide`.

* ``POST /v1/route`` — the chosen node, its URL, the matched blocks and tokens, and every
  candidate with the parts of its score.
* ``POST /v1/completions`` — route, then proxy to the chosen node (streaming passes through); the
  response names the node in ``x-kvflow-node``. A node that fails is reported as an upstream
  error (502, or an error event mid-stream) and avoided for ``suspect_s``.
* ``GET /v1/nodes``, ``/v1/nodes/{node_id}``, ``/v1/stats``, ``/healthz``, ``/metrics``,
  ``/dashboard`` (and its data, ``/v1/dashboard/data``); OpenAPI docs at ``/docs``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError

from eventbus.api import CompletionRequest, RouteRequest
from eventbus.config import Environment, RuntimeSettings
from eventbus.hashing import prompt_hash_heads
from eventbus.http import BodyLimit
from eventbus.tokenizers import Tokenizer, load_tokenizer
from routing_api.config import ApiKey, RouterSettings, parse_api_keys
from routing_api.queries import StateReader
from routing_api.scoring import Decision, NodeView, RoutingWeights, decide
from state_store.config import DatabaseSettings

log = logging.getLogger("kvflow.router")
STATIC = Path(__file__).resolve().parent / "static"


@dataclass
class Inflight:
    requests: int = 0
    blocks: int = 0


@dataclass
class RouterState:
    settings: RouterSettings
    reader: StateReader
    tokenizer: Tokenizer
    weights: RoutingWeights
    keys: dict[str, ApiKey]
    client: httpx.AsyncClient
    inflight: dict[str, Inflight] = field(default_factory=lambda: collections.defaultdict(Inflight))
    suspect_until: dict[str, float] = field(default_factory=dict)
    recent: collections.deque[dict[str, Any]] = field(default_factory=collections.deque)
    decisions: int = 0
    proxied: int = 0
    upstream_errors: int = 0
    started: float = field(default_factory=time.time)
    rng: random.Random = field(default_factory=random.Random)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("kvflow_router_decisions_total", "Routing decisions", ["node"], registry=r)
        self.decision_seconds = Histogram(
            "kvflow_router_decision_seconds", "Time to decide (tokenize, hash, query, score)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25), registry=r)
        self.matched_blocks = Counter("kvflow_router_matched_blocks_total", "Prompt blocks cached on the choice",
                                      registry=r)
        self.prompt_blocks = Counter("kvflow_router_prompt_blocks_total", "Prompt blocks routed", registry=r)
        self.proxied = Counter("kvflow_router_proxied_total", "Completions proxied", ["node", "outcome"], registry=r)
        self.inflight = Gauge("kvflow_router_inflight_requests", "Proxied requests not finished", ["node"],
                              registry=r)


def fleet_block_size(rows: list[Any]) -> int:
    """The block size prompts are hashed in: the one most live nodes report (then any node's; 32).

    Hashes depend on block boundaries, so one decision uses one size; a node with another size
    is not a candidate (see ``excluded`` in the decision)."""
    for pool in ([r for r in rows if r["status"] == "live"], rows):
        sizes: collections.Counter[int] = collections.Counter(int(r["block_size"]) for r in pool if r["block_size"])
        if sizes:
            return min(sizes, key=lambda b: (-sizes[b], b))
    return 32


@dataclass(frozen=True)
class FleetView:
    """One read of the ``nodes`` table as a request for ``model`` sees it (derived once per read):
    the block size prompts are hashed in, and every node's view without the router's own state
    (suspicion, in-flight requests), which each decision lays over it."""

    block_size: int
    views: tuple[NodeView, ...]


def fleet_view(rows: list[Any], model: str | None, block_size: int | None = None) -> FleetView:
    serving = [r for r in rows if model is None or r["model"] == model]
    size = block_size or fleet_block_size(serving)
    views = []
    for r in rows:
        excluded = ""
        if model is not None and r["model"] != model:
            excluded = f"serves {r['model'] or 'an unknown model'}, not {model}"
        elif r["block_size"] and r["block_size"] != size:
            excluded = f"block size {r['block_size']}; this fleet's prompts are hashed in blocks of {size}"
        # a node known from its events only (no heartbeat has said where it is) is unreachable
        status = r["status"] if r["url"] else "unreachable"
        views.append(NodeView(r["node_id"], r["url"] or "", status, r["capacity_gpu"], r["active_blocks"],
                              r["active_requests"], r["queued_requests"], excluded=excluded))
    return FleetView(size, tuple(views))


def _error(status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, **extra}},
                        headers={k: v for k, v in (("x-kvflow-node", extra.get("node_id")),) if v})


FastHandler = Callable[[bytes, dict[bytes, bytes]], Awaitable[tuple[int, bytes] | None]]


class FastPath:
    """Answer hot ``POST`` endpoints without the framework: plain ASGI in, JSON bytes out.

    For ``POST /v1/route`` FastAPI's middleware, routing, dependency solving, ``json.loads`` +
    validation of a dict, and response classes cost about as much CPU as the decision's own work.
    The handler validates the same pydantic model from the raw bytes (``model_validate_json``) and
    checks the same API keys; when it returns None (an invalid body, a missing key: any answer that
    is not the endpoint's own), the request goes on to ``app`` with its body replayed, so errors
    and the OpenAPI schema stay FastAPI's. So does a body over ``max_bytes``: the app's own limit
    then answers 413.
    """

    def __init__(self, app: Any, routes: dict[str, FastHandler], max_bytes: int) -> None:
        self.app = app
        self.routes = routes
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # a disconnect: let the app see it
                await self.app(scope, _replay(chunks, False, receive, message), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await self.app(scope, _replay(chunks, more, receive), send)
                return
        body = b"".join(chunks)
        answer = await handler(body, dict(scope["headers"]))
        if answer is not None:
            await _send_json(send, *answer)
            return
        await self.app(scope, _replay([body], False, receive), send)


def _replay(chunks: list[bytes], more: bool, receive: Any, then: Any = None) -> Any:
    """An ASGI ``receive`` that gives the body read so far again, then ``then``, then ``receive``."""
    pending: list[Any] = [{"type": "http.request", "body": b"".join(chunks), "more_body": more}]
    if then is not None:
        pending.append(then)

    async def replayed() -> Any:
        return pending.pop(0) if pending else await receive()

    return replayed


class RouterApp(FastAPI):
    """FastAPI with :class:`FastPath` outermost in its middleware stack (``fast_routes``)."""

    fast_routes: dict[str, FastHandler]
    max_body_bytes: int

    def build_middleware_stack(self) -> Any:
        return FastPath(super().build_middleware_stack(), self.fast_routes, self.max_body_bytes)


async def _send_json(send: Any, status: int, content: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]})
    await send({"type": "http.response.body", "body": content})


def create_app(settings: RouterSettings | None = None, database_url: str | None = None) -> FastAPI:
    s = settings or RouterSettings()
    env = RuntimeSettings().env
    spec = s.api_keys.get_secret_value() if s.api_keys else (
        Path(s.api_keys_file).read_text().strip() if s.api_keys_file else "")
    keys = parse_api_keys(spec)
    if not keys:
        if env is Environment.PRODUCTION:
            raise ValueError("KVFLOW_ROUTER_API_KEYS is required when KVFLOW_ENV=production")
        log.warning("development mode: no API keys, the router is open")
    db = DatabaseSettings()
    if database_url is None:
        db.check(env, writer=False)  # it only reads
    url = database_url or db.reader()
    metrics = Metrics()
    state_box: dict[str, RouterState] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        node_headers = {"authorization": f"Bearer {s.node_api_key.get_secret_value()}"} if s.node_api_key else {}
        client = httpx.AsyncClient(timeout=httpx.Timeout(s.upstream_timeout_s, connect=5.0), headers=node_headers,
                                   limits=httpx.Limits(max_connections=512, max_keepalive_connections=128))
        reader = StateReader(url, s.nodes_cache_s, pool_size=db.pool_size, statement_timeout_ms=db.statement_timeout_ms)
        state_box["s"] = RouterState(s, reader, load_tokenizer(s.tokenizer_dir), s.weights(), keys, client,
                                     recent=collections.deque(maxlen=s.recent_decisions))
        try:
            yield
        finally:
            await client.aclose()
            await state_box["s"].reader.close()

    app = RouterApp(title="kvflow routing API", version="1", lifespan=lifespan,
                  description="KV-aware routing over the materialized cache state of an inference fleet.")

    def st() -> RouterState:
        return state_box["s"]

    def authorize(header: str, needed: str) -> ApiKey | None:
        """The API key of an ``Authorization`` header, if it grants ``needed`` (else 401/403)."""
        if not keys:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise HTTPException(401, "missing bearer API key", headers={"WWW-Authenticate": "Bearer"})
        key = next((k for k in keys.values() if secrets.compare_digest(token, k.key)), None)
        if key is None:
            raise HTTPException(401, "unknown API key", headers={"WWW-Authenticate": "Bearer"})
        if needed not in key.scopes:
            raise HTTPException(403, f"this API key lacks the '{needed}' scope")
        return key

    def scope(needed: str) -> Any:
        async def check(request: Request) -> ApiKey | None:  # async: no thread hop per request
            return authorize(request.headers.get("authorization", ""), needed)

        return Depends(check)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
                 for e in exc.errors()[:5]]
        return _error(422, "; ".join(parts))

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code,
                            content={"error": {"message": exc.detail, "type": "http_error"}}, headers=exc.headers)

    # ------------------------------------------------------------------ deciding

    fleet_cache: dict[str | None, FleetView] = {}
    fleet_rows: list[Any] = []  # the rows fleet_cache was derived from (held: no id reuse)

    def fleet_views(rows: list[Any], model: str | None) -> FleetView:
        nonlocal fleet_rows
        if fleet_rows is not rows:  # the reader has read the nodes table again
            fleet_cache.clear()
            fleet_rows = rows
        fv = fleet_cache.get(model)
        if fv is None:
            fv = fleet_cache[model] = fleet_view(rows, model, s.block_size)
        return fv

    async def route(token_ids: list[int] | None, text: str | None, lora_id: int | None,
                    salt: str | None, model: str | None) -> tuple[Decision, dict[str, Any], int]:
        t0 = time.perf_counter()
        state = st()
        rows = await state.reader.nodes()
        if model is not None and not any(r["model"] == model for r in rows):
            raise HTTPException(404, f"model {model!r} is not served by any node")
        tokens: Sequence[int] = state.tokenizer.encode_compact(text or "") if token_ids is None else token_ids
        fleet = fleet_views(rows, model)
        block_size = fleet.block_size
        hashes = prompt_hash_heads(tokens, block_size, lora_id=lora_id, cache_salt=salt)
        n_blocks = len(hashes) // 8
        matches = await state.reader.prefix_matches(hashes)
        views = list(fleet.views)
        if state.suspect_until or state.inflight:  # lay the router's own state over the nodes' rows
            now = time.monotonic()
            for i, v in enumerate(views):
                suspect = state.suspect_until.get(v.node_id, 0) > now
                inf = state.inflight.get(v.node_id)
                if suspect or (inf is not None and (inf.requests or inf.blocks)):
                    views[i] = dataclasses.replace(
                        v, status="suspect" if suspect else v.status,
                        inflight_requests=inf.requests if inf else 0, inflight_blocks=inf.blocks if inf else 0)
        decision = decide(n_blocks, views, matches, state.weights, state.rng)
        elapsed = time.perf_counter() - t0
        state.decisions += 1
        metrics.decision_seconds.observe(elapsed)
        metrics.prompt_blocks.inc(n_blocks)
        if decision.chosen is not None:
            metrics.decisions.labels(decision.chosen.node_id).inc()
            metrics.matched_blocks.inc(decision.chosen.matched_blocks)
        body = {
            "node_id": decision.chosen.node_id if decision.chosen else None,
            "url": decision.chosen.url if decision.chosen else None,
            "matched_blocks": decision.chosen.matched_blocks if decision.chosen else 0,
            "matched_tokens": decision.chosen.matched_blocks * block_size if decision.chosen else 0,
            "prompt_tokens": len(tokens), "prompt_blocks": n_blocks, "block_size": block_size,
            "reason": decision.reason, "decision_ms": round(elapsed * 1000, 3),
            "candidates": [{"node_id": c.node_id, "status": c.status, "eligible": c.eligible,
                            "matched_blocks": c.gpu_blocks + c.host_blocks, "gpu_blocks": c.gpu_blocks,
                            "host_blocks": c.host_blocks, "cached_credit": round(c.cached_credit, 3),
                            "prefill_blocks": round(c.prefill_blocks, 3), "decode_blocks": round(c.decode_blocks, 3),
                            "cost": None if c.cost == math.inf else round(c.cost, 3), "busy": c.busy,
                            "reason": c.reason} for c in decision.candidates],
        }
        state.recent.appendleft({"ts": time.time(), "node_id": body["node_id"], "prompt_tokens": len(tokens),
                                 "matched_tokens": body["matched_tokens"], "reason": decision.reason})
        return decision, body, n_blocks

    async def route_answer(req: RouteRequest, key: ApiKey | None) -> tuple[int, bytes]:
        """``POST /v1/route`` once the body is valid and the key may route: status and JSON."""
        if (req.prompt is None) == (req.token_ids is None):
            return 422, msgspec.json.encode({"error": {"message": "give exactly one of prompt and token_ids",
                                                       "type": "invalid_request_error"}})
        salt = key.tenant if key is not None and key.tenant else req.cache_salt
        decision, body, _ = await route(req.token_ids, req.prompt, req.lora_id, salt, req.model)
        if decision.chosen is None:
            return 503, msgspec.json.encode({"error": {"message": "no live node", "type": "unavailable"}, **body})
        return 200, msgspec.json.encode(body)

    @app.post("/v1/route")
    async def route_endpoint(req: RouteRequest, key: ApiKey | None = scope("route")) -> Response:
        status, content = await route_answer(req, key)
        return Response(content, status_code=status, media_type="application/json")

    async def route_fast(body: bytes, headers: dict[bytes, bytes]) -> tuple[int, bytes] | None:
        """The same endpoint without the framework, for a valid body and key (see FastPath)."""
        try:
            req = RouteRequest.model_validate_json(body)
            key = authorize(headers.get(b"authorization", b"").decode("latin-1"), "route")
        except (ValidationError, HTTPException):
            return None  # FastAPI answers, with its own messages
        try:
            return await route_answer(req, key)
        except HTTPException as exc:
            return exc.status_code, msgspec.json.encode({"error": {"message": exc.detail, "type": "http_error"}})

    # ------------------------------------------------------------------ proxying

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, key: ApiKey | None = scope("complete")) -> Response:
        state = st()
        payload = req.model_dump(exclude_none=True, exclude_defaults=False)
        if key is not None and key.tenant:
            payload["cache_salt"] = key.tenant  # a tenant's KV never mixes with another's
        tokens = req.prompt if isinstance(req.prompt, list) else None
        text = req.prompt if isinstance(req.prompt, str) else None
        decision, body, n_blocks = await route(tokens, text, req.lora_id, payload.get("cache_salt"), req.model)
        chosen = decision.chosen
        if chosen is None:
            return _error(503, "no live node to route to", "unavailable")
        node = chosen.node_id
        inf = state.inflight[node]
        inf.requests += 1
        inf.blocks += n_blocks
        metrics.inflight.labels(node).set(inf.requests)
        state.proxied += 1

        def done(outcome: str) -> None:
            inf.requests -= 1
            inf.blocks -= n_blocks
            metrics.inflight.labels(node).set(inf.requests)
            metrics.proxied.labels(node, outcome).inc()
            if outcome == "upstream_error":
                state.upstream_errors += 1
                state.suspect_until[node] = time.monotonic() + s.suspect_s

        target = f"{chosen.url.rstrip('/')}/v1/completions"
        headers = {"x-kvflow-node": node, "x-kvflow-matched-tokens": str(body["matched_tokens"])}
        try:
            upstream = await state.client.send(state.client.build_request("POST", target, json=payload), stream=True)
        except httpx.HTTPError as exc:
            done("upstream_error")
            log.warning("node %s failed: %s", node, exc)
            return _error(502, f"upstream node {node} failed: {type(exc).__name__}: {exc}", "upstream_error",
                          node_id=node)

        if req.stream and upstream.status_code == 200:
            async def relay() -> AsyncIterator[bytes]:
                outcome = "ok"
                try:
                    async for chunk in upstream.aiter_raw():
                        yield chunk
                except httpx.HTTPError as exc:
                    outcome = "upstream_error"
                    log.warning("node %s failed mid-stream: %s", node, exc)
                    err = {"error": {"message": f"upstream node {node} failed mid-stream: {exc}",
                                     "type": "upstream_error", "node_id": node}}
                    yield b"data: " + json.dumps(err).encode() + b"\n\n"
                finally:
                    await upstream.aclose()
                    done(outcome)

            return StreamingResponse(relay(), media_type="text/event-stream", headers=headers)

        try:
            content = await upstream.aread()
        except httpx.HTTPError as exc:
            done("upstream_error")
            return _error(502, f"upstream node {node} failed: {type(exc).__name__}: {exc}", "upstream_error",
                          node_id=node)
        finally:
            await upstream.aclose()
        if upstream.status_code >= 500:
            done("upstream_error")
            return _error(502, f"upstream node {node} answered {upstream.status_code}: {content[:300]!r}",
                          "upstream_error", node_id=node)
        done("ok" if upstream.status_code < 400 else "client_error")
        return Response(content=content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type", "application/json"), headers=headers)

    # ------------------------------------------------------------------ reading

    def node_json(r: Any) -> dict[str, Any]:
        d = dict(r)
        d["last_seen"] = d["last_seen"].isoformat() if d.get("last_seen") else None
        d["counters"] = json.loads(d["counters"]) if isinstance(d.get("counters"), str) else d.get("counters")
        d["silent_s"] = float(d["silent_s"]) if d.get("silent_s") is not None else None
        inf = st().inflight.get(d["node_id"], Inflight())
        d["router_inflight"] = inf.requests
        d["suspect"] = st().suspect_until.get(d["node_id"], 0) > time.monotonic()
        return d

    @app.get("/v1/nodes")
    async def nodes(_: ApiKey | None = scope("read")) -> dict[str, Any]:
        return {"nodes": [node_json(r) for r in await st().reader.nodes(fresh=True)]}

    @app.get("/v1/nodes/{node_id}")
    async def node(node_id: str, _: ApiKey | None = scope("read")) -> Any:
        rows = [r for r in await st().reader.nodes(fresh=True) if r["node_id"] == node_id]
        if not rows:
            return _error(404, f"no node {node_id!r}", "not_found")
        out = node_json(rows[0])
        out["cache_by_priority"] = [dict(r) for r in await st().reader.fetch(
            "SELECT cache_level, priority, blocks, tokens FROM node_cache_by_priority WHERE node_id = $1 "
            "ORDER BY cache_level, priority DESC", node_id)]
        return out

    @app.get("/v1/stats")
    async def stats(_: ApiKey | None = scope("read")) -> dict[str, Any]:
        state = st()
        return {"decisions": state.decisions, "proxied": state.proxied, "upstream_errors": state.upstream_errors,
                "inflight": {k: asdict(v) for k, v in state.inflight.items() if v.requests},
                "uptime_s": round(time.time() - state.started, 1), "weights": asdict(state.weights),
                "tokenizer": state.tokenizer.name, "recent_decisions": list(state.recent)[:20]}

    @app.get("/v1/dashboard/data")
    async def dashboard_data(_: ApiKey | None = scope("read")) -> dict[str, Any]:
        state = st()
        reader = state.reader
        rows, comp, rates = await asyncio.gather(
            reader.nodes(fresh=True),
            reader.fetch("SELECT node_id, cache_level, priority, blocks FROM node_cache_by_priority"),
            reader.fetch("SELECT node_id, extract(epoch FROM minute) AS t, hit_rate FROM node_hit_rates "
                         "WHERE minute > now() - interval '30 minutes' ORDER BY minute"))
        return {"now": time.time(), "nodes": [node_json(r) for r in rows],
                "composition": [dict(r) for r in comp],
                "hit_rates": [{"node_id": r["node_id"], "t": float(r["t"]),
                               "hit_rate": float(r["hit_rate"]) if r["hit_rate"] is not None else None}
                              for r in rates],
                "decisions": list(state.recent)[:50], "router": {"decisions": state.decisions,
                                                                  "proxied": state.proxied,
                                                                  "upstream_errors": state.upstream_errors}}

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC / "dashboard.html", media_type="text/html")

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        try:
            rows = await st().reader.nodes()
        except Exception as exc:
            return JSONResponse(status_code=503, content={"status": "database unreachable", "error": str(exc)})
        live = sum(1 for r in rows if r["status"] == "live")
        return JSONResponse({"status": "ok", "nodes": len(rows), "live_nodes": live})

    @app.get("/metrics", include_in_schema=False)
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    app.add_middleware(BodyLimit, max_bytes=s.max_request_bytes)
    app.fast_routes = {"/v1/route": route_fast}  # outside all middleware (RouterApp)
    app.max_body_bytes = s.max_request_bytes
    return app
