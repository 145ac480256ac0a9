"""The routing decision, exactly."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from eventbus.hashing import prompt_block_hashes
from eventbus.protocol import DEFAULT_PRIORITY
from routing_api.config import RouterSettings
from routing_api.scoring import (
    DEFAULT_WEIGHTS,
    Finished,
    NodeView,
    PrefixMatch,
    RoutingWeights,
    finished_since,
    overlay,
    prefix_match,
)
from routing_api.scoring import decide as decide_matches
from routing_api.state import Inflight
from tests.routing_api.weights import weights

W = weights(load_bound=0.0)  # the cost alone, as before the bound: these decisions are today's
H = [101, 102, 103, 104, 105, 106, 107, 108]  # a prompt of 8 full blocks


def decide(hashes, nodes, holdings, w, rng=None):
    """decide() from raw holdings, through the pure prefix_match (the SQL computes the same)."""
    return decide_matches(len(hashes), nodes, {n: prefix_match(hashes, h) for n, h in holdings.items()}, w, rng)


def node(nid: str, status: str = "live", **kw) -> NodeView:
    return NodeView(nid, f"http://{nid}", status, kw.pop("capacity_gpu", 1000), **kw)


def gpu(*hashes: int, prio: int = 35) -> dict[int, tuple[int, int]]:
    return {h: (0, prio) for h in hashes}


def test_the_longest_cached_prefix_wins_at_equal_load():
    d = decide(H, [node("a"), node("b"), node("c")], {"a": gpu(*H[:2]), "b": gpu(*H[:6]), "c": {}}, W)
    assert d.chosen.node_id == "b"
    costs = {c.node_id: c.cost for c in d.candidates}
    assert costs == {"a": 6.0, "b": 2.0, "c": 8.0}
    assert d.chosen.matched_blocks == 6 and "6/8 prompt blocks cached" in d.reason


def test_only_the_contiguous_prefix_counts():
    # b holds blocks 1..8 except block 2: its prefix stops after block 1.
    d = decide(H, [node("a"), node("b")], {"a": gpu(*H[:3]), "b": gpu(H[0], *H[2:])}, W)
    assert d.chosen.node_id == "a"
    assert {c.node_id: c.matched_blocks for c in d.candidates} == {"a": 3, "b": 1}


def test_a_much_longer_queue_outweighs_a_small_prefix_advantage():
    busy = node("a", active_blocks=40, queued_requests=3)          # load 40 + 3 x 8 = 64 blocks
    idle = node("b", active_blocks=2)
    d = decide(H, [busy, idle], {"a": gpu(*H[:8]), "b": gpu(*H[:6])}, W)
    assert d.chosen.node_id == "b"
    assert {c.node_id: c.cost for c in d.candidates} == {"a": 64.0, "b": 4.0}
    # ... while a small load difference does not beat a large prefix advantage.
    d = decide(H, [node("a", active_blocks=3), node("b")], {"a": gpu(*H), "b": gpu(H[0])}, W)
    assert d.chosen.node_id == "a"


def test_host_tier_blocks_earn_partial_credit():
    host = {h: (1, 35) for h in H[:4]}
    d = decide(H, [node("a"), node("b")], {"a": gpu(*H[:3]), "b": host}, W)
    cand = {c.node_id: c for c in d.candidates}
    assert cand["b"].host_blocks == 4 and cand["b"].cached_credit == 3.0  # 4 x 0.75
    assert cand["a"].cached_credit == 3.0
    assert d.chosen.node_id == "a"  # equal cost: the tie goes to the lower load, then the id
    assert prefix_match(H, {**gpu(H[0]), H[1]: (1, 35)}).credit(weights(host_credit=0.5)) == 1.5
    assert prefix_match(H, {**gpu(H[0]), H[1]: (1, 35)}) == PrefixMatch(gpu=1, host=1, leaf_low=False)


def test_a_prefix_whose_leaf_is_below_the_default_priority_is_worth_a_little_less():
    d = decide(H, [node("a"), node("b")], {"a": gpu(*H[:4], prio=10), "b": gpu(*H[:4], prio=80)}, W)
    assert d.chosen.node_id == "b"
    assert {c.node_id: round(c.cached_credit, 2) for c in d.candidates} == {"a": 3.6, "b": 4.0}


def test_stale_gone_and_suspect_nodes_are_never_chosen_and_resyncing_get_no_prefix_credit():
    nodes = [node("a", "stale"), node("b", "gone"), node("c", "suspect"), node("d", "resyncing"), node("e")]
    holdings = {n.node_id: gpu(*H) for n in nodes}
    d = decide(H, nodes, holdings, W)
    assert d.chosen.node_id == "e"
    cand = {c.node_id: c for c in d.candidates}
    assert not cand["a"].eligible and "stale: never chosen" in cand["a"].reason
    assert cand["d"].eligible and cand["d"].matched_blocks == 0
    assert decide(H, [node("a", "stale")], {}, W).chosen is None


def test_nodes_over_the_load_threshold_are_filtered_first():
    full = node("a", capacity_gpu=100, active_blocks=99)   # 99 % of its blocks in use
    d = decide(H, [full, node("b", capacity_gpu=100, active_blocks=50)], {"a": gpu(*H)}, W)
    assert d.chosen.node_id == "b"
    # ... unless every node is busy: then the cheapest anyway.
    d = decide(H, [full], {"a": gpu(*H)}, W)
    assert d.chosen.node_id == "a"


def test_the_routers_own_inflight_count_adds_load():
    d = decide(H, [node("a", inflight_requests=5, inflight_blocks=40), node("b")], {"a": gpu(*H[:4])}, W)
    assert d.chosen.node_id == "b"


def test_ties_break_by_load_then_deterministically():
    d = decide(H, [node("b"), node("a")], {}, W)
    assert d.chosen.node_id == "a"
    d = decide(H, [node("a", active_blocks=1), node("b")], {"b": {}}, weights(overlap_weight=0))
    assert d.chosen.node_id == "b"


def test_softmax_sampling_prefers_cheap_nodes_in_proportion():
    w = weights(temperature=2.0)
    rng = random.Random(5)
    picks = Counter(decide(H, [node("a"), node("b")], {"a": gpu(*H[:2])}, w, rng).chosen.node_id
                    for _ in range(4000))
    # cost a = 6, b = 8: P(a) = 1 / (1 + e^-1) = 0.731
    assert abs(picks["a"] / 4000 - 0.731) < 0.03


def test_lora_and_cache_salt_separate_otherwise_equal_prompts():
    tokens = list(range(256))
    plain = prompt_block_hashes(tokens, 32)
    holdings = {"a": gpu(*plain)}
    for variant in (prompt_block_hashes(tokens, 32, lora_id=3), prompt_block_hashes(tokens, 32, cache_salt="t1")):
        assert not set(variant) & set(plain)
        d = decide(variant, [node("a"), node("b")], holdings, W)
        assert {c.node_id: c.matched_blocks for c in d.candidates} == {"a": 0, "b": 0}
    assert decide(plain, [node("a"), node("b")], holdings, W).chosen.node_id == "a"


def test_an_excluded_node_is_never_chosen_whatever_it_holds():
    d = decide(H, [node("a"), node("b", excluded="serves qwen, not llama")], {"a": {}, "b": gpu(*H)}, W)
    assert d.chosen.node_id == "a"
    b = next(c for c in d.candidates if c.node_id == "b")
    assert (b.eligible, b.reason, b.matched_blocks) == (False, "serves qwen, not llama", 0)
    assert decide(H, [node("b", excluded="x")], {"b": gpu(*H)}, W).chosen is None


def test_overlay_marks_suspects_and_adds_inflight_counts_and_leaves_the_rest_alone():
    views = [node("a", active_blocks=3), node("b", "resyncing"), node("c"), node("d"), node("e", "stale")]
    suspect_until = {"a": 110.0, "c": 99.0, "e": 200.0}  # c's suspicion has run out at now = 100
    inflight = {"b": Inflight(2, 17), "c": Inflight(0, 0), "e": Inflight(1, 4)}
    out = overlay(views, suspect_until, inflight, now=100.0)
    assert [v.node_id for v in out] == ["a", "b", "c", "d", "e"]
    assert out[0] == dataclasses.replace(views[0], status="suspect")
    assert (out[0].inflight_requests, out[0].inflight_blocks, out[0].active_blocks) == (0, 0, 3)
    assert out[1] == dataclasses.replace(views[1], inflight_requests=2, inflight_blocks=17)
    assert out[1].status == "resyncing"
    assert out[2] is views[2] and out[3] is views[3]  # an expired mark, an empty count, nothing: untouched
    assert out[4] == dataclasses.replace(views[4], status="suspect", inflight_requests=1, inflight_blocks=4)
    assert [v.status for v in views] == ["live", "resyncing", "live", "live", "stale"]  # the input is unchanged


def test_overlay_without_router_state_is_a_copy_of_the_same_views():
    views = (node("a"), node("b"))
    out = overlay(views, {}, {}, now=0.0)
    assert isinstance(out, list) and out == list(views)
    assert all(o is v for o, v in zip(out, views, strict=True))
    # a suspect mark at exactly now has run out
    assert overlay(views, {"a": 5.0}, {}, now=5.0)[0] is views[0]


def test_a_suspect_node_from_the_overlay_is_never_chosen_and_inflight_load_counts():
    views = overlay([node("a"), node("b"), node("c")], {"a": 10.0}, {"b": Inflight(1, 8)}, now=0.0)
    d = decide(H, views, {"a": gpu(*H), "b": gpu(*H[:4]), "c": gpu(*H[:3])}, W)
    cand = {c.node_id: c for c in d.candidates}
    assert (cand["a"].eligible, cand["a"].reason) == (False, "suspect: never chosen")
    assert (cand["b"].cost, cand["c"].cost) == (12.0, 5.0)  # b: 4 to prefill + 8 in flight
    assert d.chosen.node_id == "c"


def test_the_weights_defaults_have_one_home_and_are_the_policy_kvflow_sim_measures():
    from kvflow.sim.routing import SIM_WEIGHTS

    assert RoutingWeights() == DEFAULT_WEIGHTS == SIM_WEIGHTS == RouterSettings().weights()
    assert (DEFAULT_WEIGHTS.overlap_weight, DEFAULT_WEIGHTS.load_bound, DEFAULT_WEIGHTS.work_bound,
            DEFAULT_WEIGHTS.ttft_quantile) == (24.0, 0.75, 0.25, 0.9)
    for f in dataclasses.fields(RoutingWeights):
        assert RouterSettings.model_fields[f.name].default == getattr(DEFAULT_WEIGHTS, f.name)
    assert RouterSettings(overlap_weight=2.0, temperature=0.5).weights() == RoutingWeights(overlap_weight=2.0,
                                                                                         temperature=0.5)
    assert prefix_match(H, gpu(*H[:2], prio=DEFAULT_PRIORITY - 1)).leaf_low
    assert not prefix_match(H, gpu(*H[:2], prio=DEFAULT_PRIORITY)).leaf_low


def test_a_finished_request_is_taken_off_the_heartbeat_that_still_counts_it():
    """Started before the heartbeat, ended after it: the heartbeat counted it, and it is gone."""
    ended = [Finished(started=9.0, ended=9.5, blocks=50),    # ended before the heartbeat: not counted by it
             Finished(started=9.8, ended=10.4, blocks=96),   # running at the heartbeat (t = 10), ended since
             Finished(started=10.2, ended=10.6, blocks=7),   # started after the heartbeat: never counted
             Finished(started=9.9, ended=10.7, blocks=3)]
    assert finished_since(ended, 10.0) == (2, 99)
    assert finished_since(ended, 10.5) == (2, 10)       # a newer heartbeat: what ran then and ended since
    assert finished_since(ended, 11.0) == (0, 0)
    assert finished_since(ended, 0.0) == (0, 0)         # the heartbeat's time unknown: nothing
    assert finished_since([], 10.0) == (0, 0)


def test_overlay_takes_finished_load_off_never_below_zero_and_keeps_the_rest():
    views = [node("a", active_blocks=100, active_requests=1, stats_ts=10.0),
             node("b", active_blocks=5, active_requests=1, stats_ts=10.0),
             node("c", active_blocks=40, active_requests=2, stats_ts=0.0),   # no heartbeat time known
             node("d", active_blocks=8, active_requests=1, stats_ts=10.0)]
    finished = {"a": [Finished(9.5, 10.2, 96)], "b": [Finished(9.5, 10.2, 96)], "c": [Finished(9.5, 10.2, 30)],
                "d": [Finished(10.1, 10.2, 8)]}
    out = overlay(views, {}, {"a": Inflight(1, 4)}, now=0.0, finished=finished)
    assert (out[0].active_blocks, out[0].active_requests, out[0].inflight_blocks) == (4, 0, 4)
    assert (out[1].active_blocks, out[1].active_requests) == (0, 0)  # more than it counted: zero
    assert out[2] is views[2] and out[3] is views[3]
    assert overlay(views, {}, {}, now=0.0, finished={})[0] is views[0]


def test_a_conversations_next_turn_stays_where_its_history_is():
    """Finding 5 of issue 15, exactly: the node holding turn 0 still reports turn 0's blocks as
    load (its heartbeat came while it ran); without the router's knowledge the idle node wins."""
    history = gpu(*H[:7])  # turn 0: 7 of the 8 blocks of turn 1's prompt
    views = [node("a", active_blocks=8, active_requests=1, stats_ts=100.0), node("b", stats_ts=100.0)]
    old = decide(H, views, {"a": history}, W)
    assert old.chosen.node_id == "b"  # a: 1 to prefill + 8 of load = 9 > b: 8 to prefill
    turn0 = {"a": [Finished(started=99.5, ended=100.3, blocks=8)]}
    new = decide(H, overlay(views, {}, {}, now=0.0, finished=turn0), {"a": history}, W)
    assert new.chosen.node_id == "a" and new.chosen.cost == 1.0


