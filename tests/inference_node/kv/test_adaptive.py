"""The adaptive policy: what it learns from observed reuse, and how it backs off to LRU."""

from __future__ import annotations

from eventbus.protocol import Updated
from inference_node.kv.adaptive import AdaptiveLearner, AdaptivePolicy, BlockContext
from inference_node.kv.block import Block
from inference_node.kv.manager import KvCacheConfig, KVCacheManager

from .helpers import BS, hashes, prio, prompt, toks

FRESH_TAIL = BlockContext(index=9, prompt_blocks=10, matched_blocks=0, is_decode=False)
FRESH_HEAD = BlockContext(index=0, prompt_blocks=10, matched_blocks=0, is_decode=False)


def policy(**kw) -> AdaptivePolicy:
    kw.setdefault("table_every", 1)  # the class table follows every observation at once
    return AdaptivePolicy(ghost_capacity=1000, shadow_capacity=1000, **kw)


def learner(**kw) -> AdaptiveLearner:
    return AdaptiveLearner(policy(**kw), cache_blocks=250)


def evicted(digest: bytes, cls: int, released_at: float) -> Block:
    """A block as the pool hands it to ``on_evict``: digest, class and release time set."""
    b = Block(0, 0)
    b.digest, b.adaptive_class, b.released_at = digest, cls, released_at
    return b


def test_a_class_that_is_never_reused_becomes_junk_and_a_reused_one_is_protected():
    pol = learner(min_samples=4)
    _, _, tail_cls = pol.new_block(FRESH_TAIL)
    _, _, head_cls = pol.new_block(FRESH_HEAD)
    for i in range(200):
        pol.on_evict([evicted(b"tail%d" % i, tail_cls, i - 1.0)], now=float(i))  # ghosts...
    for i in range(200, 1400):
        pol.on_evict([evicted(b"x%d" % i, tail_cls, i - 1.0)], now=float(i))  # ... pushed out unreused
    for _ in range(100):  # (the table is recomputed every 64 observations)
        pol.on_reuse(head_cls, priority=35, hits=0, gap_s=30.0)
    tail_prio, tail_dur, _ = pol.new_block(FRESH_TAIL)
    head_prio, head_dur, _ = pol.new_block(FRESH_HEAD)
    assert (tail_prio, tail_dur) == (pol.policy.junk_priority, None)
    assert head_prio > 35
    assert head_dur is not None and 2 * 25 < head_dur < 2 * 35  # duration_factor x the learned gap


def test_a_miss_on_a_recently_evicted_block_counts_as_the_reuse_it_would_have_been():
    pol = learner()
    _, _, cls = pol.new_block(FRESH_HEAD)
    before = pol.probability(cls)
    pol.on_evict([evicted(b"d1", cls, released_at=90.0)], now=100.0)
    pol.on_lookup([b"d1"], matched=0, now=150.0)
    assert pol.probability(cls) > before
    assert pol.mean_gap_s(cls) < pol.policy.prior_gap_s  # learned gap 10 + 50 s, below the 120 s prior


def test_protection_backs_off_when_it_does_worse_than_a_shadow_lru():
    pol = learner(window=10)
    assert pol.new_block(FRESH_HEAD)[0] > 35
    # The shadow LRU hits a repeated prompt; the real cache (told matched=0) keeps missing.
    for _ in range(50):
        pol.on_lookup([b"a", b"b"], matched=0, now=0.0)
    assert pol.new_block(FRESH_HEAD)[:2] == (35, None)  # strength 0: plain LRU
    for _ in range(200):
        pol.on_lookup([b"a", b"b"], matched=2, now=0.0)  # never worse than the shadow ...
        pol.on_lookup([b"c"], matched=1, now=0.0)  # ... and better: strength returns
    assert pol.new_block(FRESH_HEAD)[0] > 35


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
    assert [b.priority for b in stored] == expected


def test_the_learned_state_is_the_caches_own_and_bounded_by_its_size():
    config = KvCacheConfig(num_gpu_blocks=8, num_host_blocks=4, block_size=BS, adaptive=AdaptivePolicy())
    first, second = KVCacheManager(config), KVCacheManager(config)
    assert first.adaptive is not None and second.adaptive is not None
    assert first.adaptive is not second.adaptive  # one config, a learner per cache
    assert (first.adaptive.ghost_capacity, first.adaptive.shadow_capacity) == (4 * 12, 12)
    for i in range(2):  # a reuse
        first.allocate(f"r{i}", prompt(toks(0, 10)))
        first.free(f"r{i}")
    assert first.adaptive.describe()["classes"]  # it learned ...
    assert not second.adaptive.describe()["classes"]  # ... alone
    assert config.adaptive == AdaptivePolicy()  # and the config is untouched (frozen)


