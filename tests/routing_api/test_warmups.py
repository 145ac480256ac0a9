"""Sending a hub copy (routing_api/warmups.py): the body a node gets, and the router's accounting of it
(in flight, routed work, prefill queue) while it runs and after. Against fake nodes
(httpx.MockTransport); the same body against a real node: test_router_integration.py."""

from __future__ import annotations

import asyncio
import json

import httpx

from openai_api.tokenizers import load_tokenizer
from routing_api.config import RouterSettings
from routing_api.decisions import Prompt, Routed
from routing_api.fleet import FleetView
from routing_api.hubs import Warmup
from routing_api.queries import StateReader
from routing_api.schemas import decision_body
from routing_api.scoring import NodeView, PrefixMatch, decide
from routing_api.state import RouterState
from routing_api.warmups import send_warmup, warmup_body
from tests.routing_api.weights import weights

TOKENS = list(range(100, 100 + 16 * 10 + 5))  # 10 full blocks of 16 and 5 tokens


def _routed() -> tuple[Routed, Warmup]:
    views = [NodeView("a", "http://a", "live", 1000, block_size=16), NodeView("b", "http://b", "live", 1000,
                                                                             block_size=16)]
    d = decide(10, views, {"a": PrefixMatch(gpu=8), "b": PrefixMatch(gpu=2)}, weights(), block_size=16)
    b = next(c for c in d.candidates if c.node_id == "b")
    warm = Warmup(b, 6)
    prompt = Prompt(TOKENS, {}, FleetView(16, tuple(views)))
    return Routed(d, decision_body(d, len(TOKENS), 10, 16, 0.001), 10, prompt, warmup=warm), warm


def _state(handler) -> RouterState:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return RouterState(RouterSettings(), StateReader("postgresql://nobody@127.0.0.1:1/none"), load_tokenizer(None),
                       weights(hub_fanout=16), {}, client)


def test_the_body_is_the_hubs_token_ids_for_one_token_with_the_requests_model_and_salt():
    _, warm = _routed()
    assert warmup_body(TOKENS, warm, 16, "m", "tenant-x") == {
        "prompt": TOKENS[:96], "max_tokens": 1, "stream": False, "model": "m", "cache_salt": "tenant-x"}
    assert warmup_body(TOKENS, warm, 16, None, None) == {"prompt": TOKENS[:96], "max_tokens": 1, "stream": False}


def test_a_copy_is_in_flight_and_queued_on_its_node_until_it_answers():
    routed, warm = _routed()
    seen: list[tuple[str, dict, int, int, float]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), json.loads(request.content), s.inflight["b"].requests,
                     s.prefill["b"].blocks, round(s.work["b"].value, 6)))
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    s = _state(handler)

    async def go():
        task = send_warmup(s, routed, "m", None, None)
        assert task is not None and task in s.warming
        await task
        assert not s.warming

    asyncio.run(go())
    # b holds 2 of the hub's 6 blocks: 4 to compute, counted while it runs
    assert seen == [("http://b/v1/completions", warmup_body(TOKENS, warm, 16, "m", None), 1, 4, 4.0)]
    assert s.inflight["b"].requests == 0 and s.prefill["b"].blocks == 0  # answered: out of flight and queue
    assert s.metrics.warmups.labels("b", "ok")._value.get() == 1


def test_a_refused_copy_takes_its_work_back_and_a_lora_request_sends_none():
    routed, _ = _routed()

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    s = _state(refuse)

    async def go():
        await send_warmup(s, routed, None, None, None)
        assert send_warmup(s, routed, None, None, 3) is None  # a LoRA adapter's blocks: no copy
        assert send_warmup(s, Routed(routed.decision, routed.body, 10, routed.prompt), None, None, None) is None

    asyncio.run(go())
    assert s.work["b"].value == 0.0 and s.inflight["b"].requests == 0
    assert s.metrics.warmups.labels("b", "upstream_error")._value.get() == 1
    assert s.is_suspect("b")  # as for any request a node failed