def test_a_gone_node_says_so_whatever_else_excludes_it():
    d = decide(H, [node("a", "gone", excluded="block size 16; this fleet's prompts are hashed in blocks of 32"),
                   node("b", excluded="block size 16; this fleet's prompts are hashed in blocks of 32"),
                   node("c", "stale"), node("d")], {}, W)
    why = {c.node_id: c.reason for c in d.candidates}
    assert why["a"] == "gone: never chosen"
    assert why["b"] == "block size 16; this fleet's prompts are hashed in blocks of 32"
    assert why["c"] == "stale: never chosen" and d.chosen.node_id == "d"


# ------------------------------------------------------------------- a fleet of several block sizes

TOKENS = list(range(500, 628))  # 128 tokens: 8 blocks of 16, 4 of 32
AT = {b: prompt_block_hashes(TOKENS, b) for b in (16, 32)}  # the prompt hashed as each node hashes it


def decide_mixed(nodes, held, w=W, unit=32, tokens=TOKENS, rng=None):
    """decide() as the router calls it: each node matched at its own block size (``held``: node → the
    number of the prompt's blocks it holds on the GPU, at its size), costs in blocks of ``unit``."""
    sizes = {n.node_id: n.block_size for n in nodes}
    matches = {n: prefix_match(prompt_block_hashes(tokens, sizes[n]), gpu(*prompt_block_hashes(tokens, sizes[n])[:k]))
               for n, k in held.items()}
    return decide_matches(len(tokens) // unit, nodes, matches, w, rng, block_size=unit, tokens=len(tokens))


def test_equal_cached_tokens_earn_equal_credit_whatever_the_block_size():
    nodes = [node("v16", block_size=16), node("k32", block_size=32)]
    d = decide_mixed(nodes, {"v16": 4, "k32": 2})  # 64 tokens each
    c = {x.node_id: x for x in d.candidates}
    assert (c["v16"].cached_credit, c["v16"].prefill_blocks, c["v16"].cost) == (2.0, 2.0, 2.0)
    assert (c["k32"].cached_credit, c["k32"].prefill_blocks, c["k32"].cost) == (2.0, 2.0, 2.0)
    assert (c["v16"].matched_blocks, c["v16"].matched_tokens, c["v16"].prompt_blocks) == (4, 64, 8)
    assert (c["k32"].matched_blocks, c["k32"].matched_tokens, c["k32"].prompt_blocks) == (2, 64, 4)
    assert d.chosen.node_id == "k32"  # a tie in everything: the node id decides, as in any fleet
    # on the host and below the default priority alike: 0.75 and 0.9 of the same tokens
    host = {"v16": PrefixMatch(gpu=2, host=2, leaf_low=True), "k32": PrefixMatch(gpu=1, host=1, leaf_low=True)}
    d = decide_matches(4, nodes, host, W, block_size=32, tokens=128)
    assert len({x.cached_credit for x in d.candidates}) == 1 and len({x.cost for x in d.candidates}) == 1


def test_a_16_token_node_holding_48_tokens_beats_a_32_token_node_holding_32_at_equal_load():
    nodes = [node("k32", block_size=32, active_blocks=4), node("v16", block_size=16, active_blocks=8)]
    d = decide_mixed(nodes, {"v16": 3, "k32": 1})
    c = {x.node_id: x for x in d.candidates}
    assert d.chosen.node_id == "v16"
    assert (c["v16"].cached_credit, c["k32"].cached_credit) == (1.5, 1.0)  # in blocks of 32 tokens
    assert c["v16"].decode_blocks == c["k32"].decode_blocks == 4.0  # 128 tokens of load each
    assert (c["v16"].cost, c["k32"].cost) == (6.5, 7.0)
    assert d.reason == ("cost 6.50 = 2.50 blocks to prefill + 4 blocks of load (blocks of 32 tokens); "
                        "3/8 prompt blocks of 16 tokens cached (0 on host); next best k32 at 7.00")
    # the unit is only a unit: in blocks of 16 every cost doubles, and the choice stays
    d16 = decide_mixed(nodes, {"v16": 3, "k32": 1}, unit=16)
    assert d16.chosen.node_id == "v16"
    assert {x.node_id: x.cost for x in d16.candidates} == {"v16": 13.0, "k32": 14.0}


def test_what_is_to_prefill_is_measured_from_the_same_length_for_every_node():
    """A 48-token prompt: 3 full blocks of 16, 1 of 32. The node of 16 holding all 3 has nothing left
    to prefill; the node of 32 holding its 1 block still has the 16 tokens it cannot hold as a block."""
    nodes = [node("v16", block_size=16), node("k32", block_size=32)]
    d = decide_mixed(nodes, {"v16": 3, "k32": 1}, tokens=TOKENS[:48])
    c = {x.node_id: x for x in d.candidates}
    assert (c["v16"].prefill_blocks, c["k32"].prefill_blocks) == (0.0, 0.5) and d.chosen.node_id == "v16"
    assert (c["v16"].prompt_blocks, c["k32"].prompt_blocks) == (3, 1)


def test_load_in_flight_and_finished_is_counted_in_each_nodes_own_blocks():
    """The router's in-flight counts and finished requests are in the node's blocks (as its
    heartbeat's): 8 blocks of 16 in flight weigh as 4 of 32."""
    views = [node("v16", block_size=16, stats_ts=10.0, active_blocks=8, active_requests=1),
             node("k32", block_size=32, stats_ts=10.0)]
    inflight = {"k32": Inflight(1, 4)}
    finished = {"v16": [Finished(9.5, 10.5, 8)]}  # its 8 blocks (of 16) ended after the heartbeat
    d = decide_mixed(overlay(views, {}, inflight, 0.0, finished), {})
    c = {x.node_id: x for x in d.candidates}
    assert (c["v16"].decode_blocks, c["k32"].decode_blocks) == (0.0, 4.0) and d.chosen.node_id == "v16"
    d = decide_mixed(overlay(views, {}, {"v16": Inflight(1, 8), **inflight}, 0.0), {})
    assert {x.node_id: x.decode_blocks for x in d.candidates} == {"v16": 8.0, "k32": 4.0}  # 8 + 8 of 16 = 8 of 32


def test_busy_is_measured_in_the_nodes_own_blocks():
    nodes = [node("v16", block_size=16, capacity_gpu=100, active_blocks=96), node("k32", block_size=32,
                                                                                  capacity_gpu=100, active_blocks=60)]
    d = decide_mixed(nodes, {"v16": 8})
    c = {x.node_id: x for x in d.candidates}
    assert c["v16"].busy and not c["k32"].busy and d.chosen.node_id == "k32"


def test_one_block_size_decides_exactly_as_before():
    """A fleet of one block size: the same costs, choices and reasons, whether the views carry the
    size (as the router's do now) or not (as before, and as the simulator's)."""
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 5)
        views = [node(f"n{i}", rng.choice(["live", "live", "resyncing", "stale"]), capacity_gpu=rng.choice([0, 50]),
                      active_blocks=rng.randrange(60), queued_requests=rng.randrange(3),
                      inflight_blocks=rng.randrange(9)) for i in range(n)]
        matches = {v.node_id: PrefixMatch(rng.randrange(5), rng.randrange(3), rng.random() < 0.3) for v in views}
        w = weights(queued_weight_blocks=rng.choice([8.0, 2.5]), temperature=rng.choice([0.0, 0.0, 1.0]))
        seed = rng.random()
        before = decide_matches(6, views, matches, w, random.Random(seed))
        sized = [dataclasses.replace(v, block_size=32) for v in views]
        now = decide_matches(6, sized, matches, w, random.Random(seed), block_size=32, tokens=6 * 32 + 31)
        assert [(c.node_id, c.cost, c.cached_credit, c.prefill_blocks, c.decode_blocks, c.busy, c.reason)
                for c in before.candidates] == [
            (c.node_id, c.cost, c.cached_credit, c.prefill_blocks, c.decode_blocks, c.busy, c.reason)
            for c in now.candidates]
        assert (before.chosen and before.chosen.node_id, before.reason) == (now.chosen and now.chosen.node_id,
                                                                            now.reason)


def test_a_node_of_another_size_needs_the_prompts_tokens():
    with pytest.raises(ValueError, match="need the prompt's tokens"):
        decide_matches(4, [node("a", block_size=16), node("b", block_size=32)], {}, W, block_size=32)
    # excluded or never chosen, it is no candidate: no conversion needed
    d = decide_matches(4, [node("a", block_size=16, excluded="x"), node("b", block_size=32)], {}, W, block_size=32)
    assert d.chosen.node_id == "b"
