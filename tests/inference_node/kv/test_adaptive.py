"""The adaptive policy: its three bands, what it learns from observed reuse, its life tables, and
how its guard falls back to LRU and returns."""

from __future__ import annotations

import os
import random

import pytest

from eventbus.protocol import Removed, Updated
from eventbus.replay import NodeState
from inference_node.kv.adaptive import (
    DEMOTED_PRIORITY,
    FREQUENCY_PRIORITY,
    RECENCY_PRIORITY,
    AdaptiveLearner,
    AdaptivePolicy,
    BlockContext,
)
from inference_node.kv.block import Block
from inference_node.kv.clock import ManualClock
from inference_node.kv.lifetables import FREQUENCY_BAND, NUM_BUCKETS, RECENCY_BAND, age_bucket
from inference_node.kv.manager import KvCacheConfig, KVCacheManager, OutOfBlocks
from inference_node.kv.shadows import native_available

from .helpers import BS, cache, hashes, prio, prompt, toks

FRESH_TAIL = BlockContext(index=9, prompt_blocks=10, matched_blocks=0, is_decode=False)
FRESH_HEAD = BlockContext(index=0, prompt_blocks=10, matched_blocks=0, is_decode=False)
OFF = 1e9  # a guard margin no lead reaches: the bands stay as they are


def policy(**kw) -> AdaptivePolicy:
    kw.setdefault("table_every", 1)  # the class table follows every observation at once
    kw.setdefault("ghost_capacity", 1000)
    return AdaptivePolicy(**kw)


def learner(**kw) -> AdaptiveLearner:
    return AdaptiveLearner(policy(**kw), cache_blocks=250)


def evicted(digest: bytes, cls: int) -> Block:
    """A block as the pool hands it to ``on_evict``: digest and class set."""
    b = Block(0, 0)
    b.digest, b.adaptive_class = digest, cls
    return b


def test_a_class_that_is_never_reused_becomes_junk_and_reused_blocks_go_to_the_frequency_band():
    pol = learner(min_samples=4)
    _, _, tail_cls = pol.new_block(FRESH_TAIL)
    for i in range(1200):  # ghosts pushed out of the 1,000 remembered, never asked for again
        pol.on_evict([evicted(b"t%d" % i, tail_cls)])
    assert pol.new_block(FRESH_TAIL) == (pol.policy.junk_priority, None, tail_cls)
    assert pol.new_block(FRESH_HEAD)[:2] == (RECENCY_PRIORITY, None)  # the head's class: no record yet
    _, _, head_cls = pol.new_block(FRESH_HEAD)
    assert pol.on_reuse(head_cls, RECENCY_PRIORITY, hits=0) == (FREQUENCY_PRIORITY, None, 68)
    assert pol.on_reuse(68, FREQUENCY_PRIORITY, hits=1) == (FREQUENCY_PRIORITY, None, 69)  # reused twice
    assert pol.on_reuse(-1, 35, hits=0) is None  # a client's block: not the policy's


def test_a_miss_on_a_recently_evicted_block_counts_as_a_reuse_and_it_returns_to_the_frequency_band():
    pol = learner()
    _, _, cls = pol.new_block(FRESH_HEAD)
    before = pol.probability(cls)
    pol.on_evict([evicted(b"g", cls)])
    pol.on_lookup([b"h", b"g", b"n"], matched=1, now=0.0)  # b"g" missed while remembered
    assert pol.probability(cls) > before
    (g_prio, _, g_cls), (n_prio, _, n_cls) = pol.prompt_retention(prompt_blocks=3, matched=1, end=3)
    assert (g_prio, g_cls) == (FREQUENCY_PRIORITY, 68)  # reused once: the first reused class
    assert (n_prio, n_cls) == (RECENCY_PRIORITY, 0)  # the last block of a fresh prompt of <= 4 blocks
    pol.on_lookup([b"h", b"g", b"n"], matched=1, now=0.0)
    assert pol.prompt_retention(prompt_blocks=3, matched=1, end=3)[0][2] == 4  # no ghost now: one from the end


def two_bands(mgr: KVCacheManager):
    """Two blocks stored and reused (the frequency band), then two stored once (the recency band)."""
    reused = prompt(toks(0, 10))
    for rid in ("a", "b"):  # stored, then reused: both blocks go to the frequency band
        mgr.allocate(rid, reused)
        mgr.free(rid)
    once = prompt(toks(50, 60))
    mgr.allocate("c", once)
    mgr.free("c")
    return reused, once


