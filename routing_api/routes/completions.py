"""``POST /v1/completions`` and ``POST /v1/chat/completions``: route, then proxy to the chosen node
(``routing_api.proxy``), and ``GET /v1/models``, the models of the live fleet.

The router reads only what routing needs (``openai_api.schemas.ProxiedCompletion``, ``ProxiedChat``:
the model, the prompt or messages, ``cache_salt``, ``kv_retention``, ``lora_id``, ``stream``) and
forwards the body as the client sent it, so every parameter a node accepts works through it, and
a node's 400 for one it cannot honour comes back as it is. A tenant's key sets ``cache_salt`` (its
KV never mixes with another's): then the body is re-encoded with it.

A chat is routed by its prompt as the node will compute it: the messages rendered through the
model's chat template (``routing_api.templates``), tokenized without special tokens (the template
writes them), hashed and matched as a completion's text.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Protocol

from fastapi import APIRouter, HTTPException, Request, Response

from openai_api.chat import ChatTemplateError, normalize_messages
from openai_api.schemas import ProxiedChat, ProxiedCompletion
from routing_api.config import ApiKey
from routing_api.decisions import fleet_rows, route
from routing_api.deps import State, scope
from routing_api.errors import error_response
from routing_api.proxy import forward
from routing_api.state import RouterState

router = APIRouter()


async def _body(request: Request, key: ApiKey | None) -> tuple[bytes, str | None]:
    """The body to forward and the cache salt to route with (a tenant's, set in the body)."""
    raw = await request.body()
    if key is None or not key.tenant:
        return raw, None
    payload = json.loads(raw)
    payload["cache_salt"] = key.tenant
    return json.dumps(payload).encode(), key.tenant


@router.post("/v1/completions")
async def completions(req: ProxiedCompletion, request: Request, state: State,
                      key: ApiKey | None = scope("complete")) -> Response:
    content, tenant = await _body(request, key)
    prompt = req.first_prompt()
    text, tokens = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    routed = await route(state, tokens, text, req.lora_id, tenant or req.cache_salt, req.model)
    return await forward(state, routed, "/v1/completions", content, req.stream)


class Chat(Protocol):
    """What a chat's prompt is rendered from (``ProxiedChat``, ``RouteRequest``)."""

    model: str | None
    add_generation_prompt: bool

    def chat_messages(self) -> list[dict[str, Any]]: ...
    def chat_tools(self) -> list[dict[str, Any]] | None: ...


async def chat_prompt(state: RouterState, chat: Chat) -> tuple[str, str]:
    """The model a chat goes to, and its prompt as that model's nodes will compute it: the
    messages rendered through the model's chat template ("" when no template is known yet: the
    chat is then routed by load alone, and the node renders it itself).

    Raises:
        HTTPException: 400 without a model in a fleet of several; 404 for a model no node serves.
        ChatTemplateError: messages the template refuses (the node would refuse them the same way).
        Unavailable: no fleet known yet.
    """
    rows = list((await fleet_rows(state))[0])
    model = chat.model or _only_model(rows)
    if not any(r["model"] == model for r in rows):
        raise HTTPException(404, f"model {model!r} is not served by any node")
    template = await state.templates.get(model, rows)
    if template is None:
        return model, ""
    return model, template.render(normalize_messages(chat.chat_messages()),
                                  add_generation_prompt=chat.add_generation_prompt, tools=chat.chat_tools())


@router.post("/v1/chat/completions")
async def chat_completions(req: ProxiedChat, request: Request, state: State,
                           key: ApiKey | None = scope("complete")) -> Response:
    content, tenant = await _body(request, key)
    try:
        model, text = await chat_prompt(state, req)
    except ChatTemplateError as exc:
        return error_response(400, f"messages: {exc}")
    routed = await route(state, None, text, req.lora_id, tenant or req.cache_salt, model, special_tokens=False)
    return await forward(state, routed, "/v1/chat/completions", content, req.stream)


def _only_model(rows: list[Any]) -> str:
    models = sorted({r["model"] for r in rows if r["status"] != "gone" and r["model"]})
    if len(models) != 1:
        raise HTTPException(400, f"model is required: the fleet serves {', '.join(models) or 'no model'}")
    return str(models[0])


@router.get("/v1/models")
async def models(state: State, _: ApiKey | None = scope("read", "complete")) -> dict[str, Any]:
    """OpenAI's model list: each model that a live node serves, with those nodes (``kvflow.nodes``)."""
    serving: dict[str, list[str]] = defaultdict(list)
    for r in (await fleet_rows(state))[0]:
        if r["status"] in ("live", "resyncing") and r["model"] and r["url"]:
            serving[r["model"]].append(r["node_id"])
    created = int(state.started)
    return {"object": "list", "data": [
        {"id": m, "object": "model", "created": created, "owned_by": "kvflow", "kvflow": {"nodes": nodes}}
        for m, nodes in sorted(serving.items())]}
