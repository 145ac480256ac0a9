"""The eviction policy interface: the pool asks it which block goes next and tells it what happened;
a policy orders blocks it is handed by id, priority, expiry and use order alone (another engine's
free blocks too)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from eventbus import protocol as p
from eventbus.events import EventLog, EventLogStats
from eventbus.hashing import block_hash
from inference_node.kv.adaptive import AdaptivePolicy
from inference_node.kv.adaptive_eviction import AdaptiveEviction
from inference_node.kv.block import GPU, Block
from inference_node.kv.clock import ManualClock
from inference_node.kv.manager import KvCacheConfig, KVCacheManager, policy_for
from inference_node.kv.policy import EvictionPolicy, PriorityRetention, Retention
from inference_node.kv.types import KvStats

from .helpers import BS, prio, prompt, toks


class Recording(PriorityRetention):
    """TensorRT-LLM's policy that writes down every call the pool and the manager make."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, ...]] = []

    def _released(self, level: int, first_tick: int) -> None:
        self.calls.append(("released", level, first_tick))

    def lookup(self, digests: Sequence[bytes], blocks: Sequence[Block]) -> None:
        self.calls.append(("lookup", len(digests), len(blocks)))

    def reused(self, blocks: Sequence[Block]) -> None:
        self.calls.append(("reused", len(blocks)))

    def before_eviction(self, k: int) -> None:
        self.calls.append(("before_eviction", k))

    def evicted(self, victims: Sequence[Block], runs: Sequence[Sequence[Block]] | None = None) -> None:
        self.calls.append(("evicted", [b.hash for b in victims]))

    def new_block(self, index: int, prompt_blocks: int, matched: int, is_decode: bool) -> Retention:
        self.calls.append(("new_block", index, prompt_blocks, is_decode))
        return 77, None, -1


def test_a_configuration_picks_its_policy():
    assert type(policy_for(KvCacheConfig(num_gpu_blocks=4))) is PriorityRetention
    adaptive = policy_for(KvCacheConfig(num_gpu_blocks=4, num_host_blocks=4, adaptive=AdaptivePolicy()))
    assert isinstance(adaptive, AdaptiveEviction) and adaptive.learner.life is None  # tiered: no life tables
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=4))
    assert mgr.policy.name == "priority" and mgr.policy.describe() is None and mgr.adaptive is None


def test_the_pool_tells_the_policy_what_happened_and_asks_it_for_victims():
    policy = Recording()
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=3, block_size=BS, emit_token_ids=True), clock=ManualClock(),
                         policy=policy)
    a, b, c = prompt(toks(0, 10)), prompt(toks(0, 20)), prompt(toks(50, 60))
    h0, h10, h20 = (block_hash(d) for d in (a.digests[0], a.digests[1], b.digests[1]))
    mgr.allocate("a", a)
    mgr.free("a")
    mgr.allocate("b", b)  # block 0 reused, block 20 new in the last free slot
    for t in range(BS):  # a decode block: no free slot, a's tail is evicted for it
        mgr.append_token("b", 100 + t)
    mgr.free("b")
    stored = [blk for e in mgr.drain_events() if isinstance(e.data, p.Stored) for blk in e.data.blocks]
    assert [blk.priority for blk in stored] == [35, 35, 35, 77]  # a's two, b's new one, the decode block
    mgr.allocate("c", c)  # two blocks, none free: the policy's order gives two victims
    decode = [blk for blk in mgr.cached_blocks() if blk.priority == 77]
    assert decode == []  # the decode block was a leaf: it went first, though at 77 (leaves only)
    assert policy.calls[:12] == [
        ("lookup", 2, 0), ("reused", 0), ("released", GPU, 1),
        ("lookup", 2, 1), ("reused", 1), ("evicted", [h10]), ("new_block", 2, 2, True), ("released", GPU, 3),
        ("before_eviction", 2), ("evicted", [policy.calls[9][1][0], h20]), ("lookup", 2, 0), ("reused", 0),
    ]
    assert len(policy.calls) == 12
    events = [e.data for e in mgr.drain_events()]
    removed = [e for e in events if isinstance(e, p.Removed)]
    assert removed == [p.Removed(block_hashes=[policy.calls[9][1][0], h20])]
    assert h0 in {blk.block_hash for blk in mgr.cached_blocks()}  # the root stays: c took the other two