def test_the_recency_band_is_evicted_before_the_frequency_band():
    mgr, _ = cache(6, adaptive=policy(guard_margin=OFF, life_tables=False))  # strict bands
    reused, once = two_bands(mgr)
    assert [mgr.block_info(d)["priority"] for d in (*reused.digests, *once.digests)] == [36, 36, 35, 35]
    mgr.drain_events()
    mgr.allocate("d", prompt(toks(100, 110, 120, 130)))  # 4 blocks, 2 free: the recency band goes
    removed = [h for e in mgr.drain_events() if isinstance(e.data, Removed) for h in e.data.block_hashes]
    assert sorted(removed) == sorted(hashes(once))
    assert all(mgr.block_info(d) is not None for d in reused.digests)


def test_when_the_cache_falls_behind_the_lru_shadow_the_guard_returns_every_block_to_lru():
    # (without the life tables' guard, which would first stop the tables: the next test)
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=64, block_size=BS,
                                       adaptive=policy(guard_rate=0.5, strict_guard=False)))
    pinned = prompt(toks(900, 901))
    mgr.allocate("c", pinned, prio(80, 1000.0))  # a client's protection
    mgr.free("c")
    p = prompt(toks(0, 1, 2, 3))
    for rid in ("a", "b"):
        mgr.allocate(rid, p)  # reused: the policy raises it to the frequency band
        mgr.free(rid)
    assert [mgr.block_info(d)["priority"] for d in p.digests] == [36] * 4
    learner_ = mgr.adaptive
    assert learner_ is not None and learner_.bands
    for _ in range(3):  # the shadow LRU hits a repeated prompt the cache is told it missed
        learner_.on_lookup([b"\x00x", b"\x00y"], matched=0, now=0.0)
        if not learner_.bands:
            break
    assert not learner_.bands and learner_.revoke_due and learner_.switches == 1
    mgr.drain_events()
    mgr.allocate("x", prompt(toks(50)))  # the next lookup revokes
    updated = [e.data for e in mgr.drain_events() if isinstance(e.data, Updated)]
    assert sorted(u.block_hash for u in updated) == sorted(hashes(p))
    assert {(u.priority.old, u.priority.new) for u in updated} == {(36, 35)}
    assert [mgr.block_info(d)["priority"] for d in p.digests] == [35] * 4
    client = [(mgr.block_info(d)["priority"], mgr.block_info(d)["duration"]) for d in pinned.digests]
    assert client == [(80, 1000.0)] * 2
    mgr.allocate("y", p)  # with the bands off, a reuse stays at 35: plain LRU
    mgr.free("y")
    assert [mgr.block_info(d)["priority"] for d in p.digests] == [35] * 4


def test_with_the_bands_off_the_shadow_of_the_bands_brings_them_back_when_it_leads():
    pol = learner(guard_rate=0.5)
    pol.bands = False
    pol._ranks = None
    assert pol.new_block(FRESH_HEAD)[0] == RECENCY_PRIORITY
    assert pol.on_reuse(0, RECENCY_PRIORITY, hits=0) == (RECENCY_PRIORITY, None, 68)
    # A hot pair of blocks between one-time scans longer than the shadows: LRU loses the pair,
    # the bands keep it (a scan's blocks are seen once and go first).
    hot = [b"\x00hot0", b"\x00hot1"]
    scan = 0
    for _ in range(30):
        pol.on_lookup(hot, matched=0, now=0.0)
        pol.on_lookup([b"\x00s%d" % (scan + i) for i in range(300)], matched=0, now=0.0)
        scan += 300
        if pol.bands:
            break
    assert pol.bands and not pol.revoke_due
    assert pol.on_reuse(0, RECENCY_PRIORITY, hits=0) == (FREQUENCY_PRIORITY, None, 68)


