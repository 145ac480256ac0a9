"""An engine's KV events as one kvflow node instance's (pure: no sockets, no Kafka).

**Identity.** kvflow never trusts an engine's block hash as its own: each stored block's kvflow
digest is computed from its token ids (``eventbus.hashing``), chained from its parent's kvflow
digest, with the LoRA id and, on a first block, the cache salt where the event carries them — so
a prompt the router hashes matches the engine's blocks exactly, whatever hash the engine uses.
The translator keeps the map engine hash → kvflow digest for the blocks the engine holds, to
translate removals and parents.

**Never guessed.** A store whose parent the translator does not know (stored before the bridge
attached, or lost) or whose tokens do not split into its blocks is skipped and counted, and the
view becomes *partial*: kvflow then holds a subset of what the engine holds — every block it
credits is on the engine — but not all of it. Removals of unknown blocks are counted and ignored.
Several engine hashes may map to one digest (an engine salt kvflow cannot see): the block is
stored in kvflow once and removed when the last of them goes.

**Tiers.** A medium other than GPU (vLLM's ``CPU``, SGLang's ``CPU_PINNED``/``DISK``) is kvflow's
level 1; a block held on both is on level 0, and moves (``updated``) when one copy goes.

The translator is the event source of a :class:`~eventbus.publisher.Publisher`
(``drain_events``, ``request_snapshot``) through the KV core's own :class:`EventLog` (ids from 0,
overflow → snapshot). One translator is one kvflow instance: an engine restart, an
``AllBlocksCleared`` or a gap that replay cannot fill starts a new one (``bridge.service``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from bridge.wire import EngineKey
from eventbus.events import EventLog, EventLogStats
from eventbus.hashing import block_hash, chain_digests
from eventbus.protocol import (
    DEFAULT_PRIORITY,
    EVENT_BLOCKS_CHUNK,
    GPU,
    HOST,
    BlockDigest,
    BlockHash,
    Created,
    Event,
    LevelDiff,
    PriorityDiff,
    SnapshotBlock,
    Stored,
    StoredBlock,
    Updated,
)


def level_of(medium: str | None) -> int:
    """kvflow's level of an engine medium: GPU (or none given) is 0, anything else 1."""
    return GPU if medium is None or medium.upper() in ("GPU", "CUDA", "HBM") else HOST


@dataclass
class BridgeStats:
    """What a translator saw (cumulative over the bridge's instances: ``bridge.service`` sums them)."""

    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    duplicate_blocks: int = 0
    unknown_parent_blocks: int = 0
    untranslatable_blocks: int = 0
    unknown_removed_blocks: int = 0
    conflicting_blocks: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Held:
    wire: BlockHash
    parent: BlockDigest | None
    num_tokens: int
    lora_id: int | None
    priority: int
    #: engine copies per level: [gpu, host]
    refs: list[int]

    @property
    def level(self) -> int:
        return GPU if self.refs[GPU] else HOST


