"""Hot ``POST`` endpoints answered in plain ASGI, in front of FastAPI (``POST /v1/route``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI

#: A fast handler: ``(scope, body, headers)`` → ``(status, JSON bytes)``, or None to let the app answer.
#: ``scope["app"]`` is the application (its ``state``); ``headers`` are the request's, lower-case.
FastHandler = Callable[[dict[str, Any], bytes, dict[bytes, bytes]], Awaitable[tuple[int, bytes] | None]]


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
        answer = await handler(scope, body, dict(scope["headers"]))
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


async def _send_json(send: Any, status: int, content: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]})
    await send({"type": "http.response.body", "body": content})


class RouterApp(FastAPI):
    """FastAPI with :class:`FastPath` outermost in its middleware stack.

    Attributes:
        fast_routes: path → :data:`FastHandler` (``POST`` only).
        max_body_bytes: the largest body the fast path reads; a larger one goes to the app (413).
    """

    fast_routes: dict[str, FastHandler]
    max_body_bytes: int

    def build_middleware_stack(self) -> Any:
        return FastPath(super().build_middleware_stack(), self.fast_routes, self.max_body_bytes)
