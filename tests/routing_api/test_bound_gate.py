"""The bound gate and the queue tiebreak (routing_api/prefill.py ``gate``): the bounds give way where
the node that holds the prompt would still answer sooner, and a queued choice gives way to a node
holding as much of the prompt that starts sooner."""

from __future__ import annotations

from routing_api.config import RouterSettings
from routing_api.prefill import PrefillQueue, gate
from routing_api.scoring import DEFAULT_WEIGHTS, NodeView, PrefixMatch, decide
from tests.routing_api.weights import weights

RATE = 10_000.0  # tokens/s a node is assumed to prefill before it is measured
S_PER_BLOCK = 16 / RATE
W = weights(overlap_weight=24.0, bound_gate=0.5, queue_tiebreak=True)


def test_both_are_on_by_default_and_settings():
    assert (DEFAULT_WEIGHTS.bound_gate, DEFAULT_WEIGHTS.queue_tiebreak) == (0.5, True)
    w = RouterSettings(bound_gate=0.0, queue_tiebreak=False).weights()
    assert (w.bound_gate, w.queue_tiebreak) == (0.0, False)


def _hot_holder(w=W):
    """``a`` holds the whole 10-block prompt but is over the load bound (100 blocks in hand against
    ``b``'s 0: the cap is 1.75 × 55); ``b`` holds nothing."""
    views = [NodeView("a", "http://a", "live", 10_000, active_blocks=100, block_size=16),
             NodeView("b", "http://b", "live", 10_000, block_size=16)]
    d = decide(10, views, {"a": PrefixMatch(gpu=10)}, w, block_size=16)
    assert d.chosen is not None and d.chosen.node_id == "b"  # the bound's choice
    a = next(c for c in d.candidates if c.node_id == "a")
    assert a.over_bound and a.cost < d.chosen.cost  # the cost alone would take a
    return d


def test_the_gate_lets_the_holder_take_it_when_its_queue_costs_no_time():
    d = _hot_holder()
    moved = gate(d, {}, W, RATE, 16, now=0.0)  # a has nothing queued: 0 s against b's 10 blocks
    assert moved is not None and moved.node_id == "a" and d.chosen is moved
    assert d.reason.startswith("bound gate: over the bound, but predicted TTFT 0.00 s here against 0.02 s on b")


def test_the_gate_keeps_the_bound_when_the_holders_queue_would_make_it_wait():
    d = _hot_holder()
    q = PrefillQueue(S_PER_BLOCK)
    q.add(1, 6, now=0.0)  # 6 blocks ahead of it: 0.0096 s, more than half of b's 0.016 s
    assert gate(d, {"a": q}, W, RATE, 16, now=0.0) is None and d.chosen.node_id == "b"
    d = _hot_holder()
    q = PrefillQueue(S_PER_BLOCK)
    q.add(1, 5, now=0.0)  # 5 blocks: exactly half; the gate opens
    assert gate(d, {"a": q}, W, RATE, 16, now=0.0).node_id == "a"


def test_the_gate_is_off_at_zero():
    w = weights(overlap_weight=24.0, bound_gate=0.0, queue_tiebreak=True)
    d = _hot_holder(w)
    assert gate(d, {}, w, RATE, 16, now=0.0) is None and d.chosen.node_id == "b"


def _equal_holders(matches: dict[str, int], w=W):
    """Three nodes holding ``matches`` of an 8-block prompt; ``a`` has the least in hand."""
    views = [NodeView(n, f"http://{n}", "live", 10_000, active_blocks=load, block_size=16)
             for n, load in zip("abc", (0, 4, 4), strict=True)]
    return decide(8, views, {n: PrefixMatch(gpu=m) for n, m in matches.items()}, w, block_size=16)


def test_the_tiebreak_moves_a_queued_choice_to_an_equal_holder_that_starts_sooner():
    d = _equal_holders({"a": 4, "b": 4})
    assert d.chosen.node_id == "a"
    q = PrefillQueue(S_PER_BLOCK)
    q.add(1, 20, now=0.0)
    moved = gate(d, {"a": q}, W, RATE, 16, now=0.0)
    assert moved is not None and moved.node_id == "b"  # b holds as much and starts at once; c holds less
    assert d.reason.startswith("queue tiebreak: a holds no more of the prompt and is queued")


def test_the_tiebreak_never_trades_cached_blocks_and_leaves_an_idle_choice_alone():
    q = PrefillQueue(S_PER_BLOCK)
    q.add(1, 20, now=0.0)
    d = _equal_holders({"a": 4, "b": 3, "c": 0})
    assert gate(d, {"a": q}, W, RATE, 16, now=0.0) is None  # the others hold less: a keeps it, queued
    d = _equal_holders({"a": 4, "b": 4})
    assert gate(d, {}, W, RATE, 16, now=0.0) is None  # a has no queue: nothing to gain
    off = weights(overlap_weight=24.0, bound_gate=0.5, queue_tiebreak=False)
    d = _equal_holders({"a": 4, "b": 4}, off)
    assert gate(d, {"a": q}, off, RATE, 16, now=0.0) is None
