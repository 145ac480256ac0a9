"""``GET /healthz`` (503 while PostgreSQL is unreachable) and ``GET /metrics`` (Prometheus): open to all."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from routing_api.deps import State
from routing_api.errors import error_body
from routing_api.queries import DatabaseUnavailable

router = APIRouter()


@router.get("/healthz")
async def healthz(state: State) -> JSONResponse:
    try:
        rows = await state.reader.nodes()
    except Exception as exc:  # the error shape, plus what a probe reads
        message = exc.message if isinstance(exc, DatabaseUnavailable) else f"{type(exc).__name__}: {exc}"
        return JSONResponse(status_code=503, content={
            "status": "database unreachable", **error_body(message, "unavailable"),
            # routing goes on, by load alone, over the last fleet read (none: no fleet known yet)
            "degraded": state.reader.known, "known_nodes": len(state.reader.last_nodes)})
    live = sum(1 for r in rows if r["status"] == "live")
    return JSONResponse({"status": "ok", "nodes": len(rows), "live_nodes": live})


@router.get("/metrics", include_in_schema=False)
async def prom(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type="text/plain; version=0.0.4")
