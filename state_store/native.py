"""The materializer's compiled hot path (the optional ``kvflow_native`` extension, ``native/``).

A worker spends most of its time on takes of plain batches: known nodes, events in sequence that
store, remove or update blocks as the stored state expects. :class:`NativeNodeCache` keeps the
worker's ``node_blocks`` rows in the extension's ``BlockStore`` and plans such a take there
(:class:`FastPlanner`): it reads the decoded batches and writes the ``block_events``
rows and the net ``node_blocks`` change straight into binary COPY data, with no Python object per
block event (:class:`~state_store.plans.CompiledPlan`; ~0.5 µs of CPU per block event against
~3.7 µs for planning in Python and letting asyncpg encode the rows).

Every other take (a node it has not seen, a new instance, a gap or a redelivery, a node not live,
``created`` or ``snapshot`` events, anything contradicting the stored state) is planned by the
reference planner, :class:`state_store.apply.Planner`, over the same cache (``get``/``apply``).
The rules live there; the hot path covers a subset and says so when a take is outside it.
``tests/state_store/test_native.py`` runs both planners on the same streams and compares every
row they write.

Without the extension (``pip install ./native`` needs a Rust toolchain) the materializer plans
everything in Python: the same results, slower.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from eventbus.protocol import EventBatch, NodeId, Removed, SqlBlockHash, Stored, Updated
from state_store.apply import NodeCache, ts
from state_store.pgtime import from_pg_micros, pg_micros
from state_store.plans import LIVE, STALE, BlockKey, BlockRow, CompiledPlan, Counts, NativeWrites, NodeRow, RowsPlan

try:
    import kvflow_native
except ImportError:  # the pure-Python materializer
    kvflow_native = None


def available() -> bool:
    return kvflow_native is not None


class NativeNodeCache(NodeCache):
    """A :class:`~state_store.apply.NodeCache` whose blocks live in ``kvflow_native.BlockStore``."""

    def __init__(self) -> None:
        if kvflow_native is None:
            raise RuntimeError("kvflow_native is not installed (pip install ./native)")
        super().__init__()
        self.store: Any = kvflow_native.BlockStore(Stored, Removed, Updated)

    def get(self, key: BlockKey, /) -> BlockRow | None:
        r = self.store.get(key[0], key[1])
        if r is None:
            return None
        return BlockRow(key[0], key[1], r[0], r[1], r[2], r[3], r[4], r[5], from_pg_micros(r[6]),
                        from_pg_micros(r[7]))

    def missing(self, node_ids: Iterable[NodeId]) -> list[NodeId]:
        return sorted(n for n in node_ids if not self.store.loaded(n))

    def load(self, nodes: Iterable[NodeRow], blocks: Iterable[BlockRow], node_ids: Iterable[NodeId]) -> None:
        rows: dict[NodeId, list[tuple[Any, ...]]] = {}
        for n in node_ids:
            rows[n] = []
            self.nodes.pop(n, None)
        for row in nodes:
            self.nodes[row.node_id] = row
        for b in blocks:
            rows[b.node_id].append((b.block_hash, *_row(b)))
        for n, r in rows.items():
            self.store.load(n, r)

    def apply_rows(self, p: RowsPlan) -> None:
        # What the reference planner planned (a compiled plan's blocks are in the store already).
        store = self.store
        for node in p.resets:
            store.reset(node)
        for node, h in p.deletes:
            store.delete(node, h)
        for (node, h), row in p.upserts.items():
            store.put(node, h, _row(row))

    def clear(self) -> None:
        super().clear()
        self.store.clear()

    def blocks_of(self, node: NodeId) -> dict[SqlBlockHash, BlockRow]:
        """A node's cached blocks (tests, diagnostics)."""
        return {h: b for h, _ in self.store.blocks(node) if (b := self.get((node, h))) is not None}

    def fast_planner(self) -> FastPlanner:
        return FastPlanner(self)


class FastPlanner:
    """Plans one take in the compiled store, batch by batch (so that the caller can yield to its
    event loop between batches). :meth:`add` answers False when the take is outside the hot
    path; then :meth:`abort` leaves the cache as it was and the reference planner takes over.
    :meth:`finish` returns the plan and leaves the cache at its end (``NodeCache.apply`` then
    only updates the node rows)."""

    def __init__(self, cache: NativeNodeCache) -> None:
        self.cache = cache
        self.store = cache.store
        self.rows: dict[NodeId, NodeRow] = {}
        self.counts = Counts()
        self.batch_ts: list[float] = []
        self.store.begin()

    def add(self, b: EventBatch) -> bool:
        node = b.node_id
        row = self.rows.get(node) or self.cache.nodes.get(node)
        events = b.events
        if (row is None or row.instance_id != b.instance_id or row.status not in (LIVE, STALE)
                or events[0].event_id != row.last_event_id + 1):
            return False
        if not self.store.add(b, node, b.instance_id, pg_micros(ts(b.ts))):
            return False
        # As the reference planner: a stale node that speaks is live again.
        self.rows[node] = replace(row, last_event_id=events[-1].event_id, status=LIVE,
                                  window_size=events[-1].window_size)
        c = self.counts
        c.batches += 1
        c.events += len(events)
        self.batch_ts.append(b.ts)
        return True

    def abort(self) -> None:
        self.store.abort()

    def finish(self) -> CompiledPlan:
        writes = NativeWrites(*self.store.finish())
        self.counts.block_events = writes.history_rows
        return CompiledPlan(nodes=self.rows, batch_ts=self.batch_ts, counts=self.counts, writes=writes)


def plan_fast(cache: NativeNodeCache, batches: Sequence[EventBatch]) -> CompiledPlan | None:
    """The whole take at once (tests, benchmarks); None: outside the hot path."""
    fp = cache.fast_planner()
    for b in batches:
        if not fp.add(b):
            fp.abort()
            return None
    return fp.finish()


def _row(b: BlockRow) -> tuple[Any, ...]:
    return (b.parent_hash, b.cache_level, b.priority, b.num_tokens, b.lora_id, b.window_size,
            pg_micros(b.stored_at), pg_micros(b.updated_at))
