"""The blocks of one cache: the slots of both tiers, the cached blocks by digest, each tier's
eviction order, retention clocks, and every move of a block between them.

:class:`BlockPool` does what happens to blocks — take a cached prefix into use, find slots
(evicting, offloading), onboard, cache new blocks, release them, re-prioritize, expire, remove —
and reports each change to the :class:`~eventbus.events.EventLog`, the adaptive
policy's :class:`~inference_node.kv.adaptive.AdaptiveLearner` and :class:`KvStats`. The
:class:`~inference_node.kv.manager.KVCacheManager` decides what happens to *requests* (which
blocks a prompt needs, which retention they take) and calls it. The semantics are the manager's
module docstring's.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Sequence

from eventbus.events import EventLog
from eventbus.hashing import block_hash
from eventbus.protocol import (
    DEFAULT_PRIORITY,
    BlockDigest,
    BlockHash,
    LevelDiff,
    PriorityDiff,
    SnapshotBlock,
    Stored,
    StoredBlock,
    Updated,
)
from inference_node.kv.adaptive import DEMOTED_PRIORITY, FREQUENCY_PRIORITY, RECENCY_PRIORITY, AdaptiveLearner
from inference_node.kv.block import GPU, HOST, IN_LIST, NOT_EVICTABLE, Block
from inference_node.kv.clock import Clock
from inference_node.kv.eviction import EvictionIndex
from inference_node.kv.lifetables import NUM_BUCKETS, TIE_ABOVE, TIE_BELOW
from inference_node.kv.prompt import Prompt
from inference_node.kv.types import BlockCopy, KvCacheConfig, KvStats, OutOfBlocks

#: Priority, retention duration and adaptive class of the i-th block of a prompt.
Retentions = Sequence[tuple[int, float | None, int]]

_new_object = object.__new__  # a Block without the call to __init__ (store_prompt sets every slot)
_HASH_OF = struct.Struct(">Q").unpack_from  # eventbus.hashing.block_hash, as a 1-tuple


class BlockPool:
    """Blocks, slots and eviction of one cache (see the module docstring)."""

    def __init__(self, config: KvCacheConfig, clock: Clock, stats: KvStats, events: EventLog,
                 adaptive: AdaptiveLearner | None) -> None:
        self.config = config
        self.block_size = config.block_size
        self._clock = clock
        self._stats = stats
        self._events = events
        self._adaptive = adaptive
        self._host_enabled = config.num_host_blocks > 0
        # NOTE: free lists pop from the end; reversed so that slot 0 is handed out first.
        self._free: list[list[int]] = [
            list(range(config.num_gpu_blocks - 1, -1, -1)),
            list(range(config.num_host_blocks - 1, -1, -1)),
        ]
        #: Cached blocks by digest (read it; only the pool changes it).
        self.cached: dict[BlockDigest, Block] = {}
        self._index = [EvictionIndex(GPU), EvictionIndex(HOST)]
        #: Retention timers, a heap of (deadline, uid, expiry_version, block) with lazy deletion
        #: (read it, e.g. to skip calling :meth:`expire` when it is empty; only the pool changes it).
        self.expiries: list[tuple[float, int, int, Block]] = []
        self._uid = 0
        self._tick = 0
        self._clocks: list[Block] = []  # blocks a release made evictable whose clocks start (reused)
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
        gpu_index = self._index[GPU]
        get = self.cached.get
        for d in digests:
            b = get(d)
            if b is None:
                break
            if not b.ref:
                if b.duration is not None:
                    # The retention clock stops while the block is in use. An evictable block has a
                    # live expiry entry only while it has a duration (_start_clocks, expire).
                    b.expiry_version += 1
                if b.level:
                    self._index[HOST].discard(b)
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
            adaptive = self._adaptive
            for b in reversed(blocks):
                b.hits -= 1
                if adaptive is not None:
                    adaptive.given_back(b)
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
        if self.expiries:
            self.expire()
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
        clocks = self._clocks
        first = self._tick + 1
        self._tick = self._index[GPU].release(reversed(blocks), self._tick, self._free[GPU], clocks)
        if clocks:
            self._start_clocks()
        if self._adaptive is not None and self._tick >= first:
            self._adaptive.released(self._index[GPU].arrived, first)

    def release(self, b: Block) -> None:
        """One request less uses ``b`` (on either tier; a cached block)."""
        clocks = self._clocks
        first = self._tick + 1
        self._tick = self._index[b.level].release((b,), self._tick, self._free[b.level], clocks)
        if clocks:
            self._start_clocks()
        if self._adaptive is not None and self._tick >= first:
            self._adaptive.released(self._index[b.level].arrived, first)

    def set_priority(self, b: Block, priority: int, duration: float | None) -> None:
        """Re-prioritize ``b`` (``updated`` if its priority changes)."""
        b.duration = duration
        if priority != b.priority:
            old = b.priority
            self._index[b.level].rekey(b, priority)
            self._stats.reprioritizations += 1
            self._events.emit(Updated(block_hash=b.hash, priority=PriorityDiff(old=old, new=priority)))

    def expire(self) -> None:
        """Retention durations that ran out by now: their blocks fall back to the default priority."""
        heap = self.expiries
        if not heap:
            return
        now = self._clock()
        while heap and heap[0][0] <= now:
            _, _, version, b = heapq.heappop(heap)
            if version != b.expiry_version or b.digest is None:
                continue
            b.duration = None
            self._stats.expirations += 1
            if b.priority != DEFAULT_PRIORITY:
                old = b.priority
                self._index[b.level].rekey(b, DEFAULT_PRIORITY)
                if self._adaptive is not None and not b.ref:
                    self._adaptive.moved(b, old)
                self._events.emit(Updated(block_hash=b.hash, priority=PriorityDiff(old=old, new=DEFAULT_PRIORITY)))

    def revoke_adaptive(self) -> None:
        """The adaptive policy turned its bands off (its guard): every block it raised above the
        default priority returns to it, at its place in recency (``updated`` for each), as does a
        block it demoted (``DEMOTED_PRIORITY``), and a duration it gave ends; its junk band stays.
        Blocks a client's retention config set are left alone."""
        for b in self.cached.values():
            if b.adaptive_class < 0:
                continue
            if b.duration is not None:
                b.duration = None
                b.expiry_version += 1  # its expiry entry goes stale
            if b.priority > DEFAULT_PRIORITY or b.priority == DEMOTED_PRIORITY:
                old = b.priority
                self._index[b.level].rekey(b, DEFAULT_PRIORITY)
                if not b.ref:
                    self._adaptive.moved(b, old)  # type: ignore[union-attr]
                self._events.emit(Updated(block_hash=b.hash, priority=PriorityDiff(old=old, new=DEFAULT_PRIORITY)))

    # ------------------------------------------------------------------ queries

    @property
    def tick(self) -> int:
        """The last release tick handed out (``Block.last_used`` counts in it)."""
        return self._tick

    @property
    def used_blocks(self) -> tuple[int, int]:
        """Occupied slots per tier (cached or private)."""
        return (self.config.num_gpu_blocks - len(self._free[GPU]),
                self.config.num_host_blocks - len(self._free[HOST]))

    @property
    def evictable_blocks(self) -> tuple[int, int]:
        """Blocks that eviction could take right now, per tier."""
        return self._index[GPU].count, self._index[HOST].count

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

    def _start_clocks(self) -> None:
        """Start the clocks of the blocks the last release made evictable (``_clocks``: each has a
        duration)."""
        now = self._clock()
        push, heap = heapq.heappush, self.expiries
        for b in self._clocks:
            b.expiry_version += 1
            push(heap, (now + b.duration, b.uid, b.expiry_version, b))  # type: ignore[operator]
        self._clocks.clear()

    def _evict_gpu(self, k: int, slots: list[int]) -> None:
        """Evict ``k`` GPU blocks (the free list is empty), appending their slots to ``slots``.

        With a host tier, one victim at a time (:meth:`_take_gpu_slot`: it may offload).
        Otherwise the victims come in runs (:meth:`EvictionIndex.take`, which also updates their
        parents) and leave the cache here; the adaptive policy hears of them in one call, and
        their removals go in one event.

        Raises:
            OutOfBlocks: no evictable block is left (``slots`` holds those taken so far).
        """
        adaptive = self._adaptive
        if adaptive is not None and adaptive.life is not None and adaptive.bands:
            self._replace(k)
        if self._host_enabled:
            take_slot = self._take_gpu_slot
            try:
                for _ in range(k):
                    slots.append(take_slot())
            finally:
                self._events.close_removed()
            return
        index = self._index[GPU]
        cached = self.cached
        evictions = self._stats.evictions_by_priority
        append_slot = slots.append
        hashes: list[BlockHash] = []
        append_hash = hashes.append
        victims: list[Block] = []  # for the adaptive policy, in one call (their digests still set)
        runs: list[list[Block]] = []
        try:
            while k:
                run = index.take(k)
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
            if adaptive is not None and victims:
                adaptive.on_evict(victims, self._tick, runs)
            for b in victims:
                b.digest = None  # its expiry entries are stale for good
            self._events.removed(hashes, close=True)

    def _replace(self, k: int) -> None:
        """The adaptive policy's life tables before ``k`` evictions: the frequency band's oldest
        evictable blocks that the tables rate lower than the recency band's oldest
        (:meth:`~inference_node.kv.lifetables.LifeTables.frequency_first`: less likely to be used
        again at their age, or about as likely and older), up to the victims that the junk band (and
        blocks demoted before) do not provide, go to ``DEMOTED_PRIORITY`` (``updated`` for each;
        a duration they had ends), where eviction takes them before the recency band. A client's
        block at 36 is the client's: never demoted."""
        index = self._index[GPU]
        adaptive = self._adaptive
        assert adaptive is not None and adaptive.life is not None
        k -= index.listed_below(RECENCY_PRIORITY)
        if k <= 0:
            return
        r = next(index.front(RECENCY_PRIORITY), None)
        if r is None:  # no recency block: eviction takes the frequency band anyway
            return
        tick = self._tick
        p_recency, p_frequency = adaptive.life.p
        last = NUM_BUCKETS - 1
        # NOTE: LifeTables.frequency_first with age_bucket inlined: this runs before every
        # eviction, and the walk goes on only over the blocks it demotes.
        a_r = tick - r.last_used
        n = a_r.bit_length()
        b = 2 * n - 1 + ((a_r >> (n - 2)) & 1) if n > 1 else a_r
        pr = p_recency[b if b < last else last]
        demote: list[Block] = []
        for f in index.front(FREQUENCY_PRIORITY):
            if f.adaptive_class < 0:
                continue
            a_f = tick - f.last_used
            n = a_f.bit_length()
            b = 2 * n - 1 + ((a_f >> (n - 2)) & 1) if n > 1 else a_f
            pf = p_frequency[b if b < last else last]
            if pf > pr * TIE_ABOVE or (pf >= pr * TIE_BELOW and a_f <= a_r):
                break
            demote.append(f)
            if len(demote) == k:
                break
        if not demote:
            return
        adaptive.life_demotions += len(demote)
        for f in demote:
            if f.duration is not None:
                f.duration = None
                f.expiry_version += 1
            index.rekey(f, DEMOTED_PRIORITY)
            self._events.emit(Updated(block_hash=f.hash, priority=PriorityDiff(old=FREQUENCY_PRIORITY,
                                                                               new=DEMOTED_PRIORITY)))

    def _take_gpu_slot(self) -> int:
        """One GPU slot: a free one, or an evicted block's (offloaded when the host tier takes it)."""
        free = self._free[GPU]
        if free:
            return free.pop()
        b = self._index[GPU].pop()
        if b is None:
            raise OutOfBlocks("every GPU block is in use")
        slot = b.slot
        host_slot = None
        if self._host_enabled and (b.priority >= self.config.secondary_offload_min_priority or b.children > 0):
            try:
                host_slot = self._take_host_slot(allow_fail=b.children == 0)
            except OutOfBlocks:
                self._index[GPU].add(b)  # it stays evictable on the GPU
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
            self._index[GPU].unpark(b.parent)
        offloads = self._stats.offloads_by_priority
        offloads[b.priority] = offloads.get(b.priority, 0) + 1
        self._events.emit(Updated(block_hash=b.hash, cache_level=LevelDiff(old=GPU, new=HOST)))
        self._index[HOST].add(b)

    def _take_host_slot(self, allow_fail: bool) -> int | None:
        free = self._free[HOST]
        if free:
            return free.pop()
        b = self._index[HOST].pop()
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
        if self._adaptive is not None:
            self._adaptive.on_evict((b,), self._tick)
        evictions = self._stats.evictions_by_priority
        evictions[b.priority] = evictions.get(b.priority, 0) + 1
        p = b.parent
        if p is not None:
            p.children -= 1
            if b.level == GPU:
                p.gpu_children -= 1
            self._index[p.level].unpark(p)
        b.digest = None  # its expiry entries are stale for good
        self._events.removed((b.hash,))
