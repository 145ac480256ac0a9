"""The rows the materializer writes and the plans that carry them (no I/O, no planning here).

A take (the messages of one transaction) is planned into one of three kinds of :data:`Plan`,
and the writer (:func:`state_store.writer.write`) dispatches on the kind:

* :class:`RowsPlan`: Python rows, made by the reference planner (:mod:`state_store.apply`);
* :class:`CompiledPlan`: binary ``COPY`` data, made by the compiled hot path
  (:mod:`state_store.native`);
* :class:`PartsPlan`: a take planned in parts (the reference planner and the hot path in turn),
  written part after part in the same transaction.

Every kind carries what the take did (:class:`PlanBase`): the nodes' new rows, the nodes to ask
for a snapshot, the batch times (freshness) and the counts (metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import NamedTuple

from eventbus.protocol import InstanceId, NodeId, SqlBlockHash

#: A ``node_blocks`` row's key.
BlockKey = tuple[NodeId, SqlBlockHash]
#: Where a node's row must be for a plan made from a cache to apply: (instance_id, last_event_id,
#: whether it is gone), None for no row.
Expected = dict[NodeId, tuple[InstanceId, int, bool] | None]

#: ``nodes.status`` values.
LIVE, STALE, RESYNCING, GONE = "live", "stale", "resyncing", "gone"


@dataclass(frozen=True, slots=True)
class NodeRow:
    """The replication state of one node (the ``nodes`` columns the materializer owns)."""

    node_id: NodeId
    instance_id: InstanceId
    last_event_id: int = -1
    status: str = LIVE
    instance_started_at: datetime | None = None
    window_size: int | None = None
    capacity_gpu: int = 0
    capacity_host: int = 0
    #: when this instance said goodbye (a stopping heartbeat), else None; read only (the writer
    #: sets it, a new instance clears it)
    stopped_at: datetime | None = None


class BlockRow(NamedTuple):
    """A ``node_blocks`` row; hashes in their SQL (signed) form (a tuple: cheap to make in bulk).

    The field order is that of ``sql.UPSERT_BLOCKS``'s parameters (the writer zips rows into
    columns); keep the two in step."""

    node_id: NodeId
    block_hash: SqlBlockHash
    parent_hash: SqlBlockHash | None
    cache_level: int
    priority: int
    num_tokens: int
    lora_id: int | None
    window_size: int | None
    stored_at: datetime
    updated_at: datetime


#: block_events columns, in the order of the rows in RowsPlan.history.
HISTORY_COLUMNS = (
    "node_id", "instance_id", "event_id", "seq", "kind", "block_hash", "parent_hash",
    "cache_level_old", "cache_level_new", "priority_old", "priority_new", "num_tokens", "lora_id",
    "stored_at", "event_ts",
)
HistoryRow = tuple[str, str, int, int, str, int | None, int | None, int | None, int | None,
                   int | None, int | None, int | None, int | None, datetime | None, datetime]


@dataclass
class Counts:
    """What a take held (the materializer's counters)."""

    batches: int = 0
    events: int = 0
    block_events: int = 0
    duplicates: int = 0
    stale_replays: int = 0
    gaps: int = 0
    anomalies: int = 0
    new_instances: int = 0

    def add(self, other: Counts) -> None:
        """Add ``other``'s counts to these."""
        for f in fields(Counts):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(frozen=True, slots=True)
class NativeWrites:
    """The writes of a take planned by the compiled hot path (:mod:`state_store.native`), in
    PostgreSQL's binary COPY form: ``block_events`` rows (``HISTORY_COLUMNS``); ``node_blocks``
    rows to insert (blocks the worker's cache did not hold) and to update (blocks it held), all
    columns in ``BlockRow`` order; keys to delete (node_id, block_hash: blocks it held)."""

    history: bytes
    inserts: bytes
    updates: bytes
    deletes: bytes
    history_rows: int
    insert_rows: int
    update_rows: int
    delete_rows: int


@dataclass
class PlanBase:
    """What every kind of plan says about its take."""

    #: each node's row after the take (``nodes``)
    nodes: dict[NodeId, NodeRow] = field(default_factory=dict)
    #: nodes that need a snapshot (a gap, or events that contradict the stored state)
    resync: set[NodeId] = field(default_factory=set)
    #: the timestamp of every batch applied (freshness)
    batch_ts: list[float] = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)


@dataclass
class RowsPlan(PlanBase):
    """A take planned by the reference planner: Python rows for asyncpg."""

    #: ``block_events`` rows, in ``HISTORY_COLUMNS`` order
    history: list[HistoryRow] = field(default_factory=list)
    #: nodes whose ``node_blocks`` rows are all deleted first
    resets: set[NodeId] = field(default_factory=set)
    #: the net change of ``node_blocks``: rows to insert or update, keys to delete
    upserts: dict[BlockKey, BlockRow] = field(default_factory=dict)
    deletes: set[BlockKey] = field(default_factory=set)

    def planned_by(self) -> str:
        """The ``planner`` label of ``kvflow_materializer_takes_total``."""
        return "python"


@dataclass(kw_only=True)
class CompiledPlan(PlanBase):
    """A take planned by the compiled hot path: its ``COPY`` data."""

    writes: NativeWrites

    def planned_by(self) -> str:
        """The ``planner`` label of ``kvflow_materializer_takes_total``."""
        return "compiled"


@dataclass
class PartsPlan(PlanBase):
    """A take planned in parts, written in order in one transaction (a later part may continue
    the nodes of an earlier one); ``nodes``, ``resync``, ``batch_ts`` and ``counts`` are the
    whole take's. Make one with :meth:`of`."""

    parts: list[RowsPlan | CompiledPlan] = field(default_factory=list)

    @staticmethod
    def of(parts: list[RowsPlan | CompiledPlan]) -> Plan:
        """The plan of a take planned in ``parts`` (the one part itself when there is one)."""
        if len(parts) == 1:
            return parts[0]
        # NOTE: one compiled part at most: its staging tables are emptied only at commit.
        assert sum(isinstance(part, CompiledPlan) for part in parts) <= 1
        out = PartsPlan(parts=parts)
        resync: set[NodeId] = set()
        for part in parts:
            out.batch_ts += part.batch_ts
            resync |= part.resync
            out.nodes.update(part.nodes)
            out.counts.add(part.counts)
        out.resync = {n for n in resync if out.nodes[n].status == RESYNCING}
        return out

    def planned_by(self) -> str:
        """``parts`` (the hot path and the reference planner), or ``python`` when no part is
        compiled: the ``planner`` label of ``kvflow_materializer_takes_total``."""
        return "parts" if any(isinstance(part, CompiledPlan) for part in self.parts) else "python"


#: The plan of one take, of one of the three kinds.
Plan = RowsPlan | CompiledPlan | PartsPlan
