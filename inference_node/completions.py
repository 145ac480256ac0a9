"""``POST /v1/completions`` on a node: check the request, submit it to the engine, answer in
OpenAI's ``text_completion`` shape (whole, or streamed as server-sent events).

The usage says how many prompt tokens came from the cache
(``usage.prompt_tokens_details.cached_tokens``); the answer names the node (``x-kvflow-node``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from eventbus.api import CompletionRequest
from inference_node.deps import authorized, error, metrics_of, node_of
from inference_node.engine import GenerationRequest, Output, RequestHandle
from inference_node.kv.retention import KvCacheRetentionConfig, RetentionConfigError, TokenRange
from inference_node.metrics import Metrics
from inference_node.node import Node

router = APIRouter()


@router.post("/v1/completions", dependencies=authorized)
async def completions(body: CompletionRequest, request: Request) -> Any:
    node = node_of(request)
    req = generation_request(node, body)
    if isinstance(req, JSONResponse):
        return req
    answer = Answer(node, metrics_of(request), req.request_id,
                    node.engine.submit(req, asyncio.get_running_loop()))
    if body.stream:
        return StreamingResponse(answer.stream(), media_type="text/event-stream",
                                 headers={"x-kvflow-node": node.settings.node_id, "cache-control": "no-cache"})
    return await answer.whole()


def generation_request(node: Node, body: CompletionRequest) -> GenerationRequest | JSONResponse:
    """The engine's request for ``body``, or the 4xx that says what is wrong with it."""
    s = node.settings
    cfg = node.model.cfg
    if body.model is not None and body.model not in (cfg.name, s.node_id):
        return error(404, f"model {body.model!r} is not served here; this node serves {cfg.name!r}",
                     "model_not_found")
    try:
        retention = None if body.kv_retention is None else KvCacheRetentionConfig(
            token_ranges=tuple(TokenRange(r.start, r.end, r.priority, r.duration_s)
                               for r in body.kv_retention.token_ranges),
            decode_priority=body.kv_retention.decode_priority,
            decode_duration_s=body.kv_retention.decode_duration_s)
    except RetentionConfigError as exc:
        return error(400, f"kv_retention: {exc}")
    if isinstance(body.prompt, str):
        prompt_ids = node.tokenizer.encode(body.prompt)
    else:
        prompt_ids = body.prompt
        bad = [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]
        if bad:
            return error(400, f"prompt token ids must be within 0..{cfg.vocab_size - 1}; got {bad[:3]}")
    if not prompt_ids:
        return error(400, "the prompt is empty")
    ctx = cfg.max_position_embeddings
    if len(prompt_ids) + body.max_tokens > ctx:
        return error(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({body.max_tokens}) exceeds "
                          f"the context length of {ctx}", "context_length_exceeded")
    need = -(-(len(prompt_ids) + body.max_tokens) // s.block_size)
    if need > s.num_blocks:
        return error(400, f"this request needs {need} KV blocks; the node has {s.num_blocks}")
    return GenerationRequest(f"cmpl-{uuid.uuid4().hex[:24]}", prompt_ids, body.max_tokens, body.temperature,
                             body.seed, retention, body.lora_id, body.cache_salt, body.ignore_eos)


class Answer:
    """The answer to one submitted request, from the engine's outputs (``handle``)."""

    def __init__(self, node: Node, metrics: Metrics, rid: str, handle: RequestHandle) -> None:
        self.node = node
        self.metrics = metrics
        self.rid = rid
        self.handle = handle
        self.created = int(time.time())

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"id": self.rid, "object": "text_completion", "created": self.created,
                "model": self.node.model.cfg.name, "choices": [{"index": 0, **choice}], **extra}

    def _first_token(self) -> None:
        self.metrics.ttft.observe(time.monotonic() - self.handle.submitted)

    def _finished(self, done: Output) -> dict[str, Any]:
        """Count a finished request; returns its ``usage``."""
        m = self.metrics
        m.requests.labels(done.finish_reason or "unknown").inc()
        m.prompt_tokens.inc(done.prompt_tokens)
        m.cached_tokens.inc(done.cached_tokens)
        m.completion_tokens.inc(done.completion_tokens)
        m.latency.observe(time.monotonic() - self.handle.submitted)
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}

    async def whole(self) -> JSONResponse:
        """The whole completion once it is done."""
        node = self.node
        tokens: list[int] = []
        try:
            async for out in self.handle:
                if out.error:
                    return error(503, out.error, "server_error")
                if out.token_id is not None:
                    if not tokens:
                        self._first_token()
                    tokens.append(out.token_id)
                if out.finished:
                    usage = self._finished(out)
                    choice = {"text": node.tokenizer.decode(tokens), "token_ids": tokens,
                              "finish_reason": out.finish_reason, "logprobs": None}
                    return JSONResponse(self._chunk(choice, usage=usage, kvflow={
                        "node_id": node.settings.node_id, "instance_id": node.instance_id}),
                        headers={"x-kvflow-node": node.settings.node_id})
        except asyncio.CancelledError:
            node.engine.cancel(self.rid)
            raise
        return error(500, "the request ended without output", "server_error")

    async def stream(self) -> AsyncIterator[bytes]:
        """Server-sent events: one per token (its text delta), the last with the usage, then
        ``[DONE]``. A token that ends inside a multi-byte character waits for the next."""
        tokenizer = self.node.tokenizer
        tokens: list[int] = []
        sent = ""
        try:
            async for out in self.handle:
                if out.error:
                    yield _sse({"error": {"message": out.error, "type": "server_error"}})
                    break
                if out.token_id is not None:
                    if not tokens:
                        self._first_token()
                    tokens.append(out.token_id)
                    text = tokenizer.decode(tokens)
                    delta = "" if text.endswith("\ufffd") else text[len(sent):]
                    sent += delta
                    yield _sse(self._chunk({"text": delta, "token_ids": [out.token_id], "finish_reason": None,
                                            "logprobs": None}))
                if out.finished:
                    usage = self._finished(out)
                    tail = tokenizer.decode(tokens)[len(sent):]
                    yield _sse(self._chunk({"text": tail, "finish_reason": out.finish_reason, "logprobs": None},
                                           usage=usage))
            yield b"data: [DONE]\n\n"
        finally:
            self.node.engine.cancel(self.rid)  # a no-op when finished; frees the blocks after a disconnect


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
