"""Every query in docs/sql.md runs, with the read-only role, on a materialized workload, and
answers exactly what the workload did.

The workload is two KV cores with a host tier (they evict and offload at several priorities),
published with a clock of their own so that every time in it is known. What each query must
answer is derived here from the published events by a small model of the history (every event ×
block with the block's state before and after it), and the eviction figures are also checked
against the cores' own counters (``evictions_by_priority``, ``offloads_by_priority``).
"""

from __future__ import annotations

import asyncio
import collections
import re
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from eventbus import protocol as p
from state_store.apply import ts
from state_store.config import plain_dsn
from state_store.writer import Writer
from tests.support import CoreNode

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "sql.md"
NODES = ("node-0", "node-1")


def doc_queries() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)


@dataclass(frozen=True)
class HistoryRow:
    """A block_events row as a correct materializer writes it (the columns the queries read)."""

    node_id: str
    instance_id: str
    event_id: int
    seq: int
    kind: str
    block_hash: int | None
    level_old: int | None
    level_new: int | None
    prio_old: int | None
    prio_new: int | None
    event_ts: datetime
    stored_at: datetime | None


def history(batches: list[p.EventBatch]) -> list[HistoryRow]:
    """The model: each event × block, with the block's level and priority before and after it
    (an ``updated`` event's diff, else the block's unchanged value). A clean stream: no gaps."""
    rows: list[HistoryRow] = []
    caches: dict[str, dict[int, tuple[int, int, datetime]]] = {}  # sql hash -> (level, priority, stored_at)
    for b in batches:
        t, cache = ts(b.ts), caches.setdefault(b.node_id, {})
        for ev in b.events:
            d, at = ev.data, (b.node_id, b.instance_id, ev.event_id)
            if isinstance(d, p.Created | p.Snapshot):
                # (the workload sends one snapshot, the empty one at start-up)
                assert not isinstance(d, p.Snapshot) or (d.part == 0 and not d.blocks)
                cache.clear()
                rows.append(HistoryRow(*at, 0, d.__struct_config__.tag, None, None, None, None, None, t, None))
            elif isinstance(d, p.Stored):
                for seq, sb in enumerate(d.blocks):
                    h = p.to_sql(sb.block_hash)
                    cache[h] = (sb.cache_level, sb.priority, t)
                    rows.append(HistoryRow(*at, seq, "stored", h, None, sb.cache_level, None, sb.priority, t, None))
            elif isinstance(d, p.Removed):
                for seq, wire in enumerate(d.block_hashes):
                    h = p.to_sql(wire)
                    level, prio, since = cache.pop(h)
                    rows.append(HistoryRow(*at, seq, "removed", h, level, None, prio, None, t, since))
            elif isinstance(d, p.Updated):
                h = p.to_sql(d.block_hash)
                level, prio, since = cache[h]
                lo, ln = (d.cache_level.old, d.cache_level.new) if d.cache_level else (level, level)
                po, pn = (d.priority.old, d.priority.new) if d.priority else (prio, prio)
                cache[h] = (ln, pn, since)
                rows.append(HistoryRow(*at, 0, "updated", h, lo, ln, po, pn, t, since))
    return rows


