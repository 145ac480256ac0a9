"""The paged KV cache core: block pools, prefix reuse, priority eviction, a host tier, events.

Pure Python, synchronous and deterministic: no torch, no I/O, time from an injected clock. The
model layer owns the tensors; this core owns the *bookkeeping* and tells its caller which slot
holds which block and which copies between tiers to perform (:class:`BlockCopy`).

Semantics (docs/architecture.md#retention-and-eviction: TensorRT-LLM's, reproduced):

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
``snapshot``) in the wire schema of :mod:`eventbus.protocol`, queued in an
:class:`~eventbus.events.EventLog` until a publisher drains them. The queue is bounded;
on overflow the queued events are dropped, counted, and replaced by a ``snapshot`` at the next
drain, with no gap in ``event_id``.

The manager decides what happens to requests (which blocks a prompt needs, which retention they
take: a client's :mod:`~inference_node.kv.retention` config, else the policy's) and has the
:class:`~inference_node.kv.pool.BlockPool` do it to blocks. The pool is mechanical and reports
every change to the :class:`~eventbus.events.EventLog`; what decides — each tier's eviction order
(an :class:`~inference_node.kv.eviction.EvictionIndex`), the retention clocks, the priorities of
requests without hints — is the cache's :class:`~inference_node.kv.policy.EvictionPolicy`:
:class:`~inference_node.kv.policy.PriorityRetention` (TensorRT-LLM's), or
:class:`~inference_node.kv.adaptive_eviction.AdaptiveEviction` when ``KvCacheConfig.adaptive`` is
set. The block record and its states are :mod:`~inference_node.kv.block`; the public value types
live in :mod:`~inference_node.kv.types` and are re-exported here.

Complexity: lookups are dict operations; the eviction order is kept per tier by
:class:`~inference_node.kv.eviction.EvictionIndex` (O(1) for the common operations, O(log n) at
worst); expiries use a binary heap with lazy deletion.
"""

from __future__ import annotations

from eventbus.events import EventLog
from eventbus.hashing import block_digest
from eventbus.protocol import BlockDigest, Created, Event, SnapshotBlock
from inference_node.kv.adaptive import AdaptiveLearner
from inference_node.kv.adaptive_eviction import AdaptiveEviction
from inference_node.kv.block import GPU, HOST, Block
from inference_node.kv.clock import Clock, monotonic
from inference_node.kv.policy import EvictionPolicy, PriorityRetention, Retention, Retentions
from inference_node.kv.pool import BlockPool
from inference_node.kv.prompt import Prompt
from inference_node.kv.retention import KvCacheRetentionConfig
from inference_node.kv.types import Allocation, BlockCopy, KvCacheConfig, KvStats, OutOfBlocks

__all__ = ["GPU", "HOST", "Allocation", "BlockCopy", "KVCacheManager", "KvCacheConfig", "KvStats", "OutOfBlocks",
           "policy_for"]


def policy_for(config: KvCacheConfig) -> EvictionPolicy:
    """The eviction policy a configuration asks for: the adaptive policy when
    ``config.adaptive`` holds its settings, else TensorRT-LLM's priority + retention."""
    if config.adaptive is not None:
        return AdaptiveEviction(config.adaptive, config.num_gpu_blocks + config.num_host_blocks,
                                tiered=config.num_host_blocks > 0)
    return PriorityRetention()


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


