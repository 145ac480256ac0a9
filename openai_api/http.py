"""HTTP plumbing shared by the node and the router (ASGI; no kvflow imports)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with 413.

    A declared ``Content-Length`` over the limit is refused before anything is read; a body without
    one (chunked) is counted as the application reads it and refused as soon as it passes the limit,
    so no body is ever buffered beyond ``max_bytes``. Plain ASGI: no task per request.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"request body larger than {self.max_bytes} bytes"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and (not value.isdigit() or int(value) > self.max_bytes):
                response = JSONResponse(status_code=413, content={"error": {
                    "message": self._message(), "type": "invalid_request_error"}})
                await response(scope, receive, send)
                return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # FastAPI lets an HTTPException raised while reading the body through to the
                    # app's exception handler, which answers in the service's error format.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)
