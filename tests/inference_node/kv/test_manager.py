"""Exact scenarios of the KV cache core: reuse, eviction order, durations, host tier, events."""

from __future__ import annotations

import pytest

from eventbus import protocol as p
from eventbus.hashing import block_hash
from eventbus.replay import NodeState
from inference_node.kv.manager import BlockCopy, KvCacheConfig, KVCacheManager, OutOfBlocks
from inference_node.kv.retention import KvCacheRetentionConfig, TokenRange

from .helpers import BS, cache, hashes, kinds, prio, prompt, toks


def test_startup_emits_created_then_an_empty_snapshot():
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=8, num_host_blocks=16, block_size=BS, window_size=64))
    events = mgr.drain_events()
    assert events == [
        p.Event(event_id=0, window_size=64, data=p.Created(num_blocks_per_cache_level=[8, 16])),
        p.Event(event_id=1, window_size=64, data=p.Snapshot(blocks=[])),
    ]
    assert mgr.last_event_id == 1


def test_longest_prefix_is_reused_and_new_blocks_chain_on_it():
    mgr, _ = cache(gpu=8)
    a = prompt(toks(0, 10, 20))
    alloc = mgr.allocate("a", a)
    assert alloc.num_cached_tokens == 0 and alloc.block_table == [0, 1, 2]
    mgr.free("a")
    b = prompt(toks(0, 10, 99) + [7, 7])  # two shared blocks, one new, a partial tail
    alloc = mgr.allocate("b", b)
    assert (alloc.num_cached_tokens, alloc.gpu_hit_blocks, alloc.host_hit_blocks) == (8, 2, 0)
    assert alloc.block_table[:2] == [0, 1] and len(alloc.block_table) == 4

    ha, hb = hashes(a), hashes(b)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    events = mgr.drain_events()
    assert [e.event_id for e in events] == [2, 3]
    assert events[0].data == p.Stored(parent_hash=None, blocks=[
        p.StoredBlock(block_hash=h, num_tokens=BS, priority=35) for h in ha])
    assert events[1].data == p.Stored(parent_hash=ha[1], blocks=[p.StoredBlock(block_hash=hb[2], num_tokens=BS)])
    assert mgr.stats.hit_blocks == 2 and mgr.stats.miss_blocks == 4 and mgr.stats.cached_tokens == 8


def test_eviction_takes_lowest_priority_first_then_least_recently_used():
    mgr, _ = cache(gpu=4)
    for rid, start, pr in (("r1", 0, 50), ("r2", 10, 10), ("r3", 20, 10), ("r4", 30, 80)):
        mgr.allocate(rid, prompt(toks(start)), prio(pr))
    for rid in ("r1", "r2", "r3", "r4"):  # r2 becomes evictable before r3
        mgr.free(rid)
    h = {s: block_hash(prompt(toks(s)).digests[0]) for s in (0, 10, 20, 30)}
    mgr.drain_events()

    removed = []
    for i, start in enumerate((40, 50, 60, 70)):
        mgr.allocate(f"n{i}", prompt(toks(start)))
        evs = mgr.drain_events()
        assert kinds(evs) == ["removed", "stored"]
        removed.extend(evs[0].data.block_hashes)
    assert removed == [h[10], h[20], h[0], h[30]]
    assert mgr.stats.evictions_by_priority == {10: 2, 50: 1, 80: 1}


def test_recency_is_refreshed_by_reuse():
    mgr, _ = cache(gpu=2)
    mgr.allocate("a", prompt(toks(0)))
    mgr.free("a")
    mgr.allocate("b", prompt(toks(10)))
    mgr.free("b")
    mgr.allocate("a2", prompt(toks(0)))  # reuse: a is now the most recently used
    mgr.free("a2")
    mgr.drain_events()
    mgr.allocate("c", prompt(toks(20)))
    evs = mgr.drain_events()
    assert evs[0].data == p.Removed(block_hashes=[hashes(prompt(toks(10)))[0]])


def test_only_leaves_are_evicted_so_prefixes_stay_contiguous():
    mgr, _ = cache(gpu=3)
    chain = prompt(toks(0, 10))
    cfg = KvCacheRetentionConfig(token_ranges=(TokenRange(0, 4, 10), TokenRange(4, None, 90)))
    mgr.allocate("chain", chain, cfg)   # root at 10, its child at 90
    mgr.allocate("x", prompt(toks(50)), prio(50))
    mgr.free("chain")
    mgr.free("x")
    h_root, h_child = hashes(chain)
    h_x = hashes(prompt(toks(50)))[0]
    mgr.drain_events()

    order = []
    for i, start in enumerate((100, 110, 120)):
        mgr.allocate(f"n{i}", prompt(toks(start)))
        order.extend(mgr.drain_events()[0].data.block_hashes)
    # The root (priority 10) is not a leaf while its child is cached: x (50) goes first, then
    # the child (90), and only then the root.
    assert order == [h_x, h_child, h_root]