def test_with_the_bands_off_the_junk_band_stays_and_a_revoke_leaves_junk_blocks_alone():
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=64, block_size=BS, adaptive=policy(min_samples=4)))
    learner_ = mgr.adaptive
    assert learner_ is not None
    # class 0 (the last block of a fresh prompt of <= 4 blocks): evicted unused 1,200 times
    learner_.on_evict([evicted(b"t%d" % i, 0) for i in range(1200)])
    junk = prompt(toks(7))
    mgr.allocate("j", junk)
    mgr.free("j")
    hot = prompt(toks(0, 10))
    for rid in ("a", "b"):
        mgr.allocate(rid, hot)
        mgr.free(rid)
    assert [mgr.block_info(d)["priority"] for d in (*junk.digests, *hot.digests)] == [5, 36, 36]
    learner_.bands, learner_.revoke_due = False, True  # as the guard leaves it
    learner_._ranks = None
    mgr.drain_events()
    late = prompt(toks(8))
    mgr.allocate("x", late)  # revokes: the frequency band to 35, the junk band stays
    updated = [e.data for e in mgr.drain_events() if isinstance(e.data, Updated)]
    assert sorted(u.block_hash for u in updated) == sorted(hashes(hot))
    assert {(u.priority.old, u.priority.new) for u in updated} == {(36, 35)}
    assert [mgr.block_info(d)["priority"] for d in (*junk.digests, *hot.digests)] == [5, 35, 35]
    assert mgr.block_info(late.digests[0])["priority"] == 5  # bands off: a junk class is still junk


def test_a_block_a_client_reprioritized_is_the_clients_and_survives_a_revoke():
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=64, block_size=BS, adaptive=policy()))
    p = prompt(toks(0, 1))
    mgr.allocate("a", p)  # stored by the policy
    mgr.free("a")
    mgr.allocate("c", p, prio(70, 1000.0))  # reused by a client with a retention config
    mgr.free("c")
    learner_ = mgr.adaptive
    assert learner_ is not None
    learner_.bands, learner_.revoke_due = False, True  # as the guard leaves it
    mgr.allocate("x", prompt(toks(50)))
    assert [(mgr.block_info(d)["priority"], mgr.block_info(d)["duration"]) for d in p.digests] == [(70, 1000.0)] * 2


def test_adaptive_never_lowers_a_pinned_block():
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=8, block_size=BS, adaptive=policy()))
    sys_prompt = prompt(toks(0, 10))
    mgr.allocate("a", sys_prompt, prio(100))
    mgr.free("a")
    for i in range(5):
        mgr.allocate(f"b{i}", prompt(toks(0, 10, 20 + i)))  # no config: adaptive decides
        mgr.free(f"b{i}")
    assert [mgr.block_info(d)["priority"] for d in sys_prompt.digests] == [100, 100]


def test_new_blocks_without_hints_get_the_policys_priorities():
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=8, block_size=BS, adaptive=policy()))
    p = prompt(toks(0, 10, 20))
    mgr.allocate("a", p)
    stored = mgr.drain_events()[-1].data.blocks
    fresh = AdaptiveLearner(policy(), cache_blocks=8)  # what the cache's learner knew then
    expected = [fresh.new_block(BlockContext(i, 3, 0, False))[0] for i in range(3)]
    assert [b.priority for b in stored] == expected == [35, 35, 35]


def test_the_learned_state_is_the_caches_own_and_bounded_by_its_size():
    config = KvCacheConfig(num_gpu_blocks=8, num_host_blocks=4, block_size=BS, adaptive=AdaptivePolicy())
    first, second = KVCacheManager(config), KVCacheManager(config)
    assert first.adaptive is not None and second.adaptive is not None
    assert first.adaptive is not second.adaptive  # one config, a learner per cache
    assert (first.adaptive.ghost_capacity, first.adaptive.shadow_capacity) == (42, 12)  # 3.5 x 12 blocks
    for i in range(2):  # a reuse
        first.allocate(f"r{i}", prompt(toks(0, 10)))
        first.free(f"r{i}")
    assert first.adaptive.describe()["classes"]  # it learned ...
    assert not second.adaptive.describe()["classes"]  # ... alone
    assert config.adaptive == AdaptivePolicy()  # and the config is untouched (frozen)


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
@pytest.mark.parametrize("seed", range(3))
def test_ghosts_and_shadows_stay_within_their_bounds(seed, compiled):
    if compiled and not native_available():
        if os.environ.get("KVFLOW_REQUIRE_NATIVE") == "1":
            pytest.fail("kvflow_native is not installed (make install builds it)", pytrace=False)
        pytest.skip("kvflow_native is not installed (pip install ./native)")
    rng = random.Random(seed)
    pol = AdaptiveLearner(AdaptivePolicy(ghost_capacity=40, shadow_sample_blocks=16, compiled=compiled),
                          cache_blocks=32)
    for _ in range(3000):
        keys = [bytes([rng.randrange(256)]) + b"%d" % rng.randrange(200) for _ in range(rng.randint(1, 6))]
        pol.on_lookup(keys, matched=rng.randint(0, len(keys)), now=0.0)
        pol.on_evict([evicted(k, rng.randrange(72)) for k in keys[: rng.randint(0, len(keys))]])
        assert len(pol._ghosts) <= 40
        assert len(pol._lru) <= pol.shadow_capacity
        sh = pol._shadow
        assert len(sh) <= sh.capacity and sh.num_ghosts <= sh.ghost_capacity


