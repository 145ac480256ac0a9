"""What the node's endpoints share: the node and metrics from ``app.state``, the API-key check,
the OpenAI error shape, and running a function on the engine's thread."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Depends, HTTPException, Request
from fastapi.responses import JSONResponse

from inference_node.metrics import Metrics
from inference_node.node import Node

T = TypeVar("T")


def node_of(request: Request) -> Node:
    node: Node = request.app.state.node
    return node


def metrics_of(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


def authorize(request: Request) -> None:
    """A bearer key from ``KVFLOW_NODE_API_KEYS`` when keys are set (else 401)."""
    keys: frozenset[str] = request.app.state.api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(401, "missing bearer API key", headers={"WWW-Authenticate": "Bearer"})
    if not any(secrets.compare_digest(token, k) for k in keys):
        raise HTTPException(401, "unknown API key", headers={"WWW-Authenticate": "Bearer"})


#: ``dependencies=`` of the endpoints that need a key.
authorized: list[Any] = [Depends(authorize)]


def error(status: int, message: str, kind: str = "invalid_request_error", *, param: str | None = None,
          code: str | None = None) -> JSONResponse:
    """An answer in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": code}})


async def on_engine(node: Node, fn: Callable[[], T]) -> T:
    """Run ``fn`` on the engine thread; a crashed engine is a 503, never a hang."""
    engine = node.engine
    try:
        return await asyncio.wrap_future(engine.call(fn))
    except RuntimeError as exc:
        if engine.fatal is None:
            raise
        raise HTTPException(503, str(exc)) from exc
