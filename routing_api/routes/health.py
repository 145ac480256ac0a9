"""``GET /healthz`` (503 while PostgreSQL is unreachable) and ``GET /metrics`` (Prometheus): open to all."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from routing_api.deps import State

router = APIRouter()


@router.get("/healthz")
async def healthz(state: State) -> JSONResponse:
    try:
        rows = await state.reader.nodes()
    except Exception as exc:
        return JSONResponse(status_code=503, content={"status": "database unreachable", "error": str(exc)})
    live = sum(1 for r in rows if r["status"] == "live")
    return JSONResponse({"status": "ok", "nodes": len(rows), "live_nodes": live})


@router.get("/metrics", include_in_schema=False)
async def prom(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type="text/plain; version=0.0.4")