def test_sampling_keeps_a_share_of_digests_and_of_the_capacity():
    pol = AdaptiveLearner(AdaptivePolicy(shadow_sample_blocks=2048), cache_blocks=16000)
    assert (pol.sample_below, pol.shadow_capacity) == (33, 2062)  # 33/256 of the digests and of 16,000


def test_settings_are_checked():
    with pytest.raises(ValueError, match="junk_priority"):
        AdaptivePolicy(junk_priority=35)  # the junk band must sit below the recency band
    with pytest.raises(ValueError, match="guard_rate"):
        AdaptivePolicy(guard_rate=0.0)
    with pytest.raises(ValueError, match="decay"):
        AdaptivePolicy(decay=1.5)
    with pytest.raises(ValueError, match="junk_priority"):
        AdaptivePolicy(junk_priority=DEMOTED_PRIORITY)  # below the frequency band's demoted blocks too
    with pytest.raises(ValueError, match="life_prior_blocks"):
        AdaptivePolicy(life_prior_blocks=-1.0)
    with pytest.raises(ValueError, match="life_half_events"):
        AdaptivePolicy(life_half_events=0)
    with pytest.raises(ValueError, match="life_every"):
        AdaptivePolicy(life_every=0)


def test_a_new_block_is_junk_only_if_every_new_block_after_it_is_junk():
    pol = learner(min_samples=4)
    near_end = BlockContext(index=8, prompt_blocks=10, matched_blocks=0, is_decode=False)
    _, _, near_cls = pol.new_block(near_end)
    for i in range(1200):  # the class one block before the end is never reused: junk
        pol.on_evict([evicted(b"n%d" % i, near_cls)])
    assert pol.new_block(near_end)[0] == pol.policy.junk_priority
    pol.on_lookup([b"p%d" % i for i in range(10)], matched=0, now=0.0)
    prios = [r[0] for r in pol.prompt_retention(prompt_blocks=10, matched=0, end=10)]
    assert prios == [35] * 10  # the last block is kept, so its junk parent would only wait for it
    _, _, tail_cls = pol.new_block(FRESH_TAIL)
    for i in range(1200):  # now the last block's class is junk too
        pol.on_evict([evicted(b"t%d" % i, tail_cls)])
    prios = [r[0] for r in pol.prompt_retention(prompt_blocks=10, matched=0, end=10)]
    assert prios == [35] * 8 + [pol.policy.junk_priority] * 2


def test_frequency_horizons_protect_the_frequency_band_for_so_many_lru_horizons():
    pol = AdaptiveLearner(AdaptivePolicy(frequency_horizons=6.0, table_every=1), cache_blocks=4)
    assert pol.on_reuse(0, RECENCY_PRIORITY, hits=0) == (FREQUENCY_PRIORITY, None, 68)  # no horizon yet
    for t in range(10):  # one new block a second through an LRU shadow of 4
        pol.on_lookup([b"k%d" % t], matched=0, now=float(t))
    assert pol._lru.horizon == 3.0  # the oldest of the 4 it holds was used 3 s ago
    assert pol.on_reuse(0, RECENCY_PRIORITY, hits=0) == (FREQUENCY_PRIORITY, 18.0, 68)
    assert pol.new_block(FRESH_HEAD)[1] is None  # the recency band has no duration
    assert AdaptiveLearner(AdaptivePolicy(), 4).on_reuse(0, RECENCY_PRIORITY, hits=0)[1] is None  # off by default


