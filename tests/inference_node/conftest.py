"""Fixtures for node tests: an in-process node on the tiny random model, no Kafka."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from eventbus.publisher import InMemorySink
from inference_node.engine import GenerationRequest, Output, RequestHandle
from inference_node.node import Node, NodeSettings, build_node


def make_node(**kw) -> Node:
    settings = NodeSettings(**{"model_preset": "tiny", "num_blocks": 64, "block_size": 16, "kafka": False,
                               "heartbeat_s": 0.2, **kw})
    return build_node(settings, sink=InMemorySink())


@pytest.fixture
def node() -> Iterator[Node]:
    n = make_node()
    yield n
    n.close()


def generate(node: Node, prompt: list[int], max_tokens: int = 6, **kw) -> tuple[list[int], Output]:
    """Run one request through the engine; return its tokens and its final output."""

    async def run() -> tuple[list[int], Output]:
        rid = kw.pop("request_id", f"r-{id(prompt)}-{asyncio.get_running_loop().time()}")
        handle = node.engine.submit(GenerationRequest(rid, prompt, max_tokens, **kw), asyncio.get_running_loop())
        return await collect(handle)

    return asyncio.run(run())


async def collect(handle: RequestHandle) -> tuple[list[int], Output]:
    """A request's tokens and its final output."""
    tokens = []
    async for out in handle:
        if out.token_id is not None:
            tokens.append(out.token_id)
        if out.finished:
            return tokens, out
    raise AssertionError("no final output")
