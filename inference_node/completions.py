"""``POST /v1/completions`` and ``POST /v1/chat/completions`` on a node, and ``GET /v1/chat/template``.

A body is checked and planned (``inference_node.generation``), its sequences submitted to the
engine, and the answer given in OpenAI's shapes, whole or streamed (``inference_node.answers``).
A chat is rendered through the node's chat template (``openai_api.chat``; ``GET /v1/chat/template``
serves it, with its version, to the router, which routes chats by the same rendering) and
tokenized without special tokens (the template writes them), so a conversation's next turn starts
with the tokens of the previous one and reuses its cached blocks.

A chat's prompt-caching marks (OpenAI's ``prompt_cache_breakpoint`` / ``prompt_cache_options``,
Anthropic's ``cache_control``) become retention (``openai_api.prompt_cache``); the answer's
``kvflow.prompt_cache`` says where each breakpoint fell and what is retained.

The usage says how many prompt tokens came from the cache
(``usage.prompt_tokens_details.cached_tokens``); the answer names the node (``x-kvflow-node``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from inference_node.answers import Answer, ChatShape, Shape, TextShape
from inference_node.deps import authorized, error, metrics_of, node_of
from inference_node.generation import Plan, check_model, plan, refused
from inference_node.node import Node
from openai_api.chat import ChatTemplateError, normalize_messages
from openai_api.prompt_cache import PromptCacheError, plan_chat
from openai_api.schemas import ChatCompletionRequest, CompletionRequest, GenerationBody

router = APIRouter()


@router.post("/v1/completions", dependencies=authorized)
async def completions(body: CompletionRequest, request: Request) -> Any:
    node = node_of(request)
    if (bad := _check(node, body)) is not None:
        return bad
    prompts = body.prompts()
    if prompts and isinstance(prompts[0], str):
        ids = [node.tokenizer.encode(p) for p in prompts]
    else:
        ids = [list(p) for p in prompts]  # type: ignore[arg-type]
    if not ids:
        return error(400, "the prompt is empty", param="prompt")
    planned = plan(node, body, ids, body.max_tokens, body.logprobs, "cmpl")
    if isinstance(planned, JSONResponse):
        return planned
    echo = None
    if body.echo:
        echo = [p if isinstance(p, str) else node.tokenizer.decode(list(p)) for p in prompts]
    return await _answer(request, body, planned, TextShape(node.tokenizer, echo))


@router.post("/v1/chat/completions", dependencies=authorized)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    node = node_of(request)
    if (bad := _check(node, body)) is not None:
        return bad
    try:
        text = node.chat_template.render(normalize_messages(body.chat_messages()),
                                         add_generation_prompt=body.add_generation_prompt, tools=body.chat_tools())
    except ChatTemplateError as exc:
        return error(400, f"messages: {exc}", param="messages")
    ids = node.tokenizer.encode(text, add_special_tokens=False)
    try:
        marks = plan_chat(body, node.chat_template, lambda t: node.tokenizer.encode(t, add_special_tokens=False), ids,
                          node.settings.block_size)
    except PromptCacheError as exc:
        return error(400, str(exc), param=exc.param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    planned = plan(node, body, [ids], body.token_limit(), logprobs, "chatcmpl", marks)
    if isinstance(planned, JSONResponse):
        return planned
    return await _answer(request, body, planned, ChatShape(node.tokenizer))


def _check(node: Node, body: GenerationBody) -> JSONResponse | None:
    """404 for another model, 400 naming the parameters the node cannot honour; None: go on."""
    bad = check_model(node, body.model)
    if bad is None and (refusals := body.refusals()):
        bad = refused(refusals)
    return bad


async def _answer(request: Request, body: GenerationBody, planned: Plan, shape: Shape) -> Any:
    answer = Answer(node_of(request), metrics_of(request), planned, shape, body.include_usage)
    if body.stream:
        return StreamingResponse(answer.stream(), media_type="text/event-stream",
                                 headers={**answer.headers, "cache-control": "no-cache"})
    return await answer.whole()


@router.get("/v1/chat/template", dependencies=authorized)
async def chat_template(request: Request) -> dict[str, Any]:
    """The node's chat template, its special tokens and version (docs/protocol.md)."""
    node = node_of(request)
    return {"model": node.model.cfg.name, **node.chat_template.to_json()}
