"""The blocks of one cache: the slots of both tiers, the cached blocks by digest, and every move
of a block between them.

:class:`BlockPool` is mechanical: it does what happens to blocks — take a cached prefix into use,
find slots (evicting, offloading), onboard, cache new blocks, release them, remove them — and
reports each change to the :class:`~eventbus.events.EventLog` and :class:`KvStats`. Which block
goes next, and every priority, is the :class:`~inference_node.kv.policy.EvictionPolicy`'s: the
pool asks it for victims and tells it what happened (freed, reused, moved, evicted), through its
methods and its tiers' free-block orders. The
:class:`~inference_node.kv.manager.KVCacheManager` decides what happens to *requests* (which
blocks a prompt needs, which retention they take) and calls it. The semantics are the manager's
module docstring's.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from eventbus.events import EventLog
from eventbus.hashing import block_hash
from eventbus.protocol import (
    DEFAULT_PRIORITY,
    BlockDigest,
    BlockHash,
    LevelDiff,
    SnapshotBlock,
    Stored,
    StoredBlock,
    Updated,
)
from inference_node.kv.block import GPU, HOST, IN_LIST, NOT_EVICTABLE, Block
from inference_node.kv.clock import Clock
from inference_node.kv.policy import EvictionPolicy, Retentions
from inference_node.kv.prompt import Prompt
from inference_node.kv.types import BlockCopy, KvCacheConfig, KvStats, OutOfBlocks

_new_object = object.__new__  # a Block without the call to __init__ (store_prompt sets every slot)
_HASH_OF = struct.Struct(">Q").unpack_from  # eventbus.hashing.block_hash, as a 1-tuple


class BlockPool:
    """Blocks, slots and eviction of one cache (see the module docstring)."""

    def __init__(self, config: KvCacheConfig, clock: Clock, stats: KvStats, events: EventLog,
                 policy: EvictionPolicy) -> None:
        self.config = config
        self.block_size = config.block_size
        self._stats = stats
        self._events = events
        self._policy = policy
        self._host_enabled = config.num_host_blocks > 0
        # NOTE: free lists pop from the end; reversed so that slot 0 is handed out first.
        self._free: list[list[int]] = [
            list(range(config.num_gpu_blocks - 1, -1, -1)),
            list(range(config.num_host_blocks - 1, -1, -1)),
        ]
        #: Cached blocks by digest (read it; only the pool changes it).
        self.cached: dict[BlockDigest, Block] = {}
        #: The policy's free-block order of each tier, told here what the pool does to blocks.
        self._orders = policy.orders
        policy.attach(clock, events, stats, self.cached)
        self._uid = 0
        #: Copies for the model layer, in order, since the caller last took them.
        self.copies: list[BlockCopy] = []

    # ------------------------------------------------------------------ blocks of requests

    def admit(self, digests: Sequence[BlockDigest], n_blocks: int) -> tuple[list[Block], list[Block], list[int]]:
        """Take the longest cached prefix of ``digests`` into use (contiguous by construction: its
        evictable blocks leave the eviction order) and find GPU slots for the rest of a request of
        ``n_blocks`` blocks and for the prefix's host blocks, free ones first, then evicting.

        Returns:
            The prefix's blocks, those of them on the host tier (parents first, to onboard), and
            the GPU slots (first those for onboarding).

        Raises:
            OutOfBlocks: not enough slots can be freed; nothing of the request is held (the
                blocks evicted meanwhile stay evicted).
        """
        blocks: list[Block] = []
        onboard: list[Block] = []
        n_listed = 0  # evictable GPU blocks taken into use that stay in their lists, pinned
        gpu_index = self._orders[GPU]
        get = self.cached.get
        for d in digests:
            b = get(d)
            if b is None:
                break
            if not b.ref:
                if b.duration is not None:
                    # The retention clock stops while the block is in use. An evictable block has a
                    # live expiry entry only while it has a duration (EvictionPolicy.release, expire). NOTE: the
                    # policy's clock, stopped inline: this loop runs for every reused block.
                    b.expiry_version += 1
                if b.level:
                    self._orders[HOST].discard(b)
                elif b.evict_state == IN_LIST:
                    n_listed += 1
                else:
                    gpu_index.discard(b)
            b.ref += 1
            b.hits += 1
            blocks.append(b)
            if b.level:
                onboard.append(b)
        if n_listed:
            gpu_index.pin_listed(n_listed)

        needed = len(onboard) + n_blocks - len(blocks)
        free = self._free[GPU]
        n_free = len(free)
        if needed <= n_free:
            if not needed:
                return blocks, onboard, []
            slots = free[n_free - needed:]
            slots.reverse()
            del free[n_free - needed:]
            return blocks, onboard, slots
        slots = free[::-1]
        free.clear()
        try:
            self._evict_gpu(needed - n_free, slots)
        except OutOfBlocks:
            free.extend(reversed(slots))
            given_back = self._policy.given_back
            for b in reversed(blocks):
                b.hits -= 1
                given_back(b)
                self.release(b)
            raise OutOfBlocks(f"needs {needed} GPU blocks; only {len(slots)} could be freed") from None
        return blocks, onboard, slots

    def onboard(self, blocks: list[Block], slots: list[int]) -> list[int]:
        """Bring host ``blocks`` (in use) back to the first GPU ``slots``, parents first; returns
        the other slots."""
        host_free = self._free[HOST]
        for b, gpu_slot in zip(blocks, slots, strict=False):
            self.copies.append(BlockCopy("onboard", HOST, b.slot, GPU, gpu_slot))
            host_free.append(b.slot)
            b.level, b.slot = GPU, gpu_slot
            if b.parent is not None:
                b.parent.gpu_children += 1
            self._stats.onboards += 1
            self._events.emit(Updated(block_hash=b.hash, cache_level=LevelDiff(old=HOST, new=GPU)))
        return slots[len(blocks):]

    def store_prompt(self, prompt: Prompt, blocks: list[Block], new_slots: list[int], n_blocks: int,
                     retentions: Retentions | None) -> None:
        """Blocks for the rest of the prompt, appended to ``blocks`` (which holds the matched ones):
        full ones are cached (one chained ``stored`` event), the partial tail is private. Each new
        full block but the last has one child (the next), on the GPU. ``retentions``: the
        retention of each new block, from the first unmatched one (None: the default priority, no duration)."""
        # NOTE: the core's busiest loop (``kvflow bench kv``): blocks are made without __init__
        # (see Block), with attributes and methods bound to locals.
        bs = self.block_size
        digests = prompt.digests
        n_matched = len(blocks)
        n_full = len(digests)
        uid = self._uid
        end = n_full if n_full <= n_blocks else n_blocks
        if n_matched < end:
            parent = blocks[-1] if n_matched else None
            if parent is not None:  # pinned by this request: not in an eviction index
                parent.children += 1
                parent.gpu_children += 1
            stored: list[StoredBlock] = []
            token_ids = prompt.token_ids if self.config.emit_token_ids else None
            lora_id = prompt.lora_id
            prio, dur, cls = DEFAULT_PRIORITY, None, -1
            cached = self.cached
            new = _new_object
            append_block = blocks.append
            append_stored = stored.append
            hash_of = _HASH_OF
            for i in range(n_matched, end):
                if retentions is not None:
                    prio, dur, cls = retentions[i - n_matched]
                d = digests[i]
                h = hash_of(d)[0]
                uid += 1
                nb: Block = new(Block)
                nb.uid = uid
                nb.slot = new_slots[i - n_matched]
                nb.level = GPU
                nb.digest = d
                nb.hash = h
                nb.parent = parent
                nb.lora_id = lora_id
                nb.priority = prio
                nb.duration = dur
                nb.ref = 1
                nb.last_used = 0
                nb.children = 1
                nb.gpu_children = 1
                nb.hits = 0
                nb.adaptive_class = cls
                nb.evict_state = NOT_EVICTABLE
                nb.heap_version = 0
                nb.expiry_version = 0
                cached[d] = nb
                if token_ids is None:
                    append_stored(StoredBlock(h, bs, lora_id, GPU, prio, None))
                else:
                    lo = i * bs
                    append_stored(StoredBlock(h, bs, lora_id, GPU, prio, list(token_ids[lo:lo + bs])))
                append_block(nb)
                parent = nb
            nb.children = nb.gpu_children = 0  # the last one
            self._events.emit(Stored(blocks[n_matched - 1].hash if n_matched else None, stored))
        for i in range(n_full, n_blocks):  # the partial tail: private
            uid += 1
            blocks.append(Block(uid, new_slots[i - n_matched]))
        self._uid = uid

    def new_private_block(self) -> Block:
        """A private block in a GPU slot (a decode step needs one; may evict).

        Raises:
            OutOfBlocks: no GPU slot can be freed.
        """
        if self._policy.expiries:
            self._policy.expire()
        try:
            slot = self._take_gpu_slot()
        finally:
            self._events.close_removed()
        self._uid += 1
        return Block(self._uid, slot)

    def cache_block(self, b: Block, digest: BlockDigest, parent: Block | None, lora_id: int | None,
                    priority: int, duration: float | None, token_ids: list[int] | None) -> None:
        """A private block in use, now full, becomes cached under ``digest`` (``stored``)."""
        b.digest = digest
        b.hash = block_hash(digest)
        b.parent = parent
        b.lora_id = lora_id
        b.priority = priority
        b.duration = duration
        if parent is not None:  # pinned by the request that stores b: not in an eviction index
            parent.children += 1
            parent.gpu_children += 1
        self.cached[digest] = b
        self._events.emit(Stored(parent_hash=parent.hash if parent is not None else None, blocks=[
            StoredBlock(b.hash, self.block_size, lora_id, b.level, priority, token_ids)]))

    def release_request(self, blocks: list[Block]) -> None:
        """A request finished: its blocks are released tail first (within a priority a sequence's
        tail is then evicted before its head); private ones are freed. Blocks in use are on the
        GPU."""
        self._policy.release(reversed(blocks), GPU, self._free[GPU])

    def release(self, b: Block) -> None:
        """One request less uses ``b`` (on either tier; a cached block)."""
        self._policy.release((b,), b.level, self._free[b.level])

    # ------------------------------------------------------------------ queries

    @property
    def used_blocks(self) -> tuple[int, int]:
        """Occupied slots per tier (cached or private)."""
        return (self.config.num_gpu_blocks - len(self._free[GPU]),
                self.config.num_host_blocks - len(self._free[HOST]))

    @property
    def evictable_blocks(self) -> tuple[int, int]:
        """Blocks that eviction could take right now, per tier."""
        return self._orders[GPU].count, self._orders[HOST].count

    def cached_blocks(self) -> list[SnapshotBlock]:
        """The cache's ground truth, parents before children (as in a ``snapshot``)."""
        # A cached block's parent is cached and older (smaller uid): depths in one pass by uid.
        depth: dict[Block, int] = {}
        for b in sorted(self.cached.values(), key=lambda b: b.uid):
            depth[b] = depth[b.parent] + 1 if b.parent is not None else 0
        out = sorted(depth, key=lambda b: (depth[b], b.uid))
        bs = self.block_size
        return [
            SnapshotBlock(
                block_hash=b.hash, parent_hash=b.parent.hash if b.parent is not None else None,
                num_tokens=bs, lora_id=b.lora_id, cache_level=b.level, priority=b.priority,
            )
            for b in out
        ]

    # ------------------------------------------------------------------ internals

    def _evict_gpu(self, k: int, slots: list[int]) -> None:
        """Evict ``k`` GPU blocks (the free list is empty), appending their slots to ``slots``.

        With a host tier, one victim at a time (:meth:`_take_gpu_slot`: it may offload).
        Otherwise the victims come in runs (the policy's :meth:`~EvictionPolicy.victims`: the
        order also updates their parents) and leave the cache here; the policy hears of them in
        one call, and their removals go in one event.

        Raises:
            OutOfBlocks: no evictable block is left (``slots`` holds those taken so far).
        """
        policy = self._policy
        policy.before_eviction(k)
        if self._host_enabled:
            take_slot = self._take_gpu_slot
            try:
                for _ in range(k):
                    slots.append(take_slot())
            finally:
                self._events.close_removed()
            return
        take = policy.victims
        cached = self.cached
        evictions = self._stats.evictions_by_priority
        append_slot = slots.append
        hashes: list[BlockHash] = []
        append_hash = hashes.append
        victims: list[Block] = []  # for the policy, in one call (their digests still set)
        runs: list[list[Block]] = []
        try:
            while k:
                run = take(k)
                if not run:
                    raise OutOfBlocks("every GPU block is in use")
                p = run[0].priority
                for b in run:  # the rest of _remove(b), inlined (take did the parents)
                    del cached[b.digest]  # type: ignore[arg-type]
                    append_hash(b.hash)
                    append_slot(b.slot)
                    if b.priority != p:  # a run from a heap may mix priorities
                        evictions[b.priority] = evictions.get(b.priority, 0) + 1
                        evictions[p] = evictions.get(p, 0) - 1
                n = len(run)
                evictions[p] = evictions.get(p, 0) + n
                k -= n
                victims += run
                runs.append(run)
        finally:
            if victims:
                policy.evicted(victims, runs)
            for b in victims:
                b.digest = None  # its expiry entries are stale for good
            self._events.removed(hashes, close=True)

    def _take_gpu_slot(self) -> int:
        """One GPU slot: a free one, or an evicted block's (offloaded when the host tier takes it)."""
        free = self._free[GPU]
        if free:
            return free.pop()
        b = self._policy.victim(GPU)
        if b is None:
            raise OutOfBlocks("every GPU block is in use")
        slot = b.slot
        host_slot = None
        if self._host_enabled and (b.priority >= self.config.secondary_offload_min_priority or b.children > 0):
            try:
                host_slot = self._take_host_slot(allow_fail=b.children == 0)
            except OutOfBlocks:
                self._orders[GPU].add(b)  # it stays evictable on the GPU
                raise
        if host_slot is not None:
            self._offload(b, host_slot)
        else:
            self._remove(b)
        return slot

    def _offload(self, b: Block, host_slot: int) -> None:
        """Move GPU block ``b`` (just taken from the GPU order) to ``host_slot``."""
        self.copies.append(BlockCopy("offload", GPU, b.slot, HOST, host_slot))
        b.level, b.slot = HOST, host_slot
        if b.parent is not None:
            b.parent.gpu_children -= 1
            self._orders[GPU].unpark(b.parent)
        offloads = self._stats.offloads_by_priority
        offloads[b.priority] = offloads.get(b.priority, 0) + 1
        self._events.emit(Updated(block_hash=b.hash, cache_level=LevelDiff(old=GPU, new=HOST)))
        self._orders[HOST].add(b)

    def _take_host_slot(self, allow_fail: bool) -> int | None:
        free = self._free[HOST]
        if free:
            return free.pop()
        b = self._policy.victim(HOST)
        if b is None:
            if allow_fail:
                return None
            raise OutOfBlocks("every host block is pinned")
        slot = b.slot
        self._remove(b)
        return slot

    def _remove(self, b: Block) -> None:
        """``b`` (just taken from its tier's order) leaves the cache."""
        assert b.children == 0 and b.ref == 0 and b.digest is not None
        del self.cached[b.digest]
        self._policy.evicted((b,))
        evictions = self._stats.evictions_by_priority
        evictions[b.priority] = evictions.get(b.priority, 0) + 1
        p = b.parent
        if p is not None:
            p.children -= 1
            if b.level == GPU:
                p.gpu_children -= 1
            self._orders[p.level].unpark(p)
        b.digest = None  # its expiry entries are stale for good
        self._events.removed((b.hash,))
