"""The fleet as the router sees it: ``/v1/nodes``, ``/v1/nodes/{node_id}``, ``/v1/stats``, and
``/v1/prompt_cache_keys`` (each key's node and hit rate), and ``/v1/dashboard/data`` (what the
dashboard draws, live nodes first).

Those that read PostgreSQL answer 503 (``unavailable``) while it cannot be read
(``routing_api.queries.DatabaseUnavailable``, answered by ``routing_api.errors.on_unavailable``);
``/v1/stats`` reads only this process's memory."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter

from eventbus.protocol import NodeId
from routing_api.config import ApiKey
from routing_api.deps import State, scope
from routing_api.errors import error_response
from routing_api.schemas import node_json
from routing_api.state import RouterState

router = APIRouter()


def _node(state: RouterState, row: Any) -> dict[str, Any]:
    node_id = row["node_id"]
    return node_json(row, state.router_inflight(node_id), state.is_suspect(node_id))


@router.get("/v1/nodes")
async def nodes(state: State, _: ApiKey | None = scope("read")) -> dict[str, Any]:
    return {"nodes": [_node(state, r) for r in await state.reader.nodes(fresh=True)]}


@router.get("/v1/nodes/{node_id}")
async def node(node_id: str, state: State, _: ApiKey | None = scope("read")) -> Any:
    rows = [r for r in await state.reader.nodes(fresh=True) if r["node_id"] == node_id]
    if not rows:
        return error_response(404, f"no node {node_id!r}", "not_found")
    out = _node(state, rows[0])
    out["cache_by_priority"] = await state.reader.cache_by_priority(NodeId(node_id))
    return out


#: The dashboard's order of statuses: the nodes that serve first, the gone ones last.
STATUS_ORDER = {"live": 0, "suspect": 1, "resyncing": 2, "stale": 3, "unreachable": 4, "gone": 5}


def dashboard_order(node: dict[str, Any]) -> tuple[int, str]:
    """The sort key of a node on the dashboard: live first (a suspect one after them), then by id."""
    status = "suspect" if node.get("suspect") and node["status"] == "live" else node["status"]
    return STATUS_ORDER.get(status, 4), node["node_id"]


def _counts(state: RouterState) -> dict[str, int]:
    return {"decisions": state.decisions, "proxied": state.proxied, "upstream_errors": state.upstream_errors}


@router.get("/v1/stats")
async def stats(state: State, _: ApiKey | None = scope("read")) -> dict[str, Any]:
    return {**_counts(state),
            "inflight": {k: asdict(v) for k, v in state.inflight.items() if v.requests},
            "tail_guard": {**state.tail.describe(),
                           "prefill": {k: q.describe(time.monotonic()) for k, q in state.prefill.items()}},
            "uptime_s": round(time.time() - state.started, 1), "weights": asdict(state.weights),
            "tokenizer": state.tokenizer.name, "chat_templates": state.templates.describe(),
            "replication": state.replication.state.json() if state.replication is not None else None,
            "recent_decisions": list(state.recent)[:20]}


@router.get("/v1/prompt_cache_keys")
async def prompt_cache_keys(state: State, key: ApiKey | None = scope("read")) -> dict[str, Any]:
    """The most recently used ``prompt_cache_key``s, their node and hit rate (a tenant's key: its own)."""
    return {"keys": await state.cache_keys.stats(key.tenant if key is not None else None)}


@router.get("/v1/dashboard/data")
async def dashboard_data(state: State, key: ApiKey | None = scope("read")) -> dict[str, Any]:
    reader = state.reader
    rows, composition, hit_rates, keys = await asyncio.gather(
        reader.nodes(fresh=True), reader.composition(), reader.hit_rates(),
        state.cache_keys.stats(key.tenant if key is not None else None, 20))
    shown = sorted((_node(state, r) for r in rows), key=dashboard_order)
    return {"now": time.time(), "nodes": shown, "composition": composition, "hit_rates": hit_rates,
            "prompt_cache_keys": keys, "decisions": list(state.recent)[:50], "router": _counts(state)}
