"""What a run of EventBatches does to PostgreSQL, decided without touching it.

The materializer hands :func:`plan` the batches it consumed (in Kafka order per node), the
current ``nodes`` rows of their nodes, and the current ``node_blocks`` rows of the blocks the
batches remove or update (:func:`blocks_to_look_up` says which). ``plan`` returns the writes of
one transaction (a :class:`~state_store.plans.RowsPlan`):

* ``history``: the ``block_events`` rows, one per event × block, with the old level and priority
  of removed blocks filled in, and both the old and the new ones of updated blocks (an event's
  diff, else the block's unchanged value: an offload carries its priority);
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
timestamp) is a stale replay and ignored. A node gone because it said goodbye (a stopping
heartbeat) stays gone: the later events of that instance are history only.

Pure: no I/O, so every rule is unit-tested exactly (``tests/state_store/test_apply.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Protocol

from eventbus.protocol import (
    Created,
    Event,
    EventBatch,
    InstanceId,
    NodeId,
    Removed,
    Snapshot,
    SqlBlockHash,
    Stored,
    Updated,
    to_sql,
    to_sql_list,
)
from state_store.plans import (
    GONE,
    LIVE,
    RESYNCING,
    STALE,
    BlockKey,
    BlockRow,
    CompiledPlan,
    Expected,
    HistoryRow,
    NodeRow,
    RowsPlan,
)


def ts(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def blocks_to_look_up(batches: Iterable[EventBatch]) -> set[BlockKey]:
    """(node_id, sql hash) of every block the batches remove or update: their old values may be
    needed from ``node_blocks``."""
    out: set[BlockKey] = set()
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
        self.nodes: dict[NodeId, NodeRow] = {}
        self.blocks: dict[NodeId, dict[SqlBlockHash, BlockRow]] = {}

    def get(self, key: BlockKey, /) -> BlockRow | None:
        return self.blocks[key[0]].get(key[1])

    def missing(self, node_ids: Iterable[NodeId]) -> list[NodeId]:
        return sorted(n for n in node_ids if n not in self.blocks)

    def load(self, nodes: Iterable[NodeRow], blocks: Iterable[BlockRow], node_ids: Iterable[NodeId]) -> None:
        for n in node_ids:
            self.blocks[n] = {}
            self.nodes.pop(n, None)
        for row in nodes:
            self.nodes[row.node_id] = row
        for b in blocks:
            self.blocks[b.node_id][b.block_hash] = b

    def apply(self, p: RowsPlan | CompiledPlan) -> None:
        """Bring the cache to where the database is once ``p`` is written. (A compiled plan's
        blocks are there already: the hot path plans in the cache's own store.)"""
        if isinstance(p, RowsPlan):
            self.apply_rows(p)
        self.nodes.update(p.nodes)

    def apply_rows(self, p: RowsPlan) -> None:
        """The blocks of a plan of Python rows (part of :meth:`apply`; a subclass keeping its
        blocks elsewhere overrides this)."""
        for node in p.resets:
            self.blocks[node] = {}
        for node, h in p.deletes:
            self.blocks[node].pop(h, None)
        for (node, h), row in p.upserts.items():
            self.blocks[node][h] = row

    def expected(self, node_ids: Iterable[NodeId]) -> Expected:
        """Where the database must be for a plan made from this cache to apply."""
        return {n: (r.instance_id, r.last_event_id, r.status == GONE) if (r := self.nodes.get(n)) else None
                for n in node_ids}

    def clear(self) -> None:
        self.nodes.clear()
        self.blocks.clear()


class _NodeView:
    """A node's blocks during planning: what the run changed, falling back to what SQL holds."""

    __slots__ = ("before", "changed", "known", "node_id", "reset")

    def __init__(self, node_id: NodeId, known: KnownBlocks) -> None:
        self.node_id = node_id
        self.known = known
        self.changed: dict[SqlBlockHash, BlockRow | None] = {}  # None: deleted in this run
        self.reset = False
        #: the view as it was before the last clear, while the parts of a snapshot still come
        self.before: tuple[dict[SqlBlockHash, BlockRow | None], bool] | None = None

    def get(self, h: SqlBlockHash) -> BlockRow | None:
        if h in self.changed:
            return self.changed[h]
        if self.reset:
            return None
        return self.known.get((self.node_id, h))

    def get_before(self, h: SqlBlockHash) -> BlockRow | None:
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

    def get(self, key: BlockKey, /) -> BlockRow | None: ...


class Planner:
    """Plans one transaction batch by batch (:func:`plan` in steps, so that a caller can yield to
    its event loop between batches).

    NOTE: the hot path of the Python planner (hundreds of thousands of block events a second):
    one method per event kind, each with its per-block loop inline (tuples built inline, hashes
    converted once per event, ``to_sql_list``)."""

    def __init__(self, nodes: Mapping[NodeId, NodeRow], known: KnownBlocks) -> None:
        self.nodes = nodes
        self.known = known
        self.out = RowsPlan()
        self.views: dict[NodeId, _NodeView] = {}
        self.state: dict[NodeId, NodeRow | None] = {}

    def add(self, batch: EventBatch) -> None:
        """Plan one batch (after the ones added before it)."""
        c = self.out.counts
        c.batches += 1
        node = batch.node_id
        view = self.views.get(node)
        if view is None:
            view = self.views[node] = _NodeView(node, self.known)
        batch_ts = ts(batch.ts)
        row = self._instance_row(batch, view, batch_ts)
        if row is None:
            return
        events = batch.events if batch.events[0].event_id > row.last_event_id else \
            [e for e in batch.events if e.event_id > row.last_event_id]
        if not events:
            c.duplicates += 1
            return
        if row.status == GONE and row.stopped_at is not None:
            status = self._after_goodbye(view, row, events, batch_ts)
        else:
            status = self._status_before(row, events[0])
            for ev in events:
                d = ev.data
                if isinstance(d, Updated):
                    status = self._updated(view, row.instance_id, ev, d, status, batch_ts)
                elif isinstance(d, Removed):
                    status = self._removed(view, row.instance_id, ev, d, status, batch_ts)
                elif isinstance(d, Stored):
                    status = self._stored(view, row.instance_id, ev, d, status, batch_ts)
                elif isinstance(d, Snapshot):
                    status = self._snapshot(view, row, ev, d, status, batch_ts)
                else:
                    row, status = self._created(view, row, ev, d, batch_ts), LIVE
        c.events += len(events)
        row = replace(row, last_event_id=events[-1].event_id, status=status,
                      window_size=events[-1].window_size)
        self.state[node] = row
        self.out.nodes[node] = row
        self.out.batch_ts.append(batch.ts)

    def _instance_row(self, batch: EventBatch, view: _NodeView, batch_ts: datetime) -> NodeRow | None:
        """The node's row for this batch: a fresh one for a new instance (its cache starts
        empty); None for a batch of an instance older than the current one (a stale replay)."""
        node = batch.node_id
        row = self.state[node] if node in self.state else self.nodes.get(node)
        if row is not None and row.instance_id == batch.instance_id:
            return row
        if row is not None and row.instance_started_at is not None and batch_ts < row.instance_started_at:
            self.out.counts.stale_replays += 1
            return None
        self.out.counts.new_instances += 1
        view.clear()
        self.out.resets.add(node)
        return NodeRow(node_id=node, instance_id=batch.instance_id, last_event_id=-1, status=LIVE,
                       instance_started_at=batch_ts, window_size=row.window_size if row else None,
                       capacity_gpu=row.capacity_gpu if row else 0, capacity_host=row.capacity_host if row else 0)

    def _status_before(self, row: NodeRow, first: Event) -> str:
        """The node's status as its new events start: resyncing after a gap."""
        status = row.status
        if status == GONE:
            # Its blocks were cleared when it went silent: what it says now builds on state that
            # SQL no longer has. Only a snapshot can heal that.
            status = self._resync(row.node_id)
        elif status == STALE:
            status = LIVE
        if first.event_id != row.last_event_id + 1:
            self.out.counts.gaps += 1
            status = self._resync(row.node_id)
        return status

    def _after_goodbye(self, view: _NodeView, row: NodeRow, events: Sequence[Event], batch_ts: datetime) -> str:
        """Events of an instance that said goodbye (its stopping heartbeat came first: Kafka orders
        nothing across topics, and a node's last events may trail its goodbye): recorded in the
        history, not applied, nothing asked; the node stays gone."""
        history = self.out.history
        for ev in events:
            d = ev.data
            if isinstance(d, Updated):
                self._updated(view, row.instance_id, ev, d, RESYNCING, batch_ts)  # RESYNCING: history only
            elif isinstance(d, Removed):
                self._removed(view, row.instance_id, ev, d, RESYNCING, batch_ts)
            elif isinstance(d, Stored):
                self._stored(view, row.instance_id, ev, d, RESYNCING, batch_ts)
            elif isinstance(d, Snapshot):
                for seq, sb in enumerate(d.blocks):
                    history.append(_row(row, ev.event_id, seq, "snapshot", to_sql(sb.block_hash),
                                        to_sql(sb.parent_hash) if sb.parent_hash is not None else None, None,
                                        sb.cache_level, None, sb.priority, sb.num_tokens, sb.lora_id, None, batch_ts))
                if not d.blocks:
                    history.append(_row(row, ev.event_id, 0, "snapshot", None, None, None, None, None, None, None,
                                        None, None, batch_ts))
            else:
                history.append(_row(row, ev.event_id, 0, "created", None, None, None, None, None, None, None, None,
                                    None, batch_ts))
        return GONE

    def _resync(self, node: NodeId) -> str:
        self.out.resync.add(node)
        return RESYNCING

    def _anomaly(self, node: NodeId) -> str:
        """An event that contradicts the stored state: treated like a gap."""
        self.out.counts.anomalies += 1
        return self._resync(node)

    def _stored(self, view: _NodeView, instance: InstanceId, ev: Event, d: Stored, status: str,
                batch_ts: datetime) -> str:
        node, eid, window = view.node_id, ev.event_id, ev.window_size
        applying = status != RESYNCING
        changed = view.changed
        history_append = self.out.history.append
        parent = to_sql(d.parent_hash) if d.parent_hash is not None else None
        blocks = d.blocks
        for seq, h in enumerate(to_sql_list([b.block_hash for b in blocks])):
            b = blocks[seq]
            if applying:
                if view.get(h) is not None:  # stored twice: the node and SQL disagree
                    status = self._anomaly(node)
                    applying = False
                else:
                    changed[h] = BlockRow(node, h, parent, b.cache_level, b.priority, b.num_tokens, b.lora_id,
                                          window, batch_ts, batch_ts)
            history_append((node, instance, eid, seq, "stored", h, parent, None, b.cache_level, None,
                            b.priority, b.num_tokens, b.lora_id, None, batch_ts))
            parent = h
        return status

    def _removed(self, view: _NodeView, instance: InstanceId, ev: Event, d: Removed, status: str,
                 batch_ts: datetime) -> str:
        node, eid = view.node_id, ev.event_id
        applying = status != RESYNCING
        changed = view.changed
        history_append = self.out.history.append
        for seq, h in enumerate(to_sql_list(d.block_hashes)):
            cur = view.get(h) if applying else None
            if cur is not None:
                changed[h] = None
                history_append((node, instance, eid, seq, "removed", h, cur.parent_hash, cur.cache_level, None,
                                cur.priority, None, cur.num_tokens, cur.lora_id, cur.stored_at, batch_ts))
                continue
            if applying:
                status = self._anomaly(node)
                applying = False
            history_append((node, instance, eid, seq, "removed", h, None, None, None, None, None, None, None,
                            None, batch_ts))
        return status

    def _updated(self, view: _NodeView, instance: InstanceId, ev: Event, d: Updated, status: str,
                 batch_ts: datetime) -> str:
        h = to_sql(d.block_hash)
        cur = view.get(h) if status != RESYNCING else None
        if cur is None and status != RESYNCING:
            status = self._anomaly(view.node_id)
        lv, pr = d.cache_level, d.priority
        if cur is None:
            self.out.history.append((view.node_id, instance, ev.event_id, 0, "updated", h, None,
                                     lv.old if lv else None, lv.new if lv else None,
                                     pr.old if pr else None, pr.new if pr else None, None, None, None, batch_ts))
            return status
        # The row carries the block's level and priority before and after the event: the diff where
        # the event has one, else the block's own value in both (an offload says no priority).
        lv_old, lv_new = (lv.old, lv.new) if lv else (cur.cache_level, cur.cache_level)
        pr_old, pr_new = (pr.old, pr.new) if pr else (cur.priority, cur.priority)
        # NOTE: built directly; NamedTuple._replace costs ~3x as much
        view.changed[h] = BlockRow(cur.node_id, h, cur.parent_hash, lv_new, pr_new, cur.num_tokens, cur.lora_id,
                                   cur.window_size, cur.stored_at, batch_ts)
        self.out.history.append((view.node_id, instance, ev.event_id, 0, "updated", h, cur.parent_hash,
                                 lv_old, lv_new, pr_old, pr_new, cur.num_tokens, cur.lora_id, cur.stored_at,
                                 batch_ts))
        return status

    def _created(self, view: _NodeView, row: NodeRow, ev: Event, d: Created, batch_ts: datetime) -> NodeRow:
        """The node's state anew, with its capacities (the node is live again)."""
        view.clear()
        self.out.resets.add(row.node_id)
        caps = [*d.num_blocks_per_cache_level, 0, 0]
        row = replace(row, capacity_gpu=caps[0], capacity_host=caps[1])
        self.out.history.append(_row(row, ev.event_id, 0, "created", None, None, None, None, None, None, None,
                                     None, None, batch_ts))
        return row

    def _snapshot(self, view: _NodeView, row: NodeRow, ev: Event, d: Snapshot, status: str,
                  batch_ts: datetime) -> str:
        """Part 0 replaces the node's state (the node is live again); a later part adds to it,
        or while resyncing (part 0 was missed) is history only."""
        hashes = to_sql_list([sb.block_hash for sb in d.blocks])
        if d.part == 0:
            status = LIVE
            # A block the snapshot re-asserts keeps the time it was first stored.
            since = {h: cur.stored_at for h in hashes if (cur := view.get(h)) is not None}
            view.clear(keep_before=d.parts > 1)
            self.out.resets.add(row.node_id)
        else:
            # Blocks keep the time they were first stored, as in part 0; a part planned in a
            # later transaction than its part 0 no longer sees it (the time of this batch then).
            since = {h: cur.stored_at for h in hashes if (cur := view.get_before(h)) is not None}
        applying = status != RESYNCING
        for seq, (h, sb) in enumerate(zip(hashes, d.blocks, strict=True)):
            p = to_sql(sb.parent_hash) if sb.parent_hash is not None else None
            if applying:
                view.changed[h] = BlockRow(row.node_id, h, p, sb.cache_level, sb.priority, sb.num_tokens,
                                           sb.lora_id, ev.window_size, since.get(h, batch_ts), batch_ts)
            self.out.history.append(_row(row, ev.event_id, seq, "snapshot", h, p, None, sb.cache_level, None,
                                         sb.priority, sb.num_tokens, sb.lora_id, None, batch_ts))
        if not d.blocks:
            self.out.history.append(_row(row, ev.event_id, 0, "snapshot", None, None, None, None, None, None,
                                         None, None, None, batch_ts))
        return status

    def finish(self) -> RowsPlan:
        """The plan of everything added (the net change of ``node_blocks``)."""
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


def plan(batches: Sequence[EventBatch], nodes: Mapping[NodeId, NodeRow], known: KnownBlocks) -> RowsPlan:
    """The writes of one transaction for ``batches`` (see the module docstring).

    Args:
        batches: decoded batches in consumption order (per node: Kafka order).
        nodes: current ``nodes`` rows of the batches' nodes (missing: never seen).
        known: current ``node_blocks`` rows for at least :func:`blocks_to_look_up`.

    Returns:
        The plan; neither ``nodes`` nor ``known`` is modified.
    """
    planner = Planner(nodes, known)
    for b in batches:
        planner.add(b)
    return planner.finish()


def _row(row: NodeRow, event_id: int, seq: int, kind: str, h: int | None, parent: int | None,
         level_old: int | None, level_new: int | None, prio_old: int | None, prio_new: int | None,
         num_tokens: int | None, lora_id: int | None, stored_at: datetime | None, event_ts: datetime) -> HistoryRow:
    return (row.node_id, row.instance_id, event_id, seq, kind, h, parent, level_old, level_new,
            prio_old, prio_new, num_tokens, lora_id, stored_at, event_ts)