class KVCacheManager:
    """One node's KV cache bookkeeping (see the module docstring for the semantics)."""

    def __init__(self, config: KvCacheConfig, clock: Clock = monotonic, policy: EvictionPolicy | None = None) -> None:
        """``policy``: the cache's eviction policy (a new one per cache; default
        :func:`policy_for` the configuration)."""
        self.config = config
        self.clock = clock
        self.block_size = config.block_size
        self._requests: dict[str, _Request] = {}
        self.stats = KvStats()
        self._policy = policy_for(config) if policy is None else policy
        self._events = EventLog(window_size=config.window_size, max_queued=config.max_queued_events,
                                snapshot_part_blocks=config.snapshot_part_blocks, stats=self.stats)
        self._pool = BlockPool(config, clock, self.stats, self._events, self._policy)
        self._events.emit(Created(num_blocks_per_cache_level=[config.num_gpu_blocks, config.num_host_blocks]))
        self._events.snapshot(self._pool.cached_blocks())

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
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already allocated")
        num_tokens = prompt.num_tokens
        if num_tokens <= 0:
            raise ValueError("a prompt needs at least one token")
        pool = self._pool
        policy = self._policy
        if policy.expiries:
            policy.expire()
        pool.copies = []
        n_blocks = -(-num_tokens // self.block_size)
        digests = prompt.digests

        try:
            blocks, onboard, slots = pool.admit(digests, n_blocks)
        except OutOfBlocks as exc:
            self.stats.rejected_requests += 1
            raise OutOfBlocks(f"request {request_id!r} {exc}") from None
        n_matched = len(blocks)
        n_onboard = len(onboard)
        new_slots = pool.onboard(onboard, slots) if onboard else slots
        # slots in use that hold no cached block, beyond this request's own new ones
        policy.held(sum(pool.used_blocks) - len(pool.cached) - (n_blocks - n_matched))
        policy.lookup(digests, blocks)
        if retention is not None:
            self._reprioritize(blocks, retention, num_tokens)
            retentions: Retentions | None = self._retentions(prompt, retention, n_matched, n_blocks)
        else:
            policy.reused(blocks)
            retentions = policy.prompt_retention(len(digests), n_matched, min(len(digests), n_blocks))
        if n_matched:
            block_table = [b.slot for b in blocks]
            block_table += new_slots
        else:
            block_table = new_slots.copy()
        pool.store_prompt(prompt, blocks, new_slots, n_blocks, retentions)

        hit_tokens = n_matched * self.block_size
        st = self.stats
        st.requests += 1
        st.prompt_tokens += num_tokens
        st.cached_tokens += hit_tokens
        st.hit_blocks += n_matched
        st.miss_blocks += len(digests) - n_matched
        if n_matched:
            st.requests_with_hit += 1
        self._requests[request_id] = _Request(
            request_id, blocks, num_tokens, prompt, retention,
            list(prompt.token_ids) if prompt.token_ids is not None else None,
            digests[-1] if digests else None,
        )
        copies, pool.copies = pool.copies, []
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
        pool = self._pool
        pool.copies = []
        bs = self.block_size
        idx = req.num_tokens // bs
        if idx == len(req.blocks):
            req.blocks.append(pool.new_private_block())
        block = req.blocks[idx]
        req.num_tokens += 1
        if req.token_ids is not None:
            req.token_ids.append(token_id)
        if req.num_tokens % bs == 0 and req.token_ids is not None:
            toks = req.token_ids[idx * bs:(idx + 1) * bs]
            parent_digest = req.last_full_digest
            digest = block_digest(
                parent_digest, toks, lora_id=req.prompt.lora_id,
                cache_salt=req.prompt.cache_salt if parent_digest is None else None,
            )
            req.last_full_digest = digest
            parent = req.blocks[idx - 1] if idx > 0 else None
            # Cache it unless an equal block is cached already, or this request's previous block
            # is not the cached one (a private duplicate): children hang off pinned GPU parents.
            if digest not in pool.cached and (parent is None or parent.digest == parent_digest):
                prio, dur, block.adaptive_class = self._new_block_retention(
                    req.retention, idx * bs, req.prompt.num_tokens, idx, len(req.prompt.digests), 0)
                pool.cache_block(block, digest, parent, req.prompt.lora_id, prio, dur,
                                 toks if self.config.emit_token_ids else None)
                self._policy.generated(digest)
        copies, pool.copies = pool.copies, []
        return block.slot, copies

    def free(self, request_id: str) -> None:
        """A request finished: its cached blocks become evictable, its private blocks free.

        Blocks are released tail first, so that within a priority the tail of a sequence is
        evicted before its head.
        """
        req = self._requests.pop(request_id)
        if self._policy.expiries:
            self._policy.expire()
        self._pool.release_request(req.blocks)

    def tick(self) -> None:
        """Apply retention expiries due by now (allocate/free do this too)."""
        self._policy.expire()

    # ------------------------------------------------------------------ public: queries

    def match_prefix(self, prompt: Prompt) -> tuple[int, int]:
        """How many of the prompt's leading full blocks are cached on (GPU, host); no side effects."""
        cached = self._pool.cached
        if not self.config.num_host_blocks:  # every cached block is on the GPU
            gpu = 0
            for d in prompt.digests:
                if d not in cached:
                    break
                gpu += 1
            return gpu, 0
        gpu = host = 0
        get = cached.get
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
        return self._pool.used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._pool.cached)

    @property
    def evictable_blocks(self) -> tuple[int, int]:
        """Blocks that eviction could take right now, per tier."""
        return self._pool.evictable_blocks

    @property
    def policy(self) -> EvictionPolicy:
        """The cache's eviction policy."""
        return self._policy

    @property
    def adaptive(self) -> AdaptiveLearner | None:
        """What the adaptive policy has learned (None without one)."""
        learner = self._policy.learner
        return learner if isinstance(learner, AdaptiveLearner) else None

    def cached_blocks(self) -> list[SnapshotBlock]:
        """The cache's ground truth, parents before children (as in a ``snapshot``)."""
        return self._pool.cached_blocks()

    def block_info(self, digest: BlockDigest) -> dict[str, object] | None:
        """Introspection for tests and the node's API."""
        b = self._pool.cached.get(digest)
        if b is None:
            return None
        return {"level": b.level, "slot": b.slot, "priority": b.priority, "duration": b.duration,
                "ref": b.ref, "hits": b.hits, "children": b.children, "gpu_children": b.gpu_children}

    # ------------------------------------------------------------------ public: events

    @property
    def last_event_id(self) -> int:
        """The id of the last event emitted (-1 before any)."""
        return self._events.last_event_id

    @property
    def pending_events(self) -> int:
        return self._events.pending

    def request_snapshot(self) -> None:
        """Put a snapshot after the queued events (a consumer asked to resync)."""
        self._events.snapshot_requested = True

    def drain_events(self, max_events: int | None = None) -> list[Event]:
        """Take queued events, oldest first (a snapshot first if the queue overflowed)."""
        if self._events.snapshot_due:
            self._events.snapshot(self._pool.cached_blocks())
        return self._events.drain(max_events)

    # ------------------------------------------------------------------ retention decisions

    def _reprioritize(self, blocks: list[Block], retention: KvCacheRetentionConfig, num_tokens: int) -> None:
        """The reused ``blocks`` take the request's retention config: the client's now (the
        policy neither learns from nor revokes them)."""
        bs = self.block_size
        set_priority = self._policy.set_priority
        for i, b in enumerate(blocks):
            prio, dur = retention.block_retention(i * bs, (i + 1) * bs, num_tokens)
            set_priority(b, prio, dur)
            b.adaptive_class = -1

    def _retentions(self, prompt: Prompt, retention: KvCacheRetentionConfig, matched: int,
                    n_blocks: int) -> Retentions:
        """The retention of a prompt's new full blocks (from the first unmatched one)."""
        end = min(len(prompt.digests), n_blocks)
        n, bs = prompt.num_tokens, self.block_size
        return [(*retention.block_retention(i * bs, (i + 1) * bs, n), -1) for i in range(matched, end)]

    def _new_block_retention(self, retention: KvCacheRetentionConfig | None, lo: int, prompt_len: int,
                             index: int, prompt_blocks: int, matched: int) -> Retention:
        """Priority, duration and adaptive class of a new block holding tokens from ``lo``."""
        if retention is not None:
            return (*retention.block_retention(lo, lo + self.block_size, prompt_len), -1)
        return self._policy.new_block(index, prompt_blocks, matched, lo >= prompt_len)
