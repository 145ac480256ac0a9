"""The paged KV cache core: block pools, prefix reuse, priority eviction, a host tier, events.

Pure Python, synchronous and deterministic: no torch, no I/O, time from an injected clock. The
model layer owns the tensors; this core owns the *bookkeeping* and tells its caller which slot
holds which block and which copies between tiers to perform (:class:`BlockCopy`).

Semantics (DESIGN.md, "Reference semantics", TensorRT-LLM's, reproduced):

* Blocks hold ``block_size`` tokens; only full blocks are cached and shared, keyed on their
  32-byte chained digest. A request reuses the longest cached prefix of its full blocks.
* Blocks in use (reference count > 0) are never evicted. When the last request using a block
  finishes, the block stays cached and becomes evictable.
* Eviction takes the evictable *leaf* with the lowest priority, least recently used first within a
  priority. On the GPU tier a leaf is a block with no child on the GPU; on the host tier, a block
  with no child at all. So cached prefixes stay contiguous, and every ancestor of a GPU block is
  on the GPU.
* A retention duration starts when a block becomes evictable and restarts on reuse; when it runs
  out the block's priority falls back to 35 (an ``updated`` event says so).
* A request with a retention config re-prioritizes the blocks it reuses; one without leaves them
  alone (unless the adaptive policy is on, which only ever raises them).
* With a host tier, a GPU block chosen for eviction moves to host memory if its priority is at
  least ``secondary_offload_min_priority`` (or if it has children there, which keeps prefixes
  contiguous); otherwise it is removed. Reuse brings host blocks back; host eviction removes.

Every change of the cached set is an event (``created``, ``stored``, ``removed``, ``updated``,
``snapshot``) in the wire schema of :mod:`eventbus.protocol`, queued until a publisher drains
them. The queue is bounded; on overflow the queued events are dropped, counted, and replaced by a
``snapshot`` at the next drain, with no gap in ``event_id``.

Complexity: lookups are dict operations; the eviction order is kept per tier by
:class:`~inference_node.kv.eviction.EvictionIndex` (O(1) for the common operations, O(log n) at
worst); expiries use a binary heap with lazy deletion.
"""

from __future__ import annotations

import heapq
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from eventbus.hashing import block_digest, block_hash
from eventbus.protocol import (
    DEFAULT_PRIORITY,
    EVENT_BLOCKS_CHUNK,
    BlockDigest,
    BlockHash,
    Created,
    Event,
    EventData,
    LevelDiff,
    PriorityDiff,
    Removed,
    Snapshot,
    SnapshotBlock,
    Stored,
    StoredBlock,
    Updated,
)
from inference_node.kv.adaptive import AdaptivePolicy, BlockContext
from inference_node.kv.clock import Clock, monotonic
from inference_node.kv.eviction import IN_LIST, NOT_EVICTABLE, PARKED, PINNED, EvictionIndex
from inference_node.kv.prompt import Prompt
from inference_node.kv.retention import KvCacheRetentionConfig

GPU: Final = 0
HOST: Final = 1

_new_object = object.__new__  # a Block without the call to __init__ (the hot path sets every slot)
_HASH_OF = struct.Struct(">Q").unpack_from  # eventbus.hashing.block_hash, as a 1-tuple


class OutOfBlocks(RuntimeError):
    """Not enough GPU blocks can be freed for a request (every candidate is in use)."""


