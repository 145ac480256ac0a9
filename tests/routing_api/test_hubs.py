"""Hubs (routing_api/hubs.py): which prefixes many prompts continue, a session kept where its own
context is when that costs no wait, and the hub copied to a light idle node when the gate keeps a
request on an over-bound holder."""

from __future__ import annotations

from routing_api.config import RouterSettings
from routing_api.hubs import HUB_MEMORY, Hubs, after_gate, stay, warmup
from routing_api.prefill import PrefillQueue, gate
from routing_api.scoring import DEFAULT_WEIGHTS, NodeView, PrefixMatch, decide
from tests.routing_api.weights import weights

RATE = 10_000.0
W = weights(overlap_weight=24.0, bound_gate=0.5, queue_tiebreak=True, hub_fanout=3)


def test_hubs_are_on_by_default_and_a_setting():
    assert DEFAULT_WEIGHTS.hub_fanout == 16 and HUB_MEMORY == 262_144
    assert RouterSettings(hub_fanout=0).weights().hub_fanout == 0


def test_a_hub_ends_at_the_last_block_that_enough_distinct_blocks_followed():
    h = Hubs(3)
    # a session: each turn resends the whole context and adds to it; one continuation per block
    for turn in range(1, 8):
        assert h.observe(list(range(1, turn + 3))) == 0
    # prompts that share the blocks 1, 2, 3 and then go their own ways (like an agent type's tools)
    assert h.observe([1, 2, 3, 100, 101]) == 0  # block 3 was followed by 4 and 100
    assert h.observe([1, 2, 3, 200]) == 3  # by 4, 100 and 200: a hub of 3 blocks
    assert h.observe([1, 2, 3, 300, 301]) == 3
    assert h.observe([1, 2]) == 0  # the prompt's own last block is not followed by anything here
    assert h.observe([1, 2, 3]) == 3  # but block 3 is a hub's end, whatever this prompt adds
    assert len(h) == 10  # blocks 1 … 8 (the session's), 100 and 300 have continuations recorded


def test_the_memory_forgets_the_blocks_seen_least_recently_and_zero_is_off():
    h = Hubs(2, memory=3)
    h.observe([1, 2, 3, 4])  # 1, 2, 3 remembered
    h.observe([1, 5])  # 1 again (now followed by 2 and 5)
    h.observe([7, 8])  # 7 in: 2, the least recently seen, out
    assert len(h) == 3 and h.observe([1, 9]) == 1
    assert h.observe([2, 10]) == 0  # 2 was forgotten: only 10 follows it now
    off = Hubs(0)
    assert off.observe([1, 2, 3]) == 0 and len(off) == 0


def _fleet(loads: dict[str, int], matches: dict[str, int], blocks: int = 10, work: dict[str, float] | None = None):
    views = [NodeView(n, f"http://{n}", "live", 10_000, active_blocks=load, block_size=16,
                      routed_work=(work or {}).get(n, 0.0)) for n, load in loads.items()]
    return decide(blocks, views, {n: PrefixMatch(gpu=m) for n, m in matches.items()}, W, block_size=16)


def _queue(blocks: int) -> PrefillQueue:
    q = PrefillQueue(16 / RATE)
    q.add(1, blocks, now=0.0)
    return q


def test_a_session_stays_on_an_idle_node_that_holds_its_own_context():
    # a holds 8 of the 10 blocks, 2 of them a hub's, and is over the load bound (100 in hand)
    d = _fleet({"a": 100, "b": 0, "c": 0}, {"a": 8})
    assert d.chosen.node_id == "b"
    assert gate(d, {"a": _queue(4)}, W, RATE, 16, now=0.0) is None  # 4 queued blocks: the gate keeps the bound
    assert stay(d, 2, {"a": _queue(4)}, now=0.0) is None  # and so does stay: a has a queue
    moved = stay(d, 2, {}, now=0.0)  # no queue (as the bound gate would also have found)
    assert moved is not None and moved.node_id == "a" and d.chosen is moved
    assert d.reason.startswith("stay: over the bound, but holds 8 blocks of this prompt (2 of them a shared prefix)")


def test_a_request_whose_cached_prefix_is_only_a_hub_moves_to_balance():
    d = _fleet({"a": 100, "b": 0, "c": 0}, {"a": 8, "b": 2})
    assert stay(d, 8, {}, now=0.0) is None  # all that a holds is the hub: no context of its own to keep
    d = _fleet({"a": 100, "b": 0, "c": 0}, {"a": 8, "b": 8})
    assert stay(d, 2, {}, now=0.0) is None  # b holds as much: nothing is computed again
    d = _fleet({"a": 0, "b": 0}, {"a": 8})
    assert d.chosen.node_id == "a" and stay(d, 0, {}, now=0.0) is None  # the bound moved nothing


def test_the_hub_is_copied_to_the_idle_node_with_the_least_work_that_holds_less_of_it():
    loads, work = {"a": 100, "b": 0, "c": 0, "d": 0}, {"a": 0.0, "b": 30.0, "c": 20.0, "d": 10.0}
    d = _fleet(loads, {"a": 9, "b": 1}, work=work)
    assert d.chosen.node_id != "a"
    assert gate(d, {}, W, RATE, 16, now=0.0).node_id == "a"  # 1 block to compute on a, 9 or 10 elsewhere
    assert warmup(d, 8, {"d": _queue(4)}, now=0.0).target.node_id == "c"  # d is queued; c did less than b
    w = warmup(d, 8, {}, now=0.0)
    assert (w.target.node_id, w.blocks, w.work) == ("d", 8, 8)
    assert warmup(d, 12, {}, now=0.0).blocks == 9  # only what the holder holds of a longer hub
    assert warmup(d, 0, {}, now=0.0) is None  # no hub
    assert warmup(d, 8, {"b": _queue(1), "c": _queue(1), "d": _queue(1)}, now=0.0) is None  # no idle target
    assert warmup(d, 8, {}, now=0.0, block_size=16).target.node_id == "d"
    assert warmup(d, 8, {}, now=0.0, block_size=32) is None  # the hub hashed in 32-token blocks: a holds others


def test_after_the_gate_hubs_learn_then_stay_then_copy_and_do_nothing_at_fanout_zero():
    d = _fleet({"a": 100, "b": 0, "c": 0}, {"a": 8})
    assert after_gate(Hubs(0), d, list(range(10)), {}, now=0.0) == (None, None) and d.chosen.node_id == "b"
    h = Hubs(2)
    h.observe([1, 2, 3, 50])
    stayed, warm = after_gate(h, d, [1, 2, 3, 60], {}, now=0.0)  # block 3 followed by 50 and 60: a hub of 3
    assert stayed.node_id == "a" and d.chosen is stayed  # a holds 8 blocks, more than the hub's 3
    assert (warm.target.node_id, warm.blocks) == ("b", 3)  # and a, over the bound, holds the hub: copied


def test_nothing_is_copied_when_the_choice_is_within_the_bounds():
    d = _fleet({"a": 0, "b": 0}, {"a": 9})
    assert d.chosen.node_id == "a" and not d.chosen.over_bound
    assert warmup(d, 8, {}, now=0.0) is None


def test_a_block_followed_by_one_block_again_and_again_is_no_hub_and_none_is_a_block_like_any():
    h = Hubs(2)
    for _ in range(5):
        assert h.observe([None, 1, 2]) == 0  # the same continuations each time
    assert h.observe([None, 7]) == 1  # None was followed by 1 and 7