def test_with_soon_share_a_class_reused_within_the_caches_size_goes_straight_to_the_frequency_band():
    # The cache holds 4 blocks: a reuse fewer than 4 releases after the block's last use is "soon".
    pol = AdaptiveLearner(policy(soon_share=0.3), cache_blocks=4)
    off = AdaptiveLearner(policy(), cache_blocks=4)  # soon_share 0: off
    _, _, head = pol.new_block(FRESH_HEAD)
    _, _, tail = pol.new_block(FRESH_TAIL)
    for p in (pol, off):
        p.on_lookup([], matched=0, now=0.0, tick=100)
        for _ in range(20):
            p.on_reuse(head, RECENCY_PRIORITY, hits=0, last_used=97)  # 3 releases ago: soon
            p.on_reuse(tail, RECENCY_PRIORITY, hits=0, last_used=96)  # 4 releases ago: not soon
    reused = sum(0.99 ** k for k in range(20))  # 20 reuses, each older one decayed
    assert pol.soon_probability(head) == pytest.approx(reused / (reused + 20))  # 0.48 >= 0.3
    assert pol.soon_probability(tail) == 0.0
    assert pol.new_block(FRESH_HEAD) == (FREQUENCY_PRIORITY, None, head)
    assert pol.new_block(FRESH_TAIL) == (RECENCY_PRIORITY, None, tail)
    assert off.new_block(FRESH_HEAD) == (RECENCY_PRIORITY, None, head)
    assert pol.on_reuse(head, RECENCY_PRIORITY, hits=0) == (FREQUENCY_PRIORITY, None, 68)  # no age: not soon
    assert pol.soon_probability(head) < reused / (reused + 20)
    # A miss on a ghost counts by the block's last use before its eviction.
    ghost = AdaptiveLearner(policy(soon_share=0.3), cache_blocks=4)
    b = evicted(b"g", head)
    b.last_used = 98
    ghost.on_evict([b])
    ghost.on_lookup([b"g"], matched=0, now=0.0, tick=100)
    assert ghost.soon_probability(head) == pytest.approx(1 / 21)
    with pytest.raises(ValueError, match="soon_share"):
        AdaptivePolicy(soon_share=1.5)


def test_the_core_hands_the_policy_its_release_ticks():
    # A 4-block cache: a reuse is soon when fewer than 4 releases came after the block's last use.
    soon = policy(soon_share=0.3, guard_margin=OFF)
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=4, block_size=BS, adaptive=soon))
    a, b = prompt(toks(0)), prompt(toks(100))  # one block each, both of class 0 when new

    def use(p) -> None:
        mgr.allocate("r", p)
        mgr.free("r")

    use(a)  # released at tick 1
    for _ in range(5):  # b at ticks 2..6, each reuse 0 releases after its last use: soon
        use(b)
    use(a)  # looked up at tick 6: 5 releases after its last use, not soon
    learner_ = mgr.adaptive
    assert learner_ is not None
    # class 0: b's first reuse (soon), then a's (not, and b's observation decayed once)
    assert learner_.soon_probability(0) == pytest.approx(0.99 / (1.99 + 20))
    assert learner_.soon_probability(68) == pytest.approx(1 / 21)  # b's second reuse, as a reused block


NEVER = 10**9  # a life_every no test reaches: the tables keep what the test sets


def rate(learned: AdaptiveLearner, recency: float, frequency: float) -> None:
    """Set the life tables' estimates (every age) as if learned."""
    assert learned.life is not None
    learned.life.p = [[recency] * NUM_BUCKETS, [frequency] * NUM_BUCKETS]


def test_the_core_feeds_the_life_tables_hits_ends_and_the_evictable_blocks_of_each_band():
    mgr, _ = cache(4, adaptive=policy(guard_margin=OFF, life_every=NEVER))
    learned = mgr.adaptive
    assert learned is not None and learned.life is not None
    life = learned.life
    a, b = prompt(toks(0)), prompt(toks(100))

    def use(p) -> None:
        mgr.allocate("r", p)
        mgr.free("r")

    use(a)  # tick 1: a evictable at 35
    use(b)  # tick 2: b at 35
    assert sum(c[0] for c in life.counts) == 2 and sum(c[1] for c in life.counts) == 0
    use(a)  # a reused 1 release after its last use: a hit of the recency band at age 1, then 36
    assert life.hits[RECENCY_BAND][age_bucket(1)] == 1.0
    assert [sum(c[band] for c in life.counts) for band in (0, 1)] == [1, 1]
    use(a)  # reused again at age 0, in the frequency band
    assert life.hits[FREQUENCY_BAND][age_bucket(0)] == 1.0
    for i in range(3):  # three new blocks (ticks 5, 6, 7) in 4 slots: the third evicts one
        use(prompt(toks(500 + 10 * i)))
    ends = life.ends
    # Before the tables' first estimate every age rates the same: the older of the two oldest goes
    # (b, last used at tick 2, against a at tick 4), an end of the recency band at age 6 - 2.
    assert sum(ends[RECENCY_BAND]) + sum(ends[FREQUENCY_BAND]) == 1.0
    assert ends[RECENCY_BAND][age_bucket(6 - 2)] == 1.0 and mgr.block_info(b.digests[0]) is None
    # The alive counts are exactly the policy's evictable blocks of each band.
    truth = [0, 0]
    for blk in mgr._pool.cached.values():
        band = 0 if blk.priority == RECENCY_PRIORITY else 1 if blk.priority in (FREQUENCY_PRIORITY,
                                                                                 DEMOTED_PRIORITY) else -1
        if band >= 0 and not blk.ref:
            truth[band] += 1
    assert [sum(c[band] for c in life.counts) for band in (0, 1)] == truth == [3, 1]


