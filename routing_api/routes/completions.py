"""``POST /v1/completions`` and ``POST /v1/chat/completions``: route, then proxy to the chosen node
(``routing_api.proxy``), and ``GET /v1/models``, the models of the live fleet.

The router reads only what routing needs (``openai_api.schemas.ProxiedCompletion``, ``ProxiedChat``:
the model, the prompt or messages, ``cache_salt``, ``kv_retention``, ``lora_id``, ``stream``) and
forwards the body as the client sent it, so every parameter a node accepts works through it, and
a node's 400 for one it cannot honour comes back as it is. A tenant's key sets ``cache_salt`` (its
KV never mixes with another's), and the router's retention goes in the words of the node's engine
(``routing_api.engine_words``): then the body is re-encoded.

A chat is routed by its prompt as the node will compute it: the messages rendered through the
model's chat template (``routing_api.templates``), tokenized without special tokens (the template
writes them), hashed and matched as a completion's text.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Protocol

from fastapi import APIRouter, HTTPException, Request, Response

from eventbus.protocol import ENGINE_KVFLOW
from openai_api.chat import ChatTemplate, ChatTemplateError, normalize_messages
from openai_api.prompt_cache import PromptCacheError
from openai_api.schemas import ProxiedChat, ProxiedCompletion, _Proxied
from routing_api.config import ApiKey
from routing_api.decisions import Routed, fleet_rows, route
from routing_api.deps import State, scope
from routing_api.engine_words import in_words
from routing_api.errors import error_response
from routing_api.proxy import Outgoing, forward
from routing_api.retained import Retention, retain
from routing_api.scoring import Candidate
from routing_api.state import RouterState
from routing_api.warmups import send_warmup

router = APIRouter()


def tenant_of(key: ApiKey | None) -> str | None:
    """The tenant of the request's API key (its name salts the request's blocks)."""
    return key.tenant if key is not None and key.tenant else None


def _outgoing(raw: bytes, tenant: str | None, sent: Retention | None, engine: str, said: dict[str, Any],
              headers: dict[str, str]) -> Outgoing:
    """The body for a node of ``engine``: as the client sent it, byte for byte, unless the router
    sets the tenant's ``cache_salt`` or puts the retention it decided in the engine's words
    (``routing_api.engine_words``); the answer's headers and ``kvflow.router`` say what it got."""
    content = raw
    said = dict(said)
    headers = dict(headers)
    if tenant is not None or sent is not None or engine != ENGINE_KVFLOW:
        payload = json.loads(raw)
        changed = tenant is not None
        if tenant is not None:
            payload["cache_salt"] = tenant
        words = in_words(engine, sent.body if sent is not None else None, payload,
                         in_body=sent is not None and sent.in_body)
        changed = words.apply(payload) or changed
        if changed:
            content = json.dumps(payload).encode()
        if sent is not None:
            said["retention"] = {**sent.to_json(), "engine": engine, "honoured": words.honoured,
                                 **({"notes": list(words.notes)} if words.notes else {})}
            headers["x-kvflow-retention-engine"] = f"{engine}; {words.honoured}"

    def amend(body: dict[str, Any]) -> None:
        kv = body.setdefault("kvflow", {})
        if isinstance(kv, dict):
            kv["router"] = said

    return Outgoing(content, headers, amend if said else None)


@router.post("/v1/completions")
async def completions(req: ProxiedCompletion, request: Request, state: State,
                      key: ApiKey | None = scope("complete")) -> Response:
    tenant = tenant_of(key)
    prompt = req.first_prompt()
    text, tokens = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    model = req.model or (_only_model(list((await fleet_rows(state))[0])) if req.prompt_cache_key else None)
    keyed = await key_node(state, tenant, model, req.prompt_cache_key)
    routed = await route(state, tokens, text, req.lora_id, tenant or req.cache_salt, req.model, key_node=keyed)
    sent = retain(state, routed, req, None, None, tenant, model)
    send_warmup(state, routed, req.model, tenant or req.cache_salt, req.lora_id)
    return await _forward(state, routed, "/v1/completions", await request.body(), req, tenant, model, sent)


class Chat(Protocol):
    """What a chat's prompt is rendered from (``ProxiedChat``, ``RouteRequest``)."""

    model: str | None
    add_generation_prompt: bool

    def chat_messages(self) -> list[dict[str, Any]]: ...
    def chat_tools(self) -> list[dict[str, Any]] | None: ...


async def chat_prompt(state: RouterState, chat: Chat) -> tuple[str, str, ChatTemplate | None]:
    """The model a chat goes to, its prompt as that model's nodes will compute it: the messages
    rendered through the model's chat template ("" when no template is known yet: the chat is then
    routed by load alone, and the node renders it itself), and the template.

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
        return model, "", None
    return model, template.render(normalize_messages(chat.chat_messages()),
                                  add_generation_prompt=chat.add_generation_prompt, tools=chat.chat_tools()), template


@router.post("/v1/chat/completions")
async def chat_completions(req: ProxiedChat, request: Request, state: State,
                           key: ApiKey | None = scope("complete")) -> Response:
    tenant = tenant_of(key)
    try:
        model, text, template = await chat_prompt(state, req)
    except ChatTemplateError as exc:
        return error_response(400, f"messages: {exc}")
    keyed = await key_node(state, tenant, model, req.prompt_cache_key)
    routed = await route(state, None, text, req.lora_id, tenant or req.cache_salt, model, special_tokens=False,
                         key_node=keyed)
    try:
        sent = retain(state, routed, req, req, template, tenant, model)
    except PromptCacheError as exc:
        return error_response(400, str(exc), param=exc.param)
    send_warmup(state, routed, model, tenant or req.cache_salt, req.lora_id)
    return await _forward(state, routed, "/v1/chat/completions", await request.body(), req, tenant, model, sent)


async def key_node(state: RouterState, tenant: str | None, model: str | None, key: str | None) -> str | None:
    """The node of a ``prompt_cache_key``'s last request, within the tenant (None: no key, or a new one)."""
    return None if key is None or model is None else await state.cache_keys.lookup(tenant, model, key)


async def _forward(state: RouterState, routed: Routed, path: str, raw: bytes, req: _Proxied,
                   tenant: str | None, model: str | None, sent: Retention | None) -> Response:
    """Proxy the body; note the key's node and usage; say what the router did to the retention."""
    key = req.prompt_cache_key

    def observe(node: str, usage: dict[str, Any] | None) -> None:
        if key is not None and model is not None:
            state.cache_keys.record(tenant, model, key, node, usage)

    said: dict[str, Any] = {}
    if "prompt_cache_key" in routed.body:
        said["prompt_cache_key"] = routed.body["prompt_cache_key"]
    headers = {}
    if sent is not None:
        headers["x-kvflow-retention"] = sent.source + (f":{sent.rule}" if sent.rule else "")
        if sent.lowered:
            headers["x-kvflow-retention-lowered"] = "; ".join(sent.lowered)[:1000]
    made: dict[str, Outgoing] = {}

    def prepare(cand: Candidate) -> Outgoing:  # once per engine among the candidates tried
        if cand.engine not in made:
            made[cand.engine] = _outgoing(raw, tenant, sent, cand.engine, said, headers)
        return made[cand.engine]

    return await forward(state, routed, path, prepare, req.stream, observe=observe if key is not None else None)


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
