"""kvflow's own history as a request trace: ``block_events`` → Mooncake JSON lines.

Each ``stored`` event (the rows of one node, instance and event id, ordered by ``seq``) holds the
blocks a request newly cached. Its first row's ``parent_hash`` names the block before them, whose
own ``stored`` (or ``snapshot``) row, earlier on the same node and instance, names the one before
that, and so on: the request's prompt is that chain of ancestors followed by the event's blocks.
:class:`TraceBuilder` (pure: rows in, :class:`~kvflow.traces.TraceRequest` out) does this;
:func:`export_trace` streams the rows from PostgreSQL with one query through a server-side
cursor. The rules and their limits are in docs/traces.md ("Exporting kvflow's history").
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from kvflow.traces import TraceRequest

#: The one query of the export: every stored and snapshot row of a block (an empty snapshot has a
#: row without one), grouped by node and instance, in event order (``$1``: a node or null, ``$2``: an end time or null).
EXPORT_QUERY = """
SELECT node_id, instance_id, event_id, seq, kind, block_hash, parent_hash, num_tokens, event_ts
FROM block_events
WHERE kind IN ('stored', 'snapshot') AND block_hash IS NOT NULL
  AND ($1::text IS NULL OR node_id = $1)
  AND ($2::timestamptz IS NULL OR event_ts < $2)