def test_blocks_in_use_are_never_evicted():
    mgr, _ = cache(gpu=3)
    mgr.allocate("a", prompt(toks(0, 10)), prio(0))  # lowest priority, but in use
    mgr.allocate("b", prompt(toks(20)))
    mgr.free("b")
    mgr.allocate("c", prompt(toks(30)))  # takes b's block, not a's
    with pytest.raises(OutOfBlocks, match="needs 1 GPU blocks; only 0 could be freed"):
        mgr.allocate("d", prompt(toks(40)))
    assert mgr.block_info(prompt(toks(0)).digests[0])["ref"] == 1
    assert mgr.stats.rejected_requests == 1


def test_a_rejected_request_leaves_nothing_behind():
    mgr, _ = cache(gpu=3)
    mgr.allocate("old", prompt(toks(0)))
    mgr.free("old")
    mgr.allocate("hold", prompt(toks(50, 60)))
    with pytest.raises(OutOfBlocks):
        mgr.allocate("big", prompt(toks(0, 10, 20)))  # matches old's block, needs 2 more
    info = mgr.block_info(prompt(toks(0)).digests[0])
    assert info is not None and info["ref"] == 0  # released again
    assert mgr.evictable_blocks == (1, 0)
    mgr.free("hold")
    assert mgr.allocate("big", prompt(toks(0, 10, 20))).num_cached_tokens == BS


def test_duration_runs_while_evictable_then_priority_falls_to_35():
    mgr, clock = cache(gpu=3)
    hot = prompt(toks(0))
    mgr.allocate("hot", hot, prio(80, dur=10.0))
    mgr.allocate("mid", prompt(toks(10)), prio(50))
    clock.advance(100)  # in use: the clock does not run yet
    mgr.free("hot")
    mgr.free("mid")
    mgr.drain_events()
    clock.advance(9.9)
    mgr.tick()
    assert mgr.drain_events() == []
    assert mgr.block_info(hot.digests[0])["priority"] == 80
    clock.advance(0.2)
    mgr.tick()
    evs = mgr.drain_events()
    assert [e.data for e in evs] == [p.Updated(block_hash=hashes(hot)[0], priority=p.PriorityDiff(old=80, new=35))]
    assert mgr.stats.expirations == 1
    # Now hot (35) is evicted before mid (50).
    mgr.allocate("n1", prompt(toks(20)))  # the free slot
    mgr.drain_events()
    mgr.allocate("n2", prompt(toks(30)))
    assert mgr.drain_events()[0].data == p.Removed(block_hashes=hashes(hot))


def test_reuse_restarts_the_duration():
    mgr, clock = cache(gpu=4)
    hot = prompt(toks(0))
    mgr.allocate("a", hot, prio(80, dur=10.0))
    mgr.free("a")              # t=0: expires at 10
    clock.advance(6)
    mgr.allocate("b", hot)     # reuse without config: priority kept, clock stopped
    clock.advance(3)
    mgr.free("b")              # t=9: restarts, expires at 19
    clock.set(18.9)
    mgr.tick()
    assert mgr.block_info(hot.digests[0])["priority"] == 80
    clock.set(19.0)
    mgr.tick()
    assert mgr.block_info(hot.digests[0])["priority"] == 35


def test_reuse_with_a_config_reprioritizes_and_without_one_leaves_priority_alone():
    mgr, _ = cache(gpu=8)
    sys_prompt = prompt(toks(0, 10))
    mgr.allocate("a", sys_prompt, prio(100))
    mgr.free("a")
    mgr.drain_events()
    mgr.allocate("b", prompt(toks(0, 10, 20)))  # no config: the pinned prompt stays at 100
    evs = mgr.drain_events()
    assert kinds(evs) == ["stored"]
    assert mgr.block_info(sys_prompt.digests[0])["priority"] == 100
    mgr.free("b")
    mgr.allocate("c", prompt(toks(0, 10)), prio(60, end=4))  # config: block 0 -> 60, block 1 -> 35
    evs = mgr.drain_events()
    h = hashes(sys_prompt)
    assert [e.data for e in evs] == [
        p.Updated(block_hash=h[0], priority=p.PriorityDiff(old=100, new=60)),
        p.Updated(block_hash=h[1], priority=p.PriorityDiff(old=100, new=35)),
    ]
    assert mgr.stats.reprioritizations == 2