def test_a_client_config_is_applied_through_the_policy_and_expires_there():
    clock = ManualClock()
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=4, block_size=BS), clock=clock)
    pr = prompt(toks(0, 10))
    mgr.allocate("a", pr, prio(90, dur=5.0))
    mgr.free("a")
    mgr.drain_events()
    assert len(mgr.policy.expiries) == 2
    clock.advance(5.0)
    mgr.tick()
    ups = [e.data for e in mgr.drain_events()]
    assert all(isinstance(u, p.Updated) and u.priority == p.PriorityDiff(old=90, new=35) for u in ups)
    assert len(ups) == 2 and mgr.stats.expirations == 2


def _record(uid: int, priority: int = p.DEFAULT_PRIORITY, duration: float | None = None) -> Block:
    """A block of another engine, as a policy needs it: an id, a priority, a duration; in use by
    one request; no prefix tree (no parent, no children)."""
    b = Block(uid, slot=uid, digest=p.BlockDigest(uid.to_bytes(4, "big")), hash_=uid, priority=priority,
              duration=duration)
    return b


def test_a_policy_orders_another_engines_free_blocks_by_priority_expiry_and_use_order():
    clock = ManualClock()
    stats = KvStats()
    log = EventLog(window_size=0, max_queued=100, snapshot_part_blocks=100, stats=EventLogStats())
    policy: EvictionPolicy = PriorityRetention()
    policy.attach(clock, log, stats, {})
    blocks = {i: _record(i) for i in range(1, 7)}
    blocks[2].priority = 100
    blocks[5].priority, blocks[5].duration = 80, 10.0
    freed: list[int] = []
    # Freed in this order (a request's tail first): 3, 1, 2, then 6, 5, 4.
    policy.release([blocks[3], blocks[1], blocks[2]], GPU, freed)
    policy.release([blocks[6], blocks[5], blocks[4]], GPU, freed)
    assert freed == [] and policy.orders[GPU].count == 6
    # Block 1 is reused (taken from the free order), then freed again: the newest now.
    policy.orders[GPU].discard(blocks[1])
    blocks[1].ref += 1
    policy.release([blocks[1]], GPU, freed)
    clock.advance(10.0)  # block 5's duration runs out: back to 35
    policy.expire()
    assert [e.data for e in log.drain()] == [p.Updated(block_hash=p.BlockHash(5),
                                                       priority=p.PriorityDiff(old=80, new=35))]
    policy.set_priority(blocks[4], 10, None)  # a later request re-prioritizes one
    order = [policy.victim(GPU) for _ in range(6)]
    assert [b.uid for b in order if b is not None] == [4, 3, 6, 5, 1, 2]
    assert policy.victim(GPU) is None


@pytest.mark.parametrize("settings", [AdaptivePolicy(), AdaptivePolicy(compiled=False)])
def test_the_adaptive_policy_learns_through_the_interface(settings):
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=16, block_size=BS, adaptive=settings))
    for i in range(30):
        pr = prompt(toks(0, 10, 1000 + 10 * i))
        mgr.allocate(f"r{i}", pr)
        mgr.free(f"r{i}")
    assert mgr.policy.name == "adaptive"
    learned = mgr.policy.describe()
    assert learned is not None and learned["classes"]
    reused = mgr._pool.cached[prompt(toks(0, 10)).digests[0]]
    assert reused.priority == 36  # the frequency band: reused 29 times