ORDER BY node_id, instance_id, event_id, seq
"""

_MS = timedelta(milliseconds=1)


@dataclass(frozen=True, slots=True)
class EventRow:
    """The columns of a ``block_events`` row that the export reads."""

    node_id: str
    instance_id: str
    event_id: int
    seq: int
    kind: str  # "stored" or "snapshot" (other kinds are ignored)
    block_hash: int
    parent_hash: int | None
    num_tokens: int | None
    event_ts: datetime


@dataclass
class ExportStats:
    stored_events: int = 0
    #: Stored events exported as requests.
    requests: int = 0
    #: One-block stored events right after the last block of an earlier stored event: decode.
    decode_continuations: int = 0
    #: Requests whose chain stops at a parent that no earlier row of their node and instance holds.
    partial_chains: int = 0
    #: Stored events before ``since`` (their blocks still serve as ancestors).
    before_since: int = 0


@dataclass(frozen=True, slots=True)
class _Pending:
    ts: datetime
    node_id: str
    instance_id: str
    event_id: int
    prompt: tuple[int, ...]
    tokens: int


class TraceBuilder:
    """Rows in ``(node_id, instance_id, event_id, seq)`` order in (:meth:`add`); the trace out (:meth:`finish`).

    * A stored event is a request, its prompt the ancestor chain plus its blocks, its
      ``input_length`` the ``num_tokens`` of them all; ``output_length`` is 0 (unknown).
    * An event of exactly one block whose parent is the last block of an earlier stored event of
      the same node and instance is a decode continuation (a generated block): not a request,
      but its block is an ancestor for later requests (the next turn of a conversation).
    * The chain is walked through the blocks of earlier rows (stored or snapshot) of the same node
      and instance; it stops at a parent none of them holds (counted in ``partial_chains``), or at
      a block already in it.
    * Requests stored before ``since`` are left out (their blocks still count as ancestors);
      rows at or after ``until`` are ignored.
    * The trace is in time order (ties: node, instance, event id); timestamps are whole ms from
      the first request exported; block hashes become ids 0, 1, 2 … in order of first appearance.
    """

    def __init__(self, since: datetime | None = None, until: datetime | None = None) -> None:
        self.since, self.until = since, until
        self.stats = ExportStats()
        self._pending: list[_Pending] = []
        self._group: tuple[str, str] | None = None
        self._known: dict[int, tuple[int | None, int]] = {}  # block -> (parent, tokens)
        self._tips: set[int] = set()  # the last block of each stored event so far
        self._event: list[EventRow] = []

    def add(self, row: EventRow) -> None:
        if self.until is not None and row.event_ts >= self.until:
            return
        ev = self._event
        if ev and (row.node_id, row.instance_id, row.event_id) != (ev[0].node_id, ev[0].instance_id,
                                                                     ev[0].event_id):
            self._close_event()
        if (row.node_id, row.instance_id) != self._group:
            self._group = (row.node_id, row.instance_id)
            self._known, self._tips = {}, set()
        self._event.append(row)

    def _close_event(self) -> None:
        rows, self._event = self._event, []
        stored = [r for r in rows if r.kind == "stored" and r.block_hash is not None]
        if stored:
            self._stored(stored)
        for r in rows:
            if r.kind in ("stored", "snapshot") and r.block_hash is not None:
                self._known.setdefault(r.block_hash, (r.parent_hash, r.num_tokens or 0))

    def _stored(self, rows: list[EventRow]) -> None:
        self.stats.stored_events += 1
        blocks = [r.block_hash for r in rows]
        parent = rows[0].parent_hash
        decode = len(blocks) == 1 and parent is not None and parent in self._tips
        self._tips.add(blocks[-1])
        if decode:
            self.stats.decode_continuations += 1
            return
        first = rows[0]
        if self.since is not None and first.event_ts < self.since:
            self.stats.before_since += 1
            return
        chain: list[int] = []
        seen = set(blocks)
        tokens = sum(r.num_tokens or 0 for r in rows)
        h = parent
        while h is not None and h not in seen:
            entry = self._known.get(h)
            if entry is None:
                self.stats.partial_chains += 1
                break
            chain.append(h)
            seen.add(h)
            h, n = entry
            tokens += n
        self._pending.append(_Pending(first.event_ts, first.node_id, first.instance_id, first.event_id,
                                      (*reversed(chain), *blocks), tokens))

    def finish(self) -> list[TraceRequest]:
        if self._event:
            self._close_event()
        reqs = sorted(self._pending, key=lambda p: (p.ts, p.node_id, p.instance_id, p.event_id))
        self.stats.requests = len(reqs)
        if not reqs:
            return []
        t0 = reqs[0].ts
        ids: dict[int, int] = {}
        return [TraceRequest(((p.ts - t0) // _MS) / 1000, p.tokens, 0,
                             tuple(ids.setdefault(h, len(ids)) for h in p.prompt)) for p in reqs]


def rows_to_trace(rows: Iterable[EventRow], *, since: datetime | None = None,
                  until: datetime | None = None) -> list[TraceRequest]:
    """The trace of ``block_events`` rows given in ``(node_id, instance_id, event_id, seq)`` order."""
    b = TraceBuilder(since, until)
    for r in rows:
        b.add(r)
    return b.finish()


def parse_time(text: str) -> datetime:
    """An ISO 8601 time; without a zone, UTC."""
    t = datetime.fromisoformat(text)
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


async def fetch_rows(url: str, *, node: str | None = None, until: datetime | None = None,
                     batch: int = 10_000) -> AsyncIterator[EventRow]:
    """The export's rows, ``batch`` at a time through a server-side cursor (one read-only transaction)."""
    import asyncpg

    from state_store.config import plain_dsn

    conn = await asyncpg.connect(plain_dsn(url))
    try:
        async with conn.transaction(readonly=True, isolation="repeatable_read"):
            async for r in conn.cursor(EXPORT_QUERY, node, until, prefetch=batch):
                yield EventRow(r["node_id"], r["instance_id"], r["event_id"], r["seq"], r["kind"], r["block_hash"],
                               r["parent_hash"], r["num_tokens"], r["event_ts"])
    finally:
        await conn.close()


async def export_trace(url: str, out: str | Path, *, node: str | None = None, since: datetime | None = None,
                       until: datetime | None = None) -> ExportStats:
    """Write the trace of ``block_events`` at ``url`` (optionally one node's, within [since, until)) to ``out``."""
    from kvflow.sim.workloads import write_trace_requests

    b = TraceBuilder(since, until)
    async for row in fetch_rows(url, node=node, until=until):
        b.add(row)
    write_trace_requests(b.finish(), out)
    return b.stats