def test_when_the_tables_rate_the_frequency_bands_oldest_lower_it_goes_first():
    mgr, _ = cache(6, adaptive=policy(guard_margin=OFF, life_every=NEVER))
    reused, once = two_bands(mgr)
    learned = mgr.adaptive
    assert learned is not None
    rate(learned, recency=0.5, frequency=0.1)  # a stale frequency band: less likely to be used again
    mgr.drain_events()
    mgr.allocate("d", prompt(toks(100, 110, 120, 130)))  # 4 blocks, 2 free: the frequency band goes
    events = [e.data for e in mgr.drain_events()]
    updated = [(u.block_hash, u.priority.old, u.priority.new) for u in events if isinstance(u, Updated)]
    assert updated == [(h, FREQUENCY_PRIORITY, DEMOTED_PRIORITY) for h in hashes(reused)[::-1]]  # leaf first
    removed = [h for e in events if isinstance(e, Removed) for h in e.block_hashes]
    assert sorted(removed) == sorted(hashes(reused))
    assert all(mgr.block_info(d)["priority"] == RECENCY_PRIORITY for d in once.digests)
    assert learned.life_demotions == 2 and learned.describe()["life"]["demotions"] == 2
    rate(learned, recency=0.1, frequency=0.5)  # frequency pays: the recency band goes first again
    mgr.free("d")
    mgr.drain_events()
    mgr.allocate("e", prompt(toks(200, 210)))
    events = [e.data for e in mgr.drain_events()]
    assert not [u for u in events if isinstance(u, Updated)]
    removed = [h for e in events if isinstance(e, Removed) for h in e.block_hashes]
    assert sorted(removed) == sorted(hashes(once))


def test_on_a_tie_the_older_of_the_two_oldest_goes_first_as_in_lru():
    mgr, _ = cache(6, adaptive=policy(guard_margin=OFF, life_every=NEVER))
    reused, _ = two_bands(mgr)  # the frequency band's blocks were released before the recency band's
    learned = mgr.adaptive
    assert learned is not None
    rate(learned, recency=0.3, frequency=0.3)
    mgr.drain_events()
    mgr.allocate("d", prompt(toks(100, 110, 120)))  # 3 blocks, 2 free: one victim, the oldest: reused's tail
    removed = [h for e in mgr.drain_events() if isinstance(e.data, Removed) for h in e.data.block_hashes]
    assert removed == [hashes(reused)[1]]


def test_no_life_tables_when_switched_off_or_with_a_host_tier():
    assert learner(life_tables=False).life is None
    assert AdaptiveLearner(policy(), cache_blocks=250, tiered=True).life is None
    assert learner().life is not None and learner().describe()["life"]["demotions"] == 0
    assert learner(life_tables=False).describe()["life"] is None