def test_offload_to_host_then_onboard_on_reuse_then_host_eviction():
    mgr, _ = cache(gpu=2, host=1)
    keep, drop = prompt(toks(0)), prompt(toks(10))
    mgr.allocate("keep", keep, prio(50))   # >= 35: offloaded when evicted
    mgr.allocate("drop", drop, prio(20))   # < 35: removed when evicted
    mgr.free("keep")
    mgr.free("drop")
    mgr.drain_events()
    slot_keep = mgr.block_info(keep.digests[0])["slot"]

    a1 = mgr.allocate("n1", prompt(toks(20)))  # evicts drop (20) first: removed
    assert kinds(mgr.drain_events()) == ["removed", "stored"] and a1.copies == []
    a2 = mgr.allocate("n2", prompt(toks(30)))  # then keep (50): offloaded
    assert a2.copies == [BlockCopy("offload", 0, slot_keep, 1, 0)]
    evs = mgr.drain_events()
    assert evs[0].data == p.Updated(block_hash=hashes(keep)[0], cache_level=p.LevelDiff(old=0, new=1))
    assert mgr.stats.offloads_by_priority == {50: 1}
    mgr.free("n1")
    mgr.free("n2")

    a3 = mgr.allocate("again", keep)  # host hit: onboarded into a GPU slot
    assert (a3.gpu_hit_blocks, a3.host_hit_blocks, a3.num_cached_tokens) == (0, 1, BS)
    gpu_slot = a3.block_table[0]
    # A GPU block had to go to make room: n2's (35, the least recently used) would be
    # offloaded, but the only host slot holds keep, which this request pins: it is removed.
    assert a3.copies == [BlockCopy("onboard", 1, 0, 0, gpu_slot)]
    evs = mgr.drain_events()
    assert kinds(evs) == ["removed", "updated"]
    assert evs[1].data == p.Updated(block_hash=hashes(keep)[0], cache_level=p.LevelDiff(old=1, new=0))
    assert mgr.stats.onboards == 1


def test_host_eviction_removes_the_lowest_priority_host_leaf():
    mgr, _ = cache(gpu=1, host=2)
    for rid, start, pr in (("a", 0, 60), ("b", 10, 40), ("c", 20, 70)):
        mgr.allocate(rid, prompt(toks(start)), prio(pr))
        mgr.free(rid)
    # a and b were offloaded to the host (2 slots); c is on the GPU.
    mgr.drain_events()
    mgr.allocate("d", prompt(toks(30)))  # offloads c (70): the host evicts b (40)
    evs = mgr.drain_events()
    assert [e.data for e in evs[:2]] == [
        p.Removed(block_hashes=hashes(prompt(toks(10)))),
        p.Updated(block_hash=hashes(prompt(toks(20)))[0], cache_level=p.LevelDiff(old=0, new=1)),
    ]


def test_offloading_keeps_prefixes_contiguous_across_tiers():
    mgr, _ = cache(gpu=3, host=4)
    chain = prompt(toks(0, 10))
    mgr.allocate("chain", chain)
    mgr.free("chain")
    mgr.drain_events()
    mgr.allocate("n1", prompt(toks(20, 30, 40)))  # one free slot, then the chain goes, child first
    evs = mgr.drain_events()
    h = hashes(chain)
    assert [e.data for e in evs[:2]] == [
        p.Updated(block_hash=h[1], cache_level=p.LevelDiff(old=0, new=1)),
        p.Updated(block_hash=h[0], cache_level=p.LevelDiff(old=0, new=1)),
    ]
    mgr.free("n1")
    a = mgr.allocate("chain2", prompt(toks(0, 10, 50)))
    assert (a.gpu_hit_blocks, a.host_hit_blocks) == (0, 2)
    assert [c.kind for c in a.copies][-2:] == ["onboard", "onboard"]
    assert [c.src_slot for c in a.copies if c.kind == "onboard"] == [1, 0]  # parent first


