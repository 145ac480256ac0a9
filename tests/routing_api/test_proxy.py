"""The proxy's retry rule, against fake nodes (httpx.MockTransport): a connection that was refused
goes to the next candidate; a request that was sent is never sent again."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from openai_api.tokenizers import load_tokenizer
from routing_api.config import RouterSettings
from routing_api.decisions import Routed
from routing_api.proxy import Outgoing, forward
from routing_api.queries import StateReader
from routing_api.schemas import decision_body
from routing_api.scoring import NodeView, PrefixMatch, RoutingWeights, decide
from routing_api.state import RouterState

NODES = [NodeView("a", "http://a", "live", 1000), NodeView("b", "http://b", "live", 1000, active_blocks=5),
         NodeView("c", "http://c", "live", 1000, active_blocks=1), NodeView("d", "http://d", "stale", 1000),
         NodeView("e", "http://e", "live", 10, active_blocks=10)]  # e: over the load threshold


def routed() -> Routed:
    d = decide(4, NODES, {"a": PrefixMatch(gpu=4), "c": PrefixMatch(gpu=2)}, RoutingWeights())
    return Routed(d, decision_body(d, 128, 4, 32, 0.001), 4)


def state(handler) -> RouterState:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return RouterState(RouterSettings(), StateReader("postgresql://nobody@127.0.0.1:1/none"), load_tokenizer(None),
                       RoutingWeights(), {}, client)


def run(handler, stream: bool = False) -> tuple[httpx.Response, RouterState, list[str]]:
    tried: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        tried.append(request.url.host)
        return handler(request)

    s = state(record)

    async def go():
        response = await forward(s, routed(), "/v1/completions", lambda _c: Outgoing(b'{"prompt": "x"}'), stream)
        body = b"".join([chunk async for chunk in response.body_iterator]) if stream else response.body
        return httpx.Response(response.status_code, headers=response.headers, content=body)

    return asyncio.run(go()), s, tried


def ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"node": request.url.host})


def test_the_decisions_order_is_the_choice_then_by_cost_busy_ones_last():
    d = routed().decision
    assert [c.node_id for c in d.ranked()] == ["a", "c", "b", "e"]  # d is stale: never tried


@pytest.mark.parametrize("refusal", [httpx.ConnectError, httpx.ConnectTimeout])
def test_a_refused_connection_goes_to_the_next_candidate_and_marks_the_node_suspect(refusal):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host in ("a", "c"):
            raise refusal("refused", request=request)
        return ok(request)

    r, s, tried = run(handler)
    assert r.status_code == 200 and json.loads(r.content) == {"node": "b"}
    assert tried == ["a", "c", "b"]
    assert r.headers["x-kvflow-node"] == "b" and r.headers["x-kvflow-matched-tokens"] == "0"
    assert s.is_suspect("a") and s.is_suspect("c") and not s.is_suspect("b")
    assert (s.proxied, s.upstream_errors) == (3, 2)
    assert all(inf.requests == 0 and inf.blocks == 0 for inf in s.inflight.values())
    assert "a" not in s.finished and "c" not in s.finished and len(s.finished["b"]) == 1  # nothing ran there


def test_streams_are_retried_the_same_way():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        async def events():
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    r, _s, tried = run(handler, stream=True)
    assert (r.status_code, r.content, r.headers["x-kvflow-node"], tried) == (200, b"data: [DONE]\n\n", "c", ["a", "c"])


def test_when_every_candidate_refuses_the_answer_is_502_naming_the_choice():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("All connection attempts failed", request=request)

    r, s, tried = run(handler)
    assert tried == ["a", "c", "b", "e"] and r.status_code == 502 and r.headers["x-kvflow-node"] == "a"
    err = json.loads(r.content)["error"]
    assert (err["type"], err["node_id"]) == ("upstream_error", "a")
    assert err["message"] == ("upstream node a failed: ConnectError: All connection attempts failed (and every "
                              "other candidate refused the connection: c: ConnectError; b: ConnectError; "
                              "e: ConnectError)")
    assert s.upstream_errors == 4


@pytest.mark.parametrize("failure", [httpx.ReadError, httpx.ReadTimeout, httpx.RemoteProtocolError,
                                     httpx.WriteError])
def test_a_request_that_was_sent_is_never_sent_again(failure):
    def handler(request: httpx.Request) -> httpx.Response:
        raise failure("the node went away mid-request", request=request)

    r, s, tried = run(handler)
    assert tried == ["a"] and r.status_code == 502 and r.headers["x-kvflow-node"] == "a"
    assert json.loads(r.content)["error"]["message"] == (
        f"upstream node a failed: {failure.__name__}: the node went away mid-request")
    assert s.is_suspect("a") and s.upstream_errors == 1


def test_a_node_answering_5xx_is_a_502_and_is_not_retried():
    r, _s, tried = run(lambda request: httpx.Response(500, text="boom"))
    assert (tried, r.status_code) == (["a"], 502)


def _hooked(handler, stream: bool, amend=None) -> tuple[httpx.Response, list]:
    """``forward`` with ``observe`` (and ``amend``): the answer and what was observed."""
    seen: list = []
    s = state(handler)

    async def go():
        response = await forward(s, routed(), "/v1/chat/completions", lambda _c: Outgoing(b"{}", amend=amend), stream,
                                 observe=lambda node, usage: seen.append((node, usage)))
        body = b"".join([chunk async for chunk in response.body_iterator]) if stream else response.body
        return httpx.Response(response.status_code, headers=response.headers, content=body)

    return asyncio.run(go()), seen


USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
         "prompt_tokens_details": {"cached_tokens": 32}}


def test_a_whole_answer_is_observed_and_sent_back_byte_for_byte_unless_amended():
    raw = b'{"id": "x",  "usage": ' + json.dumps(USAGE).encode() + b"}"  # odd spacing: kept as it is
    r, seen = _hooked(lambda request: httpx.Response(200, content=raw), stream=False)
    assert r.content == raw and seen == [("a", USAGE)]
    r, _ = _hooked(lambda request: httpx.Response(200, content=raw), stream=False,
                   amend=lambda body: body.setdefault("kvflow", {}).update(router={"retention": None}))
    assert json.loads(r.content) == {"id": "x", "usage": USAGE, "kvflow": {"router": {"retention": None}}}


def test_a_streams_usage_is_found_in_its_last_chunks_and_the_stream_passes_unchanged():
    chunks = [b'data: {"choices": [{"delta": {"content": "hi"}}], "usage": null}\n\n',
              b'data: {"choices": [], "usage": ' + json.dumps(USAGE).encode() + b"}\n\n", b"data: [DONE]\n\n"]

    def handler(request: httpx.Request) -> httpx.Response:
        async def events():
            for c in chunks:
                yield c

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    r, seen = _hooked(handler, stream=True)
    assert r.content == b"".join(chunks) and seen == [("a", USAGE)]
    chunks[1] = b'data: {"choices": [], "usage": null}\n\n'  # no include_usage: the key's request counts, no tokens
    _, seen = _hooked(handler, stream=True)
    assert seen == [("a", None)]