# (42, 2.0): an eviction run from a heap of priorities 35, 34, 35 (first and last alike) was once
# counted as one band's, and the tables' alive counts drifted from the cache (fixed in both tables).
@pytest.mark.parametrize(("seed", "horizons"), [(1, 0.0), (2, 0.0), (3, 0.0), (4, 2.0), (5, 2.0), (42, 2.0)])
@pytest.mark.parametrize("compiled", [True, False])
def test_with_the_life_tables_demoting_the_event_stream_still_replays_to_the_cache(seed, horizons, compiled):
    rng = random.Random(seed)
    clock = ManualClock()
    # The guard switches too; with frequency_horizons, frequency blocks also expire back to 35.
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=16, block_size=BS, window_size=64,
                                       adaptive=policy(guard_rate=0.2, guard_margin=0.0, life_every=NEVER,
                                                       frequency_horizons=horizons, compiled=compiled)), clock=clock)
    learned = mgr.adaptive
    assert learned is not None
    replayed = NodeState()
    demoted = 0
    clients: set[int] = set()
    for i in range(400):
        if i % 7 == 0:  # ratings as learned: either band may be the likelier to be used again
            rate(learned, recency=rng.random(), frequency=rng.random())
        head = rng.randint(0, 3)
        p = prompt(toks(*[1000 * head + 10 * j for j in range(rng.randint(1, 6))]))
        ret = prio(36) if rng.random() < 0.1 else None  # a client's blocks at 36 are never demoted
        clock.advance(1.0)
        try:
            mgr.allocate("r", p, ret)
        except OutOfBlocks:
            continue
        mgr.free("r")
        events = mgr.drain_events()
        for e in events:
            if isinstance(e.data, Updated) and e.data.priority.new == DEMOTED_PRIORITY:
                assert e.data.block_hash not in clients and e.data.priority.old == FREQUENCY_PRIORITY
                demoted += 1
            elif isinstance(e.data, Removed):
                clients.difference_update(e.data.block_hashes)
        if ret is not None:  # the client's now, for good, while cached
            clients.update(hashes(p))
        replayed.apply_all(events)  # strict: raises on any inconsistency
        truth = mgr.cached_blocks()
        assert replayed.blocks == NodeState.from_snapshot_blocks(truth)
        if not learned.bands:  # the revoke returned demoted blocks to 35 as well, and none is demoted since
            assert all(b.priority != DEMOTED_PRIORITY for b in truth)
        # The tables' alive counts stay exactly the evictable blocks of each band (a client's too).
        assert learned.life is not None
        counted = [sum(c[band] for c in learned.life.counts) for band in (0, 1)]
        evictable = [0, 0]
        for blk in mgr._pool.cached.values():
            if not blk.ref and blk.priority in (RECENCY_PRIORITY, FREQUENCY_PRIORITY, DEMOTED_PRIORITY):
                evictable[blk.priority != RECENCY_PRIORITY] += 1
        assert counted == evictable
    assert demoted > 0 and learned.switches > 0


def test_a_demoted_parent_waits_at_34_for_its_child_and_a_revoke_returns_it_to_35():
    mgr, _ = cache(4, adaptive=policy(guard_margin=OFF, life_every=NEVER))
    a = prompt(toks(0, 10))
    for rid in ("a", "b"):  # reused: both blocks in the frequency band
        mgr.allocate(rid, a)
        mgr.free(rid)
    ab = prompt(toks(0, 10, 20))  # a's blocks again, and a child at 35
    mgr.allocate("c", ab)
    mgr.free("c")
    learned = mgr.adaptive
    assert learned is not None
    rate(learned, recency=0.5, frequency=0.1)
    mgr.drain_events()
    mgr.allocate("d", prompt(toks(500, 510)))  # 1 free, 2 needed: the oldest of 36 (a's tail) is demoted
    events = [e.data for e in mgr.drain_events()]
    updated = [(u.block_hash, u.priority.old, u.priority.new) for u in events if isinstance(u, Updated)]
    assert updated == [(hashes(a)[1], FREQUENCY_PRIORITY, DEMOTED_PRIORITY)]
    removed = [h for e in events if isinstance(e, Removed) for h in e.block_hashes]
    assert removed == [hashes(ab)[2]]  # the demoted parent waited for its child, which went first
    assert [mgr.block_info(d)["priority"] for d in a.digests] == [FREQUENCY_PRIORITY, DEMOTED_PRIORITY]
    mgr.free("d")
    learned.bands, learned.revoke_due = False, True  # as the guard does when the cache falls behind
    mgr.allocate("e", prompt(toks(500)))  # a hit: the lookup revokes, nothing is evicted
    updated = [(u.block_hash, u.priority.old, u.priority.new) for u in (e.data for e in mgr.drain_events())
               if isinstance(u, Updated)]
    assert sorted(updated) == sorted([(hashes(a)[0], FREQUENCY_PRIORITY, RECENCY_PRIORITY),
                                      (hashes(a)[1], DEMOTED_PRIORITY, RECENCY_PRIORITY)])