def test_decode_fills_blocks_and_caches_them_with_the_decode_priority():
    mgr, _ = cache(gpu=8)
    cfg = KvCacheRetentionConfig(token_ranges=(TokenRange(0, None, 90),), decode_priority=15)
    pr = prompt(toks(0) + [1, 2])  # one full block, a partial one
    alloc = mgr.allocate("r", pr, cfg)
    mgr.drain_events()
    slot, copies = mgr.append_token("r", 3)
    assert slot == alloc.block_table[1] and copies == []
    assert mgr.drain_events() == []
    slot, _ = mgr.append_token("r", 4)  # fills the prompt's partial block: prompt retention
    evs = mgr.drain_events()
    full = prompt(toks(0) + [1, 2, 3, 4])
    assert [e.data for e in evs] == [p.Stored(parent_hash=hashes(full)[0], blocks=[
        p.StoredBlock(block_hash=hashes(full)[1], num_tokens=BS, priority=90)])]
    for t in (5, 6, 7, 8):  # a block of generated tokens only: decode retention
        mgr.append_token("r", t)
    full = prompt(toks(0) + [1, 2, 3, 4, 5, 6, 7, 8])
    assert mgr.drain_events()[0].data == p.Stored(parent_hash=hashes(full)[1], blocks=[
        p.StoredBlock(block_hash=hashes(full)[2], num_tokens=BS, priority=15)])
    assert mgr.num_tokens("r") == 12 and len(mgr.block_table("r")) == 3
    mgr.free("r")
    # A new request with the whole sequence as its prompt reuses all three blocks.
    assert mgr.allocate("s", full).num_cached_tokens == 12


def test_cache_salt_and_lora_separate_equal_tokens():
    mgr, _ = cache(gpu=8)
    t = toks(0, 10)
    mgr.allocate("plain", prompt(t))
    mgr.free("plain")
    assert mgr.allocate("salted", prompt(t, cache_salt="tenant-a")).num_cached_tokens == 0
    assert mgr.allocate("lora", prompt(t, lora_id=7)).num_cached_tokens == 0
    assert mgr.allocate("plain2", prompt(t)).num_cached_tokens == 8
    mgr.free("salted")
    assert mgr.allocate("salted2", prompt(t, cache_salt="tenant-a")).num_cached_tokens == 8
    assert mgr.allocate("other", prompt(t, cache_salt="tenant-b")).num_cached_tokens == 0


def test_queue_overflow_is_counted_and_replaced_by_a_snapshot_without_an_id_gap():
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=64, block_size=BS, max_queued_events=4))
    state = NodeState().apply_all(mgr.drain_events())
    for i in range(10):
        mgr.allocate(f"r{i}", prompt(toks(i * 10)))
    assert mgr.stats.events_overflowed == 10 - 4 + 4  # the 4 queued plus the 6 that followed
    events = mgr.drain_events()
    assert [e.event_id for e in events] == [2]
    assert isinstance(events[0].data, p.Snapshot)
    state.apply_all(events)
    assert state.blocks == NodeState.from_snapshot_blocks(mgr.cached_blocks())
    mgr.allocate("after", prompt(toks(500)))
    assert [e.event_id for e in mgr.drain_events()] == [3]


def test_requested_snapshot_follows_the_queued_events():
    mgr, _ = cache(gpu=8)
    mgr.allocate("a", prompt(toks(0)))
    mgr.request_snapshot()
    evs = mgr.drain_events()
    assert kinds(evs) == ["stored", "snapshot"]
    assert evs[1].data.blocks == mgr.cached_blocks()


def test_duplicate_request_ids_and_empty_prompts_are_refused():
    mgr, _ = cache(gpu=8)
    mgr.allocate("a", prompt(toks(0)))
    with pytest.raises(ValueError, match="already allocated"):
        mgr.allocate("a", prompt(toks(10)))
    with pytest.raises(ValueError, match="at least one token"):
        mgr.allocate("b", prompt([]))


def test_host_eviction_never_takes_a_parent_whose_child_is_on_the_host():
    mgr, _ = cache(gpu=2, host=2)
    chain = prompt(toks(0, 10))
    cfg = KvCacheRetentionConfig(token_ranges=(TokenRange(0, 4, 0), TokenRange(4, None, 80)))
    mgr.allocate("chain", chain, cfg)  # root at 0 (below the offload threshold), child at 80
    mgr.free("chain")
    mgr.drain_events()
    mgr.allocate("n1", prompt(toks(20, 30)))
    # The child (80) is offloaded; the root (0) is offloaded too, although below 35, because
    # removing it would cut its child off from the prefix.
    evs = mgr.drain_events()
    h = hashes(chain)
    assert [e.data for e in evs[:2]] == [
        p.Updated(block_hash=h[1], cache_level=p.LevelDiff(old=0, new=1)),
        p.Updated(block_hash=h[0], cache_level=p.LevelDiff(old=0, new=1)),
    ]
    mgr.free("n1")
    mgr.allocate("n2", prompt(toks(40)))  # the host is full: its only leaf is the child (80)
    evs = mgr.drain_events()
    assert evs[0].data == p.Removed(block_hashes=[h[1]])
