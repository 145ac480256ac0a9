"""What the routes depend on: the process's :class:`RouterState` and the API key's scope.

The routes take them as FastAPI dependencies (``Depends(get_state)``, ``scope("read")``); the
fast path, which runs before FastAPI, calls :func:`state_of` and :func:`authorize` itself.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request

from routing_api.config import ApiKey
from routing_api.state import RouterState


def state_of(app: Any) -> RouterState:
    """The state the app's lifespan put on ``app.state``."""
    state: RouterState = app.state.router
    return state


async def get_state(request: Request) -> RouterState:  # async: no thread hop per request
    """The dependency: the state of the app serving ``request``."""
    return state_of(request.app)


#: A route's parameter ``state: State``: the process's state.
State = Annotated[RouterState, Depends(get_state)]


def authorize(keys: Mapping[str, ApiKey], header: str, needed: str) -> ApiKey | None:
    """The API key of an ``Authorization`` header, if it grants ``needed``.

    Args:
        keys: the configured keys; none: the router is open and every request may pass.
        header: the request's ``Authorization`` header ("" when absent).
        needed: the endpoint's scope (``route``, ``complete``, ``read``).

    Returns:
        The key, or None when no keys are configured.

    Raises:
        HTTPException: 401 (with ``WWW-Authenticate: Bearer``) without a bearer key or with an
            unknown one; 403 naming the scope when the key lacks it.
    """
    if not keys:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(401, "missing bearer API key", headers={"WWW-Authenticate": "Bearer"})
    key = next((k for k in keys.values() if secrets.compare_digest(token, k.key)), None)
    if key is None:
        raise HTTPException(401, "unknown API key", headers={"WWW-Authenticate": "Bearer"})
    if needed not in key.scopes:
        raise HTTPException(403, f"this API key lacks the '{needed}' scope")
    return key


def scope(needed: str, *alternatives: str) -> Any:
    """The dependency of an endpoint that needs the scope ``needed`` (or one of ``alternatives``):
    the request's key (or None)."""

    async def check(request: Request) -> ApiKey | None:  # async: no thread hop per request
        keys, header = state_of(request.app).keys, request.headers.get("authorization", "")
        for other in alternatives:
            try:
                return authorize(keys, header, other)
            except HTTPException as exc:
                if exc.status_code != 403:
                    raise
        return authorize(keys, header, needed)

    return Depends(check)
