"""The router's error answers, in one shape (OpenAI's): ``{"error": {"message", "type", ...}}``.

``type`` is ``invalid_request_error`` (an invalid body), ``http_error`` (an ``HTTPException``:
401, 403, a model no node serves, a chunked body over the limit), ``not_found``, ``unavailable``
(503) or ``upstream_error`` (502, with ``node_id``); docs/router.md, "Errors".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


def error_body(message: str, kind: str = "invalid_request_error", **extra: Any) -> dict[str, Any]:
    """``{"error": {"message": message, "type": kind, **extra}}``."""
    return {"error": {"message": message, "type": kind, **extra}}


def error_json(message: str, kind: str = "invalid_request_error", **extra: Any) -> bytes:
    """:func:`error_body` as JSON bytes (for the fast path, which sends bytes)."""
    return msgspec.json.encode(error_body(message, kind, **extra))


def error_response(status: int, message: str, kind: str = "invalid_request_error", *,
                   headers: Mapping[str, str] | None = None, **extra: Any) -> JSONResponse:
    """An error answer; one about a node (``node_id`` in ``extra``) names it in ``x-kvflow-node``."""
    node = extra.get("node_id")
    if node:
        headers = {**(headers or {}), "x-kvflow-node": node}
    return JSONResponse(status_code=status, content=error_body(message, kind, **extra), headers=headers)


async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 for an invalid body: the first five problems, each ``field.path: message``."""
    parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
             for e in exc.errors()[:5]]
    return error_response(422, "; ".join(parts))


async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
    """An ``HTTPException`` (401, 403, 404, 413, …) in the error shape, with its headers."""
    return error_response(exc.status_code, exc.detail, "http_error", headers=exc.headers)
