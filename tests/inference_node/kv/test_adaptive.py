"""The adaptive policy: what it learns from observed reuse, and how it backs off to LRU."""

from __future__ import annotations

from inference_node.kv.adaptive import AdaptiveLearner, AdaptivePolicy, BlockContext
from inference_node.kv.manager import KvCacheConfig, KVCacheManager

from .helpers import BS, prio, prompt, toks

FRESH_TAIL = BlockContext(index=9, prompt_blocks=10, matched_blocks=0, is_decode=False)
FRESH_HEAD = BlockContext(index=0, prompt_blocks=10, matched_blocks=0, is_decode=False)


def policy(**kw) -> AdaptivePolicy:
    return AdaptivePolicy(ghost_capacity=1000, shadow_capacity=1000, **kw)


def learner(**kw) -> AdaptiveLearner:
    return AdaptiveLearner(policy(**kw), cache_blocks=250)


def test_a_class_that_is_never_reused_becomes_junk_and_a_reused_one_is_protected():
    pol = learner(min_samples=4)
    _, _, tail_cls = pol.new_block(FRESH_TAIL)
    _, _, head_cls = pol.new_block(FRESH_HEAD)
    for i in range(200):
        pol.on_evict(b"tail%d" % i, tail_cls, idle_s=1.0, now=float(i))  # ghosts...
    for i in range(200, 1400):
        pol.on_evict(b"x%d" % i, tail_cls, idle_s=1.0, now=float(i))  # ... pushed out unreused
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
    pol.on_evict(b"d1", cls, idle_s=10.0, now=100.0)
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