def test_a_block_that_returns_as_a_ghost_is_stored_as_a_reused_one():
    pol = learner(min_samples=1)
    for _ in range(100):  # reused blocks are worth protecting
        pol.on_reuse(0, priority=35, hits=0, gap_s=5.0)
    pol.on_evict([evicted(b"g", 0, released_at=0.0)], now=1.0)
    pol.on_lookup([b"h", b"g", b"n"], matched=1, now=2.0)  # b"g" missed while remembered
    (_, _, ghost_cls), (_, _, new_cls) = pol.prompt_retention(prompt_blocks=3, matched=1, end=3)
    assert ghost_cls == 68  # reused once: the first reused class
    assert new_cls == 0  # the last block of a fresh prompt of <= 4 blocks: a new block's class


def test_at_strength_zero_every_class_is_plain_lru_junk_included():
    pol = learner(window=10, min_samples=1)
    for i in range(1400):  # the tail class is never reused (ghosts pushed out unasked): junk
        pol.on_evict([evicted(b"t%d" % i, pol.new_block(FRESH_TAIL)[2], i - 1.0)], now=float(i))
    assert pol.new_block(FRESH_TAIL)[0] == pol.policy.junk_priority
    for _ in range(50):  # worse than the shadow LRU, window after window
        pol.on_lookup([b"a", b"b"], matched=0, now=0.0)
    assert pol.new_block(FRESH_TAIL)[:2] == pol.new_block(FRESH_HEAD)[:2] == (35, None)


def test_the_horizon_is_the_shadow_lrus_residence_time_and_bounds_protection():
    pol = AdaptiveLearner(AdaptivePolicy(shadow_capacity=4, max_horizons=2.0), cache_blocks=4)
    assert pol.sample_below == 256  # a small cache: every digest is sampled
    for t in range(10):  # one new block a second through a shadow of 4
        pol.on_lookup([b"k%d" % t], matched=0, now=float(t))
    assert pol.horizon_s == 3.0  # the oldest of the 4 it holds was used 3 s ago
    for _ in range(100):
        pol.on_reuse(0, priority=35, hits=0, gap_s=500.0)  # a long gap ...
    reused = pol.on_reuse(0, priority=35, hits=0, gap_s=500.0)
    assert reused is not None and reused[1] == 2.0 * 3.0  # ... protected at most 2 horizons


def test_sampling_keeps_a_share_of_digests_and_of_the_capacity():
    pol = AdaptiveLearner(AdaptivePolicy(shadow_sample_blocks=2048), cache_blocks=16000)
    assert (pol.sample_below, pol.shadow_capacity) == (33, 2062)  # 33/256 of the digests and of 16,000


def test_when_the_guard_weakens_protection_the_policys_durations_end_and_clients_stay():
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=64, block_size=BS, adaptive=policy(window=4)))
    pinned = prompt(toks(900, 901))
    mgr.allocate("c", pinned, prio(80, 1000.0))  # a client's protection
    mgr.free("c")
    p = prompt(toks(0, 1, 2, 3))
    mgr.allocate("a", p)
    mgr.free("a")
    mgr.allocate("b", p)  # reused: the policy raises it with a duration
    mgr.free("b")
    raised = [mgr.block_info(d)["priority"] for d in p.digests]
    assert all(x > 35 for x in raised)
    learner_ = mgr.adaptive
    assert learner_ is not None
    learner_._window[:] = [0, 10**6, 10**6]  # the shadow LRU beat the cache: the next lookup weakens
    mgr.drain_events()
    mgr.allocate("x", prompt(toks(50)))
    updated = [e.data for e in mgr.drain_events() if isinstance(e.data, Updated)]
    assert [mgr.block_info(d)["priority"] for d in p.digests] == [35] * 4
    assert [mgr.block_info(d)["duration"] for d in p.digests] == [None] * 4
    assert sorted(u.block_hash for u in updated) == sorted(hashes(p))
    assert [mgr.block_info(d)["priority"] for d in pinned.digests] == [80, 80]


def test_a_block_a_client_reprioritized_is_the_clients_and_survives_a_revoke():
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=64, block_size=BS, adaptive=policy(window=4)))
    p = prompt(toks(0, 1))
    mgr.allocate("a", p)  # stored by the policy
    mgr.free("a")
    mgr.allocate("c", p, prio(70, 1000.0))  # reused by a client with a retention config
    mgr.free("c")
    learner_ = mgr.adaptive
    assert learner_ is not None
    learner_._window[:] = [0, 10**6, 10**6]  # the guard weakens protection at the next lookup
    mgr.allocate("x", prompt(toks(50)))
    assert [(mgr.block_info(d)["priority"], mgr.block_info(d)["duration"]) for d in p.digests] == [(70, 1000.0)] * 2
