"""Proxying a routed request to the chosen node: in-flight accounting, streaming, upstream errors.

Endpoint-neutral: ``POST /v1/completions`` uses it, and so can any other OpenAI endpoint that the
nodes serve under the same path (the body is forwarded as given).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from routing_api.decisions import Routed
from routing_api.errors import error_body, error_response
from routing_api.state import RouterState

log = logging.getLogger("kvflow.router")


async def forward(state: RouterState, routed: Routed, path: str, payload: dict[str, Any], stream: bool) -> Response:
    """Send ``payload`` to ``path`` on the routed node and answer with the node's response.

    The response names the node (``x-kvflow-node``) and its cached prompt tokens
    (``x-kvflow-matched-tokens``). A node's 2xx and 4xx answers pass through; with ``stream`` a
    200 streams through byte for byte.

    Args:
        state: the process's state (the HTTP client, the in-flight counts).
        routed: the decision (:func:`routing_api.decisions.route`).
        path: the node's endpoint, e.g. ``/v1/completions``.
        payload: the JSON body to send.
        stream: whether the client asked for server-sent events.

    Returns:
        The node's answer; 503 when no node was chosen; 502 (``upstream_error``) when the node
        could not be reached, failed or answered ≥ 500: it is then suspect for ``suspect_s``.
    """
    chosen = routed.decision.chosen
    if chosen is None:
        return error_response(503, "no live node to route to", "unavailable")
    node = chosen.node_id
    done = state.start_proxy(node, routed.prompt_blocks)
    target = f"{chosen.url.rstrip('/')}{path}"
    headers = {"x-kvflow-node": node, "x-kvflow-matched-tokens": str(routed.matched_tokens)}
    try:
        upstream = await state.client.send(state.client.build_request("POST", target, json=payload), stream=True)
    except httpx.HTTPError as exc:
        done("upstream_error")
        log.warning("node %s failed: %s", node, exc)
        return _failed(node, exc)
    if stream and upstream.status_code == 200:
        return StreamingResponse(_relay(upstream, node, done), media_type="text/event-stream", headers=headers)
    try:
        content = await upstream.aread()
    except httpx.HTTPError as exc:
        done("upstream_error")
        return _failed(node, exc)
    finally:
        await upstream.aclose()
    if upstream.status_code >= 500:
        done("upstream_error")
        return error_response(502, f"upstream node {node} answered {upstream.status_code}: {content[:300]!r}",
                              "upstream_error", node_id=node)
    done("ok" if upstream.status_code < 400 else "client_error")
    return Response(content=content, status_code=upstream.status_code,
                    media_type=upstream.headers.get("content-type", "application/json"), headers=headers)


def _failed(node: str, exc: httpx.HTTPError) -> JSONResponse:
    return error_response(502, f"upstream node {node} failed: {type(exc).__name__}: {exc}", "upstream_error",
                          node_id=node)


async def _relay(upstream: httpx.Response, node: str, done: Callable[[str], None]) -> AsyncIterator[bytes]:
    """The node's stream, byte for byte; if it breaks, one last ``data:`` event with the error."""
    outcome = "ok"
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        outcome = "upstream_error"
        log.warning("node %s failed mid-stream: %s", node, exc)
        err = error_body(f"upstream node {node} failed mid-stream: {exc}", "upstream_error", node_id=node)
        yield b"data: " + json.dumps(err).encode() + b"\n\n"
    finally:
        await upstream.aclose()
        done(outcome)
