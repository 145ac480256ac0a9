"""``POST /v1/completions``: route, then proxy to the chosen node (``routing_api.proxy``)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from eventbus.api import CompletionRequest
from routing_api.config import ApiKey
from routing_api.decisions import route
from routing_api.deps import State, scope
from routing_api.proxy import forward

router = APIRouter()


@router.post("/v1/completions")
async def completions(req: CompletionRequest, state: State, key: ApiKey | None = scope("complete")) -> Response:
    payload = req.model_dump(exclude_none=True, exclude_defaults=False)
    if key is not None and key.tenant:
        payload["cache_salt"] = key.tenant  # a tenant's KV never mixes with another's
    tokens = req.prompt if isinstance(req.prompt, list) else None
    text = req.prompt if isinstance(req.prompt, str) else None
    routed = await route(state, tokens, text, req.lora_id, payload.get("cache_salt"), req.model)
    return await forward(state, routed, "/v1/completions", payload, req.stream)
