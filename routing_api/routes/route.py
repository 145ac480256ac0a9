"""``POST /v1/route``: the chosen node and why, through FastAPI and through the fast path."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, HTTPException, Response
from pydantic import ValidationError

from openai_api.chat import ChatTemplateError
from openai_api.schemas import RouteRequest
from routing_api.config import ApiKey
from routing_api.decisions import route
from routing_api.deps import State, authorize, scope, state_of
from routing_api.errors import Unavailable, error_body, error_json
from routing_api.routes.completions import chat_prompt, key_node, tenant_of
from routing_api.state import RouterState

router = APIRouter()


async def route_answer(state: RouterState, req: RouteRequest, key: ApiKey | None) -> tuple[int, bytes]:
    """``POST /v1/route`` once the body is valid and the key may route: status and JSON.

    Raises:
        HTTPException: 404 when no node serves the request's ``model``; 400 for a chat without a
            model in a fleet of several, or whose messages its template refuses.
        Unavailable: no fleet known yet (PostgreSQL has never been read).
    """
    if sum(x is not None for x in (req.prompt, req.token_ids, req.messages)) != 1:
        return 422, error_json("give exactly one of prompt, token_ids and messages")
    tenant = tenant_of(key)
    salt = tenant or req.cache_salt
    if req.messages is not None:  # routed as POST /v1/chat/completions routes it
        try:
            model, text, _ = await chat_prompt(state, req)
        except ChatTemplateError as exc:
            return 400, error_json(f"messages: {exc}")
        keyed = await key_node(state, tenant, model, req.prompt_cache_key)
        routed = await route(state, None, text, req.lora_id, salt, model, special_tokens=False, key_node=keyed)
    else:
        keyed = await key_node(state, tenant, req.model, req.prompt_cache_key)
        routed = await route(state, req.token_ids, req.prompt, req.lora_id, salt, req.model, key_node=keyed)
    if routed.decision.chosen is None:
        return 503, msgspec.json.encode({**error_body("no live node", "unavailable"), **routed.body})
    return 200, msgspec.json.encode(routed.body)


@router.post("/v1/route")
async def route_endpoint(req: RouteRequest, state: State, key: ApiKey | None = scope("route")) -> Response:
    status, content = await route_answer(state, req, key)
    return Response(content, status_code=status, media_type="application/json")


async def route_fast(asgi_scope: dict[str, Any], body: bytes, headers: dict[bytes, bytes]) -> tuple[int, bytes] | None:
    """The same endpoint without the framework, for a valid body and key (``routing_api.fastpath``)."""
    state = state_of(asgi_scope["app"])
    try:
        req = RouteRequest.model_validate_json(body)
        key = authorize(state.keys, headers.get(b"authorization", b"").decode("latin-1"), "route")
    except (ValidationError, HTTPException):
        return None  # FastAPI answers, with its own messages
    try:
        return await route_answer(state, req, key)
    except HTTPException as exc:
        return exc.status_code, error_json(exc.detail, "http_error")
    except Unavailable as exc:
        return 503, error_json(exc.message, "unavailable")
