"""The tail guard (routing_api/prefill.py): prefill queues learned from first tokens, the tail of
predicted TTFTs, and the rule that moves a queued request in that tail to where it starts soonest."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import httpx
import pytest

from kvflow.sim.cluster import BLOCK_TOKENS, RouterPolicy, simulate
from kvflow.sim.workloads import SimRequest
from openai_api.tokenizers import load_tokenizer
from routing_api.config import RouterSettings
from routing_api.decisions import Routed
from routing_api.prefill import PrefillQueue, TtftTail, guard, predicted_ttft
from routing_api.proxy import Outgoing, forward
from routing_api.queries import StateReader
from routing_api.schemas import decision_body
from routing_api.scoring import DEFAULT_WEIGHTS, NodeView, PrefixMatch, decide
from routing_api.state import RouterState
from tests.routing_api.weights import weights

W = weights(overlap_weight=24.0, load_bound=0.75, ttft_quantile=0.9)


def test_the_guard_is_on_by_default_and_a_setting():
    assert DEFAULT_WEIGHTS.ttft_quantile == 0.9
    w = RouterSettings(ttft_quantile=0.0, ttft_tolerance=0.2, ttft_work_slack=1.5).weights()
    assert (w.ttft_quantile, w.ttft_tolerance, w.ttft_work_slack) == (0.0, 0.2, 1.5)


def test_a_queue_waits_for_what_was_sent_and_learns_the_rate_from_first_tokens():
    q = PrefillQueue(0.1)  # assumes 0.1 s a block; the node does 0.05
    q.add(1, 10, now=0.0)
    q.add(2, 4, now=0.5)
    assert q.wait(0.5) == pytest.approx(1.4 - 0.5)  # 10 + 4 blocks at 0.1 s from 0
    q.first_token(1, now=0.5)  # 10 blocks took 0.5 s: the first measurement is taken whole
    assert q.s_per_block == pytest.approx(0.05) and q.measured == 1
    assert q.wait(0.5) == pytest.approx(4 * 0.05)  # what is left, at the learned rate
    q.first_token(2, now=0.8)  # begun at 0.5 (the previous first token): 4 blocks in 0.3 s
    assert q.s_per_block == pytest.approx((0.05 + 0.075) / 2)
    assert q.wait(0.8) == 0.0 and not q.pending and q.blocks == 0


def test_an_answer_out_of_order_or_a_cancel_leaves_the_rate_alone():
    q = PrefillQueue(0.1)
    q.add(1, 10, 0.0)
    q.add(2, 10, 0.0)
    q.first_token(2, 0.3)  # not the oldest: its time says nothing of the rate
    assert q.s_per_block == 0.1 and q.measured == 0 and list(q.pending) == [1]
    q.cancel(1)
    assert q.wait(0.3) == 0.0 and q.blocks == 0
    q.first_token(7, 1.0)  # unknown: ignored
    q.add(3, 5, 2.0)
    q.first_token(3, 2.0 + 5 * 1.0)  # 1 s a block measured: clamped to 4x the estimate
    assert q.s_per_block == pytest.approx(0.4)


def test_the_tail_is_the_quantile_of_the_recent_predictions():
    t = TtftTail(0.9, window=100, every=10)
    for v in range(9):
        t.observe(float(v))
    assert t.threshold == float("inf")  # not enough yet
    t.observe(9.0)
    assert t.threshold == 8.0  # the 0.9 quantile of 0..9 by rank
    for v in range(100, 200):
        t.observe(float(v))
    assert t.threshold == 189.0 and len(t.recent) == 100  # the window forgets


def _fleet() -> list[NodeView]:
    """Three nodes that did 50, 40 and 40 blocks of prefill lately."""
    return [NodeView(n, f"http://{n}", "live", 10_000, block_size=16, routed_work=work)
            for n, work in zip("abc", (50.0, 40.0, 40.0), strict=True)]


def _decide(matches: dict[str, int], blocks: int = 10):
    return decide(blocks, _fleet(), {n: PrefixMatch(gpu=m) for n, m in matches.items()}, W, block_size=16)


def _queues(waits: dict[str, int]) -> dict[str, PrefillQueue]:
    """Queues of ``waits[n]`` blocks sent at time 0, at 0.01 s a block (16 tokens at 1,600 tokens/s)."""
    out = {}
    for k, (n, blocks) in enumerate(waits.items()):
        out[n] = PrefillQueue(0.01)
        if blocks:
            out[n].add(k, blocks, 0.0)
    return out


def _tail(threshold: float) -> TtftTail:
    t = TtftTail(0.9)
    t.threshold = threshold
    return t


def test_a_queued_request_in_the_tail_goes_where_it_starts_soonest_within_the_tolerance():
    d = _decide({"a": 8, "b": 6, "c": 0})  # the cost prefers a (8 of 10 cached)
    assert d.chosen.node_id == "a"
    queues = _queues({"a": 100, "b": 10, "c": 0})  # a: 1 s of prefill queued; b 0.1 s; c idle
    mine = predicted_ttft(d.chosen, queues, 1600.0, 16, 0.0)
    assert mine == pytest.approx(1.0 + 2 * 0.01)
    moved = guard(d, queues, _tail(50.0), W, 1600.0, 16, 0.0)  # 102 blocks' time = 1,632 tokens > 50
    # c would start at once but holds 0 of 10 (0.8 below a's share, over the tolerance 0.35):
    # b holds 6 (0.2 below): 0.1 + 4 x 0.01 s, and its work, 40 + 4, is within 1.1 x a's 50 + 2
    assert moved is not None and moved.node_id == "b" and d.chosen is moved
    assert d.reason.startswith("tail guard: predicted TTFT 1.02 s on a") and "0.14 s here" in d.reason
    assert d.ranked()[0].node_id == "b"  # the proxy tries it first


def test_the_choice_stands_below_the_tail_or_without_a_queue_or_when_nothing_is_sooner():
    queues = _queues({"a": 100, "b": 10, "c": 0})
    assert guard(_decide({"a": 8, "b": 6}), queues, _tail(5000.0), W, 1600.0, 16, 0.0) is None  # not the tail
    idle = _queues({"a": 0, "b": 0, "c": 0})
    assert guard(_decide({"a": 8, "b": 6}), idle, _tail(0.0), W, 1600.0, 16, 0.0) is None  # a has no queue
    busy = _queues({"a": 100, "b": 200, "c": 0})
    assert guard(_decide({"a": 8, "b": 6}), busy, _tail(0.0), W, 1600.0, 16, 0.0) is None  # b is later
    off = dataclasses.replace(W, ttft_quantile=0.0)
    assert guard(_decide({"a": 8, "b": 6}), queues, _tail(0.0), off, 1600.0, 16, 0.0) is None


def test_a_move_must_save_more_time_than_the_prefill_it_gives_up():
    # a holds 8 of 10 blocks, b 5 (within the tolerance), c none; b is idle: 5 x 0.01 s there
    def moved(queued_on_a: int):
        d = _decide({"a": 8, "b": 5, "c": 0})
        return guard(d, _queues({"a": queued_on_a, "b": 0, "c": 0}), _tail(0.0), W, 1600.0, 16, 0.0)

    # a: 4 blocks queued + its own 2 = 0.06 s; b is sooner by 0.01 s but computes the 3 blocks a
    # holds again (0.03 s of the fleet's prefill): the choice stands
    assert moved(4) is None
    assert moved(6) is None  # 0.08 s: sooner by exactly what it gives up, no gain
    assert moved(7).node_id == "b"  # 0.09 s: sooner by 0.04 s, more than the 0.03 s given up


def test_the_work_slack_keeps_a_request_off_a_node_that_did_much_more_prefill_lately():
    fleet = [NodeView("a", "", "live", 10_000, block_size=16), NodeView("b", "", "live", 10_000, block_size=16,
                                                                        routed_work=40.0)]
    w = dataclasses.replace(W, load_bound=0.75, work_bound=0.0)
    queues = _queues({"a": 100, "b": 0})
    d = decide(10, fleet, {"a": PrefixMatch(gpu=8), "b": PrefixMatch(gpu=8)}, w, block_size=16)
    d.chosen = next(c for c in d.candidates if c.node_id == "a")
    # b's 40 + 2 blocks of work > 1.1 x a's 0 + 2
    assert guard(d, queues, _tail(0.0), w, 1600.0, 16, 0.0) is None
    roomy = dataclasses.replace(w, ttft_work_slack=100.0)
    assert guard(d, queues, _tail(0.0), roomy, 1600.0, 16, 0.0).node_id == "b"


def _state(handler) -> RouterState:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return RouterState(RouterSettings(prefill_tokens_per_s=1600.0), StateReader("postgresql://nobody@127.0.0.1:1/none"),
                       load_tokenizer(None), W, {}, client)


def test_the_proxy_queues_a_prefill_until_its_first_chunk_and_forgets_a_refused_one():
    fleet = [NodeView("a", "http://a", "live", 1000, block_size=16), NodeView("b", "http://b", "live", 1000,
                                                                             block_size=16)]
    d = decide(10, fleet, {"a": PrefixMatch(gpu=4)}, weights(), block_size=16)
    routed = Routed(d, decision_body(d, 160, 10, 16, 0.001), 10)
    seen: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            raise httpx.ConnectError("refused")
        seen.append(len(s.prefill["b"].pending))  # queued while the node works on it

        async def events():
            yield b"data: 1\n\n"
            seen.append(len(s.prefill["b"].pending))  # the first chunk is through: answered
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    s = _state(handler)

    async def go():
        response = await forward(s, routed, "/v1/completions", lambda _c: Outgoing(b"{}"), True)
        return [chunk async for chunk in response.body_iterator]

    asyncio.run(go())
    assert seen == [1, 0]  # b's prefill of 10 uncached blocks was queued until its first chunk
    assert not s.prefill["a"].pending and not s.prefill["b"].pending  # a refused: cancelled; b answered
    assert s.prefill["a"].s_per_block == 0.01  # nothing measured on a


def _reqs(n: int, gap: float) -> list[SimRequest]:
    return [SimRequest(i * gap, tuple(range(1000 * i, 1000 * i + 8)), 1) for i in range(n)]


def test_the_simulator_runs_the_guard_over_the_queues_the_router_would_keep():
    w = dataclasses.replace(W, ttft_quantile=0.5)
    p = RouterPolicy(w, random.Random(0))
    r = simulate(_reqs(200, 0.25), nodes=4, capacity=200, routing="kv_aware_load", eviction="lru", policy=p,
                 prefill_s_per_token=1e-4, weights=w)
    # the router learned the simulated nodes' rate (the default assumed 1e-4 s a token too) and
    # saw every request answer but those whose first token is still to come
    assert all(q.s_per_block == pytest.approx(BLOCK_TOKENS * 1e-4) for q in p.queues.values())
    assert sum(len(q.pending) for q in p.queues.values()) <= 2 and len(r.ttft_s) == 200


def test_a_whole_response_leaves_the_queue_without_measuring_and_a_4xx_is_taken_off():
    s = _state(lambda r: httpx.Response(200))
    whole = s.start_proxy("n", 10, 10, 16)
    whole("ok")  # not streamed: its time includes the decoding
    q = s.prefill["n"]
    assert not q.pending and q.measured == 0 and q.s_per_block == 0.01
    rejected = s.start_proxy("n", 10, 10, 16)
    rejected("client_error")  # a 4xx: nothing was prefilled
    assert not q.pending and q.measured == 0 and q.wait(0.0) == 0.0
    streamed = s.start_proxy("n", 10, 10, 16)
    streamed.first_token()
    streamed("ok")
    assert not q.pending and q.measured == 1