@dataclass(frozen=True)
class KvCacheConfig:
    """Sizes and policies of one node's KV cache."""

    num_gpu_blocks: int
    num_host_blocks: int = 0
    block_size: int = 32
    secondary_offload_min_priority: int = DEFAULT_PRIORITY
    #: Attention window reported with every event (the model's context length).
    window_size: int = 4096
    #: Events queued before the publisher drains them; beyond this, a snapshot replaces them.
    max_queued_events: int = 100_000
    #: Put the token ids of each block into ``stored`` events.
    emit_token_ids: bool = False
    #: Blocks per ``snapshot`` part (a larger cache is sent in several parts).
    snapshot_part_blocks: int = EVENT_BLOCKS_CHUNK
    #: Assign priorities from observed reuse to requests without a retention config.
    adaptive: AdaptivePolicy | None = None

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks must be at least 1")
        if self.num_host_blocks < 0:
            raise ValueError("num_host_blocks must be >= 0")
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if not 0 <= self.secondary_offload_min_priority <= 101:
            raise ValueError("secondary_offload_min_priority must be within 0..101 (101: never offload)")
        if self.max_queued_events < 1:
            raise ValueError("max_queued_events must be at least 1")
        if self.snapshot_part_blocks < 1:
            raise ValueError("snapshot_part_blocks must be at least 1")


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A copy the model layer must perform, in order, before the next forward pass."""

    kind: Literal["offload", "onboard"]
    src_level: int
    src_slot: int
    dst_level: int
    dst_slot: int


@dataclass(slots=True)
class Allocation:
    """The result of admitting a request."""

    #: GPU slot of each of the prompt's blocks (the partial tail included), in order.
    block_table: list[int]
    #: Prompt tokens whose KV is already in the cache (full blocks matched).
    num_cached_tokens: int
    gpu_hit_blocks: int
    host_hit_blocks: int
    #: Copies to perform before computing the prompt (offloads first, then onboards).
    copies: list[BlockCopy]


@dataclass
class KvStats:
    """Cumulative counters of one cache instance."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    requests_with_hit: int = 0
    evictions_by_priority: dict[int, int] = field(default_factory=dict)
    offloads_by_priority: dict[int, int] = field(default_factory=dict)
    onboards: int = 0
    expirations: int = 0
    reprioritizations: int = 0
    events_emitted: int = 0
    events_overflowed: int = 0
    snapshots: int = 0
    rejected_requests: int = 0


class Block:
    """One cached (or private) block. Identity for the heaps: ``uid`` (a block's parent has a
    smaller one). A cached block holds ``block_size`` tokens.

    NOTE: ``KVCacheManager.allocate`` creates blocks inline (``object.__new__`` and every slot
    set there): a slot added here must be set there too.
    """

    __slots__ = (
        "cand", "children", "digest", "duration", "exp_version", "gpu_children", "hash", "hits",
        "last_used", "level", "lora_id", "parent", "priority", "ref", "released_at", "side_ver",
        "slot", "tag", "uid",
    )

    def __init__(self, uid: int, slot: int, digest: BlockDigest | None = None, hash_: int = 0,
                 parent: Block | None = None, lora_id: int | None = None,
                 priority: int = DEFAULT_PRIORITY, duration: float | None = None) -> None:
        self.uid = uid
        self.slot = slot
        self.level = GPU
        self.digest = digest  # None: private (not cached, not shared)
        self.hash: BlockHash = hash_  # type: ignore[assignment]  # NOTE: no NewType call on the hot path
        self.parent = parent
        self.lora_id = lora_id
        self.priority = priority
        self.duration = duration
        self.ref = 1
        self.last_used = 0
        self.children = 0  # cached children on any tier
        self.gpu_children = 0  # cached children on the GPU
        self.hits = 0
        self.tag = -1  # the adaptive policy's class of the block
        self.released_at = 0.0  # clock time it last became evictable
        self.cand = 0  # where the tier's EvictionIndex holds it (eviction.NOT_EVICTABLE, IN_LIST, …)
        self.side_ver = 0  # validates its entry in an EvictionIndex heap
        self.exp_version = 0  # bumped whenever the expiry timer changes


class _Request:
    __slots__ = ("blocks", "last_full_digest", "num_tokens", "prompt", "request_id", "retention", "token_ids")

    def __init__(self, request_id: str, blocks: list[Block], num_tokens: int, prompt: Prompt,
                 retention: KvCacheRetentionConfig | None, token_ids: list[int] | None,
                 last_full_digest: BlockDigest | None) -> None:
        self.request_id = request_id
        self.blocks = blocks
        self.num_tokens = num_tokens
        self.prompt = prompt
        self.retention = retention
        self.token_ids = token_ids
        self.last_full_digest = last_full_digest


def _gpu_leaf(b: Block) -> bool:
    return b.gpu_children == 0


def _host_leaf(b: Block) -> bool:
    return b.children == 0


