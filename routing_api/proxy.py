"""Proxying a routed request to the chosen node: in-flight accounting, streaming, upstream errors.

Endpoint-neutral: ``POST /v1/completions`` and ``POST /v1/chat/completions`` use it; the body is
forwarded as the client sent it (byte for byte, unless a tenant's key sets its ``cache_salt``).

A node whose connection is refused or times out (``httpx.ConnectError``, ``ConnectTimeout``:
nothing was sent) becomes suspect, and the request goes to the next candidate in the decision's
order (``Decision.ranked``), up to every eligible one; only when all fail is the answer 502. Any
other failure (the request was sent: it may have run) is a 502 at once, never sent again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from routing_api.decisions import Routed
from routing_api.errors import error_body, error_response
from routing_api.scoring import Candidate, routed_work
from routing_api.state import Proxied, RouterState

log = logging.getLogger("kvflow.router")

#: Failures before anything was sent: the next candidate may take the request.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


async def forward(state: RouterState, routed: Routed, path: str, content: bytes, stream: bool) -> Response:
    """Send ``content`` to ``path`` on the routed node and answer with the node's response.

    The response names the node that answered (``x-kvflow-node``) and its cached prompt tokens
    (``x-kvflow-matched-tokens``). A node's 2xx and 4xx answers pass through; with ``stream`` a
    200 streams through byte for byte.

    Args:
        state: the process's state (the HTTP client, the in-flight counts).
        routed: the decision (:func:`routing_api.decisions.route`).
        path: the node's endpoint, e.g. ``/v1/completions``.
        content: the JSON body to send.
        stream: whether the client asked for server-sent events.

    Returns:
        The node's answer; 503 when no node was chosen; 502 (``upstream_error``) when the node
        failed or answered ≥ 500, or when every candidate refused the connection: a node that
        failed is suspect for ``suspect_s``.
    """
    ranked = routed.decision.ranked()
    if not ranked:
        return error_response(503, "no live node to route to", "unavailable")
    refused: list[tuple[str, httpx.HTTPError]] = []
    for cand in ranked:
        done = state.start_proxy(cand.node_id, cand.prompt_blocks, routed_work(cand),  # in the node's own blocks
                                 cand.block_size)
        request = state.client.build_request("POST", f"{cand.url.rstrip('/')}{path}", content=content,
                                           headers={"content-type": "application/json"})
        try:
            upstream = await state.client.send(request, stream=True)
        except NOT_SENT as exc:
            done("upstream_error", ran=False)
            log.warning("node %s refused the connection (%s: %s); trying the next candidate", cand.node_id,
                        type(exc).__name__, exc)
            refused.append((cand.node_id, exc))
            continue
        except httpx.HTTPError as exc:
            done("upstream_error")
            log.warning("node %s failed: %s", cand.node_id, exc)
            return _failed(cand.node_id, exc)
        if refused:
            log.warning("answered by %s after %d refused connection(s)", cand.node_id, len(refused))
        return await _answer(upstream, cand, routed, done, stream)
    first, error = refused[0]
    others = "; ".join(f"{n}: {type(e).__name__}" for n, e in refused[1:])
    message = f"upstream node {first} failed: {type(error).__name__}: {error}"
    if others:
        message += f" (and every other candidate refused the connection: {others})"
    return error_response(502, message[:2000], "upstream_error", node_id=first)


async def _answer(upstream: httpx.Response, cand: Candidate, routed: Routed, done: Proxied,
                  stream: bool) -> Response:
    """The node's response to the client: streamed (a 200 with ``stream``), else read whole."""
    node = cand.node_id
    headers = {"x-kvflow-node": node, "x-kvflow-matched-tokens": str(cand.matched_tokens)}
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


def _failed(node: str, exc: BaseException) -> JSONResponse:
    return error_response(502, f"upstream node {node} failed: {type(exc).__name__}: {exc}", "upstream_error",
                          node_id=node)


async def _relay(upstream: httpx.Response, node: str, done: Proxied) -> AsyncIterator[bytes]:
    """The node's stream, byte for byte (its first chunk is the request's first token, for the
    tail guard's queues); if it breaks, one last ``data:`` event with the error."""
    outcome = "ok"
    try:
        async for chunk in upstream.aiter_raw():
            done.first_token()
            yield chunk
    except httpx.HTTPError as exc:
        outcome = "upstream_error"
        log.warning("node %s failed mid-stream: %s", node, exc)
        err = error_body(f"upstream node {node} failed mid-stream: {exc}", "upstream_error", node_id=node)
        yield b"data: " + json.dumps(err).encode() + b"\n\n"
    finally:
        await upstream.aclose()
        done(outcome)
