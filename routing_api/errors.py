"""The router's error answers, in one shape (OpenAI's): ``{"error": {"message", "type", ...}}``.

``type`` is ``invalid_request_error`` (an invalid body), ``http_error`` (an ``HTTPException``:
401, 403, a model no node serves, a chunked body over the limit, a method an endpoint does not
take), ``not_found`` (an unknown node or path), ``unavailable`` (503) or ``upstream_error`` (502,
with ``node_id``); docs/router.md, "Errors".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class Unavailable(Exception):
    """What the router cannot do now (PostgreSQL away, no fleet known yet): 503, type ``unavailable``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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


def _not_json(body: Any, error: Mapping[str, Any]) -> str:
    """What a body that is not JSON gets told: what was expected, what was wrong, and where."""
    loc = error.get("loc", ())
    pos = loc[-1] if loc and isinstance(loc[-1], int) else 0
    what = (error.get("ctx") or {}).get("error", "not JSON")
    doc = body.decode("utf-8", "replace") if isinstance(body, bytes) else body if isinstance(body, str) else ""
    at = json.JSONDecodeError(what, doc, min(pos, len(doc)))
    return f"the body must be a JSON object: {what} at line {at.lineno} column {at.colno}"


async def on_invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 for an invalid body: the first five problems, each ``field.path: message`` (a body that
    is not JSON at all: what was expected and where the parser stopped)."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return error_response(422, _not_json(exc.body, errors[0]))
    parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}"
             for e in errors[:5]]
    return error_response(422, "; ".join(parts))


async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """An ``HTTPException`` (401, 403, 404, 413, …) in the error shape, with its headers; the
    framework's own 404 (no such path) and 405 (a method the path does not take) say which."""
    if isinstance(exc, HTTPException) or exc.status_code not in (404, 405):  # ours: as raised
        return error_response(exc.status_code, exc.detail, "http_error", headers=exc.headers)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return error_response(404, f"no such endpoint: {where}", "not_found", headers=exc.headers)
    allowed = (exc.headers or {}).get("Allow", "")
    return error_response(405, f"method not allowed: {where} (allowed: {allowed or 'none'})", "http_error",
                          headers=exc.headers)


async def on_unavailable(request: Request, exc: Unavailable) -> JSONResponse:
    """503 for what the router cannot do now (``Unavailable``: PostgreSQL away, no fleet known yet)."""
    return error_response(503, exc.message, "unavailable")