class KVCacheManager:
    """One node's KV cache bookkeeping (see the module docstring for the semantics)."""

    def __init__(self, config: KvCacheConfig, clock: Clock = monotonic) -> None:
        self.config = config
        self.clock = clock
        self.block_size = config.block_size
        self._window_size = config.window_size
        self._max_events = config.max_queued_events
        self._host_enabled = config.num_host_blocks > 0
        # NOTE: free lists pop from the end; reversed so that slot 0 is handed out first.
        self._free: list[list[int]] = [
            list(range(config.num_gpu_blocks - 1, -1, -1)),
            list(range(config.num_host_blocks - 1, -1, -1)),
        ]
        self._cached: dict[BlockDigest, Block] = {}
        self._index = [EvictionIndex(_gpu_leaf), EvictionIndex(_host_leaf)]
        self._expiry: list[tuple[float, int, int, Block]] = []
        self._requests: dict[str, _Request] = {}
        self._uid = 0
        self._tick = 0
        self._copies: list[BlockCopy] = []
        self.stats = KvStats()
        self._adaptive = config.adaptive
        if self._adaptive is not None:
            size = config.num_gpu_blocks + config.num_host_blocks
            if self._adaptive.ghost_capacity <= 0:
                self._adaptive.ghost_capacity = 4 * size
            if self._adaptive.shadow_capacity <= 0:
                self._adaptive.shadow_capacity = size
        # Events.
        self._events: deque[Event] = deque()
        self._next_event_id = 0
        self._overflowed = False
        self._snapshot_requested = False
        self._open_removed: list[int] | None = None
        self._emit(Created(num_blocks_per_cache_level=[config.num_gpu_blocks, config.num_host_blocks]))
        self._emit_snapshot()

    # ------------------------------------------------------------------ public: requests

    def allocate(self, request_id: str, prompt: Prompt,
                 retention: KvCacheRetentionConfig | None = None) -> Allocation:
        """Admit a request: reuse its longest cached prefix, allocate blocks for the rest.

        Newly filled prompt blocks are cached (``stored``) at once: the caller computes the
        prompt before admitting another request (see ``inference_node.engine``).

        Raises:
            ValueError: the request id is in use, or the prompt is empty.
            OutOfBlocks: not enough GPU blocks can be freed; nothing of the request remains.
        """
        # NOTE: this is the hot path of the core (``kvflow bench kv``): the common case (GPU
        # hits, new blocks, evictions from the GPU tier) is inlined, with attributes and
        # methods bound to locals; rarer cases go through the helpers below.
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already allocated")
        num_tokens = prompt.num_tokens
        if num_tokens <= 0:
            raise ValueError("a prompt needs at least one token")
        if self._expiry:
            self._expire()
        self._copies = []
        bs = self.block_size
        n_blocks = -(-num_tokens // bs)
        digests = prompt.digests

        # 1. Longest cached prefix (contiguous by construction); pin it at once. A block in a GPU
        #    eviction list stays there, pinned (EvictionIndex.pin, inlined); any other evictable
        #    one leaves the order via discard.
        blocks: list[Block] = []  # the matched blocks first, then the new ones
        onboard: list[Block] = []
        idle: list[Block] = []
        cached_get = self._cached.get
        gpu_index = self._index[GPU]
        n_listed = 0
        for d in digests:
            b = cached_get(d)
            if b is None:
                break
            if not b.ref:
                # The retention clock stops while the block is in use. An evictable block has a
                # live expiry entry only while it has a duration (_start_clock, _expire).
                if b.duration is not None:
                    b.exp_version += 1
                if b.cand == IN_LIST and not b.level:
                    b.cand = PINNED
                    n_listed += 1
                else:
                    idle.append(b)
            b.ref += 1
            b.hits += 1
            blocks.append(b)
            if b.level:
                onboard.append(b)
        gpu_index.count -= n_listed
        if idle:  # in use now: they leave the eviction order
            index = self._index
            for b in idle:
                index[b.level].discard(b)
        n_matched = len(blocks)
        n_onboard = len(onboard)

        # 2. GPU slots for onboarding and for the new blocks (may evict; may fail).
        needed = n_onboard + n_blocks - n_matched
        free = self._free[GPU]
        n_free = len(free)
        if needed <= n_free:
            if needed:
                slots = free[n_free - needed:]
                slots.reverse()
                del free[n_free - needed:]
            else:
                slots = []
        else:
            slots = free[::-1]
            free.clear()
            try:
                self._evict_gpu(needed - n_free, slots)
            except OutOfBlocks:
                free.extend(reversed(slots))
                for b in reversed(blocks):
                    b.hits -= 1
                    self._release(b)
                self.stats.rejected_requests += 1
                self._open_removed = None
                raise OutOfBlocks(
                    f"request {request_id!r} needs {needed} GPU blocks; only {len(slots)} could be freed"
                ) from None

        # 3. Onboard host hits, parents first.
        if onboard:
            for b, gpu_slot in zip(onboard, slots, strict=False):
                self._copies.append(BlockCopy("onboard", HOST, b.slot, GPU, gpu_slot))
                self._free[HOST].append(b.slot)
                b.level, b.slot = GPU, gpu_slot
                if b.parent is not None:
                    b.parent.gpu_children += 1
                self.stats.onboards += 1
                self._emit(Updated(block_hash=b.hash, cache_level=LevelDiff(old=HOST, new=GPU)))
            new_slots = slots[n_onboard:]
        else:
            new_slots = slots

        # 4. Re-prioritize reused blocks.
        adaptive = self._adaptive
        if adaptive is not None or retention is not None:
            now = self.clock() if adaptive is not None else 0.0
            if adaptive is not None:
                adaptive.on_lookup(digests, n_matched, now)
            for i, b in enumerate(blocks):
                if retention is not None:
                    prio, dur = retention.block_retention(i * bs, (i + 1) * bs, num_tokens)
                    self._set_priority(b, prio, dur)
                elif adaptive is not None:
                    raised = adaptive.on_reuse(b.tag, b.priority, b.hits - 1, now - b.released_at)
                    if raised is not None and raised[0] >= b.priority:
                        self._set_priority(b, raised[0], raised[1])
                        b.tag = raised[2]
        if n_matched:
            block_table = [b.slot for b in blocks]
            block_table += new_slots
        else:
            block_table = new_slots.copy()

        # 5. New blocks: full ones are cached (one chained `stored` event), the tail is private.
        #    Each new full block but the last has one child (the next), on the GPU.
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
            hinted = retention is not None or adaptive is not None
            prio, dur, tag = DEFAULT_PRIORITY, None, -1
            cached = self._cached
            new = _new_object
            append_block = blocks.append
            append_stored = stored.append
            hash_of = _HASH_OF
            for i in range(n_matched, end):
                if hinted:
                    lo = i * bs
                    prio, dur, tag = self._new_block_retention(retention, lo, lo + bs, num_tokens, i,
                                                               n_full, n_matched)
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
                nb.tag = tag
                nb.released_at = 0.0
                nb.cand = NOT_EVICTABLE
                nb.side_ver = 0
                nb.exp_version = 0
                cached[d] = nb
                if token_ids is None:
                    append_stored(StoredBlock(h, bs, lora_id, GPU, prio, None))
                else:
                    lo = i * bs
                    append_stored(StoredBlock(h, bs, lora_id, GPU, prio, list(token_ids[lo:lo + bs])))
                append_block(nb)
                parent = nb
            nb.children = nb.gpu_children = 0  # the last one
            data = Stored(blocks[n_matched - 1].hash if n_matched else None, stored)
            q = self._events
            if self._overflowed or len(q) >= self._max_events:
                self._emit(data)
            else:  # _emit, inlined
                q.append(Event(self._next_event_id, self._window_size, data))
                self._next_event_id += 1
                self.stats.events_emitted += 1
        if n_blocks > n_full:
            for i in range(n_full, n_blocks):  # the partial tail: private
                uid += 1
                blocks.append(Block(uid, new_slots[i - n_matched]))
        self._uid = uid

        # 6. Bookkeeping.
        hit_tokens = n_matched * bs
        st = self.stats
        st.requests += 1
        st.prompt_tokens += num_tokens
        st.cached_tokens += hit_tokens
        st.hit_blocks += n_matched
        st.miss_blocks += n_full - n_matched
        if n_matched:
            st.requests_with_hit += 1
        self._requests[request_id] = _Request(
            request_id, blocks, num_tokens, prompt, retention,
            list(prompt.token_ids) if prompt.token_ids is not None else None,
            digests[-1] if digests else None,
        )
        self._open_removed = None
        copies, self._copies = self._copies, []
        return Allocation(block_table, hit_tokens, n_matched - n_onboard, n_onboard, copies)

    def append_token(self, request_id: str, token_id: int) -> tuple[int, list[BlockCopy]]:
        """Extend a running request by one token (its KV is written at the returned slot).

        Returns the GPU slot of the token's block and the copies to perform first (an eviction
        to make room for a new block may offload). When the token fills its block, the block is
        cached (``stored``) with the decode retention, unless the same block is cached already.

        Raises:
            KeyError: unknown request.
            OutOfBlocks: a new block is needed and none can be freed.
        """
        req = self._requests[request_id]
        self._copies = []
        bs = self.block_size
        pos = req.num_tokens
        idx = pos // bs
        if idx == len(req.blocks):
            self._expire()
            req.blocks.append(self._new_block(self._take_gpu_slot()))
        block = req.blocks[idx]
        req.num_tokens += 1
        if req.token_ids is not None:
            req.token_ids.append(token_id)
        if req.num_tokens % bs == 0 and req.token_ids is not None:
            toks = tuple(req.token_ids[idx * bs:(idx + 1) * bs])
            parent_digest = req.last_full_digest
            digest = block_digest(
                parent_digest, toks, lora_id=req.prompt.lora_id,
                cache_salt=req.prompt.cache_salt if parent_digest is None else None,
            )
            req.last_full_digest = digest
            parent = req.blocks[idx - 1] if idx > 0 else None
            # Cache it unless an equal block is cached already, or this request's previous block
            # is not the cached one (a private duplicate): children hang off pinned GPU parents.
            if digest not in self._cached and (parent is None or parent.digest == parent_digest):
                prio, dur, block.tag = self._new_block_retention(
                    req.retention, idx * bs, (idx + 1) * bs, req.prompt.num_tokens, idx, len(req.prompt.digests), 0)
                self._register(block, digest, parent, req.prompt.lora_id, prio, dur)
                self._emit(Stored(parent_hash=parent.hash if parent is not None else None,
                                  blocks=[self._stored_block(block, toks)]))
        self._close_removed()
        copies, self._copies = self._copies, []
        return block.slot, copies

    def free(self, request_id: str) -> None:
        """A request finished: its cached blocks become evictable, its private blocks free.

        Blocks are released tail first, so that within a priority the tail of a sequence is
        evicted before its head.
        """
        req = self._requests.pop(request_id)
        if self._expiry:
            self._expire()
        free = self._free[GPU]
        start = tick = self._tick
        timed = self._adaptive is not None
        # Blocks in use are on the GPU, and each release is the newest: each goes to the back of
        # its priority's list (EvictionIndex.add_released, inlined); a pinned one is there already.
        # A priority's tail (the newest last_used in its list) is set when its run of releases ends.
        index = self._index[GPU]
        lists, tails = index._lists, index._tails
        p = -1
        lst = lists[0]
        for b in reversed(req.blocks):
            if b.digest is None:
                free.append(b.slot)
                continue
            b.ref -= 1
            if not b.ref:
                tick += 1
                b.last_used = tick
                if timed or b.duration is not None:
                    self._start_clock(b)
                if b.priority != p:
                    if p >= 0:
                        tails[p] = tick - 1
                    p = b.priority
                    index._mask |= 1 << p
                    lst = lists[p]
                if b.cand == PINNED:
                    lst.move_to_end(b)
                else:
                    lst[b] = None
                b.cand = IN_LIST
        if p >= 0:
            tails[p] = tick
        self._tick = tick
        index.count += tick - start
        self._open_removed = None

    def tick(self) -> None:
        """Apply retention expiries due by now (allocate/free do this too)."""
        self._expire()
        self._close_removed()

    # ------------------------------------------------------------------ public: queries

    def match_prefix(self, prompt: Prompt) -> tuple[int, int]:
        """How many of the prompt's leading full blocks are cached on (GPU, host); no side effects."""
        if not self._host_enabled:  # every cached block is on the GPU
            cached = self._cached
            gpu = 0
            for d in prompt.digests:
                if d not in cached:
                    break
                gpu += 1
            return gpu, 0
        gpu = host = 0
        get = self._cached.get
        for d in prompt.digests:
            b = get(d)
            if b is None:
                break
            if b.level:
                host += 1
            else:
                gpu += 1
        return gpu, host

    def block_table(self, request_id: str) -> list[int]:
        return [b.slot for b in self._requests[request_id].blocks]

    def num_tokens(self, request_id: str) -> int:
        return self._requests[request_id].num_tokens

    @property
    def active_requests(self) -> int:
        return len(self._requests)

    @property
    def used_blocks(self) -> tuple[int, int]:
        """Occupied slots per tier (cached or private)."""
        return (self.config.num_gpu_blocks - len(self._free[GPU]),
                self.config.num_host_blocks - len(self._free[HOST]))

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def evictable_blocks(self) -> tuple[int, int]:
        """Blocks that eviction could take right now, per tier."""
        return self._index[GPU].count, self._index[HOST].count

    def cached_blocks(self) -> list[SnapshotBlock]:
        """The cache's ground truth, parents before children (as in a ``snapshot``)."""
        # A cached block's parent is cached and older (smaller uid): depths in one pass by uid.
        depth: dict[Block, int] = {}
        for b in sorted(self._cached.values(), key=lambda b: b.uid):
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

    def block_info(self, digest: BlockDigest) -> dict[str, object] | None:
        """Introspection for tests and the node's API."""
        b = self._cached.get(digest)
        if b is None:
            return None
        return {"level": b.level, "slot": b.slot, "priority": b.priority, "duration": b.duration,
                "ref": b.ref, "hits": b.hits, "children": b.children, "gpu_children": b.gpu_children}

    # ------------------------------------------------------------------ public: events

    @property
    def last_event_id(self) -> int:
        """The id of the last event emitted (-1 before any)."""
        return self._next_event_id - 1

    @property
    def pending_events(self) -> int:
        return len(self._events)

    def request_snapshot(self) -> None:
        """Put a snapshot after the queued events (a consumer asked to resync)."""
        self._snapshot_requested = True

    def drain_events(self, max_events: int | None = None) -> list[Event]:
        """Take queued events, oldest first (a snapshot first if the queue overflowed)."""
        if self._overflowed:
            self._overflowed = False
            self._emit_snapshot()
        elif self._snapshot_requested:
            self._snapshot_requested = False
            self._emit_snapshot()
        q = self._events
        if max_events is None or max_events >= len(q):
            out = list(q)
            q.clear()
        else:
            out = [q.popleft() for _ in range(max_events)]
        self._open_removed = None
        return out

    # ------------------------------------------------------------------ internals: blocks

    def _new_block(self, slot: int) -> Block:
        self._uid += 1
        return Block(self._uid, slot)

    def _new_block_retention(self, retention: KvCacheRetentionConfig | None, lo: int, hi: int,
                             prompt_len: int, index: int, prompt_blocks: int,
                             matched: int) -> tuple[int, float | None, int]:
        """Priority, duration and adaptive class of a new block."""
        if retention is not None:
            return (*retention.block_retention(lo, hi, prompt_len), -1)
        if self._adaptive is not None:
            return self._adaptive.new_block(
                BlockContext(index=index, prompt_blocks=prompt_blocks, matched_blocks=matched,
                             is_decode=lo >= prompt_len))
        return DEFAULT_PRIORITY, None, -1

    def _register(self, b: Block, digest: BlockDigest, parent: Block | None, lora_id: int | None,
                  priority: int, duration: float | None) -> None:
        b.digest = digest
        b.hash = block_hash(digest)
        b.parent = parent
        b.lora_id = lora_id
        b.priority = priority
        b.duration = duration
        if parent is not None:  # pinned by the request that stores b: not in an eviction index
            parent.children += 1
            parent.gpu_children += 1
        self._cached[digest] = b

    def _stored_block(self, b: Block, token_ids: Sequence[int]) -> StoredBlock:
        return StoredBlock(block_hash=b.hash, num_tokens=self.block_size, lora_id=b.lora_id,
                           cache_level=b.level, priority=b.priority,
                           token_ids=list(token_ids) if self.config.emit_token_ids else None)

    def _release(self, b: Block) -> None:
        b.ref -= 1
        if b.ref == 0:
            self._tick += 1
            b.last_used = self._tick
            if b.duration is not None or self._adaptive is not None:
                self._start_clock(b)
            self._index[b.level].add(b)

    def _start_clock(self, b: Block) -> None:
        """b became evictable: note when, and start its retention duration if it has one."""
        b.released_at = now = self.clock()
        if b.duration is not None:
            b.exp_version += 1
            heapq.heappush(self._expiry, (now + b.duration, b.uid, b.exp_version, b))

    def _set_priority(self, b: Block, priority: int, duration: float | None) -> None:
        b.duration = duration
        if priority != b.priority:
            old = b.priority
            self._rekey(b, priority)
            self.stats.reprioritizations += 1
            self._emit(Updated(block_hash=b.hash, priority=PriorityDiff(old=old, new=priority)))

    def _rekey(self, b: Block, priority: int) -> None:
        """Change the priority of a block that may be evictable (it moves in its eviction order)."""
        cand = b.cand
        if cand == PINNED:  # in use: it only leaves its list
            self._index[b.level].discard(b)
            b.priority = priority
        elif cand:
            index = self._index[b.level]
            index.discard(b)
            b.priority = priority
            index.add(b)
        else:
            b.priority = priority

    def _unpark_parent(self, p: Block) -> None:
        if p.cand == PARKED and (p.gpu_children == 0 if p.level == GPU else p.children == 0):
            self._index[p.level].unpark(p)

    def _evict_gpu(self, k: int, slots: list[int]) -> None:
        """Evict ``k`` GPU blocks (the free list is empty), appending their slots to ``slots``.

        :meth:`_take_gpu_slot` ``k`` times; without a host tier or an adaptive policy, the common
        case (the victim at the front of its priority's list, removed from the cache) is inlined.

        Raises:
            OutOfBlocks: no evictable block is left (``slots`` holds those taken so far).
        """
        if self._host_enabled or self._adaptive is not None:
            take = self._take_gpu_slot
            for _ in range(k):
                slots.append(take())
            return
        index = self._index[GPU]
        lists, heaps = index._lists, index._heaps
        cached = self._cached
        evictions = self.stats.evictions_by_priority
        append = slots.append
        removed = self._open_removed
        while k:
            mask = index._mask
            p = (mask & -mask).bit_length() - 1
            lst = lists[p] if mask else None
            if lst and not heaps[p]:
                # The fast path: pop the front of priority p's list while it lasts (nothing
                # else enters the index meanwhile, unless a parent is unparked: then re-check).
                n_taken = 0
                while lst:
                    b = lst.popitem(last=False)[0]
                    if b.cand == PINNED:  # in use: it returns to the back when released
                        b.cand = NOT_EVICTABLE
                        continue
                    if b.gpu_children:
                        b.cand = PARKED  # still counted: it is evictable once its children go
                        continue
                    # _remove(b), inlined. (No exp_version bump: with its digest gone, b's
                    # expiry entries are stale for good.)
                    b.cand = NOT_EVICTABLE
                    n_taken += 1
                    del cached[b.digest]  # type: ignore[arg-type]
                    b.digest = None
                    # Consecutive removals within one operation share one `removed` event.
                    if removed is not None and len(removed) < EVENT_BLOCKS_CHUNK:
                        removed.append(b.hash)
                    else:
                        removed = [b.hash]
                        self._emit(Removed(block_hashes=removed))
                    append(b.slot)
                    par = b.parent
                    if par is not None:
                        par.children -= 1
                        par.gpu_children -= 1
                        if par.cand == PARKED:
                            self._unpark_parent(par)
                            break
                    if n_taken == k:
                        break
                if n_taken:
                    k -= n_taken
                    index.count -= n_taken
                    evictions[p] = evictions.get(p, 0) + n_taken
                continue
            popped = index.pop()
            if popped is None:
                self._open_removed = removed
                raise OutOfBlocks("every GPU block is in use")
            b = popped
            # _remove(b), inlined
            prio = b.priority
            del cached[b.digest]  # type: ignore[arg-type]
            evictions[prio] = evictions.get(prio, 0) + 1
            par = b.parent
            if par is not None:
                par.children -= 1
                par.gpu_children -= 1
                if par.cand == PARKED:
                    self._unpark_parent(par)
            b.digest = None
            b.exp_version += 1
            if removed is not None and len(removed) < EVENT_BLOCKS_CHUNK:
                removed.append(b.hash)
            else:
                removed = [b.hash]
                self._emit(Removed(block_hashes=removed))
            append(b.slot)
            k -= 1
        self._open_removed = removed

    def _take_gpu_slot(self) -> int:
        free = self._free[GPU]
        if free:
            return free.pop()
        b = self._index[GPU].pop()
        if b is None:
            raise OutOfBlocks("every GPU block is in use")
        slot = b.slot
        offload = self._host_enabled and (
            b.priority >= self.config.secondary_offload_min_priority or b.children > 0
        )
        host_slot = None
        if offload:
            try:
                host_slot = self._take_host_slot(allow_fail=b.children == 0)
            except OutOfBlocks:
                self._index[GPU].add(b)  # it stays evictable on the GPU
                raise
            offload = host_slot is not None
        if offload:
            assert host_slot is not None
            self._copies.append(BlockCopy("offload", GPU, slot, HOST, host_slot))
            b.level, b.slot = HOST, host_slot
            if b.parent is not None:
                b.parent.gpu_children -= 1
                self._unpark_parent(b.parent)
            self.stats.offloads_by_priority[b.priority] = self.stats.offloads_by_priority.get(b.priority, 0) + 1
            self._emit(Updated(block_hash=b.hash, cache_level=LevelDiff(old=GPU, new=HOST)))
            self._index[HOST].add(b)
        else:
            self._remove(b)
        return slot

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
        assert b.children == 0 and b.ref == 0 and b.digest is not None
        del self._cached[b.digest]
        if self._adaptive is not None:
            now = self.clock()
            self._adaptive.on_evict(b.digest, b.tag, now - b.released_at, now)
        stats = self.stats.evictions_by_priority
        stats[b.priority] = stats.get(b.priority, 0) + 1
        p = b.parent
        if p is not None:
            p.children -= 1
            if b.level == GPU:
                p.gpu_children -= 1
            self._unpark_parent(p)
        b.digest = None
        b.exp_version += 1
        # Consecutive removals within one operation share one `removed` event: `_emit` closes
        # the open list whenever another event comes in between.
        if self._open_removed is not None and len(self._open_removed) < EVENT_BLOCKS_CHUNK:
            self._open_removed.append(b.hash)
        else:
            hashes: list[int] = [b.hash]
            self._emit(Removed(block_hashes=hashes))
            self._open_removed = hashes

    def _expire(self) -> None:
        heap = self._expiry
        if not heap:
            return
        now = self.clock()
        while heap and heap[0][0] <= now:
            _, _, exp_version, b = heapq.heappop(heap)
            if exp_version != b.exp_version or b.digest is None:
                continue
            b.duration = None
            self.stats.expirations += 1
            if b.priority != DEFAULT_PRIORITY:
                old = b.priority
                self._rekey(b, DEFAULT_PRIORITY)
                self._emit(Updated(block_hash=b.hash, priority=PriorityDiff(old=old, new=DEFAULT_PRIORITY)))

    # ------------------------------------------------------------------ internals: events

    def _emit(self, data: EventData, *, always: bool = False) -> None:
        self._open_removed = None
        if self._overflowed:
            self.stats.events_overflowed += 1
            return
        q = self._events
        if len(q) >= self._max_events and not always:
            # Overflow: drop what is queued (never delivered, so its ids are reused) and owe the
            # consumer a snapshot at the next drain.
            self.stats.events_overflowed += len(q) + 1
            self._next_event_id = q[0].event_id
            q.clear()
            self._overflowed = True
            return
        q.append(Event(self._next_event_id, self._window_size, data))
        self._next_event_id += 1
        self.stats.events_emitted += 1

    def _emit_snapshot(self) -> None:
        """The whole cache, in parts of at most ``EVENT_BLOCKS_CHUNK`` blocks (one part when it fits).

        The parts are queued even past ``max_queued_events``: they replace what overflowed, and
        refusing them would only owe the consumer another snapshot."""
        self.stats.snapshots += 1
        blocks = self.cached_blocks()
        step = self.config.snapshot_part_blocks
        parts = max(1, -(-len(blocks) // step))
        for part in range(parts):
            self._emit(Snapshot(blocks=blocks[part * step:(part + 1) * step], part=part, parts=parts), always=True)

    def _close_removed(self) -> None:
        self._open_removed = None
