"""The answer to one request: its sequences' outputs (``inference_node.engine.Output``) gathered
into OpenAI's shapes, whole or streamed as server-sent events.

Two shapes (:class:`TextShape`, ``text_completion``; :class:`ChatShape`, ``chat.completion`` and
``chat.completion.chunk``), one gathering: each output's ``text`` is already what may be shown (the
engine holds back a possible start of a stop string and cuts at one), so a choice's streamed deltas
add up to its whole text. Streaming sends one event per token (with its logprobs when asked), a
last event per choice with its ``finish_reason``, with ``stream_options.include_usage`` a last
event with empty ``choices`` and the usage (``usage`` null on the others), then ``[DONE]``.

The usage counts each prompt once (``prompt_tokens``, and ``prompt_tokens_details.cached_tokens``:
the prompt's tokens that came from the cache for its first sequence) and every sequence's tokens
(``completion_tokens``); ``kvflow.cached_tokens`` has each choice's own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from inference_node.deps import error
from inference_node.engine import Output, RequestHandle
from inference_node.generation import Plan
from inference_node.metrics import Metrics
from inference_node.node import Node
from openai_api.tokenizers import Tokenizer


def token_text(tokenizer: Tokenizer, token: int) -> tuple[str, list[int]]:
    """A token as logprobs show it: its text and its UTF-8 bytes; a token that is not whole
    characters (a byte of a longer character) is shown as ``bytes:\\xNN`` (OpenAI's way)."""
    if tokenizer.name == "bytes":
        raw = bytes([token]) if token < 256 else b""
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
    text = tokenizer.decode([token])
    return text, list(text.encode("utf-8"))


@dataclass
class Choice:
    """One sequence's answer so far."""

    index: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    #: per token: (token, logprob, top alternatives)
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    done: Output | None = None


class TextShape:
    """``POST /v1/completions``: ``text_completion`` (``echo`` puts each prompt's text first)."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer: Tokenizer, echo: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.echo = echo

    def prefix(self, plan: Plan, index: int) -> str:
        return self.echo[index // plan.n] if self.echo is not None else ""

    def logprobs(self, entries: list[tuple[int, float, list[tuple[int, float]]]], offset: int) -> dict[str, Any]:
        tokens, offsets, top = [], [], []
        for token, lp, alternatives in entries:
            text = token_text(self.tokenizer, token)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            # vLLM's way: the top alternatives, and the chosen token among them
            top.append({**{token_text(self.tokenizer, t)[0]: v for t, v in alternatives}, text: lp})
        return {"tokens": tokens, "token_logprobs": [e[1] for e in entries], "top_logprobs": top,
                "text_offset": offsets}

    def whole(self, c: Choice, plan: Plan, prefix: str) -> dict[str, Any]:
        assert c.done is not None
        lp = self.logprobs(c.logprobs, len(prefix)) if plan.logprobs is not None else None
        return {"index": c.index, "text": prefix + c.text, "logprobs": lp, "finish_reason": c.done.finish_reason,
                "token_ids": c.tokens}

    def first(self, index: int, prefix: str) -> dict[str, Any] | None:
        return {"index": index, "text": prefix, "logprobs": None, "finish_reason": None, "token_ids": []} \
            if prefix else None

    def delta(self, index: int, out: Output, plan: Plan) -> dict[str, Any]:
        lp = None
        if plan.logprobs is not None and out.token_id is not None and out.logprob is not None:
            lp = self.logprobs([(out.token_id, out.logprob, out.top_logprobs or [])], 0)
        return {"index": index, "text": out.text, "logprobs": lp, "finish_reason": None,
                "token_ids": [out.token_id] if out.token_id is not None else []}

    def last(self, index: int, out: Output) -> dict[str, Any]:
        return {"index": index, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason,
                "token_ids": []}


class ChatShape:
    """``POST /v1/chat/completions``: ``chat.completion`` and ``chat.completion.chunk``."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def prefix(self, plan: Plan, index: int) -> str:
        return ""

    def logprobs(self, entries: list[tuple[int, float, list[tuple[int, float]]]]) -> dict[str, Any]:
        def one(token: int, lp: float) -> dict[str, Any]:
            text, raw = token_text(self.tokenizer, token)
            return {"token": text, "logprob": lp, "bytes": raw}

        return {"content": [{**one(t, lp), "top_logprobs": [one(a, v) for a, v in alternatives]}
                            for t, lp, alternatives in entries], "refusal": None}

    def whole(self, c: Choice, plan: Plan, prefix: str) -> dict[str, Any]:
        assert c.done is not None
        return {"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None,
                                              "tool_calls": []},
                "logprobs": self.logprobs(c.logprobs) if plan.logprobs is not None else None,
                "finish_reason": c.done.finish_reason, "token_ids": c.tokens}

    def first(self, index: int, prefix: str) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, index: int, out: Output, plan: Plan) -> dict[str, Any]:
        lp = None
        if plan.logprobs is not None and out.token_id is not None and out.logprob is not None:
            lp = self.logprobs([(out.token_id, out.logprob, out.top_logprobs or [])])
        return {"index": index, "delta": {"content": out.text}, "logprobs": lp, "finish_reason": None,
                "token_ids": [out.token_id] if out.token_id is not None else []}

    def last(self, index: int, out: Output) -> dict[str, Any]:
        return {"index": index, "delta": {"content": out.text} if out.text else {}, "logprobs": None,
                "finish_reason": out.finish_reason}


