"""The meaning of the event stream, as code: fold a node's events into its cache state.

This is the reference that every consumer must agree with (the materializer does the same in
SQL; tests compare both with the node's own ground truth). It is strict: an event that does not
fit the state it applies to (a store of a cached block, a removal of an unknown one, a gap in
``event_id``) raises :class:`ReplayError`, because for a correct producer that cannot happen.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from eventbus.protocol import (
    Created,
    Event,
    Removed,
    Snapshot,
    SnapshotBlock,
    Stored,
    Updated,
)


class ReplayError(ValueError):
    """The stream contradicts itself."""


@dataclass(frozen=True, slots=True)
class BlockState:
    parent_hash: int | None
    num_tokens: int
    lora_id: int | None
    cache_level: int
    priority: int


@dataclass
class NodeState:
    """One node instance's cache as the events describe it."""

    last_event_id: int = -1
    capacity: tuple[int, ...] = ()
    blocks: dict[int, BlockState] = field(default_factory=dict)

    def apply_all(self, events: Iterable[Event]) -> NodeState:
        for ev in events:
            self.apply(ev)
        return self

    def apply(self, ev: Event) -> None:
        d = ev.data
        heals = isinstance(d, Snapshot) and d.part == 0  # the first part of a snapshot: the whole state anew
        if ev.event_id != self.last_event_id + 1 and not heals:
            raise ReplayError(f"event {ev.event_id} after {self.last_event_id}: events were missed")
        if isinstance(d, Created):
            self.blocks.clear()
            self.capacity = tuple(d.num_blocks_per_cache_level)
        elif isinstance(d, Snapshot):
            if heals:
                self.blocks = {}
            for sb in d.blocks:
                if sb.block_hash in self.blocks:
                    raise ReplayError(f"event {ev.event_id}: block {sb.block_hash} twice in one snapshot")
                self.blocks[sb.block_hash] = BlockState(sb.parent_hash, sb.num_tokens, sb.lora_id, sb.cache_level,
                                                        sb.priority)
        elif isinstance(d, Stored):
            parent = d.parent_hash
            for b in d.blocks:
                if b.block_hash in self.blocks:
                    raise ReplayError(f"event {ev.event_id}: block {b.block_hash} stored twice")
                if parent is not None and parent not in self.blocks:
                    raise ReplayError(f"event {ev.event_id}: parent {parent} of {b.block_hash} is not cached")
                self.blocks[b.block_hash] = BlockState(parent, b.num_tokens, b.lora_id, b.cache_level, b.priority)
                parent = b.block_hash
        elif isinstance(d, Removed):
            for h in d.block_hashes:
                if self.blocks.pop(h, None) is None:
                    raise ReplayError(f"event {ev.event_id}: removed block {h} is not cached")
        elif isinstance(d, Updated):
            cur = self.blocks.get(d.block_hash)
            if cur is None:
                raise ReplayError(f"event {ev.event_id}: updated block {d.block_hash} is not cached")
            level, prio = cur.cache_level, cur.priority
            if d.cache_level is not None:
                if d.cache_level.old != level:
                    raise ReplayError(f"event {ev.event_id}: block {d.block_hash} is on level {level}, "
                                      f"not {d.cache_level.old}")
                level = d.cache_level.new
            if d.priority is not None:
                if d.priority.old != prio:
                    raise ReplayError(f"event {ev.event_id}: block {d.block_hash} has priority {prio}, "
                                      f"not {d.priority.old}")
                prio = d.priority.new
            self.blocks[d.block_hash] = BlockState(cur.parent_hash, cur.num_tokens, cur.lora_id, level, prio)
        else:  # pragma: no cover - the schema is closed
            raise ReplayError(f"unknown event {d!r}")
        self.last_event_id = ev.event_id

    @staticmethod
    def from_snapshot_blocks(blocks: Iterable[SnapshotBlock]) -> dict[int, BlockState]:
        """A ground-truth block list (``/v1/kv/state``, ``cached_blocks()``) in the same shape."""
        return {b.block_hash: BlockState(b.parent_hash, b.num_tokens, b.lora_id, b.cache_level, b.priority)
                for b in blocks}
