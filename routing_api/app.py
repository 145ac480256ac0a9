"""The routing API (FastAPI): decide, explain, proxy; nodes and stats; a live dashboard.

Routes only parse, query and format: the decision is :func:`routing_api.scoring.decide`.

* ``POST /v1/route`` — the chosen node, its URL, the matched blocks and tokens, and every
  candidate with the parts of its score.
* ``POST /v1/completions`` — route, then proxy to the chosen node (streaming passes through); the
  response names the node in ``x-kvflow-node``. A node that fails is reported as an upstream
  error (502, or an error event mid-stream) and avoided for ``suspect_s``.
* ``GET /v1/nodes``, ``/v1/nodes/{node_id}``, ``/v1/stats``, ``/healthz``, ``/metrics``,
  ``/dashboard`` (and its data, ``/v1/dashboard/data``); OpenAPI docs at ``/docs``.

This module only assembles the app: the endpoints are ``routing_api.routes``, what they share
``routing_api.deps`` and ``routing_api.state``, the fast path ``routing_api.fastpath``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import SecretStr
from sqlalchemy.engine import make_url
from starlette.exceptions import HTTPException

from eventbus.config import Environment, RuntimeSettings, check_secret
from openai_api.http import BodyLimit
from routing_api.config import RouterSettings, parse_api_keys
from routing_api.errors import Unavailable, on_http, on_invalid, on_unavailable
from routing_api.fastpath import RouterApp
from routing_api.routes import completions, dashboard, health, nodes, route
from routing_api.state import Metrics, RouterState
from state_store.config import DatabaseSettings

log = logging.getLogger("kvflow.router")


def create_app(settings: RouterSettings | None = None, database_url: str | None = None) -> FastAPI:
    """The router's app (also ``uvicorn routing_api.app:create_app --factory``, one per worker).

    Args:
        settings: the router's settings (default: from the environment).
        database_url: the database to read (default: the reader role's URL from the environment,
            checked for placeholder passwords in production).

    Raises:
        ValueError: a bad configuration (no API keys in production, an unknown key scope, a
            placeholder password), before anything starts.
    """
    s = settings or RouterSettings()
    env = RuntimeSettings().env
    keys = parse_api_keys(s.api_key_spec())
    if not keys:
        if env is Environment.PRODUCTION:
            raise ValueError("KVFLOW_ROUTER_API_KEYS is required when KVFLOW_ENV=production")
        log.warning("development mode: no API keys, the router is open")
    db = DatabaseSettings()
    if database_url is None:
        db.check(env, writer=False)  # it only reads
    url = database_url or db.reader()
    if s.primary_reader_url is not None and database_url is None:
        pw = make_url(s.primary_reader_url.get_secret_value()).password
        check_secret("the password in KVFLOW_ROUTER_PRIMARY_READER_URL", SecretStr(pw) if pw else None, env)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = app.state.router = RouterState.open(s, keys, url, db, metrics)
        lag = None
        if state.replication is not None:  # the standby's lag, and the reader to use (routing_api/replica.py)
            lag = asyncio.ensure_future(state.replication.run(s.replica_check_s, state.use_reader))
        try:
            yield
        finally:
            if lag is not None:
                lag.cancel()
                with contextlib.suppress(BaseException):
                    await lag
            await state.close()

    app = RouterApp(title="kvflow routing API", version="1", lifespan=lifespan,
                    description="KV-aware routing over the materialized cache state of an inference fleet.")
    app.exception_handler(RequestValidationError)(on_invalid)
    app.exception_handler(HTTPException)(on_http)  # Starlette's: the framework's own 404 and 405 too
    app.exception_handler(Unavailable)(on_unavailable)
    for module in (route, completions, nodes, dashboard, health):  # in this order (the OpenAPI's)
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=s.max_request_bytes)
    app.fast_routes = {"/v1/route": route.route_fast}  # outside all middleware (RouterApp)
    app.max_body_bytes = s.max_request_bytes
    return app
