"""The adaptive policy's floor against LRU (inference_node/kv/floor.py): its exact shadow is the
core's own LRU, its rule engages and lets go where it says, and on traces built to defeat the
policy its loss stays within the bound the docs argue."""

from __future__ import annotations

import random

import pytest

from inference_node.kv.adaptive import AdaptivePolicy
from inference_node.kv.floor import ExactLru, LruFloor
from inference_node.kv.manager import KvCacheConfig, KVCacheManager
from inference_node.kv.prompt import Prompt
from inference_node.kv.shadows import native_available, tables
from kvflow.sim.adversarial import ADVERSARIAL, replay_floor, replay_hits
from kvflow.sim.request import BLOCK_TOKENS, SimRequest


def _prefix_trace(n: int, seed: int) -> list[SimRequest]:
    """Prompts sharing prefixes at several depths, some asked again soon, some never."""
    rng = random.Random(seed)
    roots = [tuple(range(1000 * r, 1000 * r + rng.randint(1, 4))) for r in range(12)]
    out: list[SimRequest] = []
    nxt = 10**6
    for i in range(n):
        if out and rng.random() < 0.3:
            keys = rng.choice(out[-40:]).keys
        else:
            tail = rng.randint(0, 6)
            keys = rng.choice(roots) + tuple(range(nxt, nxt + tail))
            nxt += tail
        out.append(SimRequest(float(i), keys, 10))
    return out


SHADOWS = [False, pytest.param(True, marks=pytest.mark.skipif(not native_available(), reason="no kvflow_native"))]


@pytest.mark.parametrize("compiled", SHADOWS)
@pytest.mark.parametrize("capacity", [7, 30, 120])
def test_the_exact_shadow_hits_what_the_cores_lru_hits_request_by_request(capacity, compiled):
    reqs = _prefix_trace(1500, seed=capacity)
    core = replay_hits(reqs, capacity, None)
    shadow = tables(compiled).exact(capacity)
    assert type(shadow).__module__ == ("kvflow_native" if compiled else "inference_node.kv.floor")
    mine = [0 if len(r.keys) > capacity else shadow.replay(Prompt.from_block_keys(r.keys, BLOCK_TOKENS).digests)
            for r in reqs]
    assert mine == core
    assert sum(core) > 200  # the trace reuses enough for the order of eviction to matter


@pytest.mark.skipif(not native_available(), reason="no kvflow_native")
def test_the_compiled_shadow_answers_as_the_reference_call_for_call():
    rng = random.Random(5)
    ref, twin = ExactLru(50), tables(True).exact(50)
    for _ in range(3000):
        start = rng.randrange(200)
        digests = [bytes([k % 251]) + k.to_bytes(4, "big") for k in range(start, start + rng.randint(0, 12))]
        assert twin.replay(digests) == ref.replay(digests)
        assert len(twin) == len(ref)
    held = {d: None for d in list(ref.keys)[::3]}
    assert twin.missing_from(held) == ref.missing_from(held) == len(ref) - len(held)
    assert all(d in twin for d in ref.keys)
    with pytest.raises(ValueError, match="33 bytes"):
        twin.replay([b"x" * 33])  # a digest longer than the core's


@pytest.mark.parametrize("compiled", SHADOWS)
def test_the_shadow_evicts_a_prompts_last_block_first(compiled):
    lru = tables(compiled).exact(3)
    assert lru.replay([b"a", b"b", b"c"]) == 0
    assert lru.replay([b"d"]) == 0  # evicts c, the oldest: the prompt's blocks were touched c, b, a
    assert b"c" not in lru and all(k in lru for k in (b"b", b"a", b"d"))
    assert lru.missing_from({b"b": 1}) == 2
    assert lru.replay([b"a", b"b", b"c"]) == 2 and b"c" in lru and len(lru) == 3


def test_the_floor_engages_once_the_loss_beyond_its_share_exceeds_its_blocks():
    f = LruFloor(capacity=10, share=0.1, blocks=3, retry=1.0)
    a, b, c = b"a", b"b", b"c"
    assert not f.step([a, b, c], 0)  # LRU had nothing either
    # LRU hits 3 each time; the cache 2: X grows by 1 - 0.3 = 0.7 a lookup
    steps = [f.step([a, b, c], 2) for _ in range(5)]
    assert steps == [False, False, False, False, True]  # 4 x 0.7 = 2.8 <= 3 < 3.5
    assert f.engaged and f.switches == 1 and f.deficit == 5 and f.lru_hits == 15
    assert f.describe()["engaged"] is True


