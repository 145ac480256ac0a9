"""The traces built to defeat the adaptive policy's guard (kvflow/sim/adversarial.py), and the
windowed comparison with LRU."""

from __future__ import annotations

from collections import Counter

from inference_node.kv.adaptive import AdaptivePolicy
from kvflow.sim.adversarial import ADVERSARIAL, frequency_trap, junk_trap, replay_hits, windowed_deficit
from kvflow.sim.request import SimRequest


def test_replay_hits_counts_each_requests_cached_prefix_under_lru():
    reqs = [SimRequest(float(i), keys, 10) for i, keys in enumerate([(1, 2), (3, 4), (1, 2), (5, 6), (3, 4), (1, 2)])]
    # 4 blocks: (1, 2) hits once; (5, 6) evicts the least recently used (3, 4), then (3, 4) evicts (1, 2)
    assert replay_hits(reqs, 4, None) == [0, 0, 2, 0, 0, 0]


def test_the_windowed_deficit_is_lrus_hits_less_the_policys_over_the_worst_window():
    reqs = junk_trap(n=600, capacity=100, period=200)
    lru = replay_hits(reqs, 100, None)
    ours = replay_hits(reqs, 100, AdaptivePolicy())
    d = windowed_deficit(reqs, 100, AdaptivePolicy(), window=50)
    assert (d.lru_hits, d.hits, d.blocks) == (sum(lru), sum(ours), sum(len(r.keys) for r in reqs))
    diffs = [sum(lru[i:i + 50]) - sum(ours[i:i + 50]) for i in range(len(reqs) - 49)]
    assert d.worst_window_deficit == max(diffs)


def test_the_junk_trap_teaches_that_short_prompts_are_junk_then_repeats_them_where_lru_hits():
    reqs = junk_trap(n=4000, capacity=1000, period=1000)
    assert reqs == junk_trap(n=4000, capacity=1000, period=1000)
    short = Counter(r.keys for r in reqs if len(r.keys) == 2)
    teach = Counter(r.keys for r in reqs[:1000] if len(r.keys) == 2)
    trap = Counter(r.keys for r in reqs[1000:2000] if len(r.keys) == 2)
    assert set(teach.values()) == {1}  # one-offs
    assert max(trap.values()) == 3 and sum(v == 3 for v in trap.values()) > 100  # asked three times
    assert len(short) == len(teach) + len(trap) + len(Counter(r.keys for r in reqs[2000:] if len(r.keys) == 2))
    hits = replay_hits(reqs, 1000, None)
    trap_hits = sum(h for r, h in zip(reqs[1000:2000], hits[1000:2000], strict=True) if len(r.keys) == 2)
    assert trap_hits >= 0.9 * 2 * 2 * sum(v == 3 for v in trap.values())  # LRU hits (nearly) every repeat
    long_hits = sum(h for r, h in zip(reqs, hits, strict=True) if len(r.keys) == 12)
    assert long_hits == 0  # the long prompts return after the cache has forgotten them


def test_the_frequency_trap_alternates_a_hot_set_and_a_shifting_one():
    reqs = frequency_trap(n=4000, capacity=1000, period=1000)
    hot = Counter(r.keys for r in reqs[:1000])
    assert max(hot.values()) > 2  # reused many times
    assert not set(hot) & {r.keys for r in reqs[2000:3000]}  # the next hot phase has a new set
    shift = Counter(r.keys for r in reqs[1000:2000])
    assert max(shift.values()) == 2
    assert set(ADVERSARIAL) == {"junk_trap", "frequency_trap"}