def hour(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def minute(t: datetime) -> datetime:
    return t.replace(second=0, microsecond=0)


def evictions(rows: list[HistoryRow]) -> collections.Counter[tuple[int | None, str]]:
    """(priority, action) -> blocks: as the evictions_by_priority view counts them."""
    out: collections.Counter[tuple[int | None, str]] = collections.Counter()
    for r in rows:
        if r.kind == "removed":
            out[(r.prio_old, "removed")] += 1
        elif r.kind == "updated" and (r.level_old, r.level_new) == (0, 1):
            out[(r.prio_old, "offloaded")] += 1
    return out


class Workload:
    """Two KV cores, their batches as published, their heartbeats."""

    def __init__(self) -> None:
        self.nodes: list[CoreNode] = []
        self.batches: list[p.EventBatch] = []
        self.stats: list[p.NodeStats] = []

    def run(self) -> None:
        start = time.time() - 90.0  # every event within the last 90 s (the ManualClock moves ~10 s)
        for i, node_id in enumerate(NODES):
            node = CoreNode(None, node_id, seed=i)
            # Publish times follow the core's clock, each node a little apart: times are known and
            # no two batches share one.
            # (A microsecond per batch sent: batches between two ticks of the core's clock differ.)
            node.publisher.clock = lambda node=node, i=i: (start + node.clock.now + i * 0.001
                                                           + len(node.sink.batches) * 1e-6)
            self.nodes.append(node)
        for node in self.nodes:
            node.run(300)
            for rid in node.active:
                node.core.free(rid)
            node.active.clear()
            node.publisher.pump()
            self.batches += node.sink.batches
            now = time.time()
            self.stats += [p.NodeStats(schema_version=1, node_id=node.node_id, instance_id=node.instance_id, url="u",
                                       model="m", block_size=4, ts=now - 120 + k * 30, capacity=[24, 16],
                                       used=[3, 1], active_requests=k, queued_requests=0,
                                       last_event_id=node.core.last_event_id,
                                       counters=p.NodeCounters(prompt_tokens=100 * k, cached_tokens=40 * k))
                           for k in range(5)]

    async def materialize(self, url: str) -> None:
        writer = Writer(url)
        try:
            for b in self.batches:
                await writer.apply([b])
            for node_id in NODES:
                await writer.apply_stats([s for s in self.stats if s.node_id == node_id])
        finally:
            await writer.close()


@pytest.fixture
def workload(migrated_database_url: str) -> Workload:
    w = Workload()
    w.run()
    asyncio.run(w.materialize(migrated_database_url))
    return w


def run_documented_queries(reader_url: str) -> tuple[datetime, list[list[tuple[Any, ...]]]]:
    """Every documented query, in one read-only transaction (one ``now()``), times in UTC."""
    async def run_all() -> tuple[datetime, list[list[tuple[Any, ...]]]]:
        conn = await asyncpg.connect(plain_dsn(reader_url))
        try:
            await conn.execute("SET TIME ZONE 'UTC'")
            async with conn.transaction(readonly=True):
                now = await conn.fetchval("SELECT now()")
                return now, [[tuple(r) for r in await conn.fetch(q)] for q in doc_queries()]
        finally:
            await conn.close()

    return asyncio.run(run_all())


def test_every_documented_query_answers_what_the_workload_did(workload, reader_url):
    now, results = run_documented_queries(reader_url)
    assert len(results) == 9
    (summary, composition, popular, liveness, evicted, residency, rates, life, hit_rates) = results
    rows = history(workload.batches)
    truth = {n.node_id: {p.to_sql(h): b for h, b in n.truth().items()} for n in workload.nodes}

    # What is cached where: the cores' own state.
    assert summary == [
        (n, "live", sum(b.cache_level == 0 for b in t.values()), sum(b.cache_level == 1 for b in t.values()),
         sum(b.num_tokens for b in t.values() if b.cache_level == 0), min(b.priority for b in t.values()),
         max(b.priority for b in t.values()), sum(b.priority >= 80 for b in t.values()), 4)
        for n, t in truth.items()]
    by_tier: collections.Counter[tuple[str, int, int]] = collections.Counter()
    tokens: collections.Counter[tuple[str, int, int]] = collections.Counter()
    for n, t in truth.items():
        for b in t.values():
            by_tier[(n, b.cache_level, b.priority)] += 1
            tokens[(n, b.cache_level, b.priority)] += b.num_tokens
    assert composition == [(*k, by_tier[k], tokens[k]) for k in sorted(by_tier, key=lambda k: (k[0], k[1], -k[2]))]
    shared: dict[int, list[int]] = collections.defaultdict(list)
    for t in truth.values():
        for h, b in t.items():
            shared[h].append(b.priority)
    assert max(len(v) for v in shared.values()) == 2  # the nodes share prefixes
    assert popular == [(h, len(v), max(v)) for h, v in sorted(shared.items(), key=lambda kv: (-len(kv[1]), kv[0]))][:10]
    assert [r[:3] for r in liveness] == [(n.node_id, "live", n.core.last_event_id) for n in workload.nodes]
    assert all(timedelta(0) <= r[3] < timedelta(minutes=5) and r[4] is not None for r in liveness)

    # Evictions in the last hour by priority: offloads have their priority, and both actions
    # match what the cores counted.
    recent = [r for r in rows if hour(r.event_ts) > now - timedelta(hours=1)]
    want = evictions(recent)
    assert evicted == [(prio, action, want[(prio, action)]) for prio, action in sorted(want)]
    assert all(prio is not None for prio, _, _ in evicted)
    offloaded = {prio for prio, action, _ in evicted if action == "offloaded"}
    if len(recent) == len(rows):  # (unless the hour turned during the run: then the hour before is not "recent")
        assert len(offloaded) >= 2, evicted  # the workload offloads at several priorities
        counted: dict[str, collections.Counter[int]] = {"removed": collections.Counter(),
                                                         "offloaded": collections.Counter()}
        for n in workload.nodes:
            counted["removed"].update(n.core.stats.evictions_by_priority)
            counted["offloaded"].update(n.core.stats.offloads_by_priority)
        assert {(prio, action): blocks for prio, action, blocks in evicted} == {
            (prio, action): c for action, per in counted.items() for prio, c in per.items()}

    # How long blocks stay, by priority.
    stays: dict[int | None, list[timedelta]] = collections.defaultdict(list)
    for r in rows:
        if r.kind == "removed":
            assert r.stored_at is not None
            stays[r.prio_old].append(r.event_ts - r.stored_at)
    assert [r[:2] for r in residency] == [(prio, len(stays[prio])) for prio in sorted(stays)]  # type: ignore[type-var]
    for prio, _, median_s, longest in residency:
        assert median_s == pytest.approx(statistics.median(s.total_seconds() for s in stays[prio]), abs=1e-6)
        assert longest == max(stays[prio])

    # Event rate per node and kind (everything is within the last 10 minutes).
    blocks_of: collections.Counter[tuple[str, str]] = collections.Counter()
    events_of: dict[tuple[str, str], set[tuple[str, int]]] = collections.defaultdict(set)
    for r in rows:
        blocks_of[(r.node_id, r.kind)] += 1
        events_of[(r.node_id, r.kind)].add((r.instance_id, r.event_id))
    assert rates == [(*k, blocks_of[k], len(events_of[k])) for k in sorted(blocks_of)]
    assert {k for _, k, _, _ in rates} == {"created", "snapshot", "stored", "removed", "updated"}

    # The life of the most recently stored block, on every node.
    last = max((r for r in rows if r.kind == "stored"), key=lambda r: (r.event_ts, r.event_id, r.seq))
    assert life == [(r.event_ts, r.node_id, r.kind, r.level_old, r.level_new, r.prio_old, r.prio_new)
                    for r in sorted((r for r in rows if r.block_hash == last.block_hash),
                                    key=lambda r: (r.event_ts, r.node_id, r.event_id))]
    assert life and life[-1][2] in ("stored", "updated", "removed")

    # Prompt-token hit rate per node and minute: 100 prompt tokens and 40 cached per heartbeat.
    per_minute: collections.Counter[tuple[str, datetime]] = collections.Counter()
    for s in workload.stats:
        if s.counters.prompt_tokens:  # the first sample of each node has no delta
            per_minute[(s.node_id, minute(ts(s.ts)))] += 1
    assert hit_rates == [(n, m, Decimal(100 * k), Decimal(40 * k), Decimal("0.4000"))
                         for (n, m), k in sorted(per_minute.items())]