def test_a_policy_ahead_of_lru_moves_the_low_and_is_never_stopped():
    f = LruFloor(capacity=10, share=0.0, blocks=2, retry=1.0)
    f.step([b"a", b"b"], 0)
    for _ in range(50):
        assert not f.step([b"x", b"y"], 2)  # LRU misses x, y the first time only; the cache hits
    assert not f.engaged and f.low < 0


def test_the_floor_retries_after_a_cache_of_lookups_and_doubles_the_wait_after_a_lost_episode():
    f = LruFloor(capacity=4, share=0.0, blocks=1, retry=1.0)
    assert not f.step([b"a", b"b"], 0)
    assert f.step([b"a", b"b"], 0) and f.engaged  # lost 2 > 1
    assert f.retry == 8  # the episode lost against where it started: twice the cache
    for _ in range(3):
        assert not f.step([b"a", b"b"], 2)
    assert f.step([b"a", b"b"], 2) and not f.engaged  # 8 blocks looked up: the policy runs again
    assert f.step([b"a", b"b"], 0) and f.engaged and f.retry == 16  # lost again: doubled again
    # an episode that ends no worse than where it started restores the first wait
    h = LruFloor(capacity=4, share=0.0, blocks=1, retry=1.0)
    h.start = 5.0
    assert not h.step([b"y"], 0)
    assert not h.step([b"y"], 0)
    assert h.step([b"y"], 0) and h.engaged and h.retry == 4


def test_settings_refuse_a_floor_that_cannot_work():
    for bad in ({"floor_share": 1.0}, {"floor_retry": 0}, {"floor_blocks": -1}, {"floor_caches": -0.5}):
        with pytest.raises(ValueError, match="floor_share must be within"):
            AdaptivePolicy(**bad)


@pytest.mark.parametrize("settings", [{}, {"floor_blocks": 16.0}, {"floor_blocks": 4.0, "floor_share": 0.0,
                                                                    "floor_retry": 0.25}])
@pytest.mark.parametrize(("name", "capacity"), [("junk_trap", 200), ("junk_trap", 1000),
                                                 ("frequency_trap", 200), ("frequency_trap", 1000)])
def test_on_traces_built_to_defeat_it_the_loss_stays_within_the_argued_bound(name, capacity, settings):
    """The bound holds whatever the settings: the defaults (which engage only on the frequency
    trap at 200 blocks) and two that engage often, so that the retries and their costs count."""
    reqs = ADVERSARIAL[name](n=8000, capacity=capacity)
    pol = AdaptivePolicy(**settings)
    theta = min(pol.floor_blocks, pol.floor_caches * capacity)
    lru = replay_hits(reqs, capacity, None)
    run = replay_floor(reqs, capacity, pol)
    biggest = max(len(r.keys) for r in reqs)
    loss = sum(lru) - sum(run.hits)
    assert loss <= pol.floor_share * sum(lru) + run.episodes * (theta + biggest) + run.missing_total
    assert all(m <= capacity for m in run.missing)
    # and per window: every window of 1,000 requests within the bound counted in the window
    assert run.worst_window_excess(lru, 1000, pol, theta, biggest) <= 0
    if settings or (name, capacity) == ("frequency_trap", 200):
        assert run.switches >= 1  # it did engage, so the switches' costs are in the bound


@pytest.mark.parametrize("compiled", SHADOWS)
def test_a_generated_block_is_the_shadows_newest(compiled):
    lru = tables(compiled).exact(3)
    lru.replay([b"a", b"b"])
    lru.touch(b"g")  # stored without a lookup, as LRU holds it
    lru.touch(b"h")  # the oldest, b (the prompt's last block), leaves
    assert b"b" not in lru and all(k in lru for k in (b"a", b"g", b"h")) and len(lru) == 3
    lru.touch(b"a")
    assert lru.replay([b"g", b"h"]) == 2 and b"a" in lru


def test_the_core_hands_the_floor_every_generated_block_it_caches():
    """Generated blocks are cached and no lookup brings them: the floor's shadow holds them as LRU
    would, and a later prompt that continues the answer hits them there too."""
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=64, block_size=4, adaptive=AdaptivePolicy()))
    prompt = list(range(8))  # 2 prompt blocks
    mgr.allocate("a", Prompt.from_tokens(prompt, 4))
    answer = [100 + t for t in range(9)]  # 8 generated tokens fill 2 more blocks (and start a third)
    for t in answer:
        mgr.append_token("a", t)
    mgr.free("a")
    floor = mgr.adaptive.floor
    assert floor is not None and len(floor.lru) == 4
    follow_up = Prompt.from_tokens(prompt + answer[:8] + [7, 7, 7, 7], 4)  # the next turn: 5 blocks
    mgr.allocate("b", follow_up)
    assert floor.lru_hits == 4 and floor.deficit == 0  # LRU hits what the cache hits: 4 blocks
