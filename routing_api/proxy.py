"""Proxying a routed request to the chosen node: in-flight accounting, streaming, upstream errors.

Endpoint-neutral: ``POST /v1/completions`` and ``POST /v1/chat/completions`` use it; the body is
forwarded as the client sent it (byte for byte, unless a tenant's key sets its ``cache_salt`` or the
router's retention goes in, in the words of the candidate's engine: ``routing_api.engine_words``).

A node whose connection is refused or times out (``httpx.ConnectError``, ``ConnectTimeout``:
nothing was sent) becomes suspect, and the request goes to the next candidate in the decision's
order (``Decision.ranked``), up to every eligible one; only when all fail is the answer 502. Any
other failure (the request was sent: it may have run) is a 502 at once, never sent again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from routing_api.decisions import Routed
from routing_api.errors import error_body, error_response
from routing_api.scoring import Candidate, routed_work
from routing_api.state import Proxied, RouterState

log = logging.getLogger("kvflow.router")

#: Failures before anything was sent: the next candidate may take the request.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)

#: ``forward``'s hook on a 200: the node that answered and the answer's usage (None: it had none).
Observe = Callable[[str, "dict[str, Any] | None"], None]
#: ``forward``'s hook on a whole 200 JSON answer: it may add to the body before it is sent back.
Amend = Callable[["dict[str, Any]"], None]


@dataclass(frozen=True)
class Outgoing:
    """What goes to one candidate: the body, more headers for the answer, and ``amend``."""

    content: bytes
    headers: dict[str, str] = field(default_factory=dict)
    amend: Amend | None = None


#: ``forward``'s body for each candidate it tries (candidates of other engines take other words).
Prepare = Callable[[Candidate], Outgoing]
#: How much of a stream's end is kept to find its usage chunk.
TAIL_BYTES = 8192


def stream_usage(tail: bytes) -> dict[str, Any] | None:
    """The usage of a stream: its last chunk with a non-null usage, in the stream's ``tail``."""
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                usage = json.loads(line[6:]).get("usage")
            except ValueError:
                continue
            if isinstance(usage, dict):
                return usage
    return None


async def forward(state: RouterState, routed: Routed, path: str, prepare: Prepare, stream: bool, *,
                  observe: Observe | None = None) -> Response:
    """Send ``prepare(candidate)``'s body to ``path`` on the routed node and answer with the node's response.

    The response names the node that answered (``x-kvflow-node``) and its cached prompt tokens
    (``x-kvflow-matched-tokens``). A node's 2xx and 4xx answers pass through; with ``stream`` a
    200 streams through byte for byte.

    Args:
        state: the process's state (the HTTP client, the in-flight counts).
        routed: the decision (:func:`routing_api.decisions.route`).
        path: the node's endpoint, e.g. ``/v1/completions``.
        prepare: the JSON body for a candidate, the answer's extra headers, and its ``amend``
            (called with a whole 200 JSON answer's body, which it may add to, e.g. ``kvflow``).
        stream: whether the client asked for server-sent events.
        observe: called once a 200 has been sent back whole or streamed, with the node and the usage.

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
        out = prepare(cand)
        request = state.client.build_request("POST", f"{cand.url.rstrip('/')}{path}", content=out.content,
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
        return await _answer(upstream, cand, routed, done, stream, observe, out.amend, out.headers)
    first, error = refused[0]
    others = "; ".join(f"{n}: {type(e).__name__}" for n, e in refused[1:])
    message = f"upstream node {first} failed: {type(error).__name__}: {error}"
    if others:
        message += f" (and every other candidate refused the connection: {others})"
    return error_response(502, message[:2000], "upstream_error", node_id=first)


async def _answer(upstream: httpx.Response, cand: Candidate, routed: Routed, done: Proxied, stream: bool,
                  observe: Observe | None, amend: Amend | None, extra: dict[str, str]) -> Response:
    """The node's response to the client: streamed (a 200 with ``stream``), else read whole."""
    node = cand.node_id
    headers = {"x-kvflow-node": node, "x-kvflow-matched-tokens": str(cand.matched_tokens), **extra}
    if stream and upstream.status_code == 200:
        return StreamingResponse(_relay(upstream, node, done, observe), media_type="text/event-stream",
                                 headers=headers)
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
    if upstream.status_code == 200 and (observe or amend):
        content = _whole(content, node, observe, amend)
    return Response(content=content, status_code=upstream.status_code,
                    media_type=upstream.headers.get("content-type", "application/json"), headers=headers)


def _whole(content: bytes, node: str, observe: Observe | None, amend: Amend | None) -> bytes:
    """A whole 200 answer seen by ``observe`` and amended by ``amend`` (unchanged if not JSON)."""
    try:
        body = json.loads(content)
    except ValueError:
        return content
    if not isinstance(body, dict):
        return content
    if observe is not None:
        usage = body.get("usage")
        observe(node, usage if isinstance(usage, dict) else None)
    if amend is None:
        return content
    amend(body)
    return json.dumps(body).encode()


def _failed(node: str, exc: BaseException) -> JSONResponse:
    return error_response(502, f"upstream node {node} failed: {type(exc).__name__}: {exc}", "upstream_error",
                          node_id=node)


async def _relay(upstream: httpx.Response, node: str, done: Proxied,
                 observe: Observe | None = None) -> AsyncIterator[bytes]:
    """The node's stream, byte for byte (its first chunk is the request's first token, for the
    tail guard's queues); if it breaks, one last ``data:`` event with the error. ``observe``
    gets the usage of its last chunk that has one (kept from its last ``TAIL_BYTES``)."""
    outcome = "ok"
    tail = b""
    try:
        async for chunk in upstream.aiter_raw():
            done.first_token()
            if observe is not None:
                tail = (tail + chunk)[-TAIL_BYTES:]
            yield chunk
    except httpx.HTTPError as exc:
        outcome = "upstream_error"
        log.warning("node %s failed mid-stream: %s", node, exc)
        err = error_body(f"upstream node {node} failed mid-stream: {exc}", "upstream_error", node_id=node)
        yield b"data: " + json.dumps(err).encode() + b"\n\n"
    finally:
        await upstream.aclose()
        done(outcome)
        if observe is not None and outcome == "ok":
            observe(node, stream_usage(tail))
