"""Property test: the KV core against a small, obviously-correct reference model.

The reference keeps blocks in a dict and finds every eviction victim by scanning all blocks
(lowest priority, then least recently used, leaves only) — O(n), no heaps, no lazy deletion.
Hypothesis drives both with the same random operations and checks after each step that

* both hold exactly the same cached blocks (hash, parent, tier, priority) and slot usage;
* replaying the core's events (eventbus.replay, strict) reproduces the core's cache exactly,
  with no gap in event_id, also across queue overflows;
* capacity is never exceeded, and no block of a running request was evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from eventbus.hashing import block_digest, block_hash
from eventbus.protocol import DEFAULT_PRIORITY
from eventbus.replay import NodeState
from inference_node.kv.adaptive import AdaptiveLearner, AdaptivePolicy, BlockContext
from inference_node.kv.clock import ManualClock
from inference_node.kv.manager import KvCacheConfig, KVCacheManager, OutOfBlocks
from inference_node.kv.prompt import Prompt
from inference_node.kv.retention import KvCacheRetentionConfig, TokenRange

BS = 4
SEGMENTS = [list(range(s, s + BS)) for s in (0, 10, 20, 30, 40, 50)]


@dataclass
class RBlock:
    parent: bytes | None
    level: int
    priority: int
    duration: float | None
    ref: int = 1
    last_used: int = 0
    expires_at: float | None = None
    hits: int = 0
    tag: int = -1


@dataclass
class RRequest:
    entries: list[bytes | None]  # digest of a cached block, None for a private one
    num_tokens: int
    prompt: Prompt
    retention: KvCacheRetentionConfig | None
    tokens: list[int] | None
    last_full: bytes | None


class OutOfBlocksRef(Exception):
    pass


@dataclass
class Reference:
    gpu: int
    host: int
    min_offload: int
    adaptive: AdaptiveLearner | None
    free_gpu: int = 0
    free_host: int = 0
    tick: int = 0
    blocks: dict[bytes, RBlock] = field(default_factory=dict)
    requests: dict[str, RRequest] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free_gpu, self.free_host = self.gpu, self.host

    # -- helpers
    def children(self, d: bytes, level: int | None = None) -> int:
        return sum(1 for b in self.blocks.values() if b.parent == d and (level is None or b.level == level))

    def victim(self, level: int) -> bytes | None:
        cands = [(b.priority, b.last_used, d) for d, b in self.blocks.items()
                 if b.ref == 0 and b.level == level
                 and self.children(d, 0 if level == 0 else None) == 0]
        return min(cands)[2] if cands else None

    def expire(self, now: float) -> None:
        for b in self.blocks.values():
            if b.ref == 0 and b.expires_at is not None and b.expires_at <= now:
                b.expires_at = None
                b.duration = None
                b.priority = DEFAULT_PRIORITY

    def release(self, d: bytes, now: float) -> None:
        b = self.blocks[d]
        b.ref -= 1
        if b.ref == 0:
            self.tick += 1
            b.last_used = self.tick
            b.expires_at = now + b.duration if b.duration is not None else None

    def evict(self, d: bytes, now: float) -> None:
        b = self.blocks.pop(d)
        if self.adaptive is not None:
            self.adaptive.on_evict([SimpleNamespace(digest=d, adaptive_class=b.tag, last_used=b.last_used)])

    def take_gpu(self, now: float) -> None:
        if self.free_gpu:
            self.free_gpu -= 1
            return
        d = self.victim(0)
        if d is None:
            raise OutOfBlocksRef
        b = self.blocks[d]
        has_children = self.children(d) > 0
        if self.host and (b.priority >= self.min_offload or has_children):
            if self.free_host:
                self.free_host -= 1
                b.level = 1
                return
            h = self.victim(1)
            if h is not None:
                self.evict(h, now)
                b.level = 1
                return
            if has_children:
                raise OutOfBlocksRef
        self.evict(d, now)

    def retention_of(self, ret, lo, hi, n, index, prompt_blocks, matched):
        """(priority, duration, adaptive class)."""
        if ret is not None:
            return (*ret.block_retention(lo, hi, n), -1)
        if self.adaptive is not None:
            return self.adaptive.new_block(BlockContext(index, prompt_blocks, matched, lo >= n))
        return DEFAULT_PRIORITY, None, -1

    # -- operations
    def allocate(self, rid: str, prompt: Prompt, ret, now: float) -> None:
        self.expire(now)
        matched = []
        for d in prompt.digests:
            if d not in self.blocks:
                break
            matched.append(d)
        for d in matched:
            b = self.blocks[d]
            b.ref += 1
            b.expires_at = None
        n_blocks = -(-prompt.num_tokens // BS)
        onboard = [d for d in matched if self.blocks[d].level == 1]
        needed = len(onboard) + n_blocks - len(matched)
        taken = 0
        try:
            for _ in range(needed):
                self.take_gpu(now)
                taken += 1
        except OutOfBlocksRef:
            self.free_gpu += taken
            for d in reversed(matched):
                self.release(d, now)
            raise
        for d in onboard:
            self.blocks[d].level = 0
            self.free_host += 1
        adaptive_new = None
        if self.adaptive is not None:
            self.adaptive.on_lookup(prompt.digests, len(matched), now, self.tick)
            if self.adaptive.revoke_due:  # the guard turned the bands off: raised blocks to 35
                self.adaptive.revoke_due = False
                for b in self.blocks.values():
                    if b.tag >= 0:
                        b.priority = min(b.priority, DEFAULT_PRIORITY)
                        b.duration = b.expires_at = None
        for i, d in enumerate(matched):
            b = self.blocks[d]
            if ret is not None:
                b.priority, b.duration = ret.block_retention(i * BS, (i + 1) * BS, prompt.num_tokens)
                b.tag = -1
            elif self.adaptive is not None:
                raised = self.adaptive.on_reuse(b.tag, b.priority, b.hits, b.last_used)
                if raised is not None and raised[0] >= b.priority:
                    if raised[0] != b.priority:
                        b.priority = raised[0]
                    b.duration, b.tag = raised[1], raised[2]
            b.hits += 1
        if self.adaptive is not None and ret is None:  # after the reuses, as the core asks
            n_full = len(prompt.digests)
            adaptive_new = self.adaptive.prompt_retention(n_full, len(matched), min(n_full, n_blocks))
        entries: list[bytes | None] = list(matched)
        parent = matched[-1] if matched else None
        for i in range(len(matched), n_blocks):
            if i < len(prompt.digests):
                d = prompt.digests[i]
                if adaptive_new is not None:
                    pr, du, tag = adaptive_new[i - len(matched)]
                else:
                    pr, du, tag = self.retention_of(ret, i * BS, (i + 1) * BS, prompt.num_tokens, i,
                                                    len(prompt.digests), len(matched))
                self.blocks[d] = RBlock(parent, 0, pr, du, tag=tag)
                entries.append(d)
                parent = d
            else:
                entries.append(None)
        self.requests[rid] = RRequest(entries, prompt.num_tokens, prompt, ret,
                                      list(prompt.token_ids) if prompt.token_ids else None,
                                      prompt.digests[-1] if prompt.digests else None)

    def append(self, rid: str, token: int, now: float) -> None:
        r = self.requests[rid]
        idx = r.num_tokens // BS
        if idx == len(r.entries):
            self.expire(now)
            self.take_gpu(now)
            r.entries.append(None)
        r.num_tokens += 1
        r.tokens.append(token)
        if r.num_tokens % BS == 0:
            toks = tuple(r.tokens[idx * BS:(idx + 1) * BS])
            parent_digest = r.last_full
            d = block_digest(parent_digest, toks, lora_id=r.prompt.lora_id,
                             cache_salt=r.prompt.cache_salt if parent_digest is None else None)
            r.last_full = d
            prev = r.entries[idx - 1] if idx > 0 else None
            if d not in self.blocks and (idx == 0 or (prev is not None and prev == parent_digest)):
                pr, du, tag = self.retention_of(r.retention, idx * BS, (idx + 1) * BS, r.prompt.num_tokens, idx,
                                                len(r.prompt.digests), 0)
                self.blocks[d] = RBlock(prev, 0, pr, du, tag=tag)
                r.entries[idx] = d

    def free(self, rid: str, now: float) -> None:
        r = self.requests.pop(rid)
        self.expire(now)
        for d in reversed(r.entries):
            if d is None:
                self.free_gpu += 1
            else:
                self.release(d, now)

    def state(self) -> dict[int, tuple[int | None, int, int]]:
        return {block_hash(d): (block_hash(b.parent) if b.parent else None, b.level, b.priority)
                for d, b in self.blocks.items()}


retentions = st.one_of(
    st.none(),
    st.builds(
        lambda p1, d1, cut, p2, dp: KvCacheRetentionConfig(
            (TokenRange(0, cut, p1, d1), TokenRange(cut, None, p2)), decode_priority=dp),
        st.sampled_from([0, 10, 35, 50, 90, 100]), st.sampled_from([None, 1.0, 5.0]),
        st.integers(1, 12), st.sampled_from([5, 35, 80]), st.sampled_from([10, 35, 60]),
    ),
)


class CacheMachine(RuleBasedStateMachine):
    @initialize(gpu=st.integers(3, 10), host=st.sampled_from([0, 0, 2, 5]), min_offload=st.sampled_from([0, 35, 60]),
                max_events=st.sampled_from([3, 10_000]), adaptive=st.booleans(), part_blocks=st.sampled_from([2, 64]))
    def setup(self, gpu, host, min_offload, max_events, adaptive, part_blocks):
        # Two learners of the (stateful, deterministic) policy see the same calls.
        # The guard switches often (rate 0.2, margin 0); the frequency band gets durations; junk
        # is common (a class starts below 0.3), so revokes meet junk blocks (which stay junk); new
        # blocks of classes reused within the cache's size in releases go to the frequency band.
        policy = AdaptivePolicy(min_samples=2.0, guard_rate=0.2, guard_margin=0.0, junk_probability=0.3,
                                frequency_horizons=2.0, soon_share=0.3, life_tables=False) if adaptive else None
        self.clock = ManualClock()
        self.core = KVCacheManager(KvCacheConfig(
            num_gpu_blocks=gpu, num_host_blocks=host, block_size=BS, secondary_offload_min_priority=min_offload,
            max_queued_events=max_events, adaptive=policy, snapshot_part_blocks=part_blocks), clock=self.clock)
        ref_learner = None if policy is None else AdaptiveLearner(policy, gpu + host)
        self.ref = Reference(gpu, host, min_offload, ref_learner)
        self.replayed = NodeState()
        self.next_id = 0
        self.capacity = gpu

    @rule(segs=st.lists(st.integers(0, len(SEGMENTS) - 1), min_size=1, max_size=4),
          tail=st.integers(0, BS - 1), ret=retentions, salt=st.sampled_from([None, None, "t1"]))
    def allocate(self, segs, tail, ret, salt):
        tokens = [t for s in segs for t in SEGMENTS[s]] + list(range(900, 900 + tail))
        prompt = Prompt.from_tokens(tokens, BS, cache_salt=salt)
        rid = f"r{self.next_id}"
        self.next_id += 1
        try:
            self.core.allocate(rid, prompt, ret)
            core_ok = True
        except OutOfBlocks:
            core_ok = False
        try:
            self.ref.allocate(rid, prompt, ret, self.clock())
            ref_ok = True
        except OutOfBlocksRef:
            ref_ok = False
        assert core_ok == ref_ok

    @precondition(lambda self: self.ref.requests)
    @rule(data=st.data(), token=st.integers(0, 5))
    def append(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.ref.requests)))
        try:
            self.core.append_token(rid, token)
            core_ok = True
        except OutOfBlocks:
            core_ok = False
        try:
            self.ref.append(rid, token, self.clock())
            ref_ok = True
        except OutOfBlocksRef:
            ref_ok = False
        assert core_ok == ref_ok

    @precondition(lambda self: self.ref.requests)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.ref.requests)))
        self.core.free(rid)
        self.ref.free(rid, self.clock())

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0, 4.0]))
    def advance(self, dt):
        self.clock.advance(dt)
        self.core.tick()
        self.ref.expire(self.clock())

    @rule()
    def resync(self):  # a consumer asks; with 2 blocks a part, most snapshots come in several parts
        self.core.request_snapshot()

    @rule()
    def drain(self):
        self.replayed.apply_all(self.core.drain_events())  # strict: raises on any inconsistency
        truth = NodeState.from_snapshot_blocks(self.core.cached_blocks())
        assert self.replayed.blocks == truth

    @invariant()
    def same_as_reference(self):
        if not hasattr(self, "core"):
            return
        core_state = {b.block_hash: (b.parent_hash, b.cache_level, b.priority) for b in self.core.cached_blocks()}
        assert core_state == self.ref.state()
        used_gpu, used_host = self.core.used_blocks
        assert used_gpu == self.ref.gpu - self.ref.free_gpu
        assert used_host == self.ref.host - self.ref.free_host

    @invariant()
    def capacity_and_pinning(self):
        if not hasattr(self, "core"):
            return
        used_gpu, used_host = self.core.used_blocks
        assert 0 <= used_gpu <= self.core.config.num_gpu_blocks
        assert 0 <= used_host <= self.core.config.num_host_blocks
        # No block held by a running request was evicted or moved off the GPU.
        for r in self.ref.requests.values():
            for d in r.entries:
                if d is not None:
                    info = self.core.block_info(d)
                    assert info is not None and info["level"] == 0 and info["ref"] >= 1

    def teardown(self):
        if hasattr(self, "core"):
            self.replayed.apply_all(self.core.drain_events())
            assert self.replayed.blocks == NodeState.from_snapshot_blocks(self.core.cached_blocks())


CacheMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