Shape = TextShape | ChatShape


class _Failed(Exception):
    """A sequence failed in the engine (its message is the answer's)."""


class Answer:
    """The answer to a planned request: submits its sequences and gathers their outputs."""

    def __init__(self, node: Node, metrics: Metrics, plan: Plan, shape: Shape, include_usage: bool = False) -> None:
        self.node = node
        self.metrics = metrics
        self.plan = plan
        self.shape = shape
        self.include_usage = include_usage
        self.created = int(time.time())
        self.choices = [Choice(i) for i in range(len(plan.requests))]
        self.queue: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.handles = [node.engine.submit(r, loop, RequestHandle(r.request_id, loop, queue=self.queue, index=i))
                        for i, r in enumerate(plan.requests)]
        self._first = False

    @property
    def headers(self) -> dict[str, str]:
        return {"x-kvflow-node": self.node.settings.node_id}

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool, **extra: Any) -> dict[str, Any]:
        return {"id": self.plan.rid, "object": self.shape.chunk_object if chunk else self.shape.object,
                "created": self.created, "model": self.node.model.cfg.name, "choices": choices, **extra}

    async def _outputs(self) -> AsyncIterator[tuple[int, Output]]:
        """Every sequence's outputs as they come, until all have finished (a failure: ``_Failed``)."""
        left = len(self.choices)
        while left:
            index, out = await self.queue.get()
            if out.error:
                raise _Failed(out.error)
            c = self.choices[index]
            if out.token_id is not None:
                if not self._first:
                    self._first = True
                    self.metrics.ttft.observe(time.monotonic() - self.handles[index].submitted)
                c.tokens.append(out.token_id)
                if out.logprob is not None:
                    c.logprobs.append((out.token_id, out.logprob, out.top_logprobs or []))
            c.text += out.text
            if out.finished:
                c.done = out
                left -= 1
                self._count(out, self.handles[index])
            yield index, out

    def _count(self, done: Output, handle: RequestHandle) -> None:
        m = self.metrics
        m.requests.labels(done.finish_reason or "unknown").inc()
        m.prompt_tokens.inc(done.prompt_tokens)
        m.cached_tokens.inc(done.cached_tokens)
        m.completion_tokens.inc(done.completion_tokens)
        m.latency.observe(time.monotonic() - handle.submitted)

    def usage(self) -> dict[str, Any]:
        n = self.plan.n
        firsts = [c.done for c in self.choices[::n] if c.done is not None]
        prompt = sum(d.prompt_tokens for d in firsts)
        completion = sum(c.done.completion_tokens for c in self.choices if c.done is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in firsts)}}

    def _cancel(self) -> None:
        for r in self.plan.requests:  # a no-op for those finished; frees the blocks after a disconnect
            self.node.engine.cancel(r.request_id)

    async def whole(self) -> JSONResponse:
        """The whole answer once every sequence is done (503 if one failed in the engine)."""
        node = self.node
        try:
            async for _ in self._outputs():
                pass
        except _Failed as exc:
            self._cancel()
            return error(503, str(exc), "server_error")
        except asyncio.CancelledError:
            self._cancel()
            raise
        choices = [self.shape.whole(c, self.plan, self.shape.prefix(self.plan, c.index)) for c in self.choices]
        kvflow = {"node_id": node.settings.node_id, "instance_id": node.instance_id,
                  "cached_tokens": [c.done.cached_tokens if c.done else 0 for c in self.choices], **self._marks()}
        return JSONResponse(self._envelope(choices, False, usage=self.usage(), kvflow=kvflow), headers=self.headers)

    def _marks(self) -> dict[str, Any]:
        """``prompt_cache``: what the body's prompt-caching marks retain, when it has marks."""
        marks = self.plan.prompt_cache
        return {} if marks is None else {"prompt_cache": marks.to_json()}

    async def stream(self) -> AsyncIterator[bytes]:
        """Server-sent events (see the module docstring); a failure is a last ``error`` event."""
        usage_null: dict[str, Any] = {"usage": None} if self.include_usage else {}
        try:
            for c in self.choices:
                first = self.shape.first(c.index, self.shape.prefix(self.plan, c.index))
                if first is not None:
                    extra = {"kvflow": self._marks()} if c.index == 0 and self.plan.prompt_cache else {}
                    yield _sse(self._envelope([first], True, **usage_null, **extra))
            async for index, out in self._outputs():
                part = self.shape.last(index, out) if out.finished else self.shape.delta(index, out, self.plan)
                yield _sse(self._envelope([part], True, **usage_null))
            if self.include_usage:
                yield _sse(self._envelope([], True, usage=self.usage()))
            yield b"data: [DONE]\n\n"
        except _Failed as exc:
            yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
            yield b"data: [DONE]\n\n"
        finally:
            self._cancel()


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
