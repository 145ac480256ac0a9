"""The block record of the KV core, the two tiers, and where a block stands in eviction.

A :class:`Block` is one physical slot's worth of KV (``block_size`` tokens) as the core's
bookkeeping sees it. A *cached* block has a digest and can be shared by any request whose prompt
starts with the same blocks; a *private* block (``digest is None``) belongs to one request (the
partial tail of a prompt, or a decode block that duplicates a cached one).

Cached blocks form a forest by ``parent`` (the previous block of the same prefix). Every ancestor
of a GPU block is on the GPU, so a prefix is contiguous from the root: the core keeps
``children`` (cached children on any tier) and ``gpu_children`` (those on the GPU) per block, and
eviction takes only *leaves* of a tier (:mod:`inference_node.kv.eviction`).

Which module writes which slots:

=========================================  ======================================================
``uid``, ``slot``, ``level``, ``digest``,  the pool (``inference_node.kv.pool``), when it
``hash``, ``parent``, ``lora_id``,         creates, caches, moves, takes into use,
``priority``, ``duration``, ``ref`` (up),  re-prioritizes or removes a block
``children``, ``gpu_children``, ``hits``,
``expiry_version``
``adaptive_class``                         the pool and the manager, with what the adaptive
                                           policy decides
``evict_state``, ``heap_version``,         the tier's :class:`~inference_node.kv.eviction.EvictionIndex`
``ref`` (down), ``last_used``              (``release``: whether and where a block is evictable);
                                           the pool starts a new block at ``NOT_EVICTABLE``
``children``, ``gpu_children`` (down)      also ``EvictionIndex.take``, for the parents of the
                                           victims it hands out (so a parent can be the next one)
=========================================  ======================================================
"""

from __future__ import annotations

from typing import Final

from eventbus.protocol import DEFAULT_PRIORITY, GPU, HOST, BlockDigest, BlockHash

__all__ = ["GPU", "HOST", "IN_HEAP", "IN_LIST", "NOT_EVICTABLE", "PARKED", "Block"]

# Where a block stands in its tier's eviction order (``Block.evict_state``).
#: In use, or not cached: not in any eviction order.
NOT_EVICTABLE: Final = 0
#: In its priority's list in release order: evictable (the common case), or *pinned* when in
#: use (``ref > 0``): eviction skips it, its release moves it to the back.
IN_LIST: Final = 1
#: Evictable, in its priority's side heap (it re-entered the order at an older position).
IN_HEAP: Final = 2
#: Evictable but not a leaf of its tier yet: it waits, counted, until its last child there goes.
PARKED: Final = 3


class Block:
    """One cached (or private) block; see the module docstring for who writes what.

    NOTE: ``BlockPool.store_prompt`` creates blocks inline (``object.__new__`` and every slot set
    there, without a call to ``__init__`` per block: one of the inlinings that brought
    ``kvflow bench kv``'s ``cost_vs_lru`` under 2, docs/benchmarks.md#cost-of-the-core): a slot added here must be
    set there too.
    """

    __slots__ = (
        "adaptive_class", "children", "digest", "duration", "evict_state", "expiry_version", "gpu_children",
        "hash", "heap_version", "hits", "last_used", "level", "lora_id", "parent", "priority", "ref",
        "slot", "uid",
    )

    def __init__(self, uid: int, slot: int, digest: BlockDigest | None = None, hash_: int = 0,
                 parent: Block | None = None, lora_id: int | None = None,
                 priority: int = DEFAULT_PRIORITY, duration: float | None = None) -> None:
        #: Creation order: a block's parent has a smaller one (a tie-break in the heaps).
        self.uid = uid
        #: Its slot in the pool of its tier.
        self.slot = slot
        #: ``GPU`` or ``HOST``.
        self.level = GPU
        #: The 32-byte chained digest, the key of reuse; None: private (not cached, not shared).
        self.digest = digest
        #: The digest's first 8 bytes as the wire's unsigned 64-bit ``block_hash``.
        self.hash: BlockHash = hash_  # type: ignore[assignment]  # NOTE: no NewType call on the hot path
        self.parent = parent
        self.lora_id = lora_id
        self.priority = priority
        #: Retention duration in seconds from when it becomes evictable; None: never expires.
        self.duration = duration
        #: Running requests that use it (> 0: never evicted).
        self.ref = 1
        #: The core's tick when it last became evictable (recency within a priority).
        self.last_used = 0
        #: Cached children on any tier, and those on the GPU (the leaf rule of each tier).
        self.children = 0
        self.gpu_children = 0
        #: Times a request reused it.
        self.hits = 0
        #: The adaptive policy's class of the block (-1: none).
        self.adaptive_class = -1
        #: Where its tier's EvictionIndex holds it (``NOT_EVICTABLE``, ``IN_LIST``, …).
        self.evict_state = NOT_EVICTABLE
        #: Validates its entry in an EvictionIndex side heap (lazy deletion).
        self.heap_version = 0
        #: Validates its entry in the manager's expiry heap (bumped whenever its timer changes).
        self.expiry_version = 0
