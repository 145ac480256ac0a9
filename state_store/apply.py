"""What a run of EventBatches does to PostgreSQL, decided without touching it.

The materializer hands :func:`plan` the batches it consumed (in Kafka order per node), the
current ``nodes`` rows of their nodes, and the current ``node_blocks`` rows of the blocks the
batches remove or update (:func:`blocks_to_look_up` says which). ``plan`` returns the writes of
one transaction:

* ``history``: the ``block_events`` rows, one per event × block, with the old level and priority
  of removed blocks filled in;
* ``resets``: nodes whose cached blocks are all deleted first (``created``, ``snapshot``, a new
  instance);
* ``upserts`` / ``deletes``: the *net* change of ``node_blocks`` (a block stored and removed in
  the same run is neither);
* ``nodes``: each node's new ``instance_id``, ``last_event_id``, ``status``, …

Exactly once in effect: a batch whose events are at or below the node's ``last_event_id`` (of the
same instance) is a redelivery and changes nothing; the new ``last_event_id`` is written in the
same transaction as the blocks. A gap in ``event_id`` puts the node in ``resyncing`` (its later
events are recorded in the history but not applied) until a ``snapshot`` heals it; the caller asks
the node for one. A batch of an older instance than the current one (by its first batch's
timestamp) is a stale replay and ignored.

Pure: no I/O, so every rule is unit-tested exactly (``tests/state_store/test_apply.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import NamedTuple, Protocol

from eventbus.protocol import (
    Created,
    EventBatch,
    Removed,
    Snapshot,
    Stored,
    Updated,
    to_sql,
)

LIVE, STALE, RESYNCING, GONE = "live", "stale", "resyncing", "gone"
_I64, _U64 = 1 << 63, 1 << 64


@dataclass(frozen=True, slots=True)
class NodeRow:
    """The replication state of one node (the ``nodes`` columns the materializer owns)."""

    node_id: str
    instance_id: str
    last_event_id: int = -1
    status: str = LIVE
    instance_started_at: datetime | None = None
    window_size: int | None = None
    capacity_gpu: int = 0
    capacity_host: int = 0


class BlockRow(NamedTuple):
    """A ``node_blocks`` row; hashes in their SQL (signed) form (a tuple: cheap to make in bulk).

    The field order is that of ``writer.UPSERT_BLOCKS``'s parameters (the writer zips rows into
    columns); keep the two in step."""

    node_id: str
    block_hash: int
    parent_hash: int | None
    cache_level: int
    priority: int
    num_tokens: int
    lora_id: int | None
    window_size: int | None
    stored_at: datetime
    updated_at: datetime


#: block_events columns, in the order of the rows in Plan.history.
HISTORY_COLUMNS = (
    "node_id", "instance_id", "event_id", "seq", "kind", "block_hash", "parent_hash",
    "cache_level_old", "cache_level_new", "priority_old", "priority_new", "num_tokens", "lora_id",
    "stored_at", "event_ts",
)
HistoryRow = tuple[str, str, int, int, str, int | None, int | None, int | None, int | None,
                   int | None, int | None, int | None, int | None, datetime | None, datetime]


@dataclass
class Counts:
    batches: int = 0
    events: int = 0
    block_events: int = 0
    duplicates: int = 0
    stale_replays: int = 0
    gaps: int = 0
    anomalies: int = 0
    new_instances: int = 0


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
class Plan:
    history: list[HistoryRow] = field(default_factory=list)
    resets: set[str] = field(default_factory=set)
    upserts: dict[tuple[str, int], BlockRow] = field(default_factory=dict)
    deletes: set[tuple[str, int]] = field(default_factory=set)
    nodes: dict[str, NodeRow] = field(default_factory=dict)
    #: nodes that need a snapshot (a gap, or events that contradict the stored state)
    resync: set[str] = field(default_factory=set)
    #: the newest batch timestamp applied per node (freshness)
    batch_ts: list[float] = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)
    #: set instead of history/upserts/deletes when the compiled hot path planned the take
    native: NativeWrites | None = None
    #: plans of parts of the same take, written after this one's writes, in order, in the same
    #: transaction (see :meth:`sequence`)
    after: list[Plan] = field(default_factory=list)

    @staticmethod
    def sequence(parts: list[Plan]) -> Plan:
        """One plan of a take planned in parts, one after the other (a later part may continue
        the nodes of an earlier one): the parts are written in order; the counts, batch times
        and snapshot requests are the take's."""
        if len(parts) == 1:
            return parts[0]
        # NOTE: one compiled part at most: its staging tables are emptied only at commit.
        assert sum(part.native is not None for part in parts) <= 1
        out = Plan(after=parts)
        final: dict[str, NodeRow] = {}
        for part in parts:
            out.batch_ts += part.batch_ts
            out.resync |= part.resync
            final.update(part.nodes)
            for f in fields(Counts):
                setattr(out.counts, f.name, getattr(out.counts, f.name) + getattr(part.counts, f.name))
        out.resync = {n for n in out.resync if final[n].status == RESYNCING}
        return out

    def planned_by(self) -> str:
        """``compiled`` (the hot path alone), ``parts`` (it and the reference planner) or
        ``python`` (the reference planner alone)."""
        compiled = [part.native is not None for part in (self.after or [self])]
        return "python" if not any(compiled) else "compiled" if len(compiled) == 1 else "parts"