class Translator:
    """One kvflow node instance fed by an engine's events (see the module docstring)."""

    def __init__(self, *, num_blocks: Sequence[int], window_size: int = 0, max_keys: int = 1 << 22,
                 max_queued_events: int = 100_000, stats: BridgeStats | None = None, partial: bool = False) -> None:
        self.stats = stats if stats is not None else BridgeStats()
        self.event_stats = EventLogStats()
        self.log = EventLog(window_size=window_size, max_queued=max_queued_events,
                            snapshot_part_blocks=EVENT_BLOCKS_CHUNK, stats=self.event_stats)
        self.max_keys = max_keys
        #: kvflow holds a subset of the engine's blocks (attached late, or something was skipped)
        self.partial = partial
        #: set when the view is wrong, not just partial: the caller must start a new instance
        self.reset_reason: str | None = None
        self._keys: dict[EngineKey, BlockDigest] = {}
        #: engine copies per (engine hash, level): vLLM may hold one hash twice (a recomputed last
        #: block) and removes each copy with its own event
        self._present: dict[tuple[EngineKey, int], int] = {}
        self._held: dict[BlockDigest, _Held] = {}
        self._on = [0, 0]  # held blocks per level
        self.log.emit(Created(num_blocks_per_cache_level=list(num_blocks)))

    # ------------------------------------------------------------------ the event source

    @property
    def last_event_id(self) -> int:
        return self.log.last_event_id

    @property
    def pending_events(self) -> int:
        return self.log.pending

    @property
    def num_blocks(self) -> int:
        """Blocks kvflow holds for the engine."""
        return len(self._held)

    def blocks_on(self, level: int) -> int:
        """Blocks kvflow holds on ``level`` (kept as they change: the heartbeat reads it often)."""
        return self._on[level]

    def request_snapshot(self) -> None:
        self.log.snapshot_requested = True

    def drain_events(self, max_events: int | None = None) -> list[Event]:
        if self.log.snapshot_due:
            self.log.snapshot(self.cached_blocks())
        return self.log.drain(max_events)

    def cached_blocks(self) -> list[SnapshotBlock]:
        """What kvflow holds, parents before children (as in a ``snapshot``)."""
        out: list[SnapshotBlock] = []
        done: set[BlockDigest] = set()
        for digest in self._held:
            chain = []
            d: BlockDigest | None = digest
            while d is not None and d not in done and d in self._held:
                chain.append(d)
                d = self._held[d].parent
            for c in reversed(chain):
                done.add(c)
                h = self._held[c]
                parent = self._held.get(h.parent) if h.parent is not None else None
                out.append(SnapshotBlock(block_hash=h.wire, parent_hash=parent.wire if parent else None,
                                         num_tokens=h.num_tokens, lora_id=h.lora_id, cache_level=h.level,
                                         priority=h.priority))
        return out

    # ------------------------------------------------------------------ engine events

    def stored(self, keys: Sequence[EngineKey], parent: EngineKey | None, token_ids: Sequence[int],
               block_size: int, *, lora_id: int | None = None, cache_salt: str | None = None, level: int = GPU,
               priorities: Sequence[int] | None = None) -> None:
        """Blocks the engine cached: a chain under ``parent`` (None: from the sequence's start),
        block ``i`` with engine hash ``keys[i]`` and the ``i``-th ``block_size`` tokens of
        ``token_ids`` (the event's concatenation)."""
        n = len(keys)
        parent_digest: BlockDigest | None = None
        if parent is not None:
            parent_digest = self._keys.get(parent)
            if parent_digest is None:
                self._skip("unknown_parent_blocks", n)
                return
        size = block_size
        if not n or size <= 0 or len(token_ids) != n * size:  # a partial block, or a hybrid model's
            self._skip("untranslatable_blocks", n)
            return
        digests = chain_digests(token_ids, size, lora_id=lora_id, cache_salt=cache_salt, parent=parent_digest)
        run: list[StoredBlock] = []
        run_parent = self._held[parent_digest].wire if parent_digest is not None else None
        for i, (key, digest) in enumerate(zip(keys, digests, strict=True)):
            known = self._keys.get(key)
            if known is not None and known != digest:  # the engine reuses a hash for other tokens
                self._skip("conflicting_blocks", n - i)  # keep the first; what chains on it is not guessed
                break
            prio = priorities[i] if priorities is not None else DEFAULT_PRIORITY
            new = self._add(key, digest, parent_digest, size, lora_id, level, prio)
            if new is not None:
                run.append(new)
            else:  # already in kvflow: a new run of stores starts under it
                self._flush_run(run_parent, run)
                run = []
                run_parent = self._held[digest].wire
            parent_digest = digest
        self._flush_run(run_parent, run)
        if len(self._keys) > self.max_keys:
            self.reset_reason = f"{len(self._keys)} engine blocks held, more than the bound of {self.max_keys}"

    def _flush_run(self, parent: BlockHash | None, run: list[StoredBlock]) -> None:
        if run:
            self.log.emit(Stored(parent_hash=parent, blocks=run))

    def _add(self, key: EngineKey, digest: BlockDigest, parent: BlockDigest | None, size: int,
             lora_id: int | None, level: int, priority: int) -> StoredBlock | None:
        """Record one engine block; the block to store in kvflow when it is new there."""
        copies = self._present.get((key, level), 0)
        self._present[(key, level)] = copies + 1
        if copies:
            self.stats.duplicate_blocks += 1  # another copy of a block kvflow holds: counted, not stored
            return None
        self._keys[key] = digest
        held = self._held.get(digest)
        if held is not None:
            before = held.level
            held.refs[level] += 1
            self._moved(held, before)
            return None
        refs = [0, 0]
        refs[level] = 1
        wire = block_hash(digest)
        self._held[digest] = _Held(wire, parent, size, lora_id, priority, refs)
        self._on[level] += 1
        self.stats.stored_blocks += 1
        return StoredBlock(block_hash=wire, num_tokens=size, lora_id=lora_id, cache_level=level, priority=priority)

    def removed(self, keys: Sequence[EngineKey], level: int | None = GPU) -> None:
        """Blocks the engine dropped from ``level`` (None: from the level it holds them on; from
        GPU first when on both)."""
        gone: list[BlockHash] = []
        for key in keys:
            lv = level
            if lv is None:
                lv = GPU if (key, GPU) in self._present else HOST
            copies = self._present.get((key, lv), 0)
            if not copies:
                self.stats.unknown_removed_blocks += 1
                continue
            level_ = lv
            if copies > 1:  # another copy of it stays on that level
                self._present[(key, level_)] = copies - 1
                continue
            del self._present[(key, level_)]
            digest = self._keys[key]
            if (key, GPU) not in self._present and (key, HOST) not in self._present:
                del self._keys[key]
            held = self._held[digest]
            before = held.level
            held.refs[level_] -= 1
            if not any(held.refs):
                del self._held[digest]
                self._on[before] -= 1
                gone.append(held.wire)
                self.stats.removed_blocks += 1
            else:
                self._moved(held, before)
        if gone:
            self.log.removed(gone, close=True)

    def updated(self, key: EngineKey, *, level: int | None = None, priority: int | None = None) -> None:
        """A block moved to ``level`` and/or took ``priority`` (TensorRT-LLM's ``updated``)."""
        digest = self._keys.get(key)
        if digest is None:
            self.stats.unknown_removed_blocks += 1
            return
        held = self._held[digest]
        level_diff = prio_diff = None
        if level is not None and level != held.level:
            old = held.level
            self._present[(key, level)] = self._present.pop((key, old), 1)
            held.refs[old] -= 1
            held.refs[level] += 1
            if held.level != old:
                level_diff = LevelDiff(old=old, new=held.level)
                self._on[old] -= 1
                self._on[held.level] += 1
        if priority is not None and priority != held.priority:
            prio_diff = PriorityDiff(old=held.priority, new=priority)
            held.priority = priority
        if level_diff is not None or prio_diff is not None:
            self.log.emit(Updated(block_hash=held.wire, cache_level=level_diff, priority=prio_diff))

    def _moved(self, held: _Held, before: int) -> None:
        """``held`` was on ``before``: if its level changed, count it and say so (``updated``)."""
        if held.level != before:
            self._on[before] -= 1
            self._on[held.level] += 1
            self.log.emit(Updated(block_hash=held.wire, cache_level=LevelDiff(old=before, new=held.level)))

    def _skip(self, counter: str, n: int) -> None:
        setattr(self.stats, counter, getattr(self.stats, counter) + n)
        self.partial = True
