"""``kvflow events tail``: an independent consumer of ``kv-events``, printing events live.

It is also the example of how another team attaches its own consumer: its own consumer group
(so it never takes partitions away from the materializer), the one wire schema
(``eventbus.protocol.decode_batch``), and nothing else from kvflow.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from eventbus.config import KafkaSettings
from eventbus.kafka import make_consumer
from eventbus.protocol import (
    Created,
    Event,
    EventBatch,
    ProtocolError,
    Removed,
    Snapshot,
    Stored,
    Updated,
    decode_batch,
)


def describe(batch: EventBatch, ev: Event) -> str:
    """One line per event."""
    d = ev.data
    head = f"{batch.node_id} {batch.instance_id[:8]} #{ev.event_id:<6}"
    if isinstance(d, Stored):
        prios = sorted({b.priority for b in d.blocks})
        return (f"{head} stored   {len(d.blocks):>4} blocks  parent={_h(d.parent_hash)} "
                f"first={_h(d.blocks[0].block_hash)} priority={','.join(map(str, prios))}")
    if isinstance(d, Removed):
        return f"{head} removed  {len(d.block_hashes):>4} blocks  first={_h(d.block_hashes[0])}"
    if isinstance(d, Updated):
        parts = []
        if d.cache_level is not None:
            parts.append(f"level {d.cache_level.old}->{d.cache_level.new}")
        if d.priority is not None:
            parts.append(f"priority {d.priority.old}->{d.priority.new}")
        return f"{head} updated  {_h(d.block_hash)} {' '.join(parts)}"
    if isinstance(d, Snapshot):
        return f"{head} snapshot {len(d.blocks):>4} blocks"
    assert isinstance(d, Created)
    return f"{head} created  capacity={d.num_blocks_per_cache_level}"


def _h(h: int | None) -> str:
    return "-" if h is None else f"{h:016x}"


@dataclass
class TailSummary:
    events: Counter[str] = field(default_factory=Counter)
    blocks: Counter[str] = field(default_factory=Counter)
    nodes: set[str] = field(default_factory=set)
    batches: int = 0
    bad: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, batch: EventBatch) -> None:
        self.batches += 1
        self.nodes.add(batch.node_id)
        for ev in batch.events:
            kind = type(ev.data).__name__.lower()
            self.events[kind] += 1
            d = ev.data
            n = len(d.blocks) if isinstance(d, (Stored, Snapshot)) else (
                len(d.block_hashes) if isinstance(d, Removed) else 1)
            self.blocks[kind] += n

    def line(self) -> str:
        dt = max(1e-9, time.monotonic() - self.started)
        total = sum(self.events.values())
        kinds = " ".join(f"{k}={self.events[k]}" for k in ("created", "stored", "removed", "updated", "snapshot"))
        return (f"-- {total} events ({total / dt:.0f}/s) in {self.batches} batches from {len(self.nodes)} nodes; "
                f"{kinds}; block events {sum(self.blocks.values())}; bad messages {self.bad}")


def tail(settings: KafkaSettings, *, group: str | None = None, from_beginning: bool = False,
         node: str | None = None, limit: int | None = None, idle_timeout_s: float | None = None,
         summary_every_s: float = 5.0, emit: Callable[[str], None] = print) -> TailSummary:
    """Print events until ``limit`` events, ``idle_timeout_s`` without messages, or Ctrl-C."""
    consumer = make_consumer(settings, group_id=group or f"kvflow-tail-{uuid.uuid4().hex[:8]}",
                             **{"auto.offset.reset": "earliest" if from_beginning else "latest",
                                "enable.auto.commit": True})
    consumer.subscribe([settings.events_topic])
    summary = TailSummary()
    seen = 0
    last_msg = last_summary = time.monotonic()
    try:
        while limit is None or seen < limit:
            msg = consumer.poll(0.5)
            now = time.monotonic()
            if now - last_summary >= summary_every_s:
                emit(summary.line())
                last_summary = now
            if msg is None:
                if idle_timeout_s is not None and now - last_msg > idle_timeout_s:
                    break
                continue
            if msg.error() is not None:
                continue
            last_msg = now
            try:
                batch = decode_batch(msg.value() or b"")
            except ProtocolError as exc:
                summary.bad += 1
                emit(f"!! bad message at {msg.topic()}[{msg.partition()}]@{msg.offset()}: {exc}")
                continue
            if node is not None and batch.node_id != node:
                continue
            summary.add(batch)
            for ev in batch.events:
                emit(describe(batch, ev))
                seen += 1
                if limit is not None and seen >= limit:
                    break
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    emit(summary.line())
    return summary