def ts(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def blocks_to_look_up(batches: Iterable[EventBatch]) -> set[tuple[str, int]]:
    """(node_id, sql hash) of every block the batches remove or update: their old values may be
    needed from ``node_blocks``."""
    out: set[tuple[str, int]] = set()
    for b in batches:
        node = b.node_id
        for ev in b.events:
            d = ev.data
            if isinstance(d, Removed):
                out.update((node, to_sql(h)) for h in d.block_hashes)
            elif isinstance(d, Updated):
                out.add((node, to_sql(d.block_hash)))
            elif isinstance(d, Snapshot):  # to keep the stored time of the blocks it re-asserts
                out.update((node, to_sql(b.block_hash)) for b in d.blocks)
    return out


class NodeCache:
    """The complete ``nodes`` and ``node_blocks`` state of the nodes a materializer worker owns.

    With it a worker plans a transaction without reading the database, so it can plan the next
    batches while the previous ones are being written. It is only a cache: every transaction
    verifies, under a row lock, that the database is where the cache says it is (see
    ``Writer.apply_planned``), and the cache is dropped whenever it is not.
    """

    def __init__(self) -> None:
        self.nodes: dict[str, NodeRow] = {}
        self.blocks: dict[str, dict[int, BlockRow]] = {}

    def get(self, key: tuple[str, int], /) -> BlockRow | None:
        return self.blocks[key[0]].get(key[1])

    def missing(self, node_ids: Iterable[str]) -> list[str]:
        return sorted(n for n in node_ids if n not in self.blocks)

    def load(self, nodes: Iterable[NodeRow], blocks: Iterable[BlockRow], node_ids: Iterable[str]) -> None:
        for n in node_ids:
            self.blocks[n] = {}
            self.nodes.pop(n, None)
        for row in nodes:
            self.nodes[row.node_id] = row
        for b in blocks:
            self.blocks[b.node_id][b.block_hash] = b

    def apply(self, p: Plan) -> None:
        for node in p.resets:
            self.blocks[node] = {}
        for node, h in p.deletes:
            self.blocks[node].pop(h, None)
        for (node, h), row in p.upserts.items():
            self.blocks[node][h] = row
        self.nodes.update(p.nodes)

    def expected(self, node_ids: Iterable[str]) -> dict[str, tuple[str, int] | None]:
        """Where the database must be for a plan made from this cache to apply."""
        return {n: (r.instance_id, r.last_event_id) if (r := self.nodes.get(n)) else None for n in node_ids}

    def clear(self) -> None:
        self.nodes.clear()
        self.blocks.clear()


class _NodeView:
    """A node's blocks during planning: what the run changed, falling back to what SQL holds."""

    __slots__ = ("before", "changed", "known", "node_id", "reset")

    def __init__(self, node_id: str, known: KnownBlocks) -> None:
        self.node_id = node_id
        self.known = known
        self.changed: dict[int, BlockRow | None] = {}  # None: deleted in this run
        self.reset = False
        #: the view as it was before the last clear, while the parts of a snapshot still come
        self.before: tuple[dict[int, BlockRow | None], bool] | None = None

    def get(self, h: int) -> BlockRow | None:
        if h in self.changed:
            return self.changed[h]
        if self.reset:
            return None
        return self.known.get((self.node_id, h))

    def get_before(self, h: int) -> BlockRow | None:
        if self.before is None:
            return None
        changed, reset = self.before
        if h in changed:
            return changed[h]
        return None if reset else self.known.get((self.node_id, h))

    def clear(self, keep_before: bool = False) -> None:
        self.before = (dict(self.changed), self.reset) if keep_before else None
        self.changed = {}
        self.reset = True


class KnownBlocks(Protocol):
    """Current ``node_blocks`` rows by (node_id, sql hash): a dict, or the materializer's cache."""

    def get(self, key: tuple[str, int], /) -> BlockRow | None: ...


class Planner:
    """Plans one transaction batch by batch (:func:`plan` in steps, so that a caller can yield to
    its event loop between batches)."""

    def __init__(self, nodes: Mapping[str, NodeRow], known: KnownBlocks) -> None:
        self.nodes = nodes
        self.known = known
        self.out = Plan()
        self.views: dict[str, _NodeView] = {}
        self.state: dict[str, NodeRow | None] = {}

    def add(self, batch: EventBatch) -> None:
        out = self.out
        c = out.counts
        history_append = out.history.append
        views = self.views
        state = self.state
        known = self.known
        c.batches += 1
        node = batch.node_id
        row = state[node] if node in state else self.nodes.get(node)
        view = views.get(node)
        if view is None:
            view = views[node] = _NodeView(node, known)
        batch_ts = ts(batch.ts)

        if row is None or row.instance_id != batch.instance_id:
            if row is not None and row.instance_started_at is not None and batch_ts < row.instance_started_at:
                c.stale_replays += 1  # a batch of an instance older than the current one
                return
            # A new instance (or a new node): its cache starts empty.
            c.new_instances += 1
            row = NodeRow(node_id=node, instance_id=batch.instance_id, last_event_id=-1, status=LIVE,
                          instance_started_at=batch_ts, window_size=row.window_size if row else None,
                          capacity_gpu=row.capacity_gpu if row else 0, capacity_host=row.capacity_host if row else 0)
            view.clear()
            out.resets.add(node)

        instance = row.instance_id
        events = batch.events if batch.events[0].event_id > row.last_event_id else \
            [e for e in batch.events if e.event_id > row.last_event_id]
        if not events:
            c.duplicates += 1
            return
        status = row.status
        if status == GONE:
            # Its blocks were cleared when it went silent: what it says now builds on state that
            # SQL no longer has. Only a snapshot can heal that.
            status = _resync(out, node)
        elif status == STALE:
            status = LIVE
        if events[0].event_id != row.last_event_id + 1:
            c.gaps += 1
            status = _resync(out, node)
        for ev in events:
            d = ev.data
            if isinstance(d, Created) or (isinstance(d, Snapshot) and d.part == 0):  # the whole state anew
                status = LIVE
                # A block the snapshot re-asserts keeps the time it was first stored.
                since = {} if isinstance(d, Created) else {
                    h: cur.stored_at for sb in d.blocks
                    if (cur := view.get(h := to_sql(sb.block_hash))) is not None}
                view.clear(keep_before=isinstance(d, Snapshot) and d.parts > 1)
                out.resets.add(node)
                if isinstance(d, Created):
                    caps = list(d.num_blocks_per_cache_level) + [0, 0]
                    row = replace(row, capacity_gpu=caps[0], capacity_host=caps[1])
                    out.history.append(_row(row, ev.event_id, 0, "created", None, None, None, None, None, None,
                                            None, None, None, batch_ts))
                    continue
            if isinstance(d, Snapshot):
                if d.part > 0:  # adds to part 0; while resyncing (part 0 was missed) it is history only
                    # Blocks keep the time they were first stored, as in part 0; a part planned in a
                    # later transaction than its part 0 no longer sees it (the time of this batch then).
                    since = {h: cur.stored_at for sb in d.blocks
                             if (cur := view.get_before(h := to_sql(sb.block_hash))) is not None}
                applying = status != RESYNCING
                for seq, sb in enumerate(d.blocks):
                    h = to_sql(sb.block_hash)
                    p = to_sql(sb.parent_hash) if sb.parent_hash is not None else None
                    if applying:
                        view.changed[h] = BlockRow(node, h, p, sb.cache_level, sb.priority, sb.num_tokens,
                                                   sb.lora_id, ev.window_size, since.get(h, batch_ts), batch_ts)
                    out.history.append(_row(row, ev.event_id, seq, "snapshot", h, p, None, sb.cache_level, None,
                                            sb.priority, sb.num_tokens, sb.lora_id, None, batch_ts))
                if not d.blocks:
                    out.history.append(_row(row, ev.event_id, 0, "snapshot", None, None, None, None, None, None,
                                            None, None, None, batch_ts))
                continue

            # NOTE: the hot path (hundreds of thousands of block events per second): tuples built
            # inline, hashes mapped to SQL inline (see protocol.to_sql).
            applying = status != RESYNCING
            eid = ev.event_id
            changed = view.changed
            if isinstance(d, Stored):
                parent = d.parent_hash
                if parent is not None and parent >= _I64:
                    parent -= _U64
                for seq, b in enumerate(d.blocks):
                    h = b.block_hash
                    if h >= _I64:
                        h -= _U64
                    if applying:
                        if view.get(h) is not None:
                            c.anomalies += 1  # stored twice: the node and SQL disagree
                            status = _resync(out, node)
                            applying = False
                        else:
                            changed[h] = BlockRow(node, h, parent, b.cache_level, b.priority, b.num_tokens,
                                                  b.lora_id, ev.window_size, batch_ts, batch_ts)
                    history_append((node, instance, eid, seq, "stored", h, parent, None, b.cache_level, None,
                                    b.priority, b.num_tokens, b.lora_id, None, batch_ts))
                    parent = h
            elif isinstance(d, Removed):
                for seq, h in enumerate(d.block_hashes):
                    if h >= _I64:
                        h -= _U64
                    cur = view.get(h) if applying else None
                    if cur is not None:
                        changed[h] = None
                        history_append((node, instance, eid, seq, "removed", h, cur.parent_hash, cur.cache_level,
                                        None, cur.priority, None, cur.num_tokens, cur.lora_id, cur.stored_at,
                                        batch_ts))
                        continue
                    if applying:
                        c.anomalies += 1
                        status = _resync(out, node)
                        applying = False
                    history_append((node, instance, eid, seq, "removed", h, None, None, None, None, None, None,
                                    None, None, batch_ts))
            elif isinstance(d, Updated):
                h = d.block_hash
                if h >= _I64:
                    h -= _U64
                cur = view.get(h) if applying else None
                if applying and cur is None:
                    c.anomalies += 1
                    status = _resync(out, node)
                    applying = False
                lv, pr = d.cache_level, d.priority
                if cur is not None:  # NOTE: built directly; NamedTuple._replace costs ~3x as much
                    changed[h] = BlockRow(cur.node_id, cur.block_hash, cur.parent_hash,
                                          lv.new if lv else cur.cache_level, pr.new if pr else cur.priority,
                                          cur.num_tokens, cur.lora_id, cur.window_size, cur.stored_at, batch_ts)
                history_append((node, instance, eid, 0, "updated", h, cur.parent_hash if cur else None,
                                lv.old if lv else None, lv.new if lv else None,
                                pr.old if pr else None, pr.new if pr else None,
                                cur.num_tokens if cur else None, cur.lora_id if cur else None,
                                cur.stored_at if cur else None, batch_ts))
        c.events += len(events)
        row = replace(row, last_event_id=events[-1].event_id, status=status,
                      window_size=events[-1].window_size)
        state[node] = row
        out.nodes[node] = row
        out.batch_ts.append(batch.ts)


    def finish(self) -> Plan:
        out = self.out
        c = out.counts
        out.resync = {n for n in out.resync if n in out.nodes and out.nodes[n].status == RESYNCING}
        for node, view in self.views.items():
            for h, br in view.changed.items():
                key = (node, h)
                if br is None:
                    # Only what SQL holds (after a reset: nothing); a block stored and removed
                    # within the run was never written.
                    if not view.reset and view.known.get(key) is not None:
                        out.deletes.add(key)
                else:
                    out.upserts[key] = br
        c.block_events = len(out.history)
        return out


def plan(batches: Sequence[EventBatch], nodes: Mapping[str, NodeRow], known: KnownBlocks) -> Plan:
    """The writes of one transaction for ``batches`` (see the module docstring).

    Args:
        batches: decoded batches in consumption order (per node: Kafka order).
        nodes: current ``nodes`` rows of the batches' nodes (missing: never seen).
        known: current ``node_blocks`` rows for at least :func:`blocks_to_look_up`.

    Neither ``nodes`` nor ``known`` is modified.
    """
    planner = Planner(nodes, known)
    for b in batches:
        planner.add(b)
    return planner.finish()


def _resync(out: Plan, node: str) -> str:
    out.resync.add(node)
    return RESYNCING


def _row(row: NodeRow, event_id: int, seq: int, kind: str, h: int | None, parent: int | None,
         level_old: int | None, level_new: int | None, prio_old: int | None, prio_new: int | None,
         num_tokens: int | None, lora_id: int | None, stored_at: datetime | None, event_ts: datetime) -> HistoryRow:
    return (row.node_id, row.instance_id, event_id, seq, kind, h, parent, level_old, level_new,
            prio_old, prio_new, num_tokens, lora_id, stored_at, event_ts)
