"""The compiled hot path (kvflow_native) writes exactly what the reference planner writes.

The materializer's pipeline plans each take with the compiled store when the take is plain, and
with the Python planner (over the same cache) otherwise. Here both run on the same random streams
of KV cores — with redeliveries, gaps, restarts, snapshots, stale nodes and events contradicting
the state mixed in — and every take's rows are compared: the binary COPY data is parsed back.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import struct
from dataclasses import replace
from datetime import datetime
from typing import Any

import msgspec
import pytest

from eventbus import protocol as p
from state_store.apply import NodeCache, Planner, ts
from state_store.native import NativeNodeCache, available, plan_fast
from state_store.pgtime import from_pg_micros, pg_micros
from state_store.pipeline import TakePlanner
from state_store.plans import (
    LIVE,
    STALE,
    BlockRow,
    CompiledPlan,
    NodeRow,
    PartsPlan,
    Plan,
    RowsPlan,
)
from tests.support import CoreNode

if not available():
    if os.environ.get("KVFLOW_REQUIRE_NATIVE") == "1":
        pytest.fail("kvflow_native is not installed (make install builds it)", pytrace=False)
    pytest.skip("kvflow_native is not installed (pip install ./native)", allow_module_level=True)

HISTORY_TYPES = ("text", "text", "i8", "i4", "text", "i8", "i8", "i2", "i2", "i2", "i2", "i4", "i8", "ts", "ts")
BLOCK_TYPES = ("text", "i8", "i8", "i2", "i2", "i4", "i8", "i4", "ts", "ts")


def parse_copy(data: bytes, types: tuple[str, ...]) -> list[tuple[Any, ...]]:
    """Rows of PostgreSQL binary COPY data (the format, checked strictly)."""
    assert data[:11] == b"PGCOPY\n\xff\r\n\0"
    assert struct.unpack_from(">ii", data, 11) == (0, 0)
    pos, rows = 19, []
    while True:
        (n,) = struct.unpack_from(">h", data, pos)
        pos += 2
        if n == -1:
            break
        assert n == len(types)
        row: list[Any] = []
        for t in types:
            (size,) = struct.unpack_from(">i", data, pos)
            pos += 4
            if size == -1:
                row.append(None)
                continue
            raw = data[pos:pos + size]
            pos += size
            if t == "text":
                row.append(raw.decode())
            else:
                fmt = {"i8": ">q", "i4": ">i", "i2": ">h", "ts": ">q"}[t]
                assert size == struct.calcsize(fmt)
                (v,) = struct.unpack(fmt, raw)
                row.append(from_pg_micros(v) if t == "ts" else v)
        rows.append(tuple(row))
    assert pos == len(data)
    return rows


Keyed = dict[tuple[str, int], BlockRow]


def rows_of(part: RowsPlan | CompiledPlan) -> tuple[list[tuple[Any, ...]], Keyed, Keyed, Keyed, set[tuple[str, int]]]:
    """A part's history rows, inserts, updates, upserts (either) and deletes; the hot path's
    parsed from its COPY data (it always knows which rows are new: no upserts)."""
    if isinstance(part, RowsPlan):
        return part.history, {}, {}, part.upserts, part.deletes
    n = part.writes
    history = parse_copy(n.history, HISTORY_TYPES)
    inserts = [BlockRow(*r) for r in parse_copy(n.inserts, BLOCK_TYPES)]
    updates = [BlockRow(*r) for r in parse_copy(n.updates, BLOCK_TYPES)]
    deletes = parse_copy(n.deletes, ("text", "i8"))
    assert (len(history), len(inserts), len(updates), len(deletes)) == (
        n.history_rows, n.insert_rows, n.update_rows, n.delete_rows)
    return (history, {(r.node_id, r.block_hash): r for r in inserts},
            {(r.node_id, r.block_hash): r for r in updates}, {}, set(deletes))


def write(sql: Keyed, pl: Plan) -> list[tuple[Any, ...]]:
    """What Writer.write does to node_blocks (a dict here), in its order; returns the history rows.
    A delete or update of a row that is not there, or an insert of one that is, fails (as the
    writer makes them fail: the cache was wrong)."""
    history: list[tuple[Any, ...]] = []
    for part in parts_of(pl):
        if isinstance(part, RowsPlan):
            for key in [k for k in sql if k[0] in part.resets]:
                del sql[key]
        rows, inserts, updates, upserts, deletes = rows_of(part)
        for key in deletes:
            del sql[key]
        for key, row in updates.items():
            assert key in sql, key
            sql[key] = row
        for key, row in inserts.items():
            assert key not in sql, key
            sql[key] = row
        sql.update(upserts)
        history += rows
    return history


def parts_of(pl: Plan) -> list[RowsPlan | CompiledPlan]:
    return pl.parts if isinstance(pl, PartsPlan) else [pl]


def node_of(row: tuple[Any, ...]) -> str:
    return row[0]


def reference(cache: NodeCache, take: list[p.EventBatch]) -> RowsPlan:
    planner = Planner(cache.nodes, cache)
    for b in take:
        planner.add(b)
    pl = planner.finish()
    cache.apply(pl)
    return pl


def perturbed_stream(seed: int) -> list[p.EventBatch]:
    """Batches of three KV cores in publish order, with the troubles a materializer meets."""
    rng = random.Random(seed)
    nodes = [CoreNode(None, f"n{i}", seed=seed * 10 + i) for i in range(3)]
    out: list[p.EventBatch] = []
    seen = 0
    for step in range(600):
        for n in nodes:
            n.step()
        if step == 300:  # n1 restarts: a new instance
            nodes[1] = CoreNode(None, "n1", seed=seed * 10 + 7)
        if step % 50 == 49:  # what the materializer asks of a node after a gap or an anomaly
            nodes[step // 50 % 3].core.request_snapshot()
        for n in nodes:
            n.publisher.pump()
        fresh = [b for n in nodes for b in n.sink.batches]
        for n in nodes:
            n.sink.batches.clear()
        for b in fresh:
            r = rng.random()
            if r < 0.005 and out:
                out.append(rng.choice(out))  # a redelivery of an earlier batch
            if r > 0.997 and b.node_id == "n2":
                continue  # lost: a gap until n2's next snapshot
            if 0.990 < r <= 0.993:  # an event the stored state contradicts
                ev = b.events[0]
                b = msgspec.structs.replace(b, events=[
                    msgspec.structs.replace(ev, data=p.Removed(block_hashes=[rng.getrandbits(64)])), *b.events[1:]])
            if 0.993 < r <= 0.996:  # a window beyond SQL's integer (valid on the wire)
                b = msgspec.structs.replace(b, events=[
                    msgspec.structs.replace(e, window_size=p.MAX_WINDOW_SIZE) for e in b.events])
            out.append(b)
            seen += 1
    assert seen > 300
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_hot_path_writes_what_the_reference_planner_writes(seed):
    stream = perturbed_stream(seed)
    rng = random.Random(seed)
    ref = NodeCache()
    planner = TakePlanner(native=True)
    nat = planner.cache
    assert isinstance(nat, NativeNodeCache)
    i = takes = mixed = offloads = 0
    by: collections.Counter[str] = collections.Counter()
    sql_ref: dict[tuple[str, int], BlockRow] = {}
    sql_nat: dict[tuple[str, int], BlockRow] = {}
    while i < len(stream):
        take = stream[i:i + rng.randint(1, 12)]
        i += len(take)
        takes += 1
        for c in (ref, nat):  # first sight of a node: the database has nothing of it
            if missing := c.missing({b.node_id for b in take}):
                c.load([], [], missing)
        if rng.random() < 0.02:  # a node gone stale in SQL (no heartbeat): its next batch revives it
            for c in (ref, nat):
                if "n0" in c.nodes:
                    c.nodes["n0"] = replace(c.nodes["n0"], status=STALE)
        want = reference(ref, take)
        got = asyncio.run(planner.plan(take, planner.generation))
        assert got is not None
        parts = parts_of(got)
        mixed += len(parts) > 1
        by[got.planned_by()] += 1
        want_history = write(sql_ref, want)
        got_history = write(sql_nat, got)
        assert sql_nat == sql_ref
        # The parts plan nodes in turn: each node's rows in order.
        assert sorted(got_history, key=node_of) == sorted(want_history, key=node_of)
        for row in got_history:  # an updated row of a known block has its state before and after
            if row[4] == "updated" and row[13] is not None:
                assert None not in row[7:11], row
                offloads += row[7:9] == (0, 1)
        assert sorted(got.batch_ts) == sorted(want.batch_ts)
        assert got.counts == want.counts
        assert got.resync == want.resync
        final: dict[str, NodeRow] = {}
        for part in parts:
            final.update(part.nodes)
        assert final == want.nodes
        assert nat.nodes == ref.nodes
    for n in ref.blocks:
        assert nat.blocks_of(n) == ref.blocks[n]
    # Both paths were really taken.
    assert by["compiled"] > takes / 2
    assert by["python"] + by["parts"] > 10
    assert by["parts"] > 0
    assert mixed > 5
    assert offloads > 10  # the streams offload (their rows are checked above)


T0 = 1_700_000_000.0


def batch(node: str, inst: str, first_id: int, *datas: p.EventData, window: int = 64) -> p.EventBatch:
    return p.EventBatch(schema_version=1, node_id=node, instance_id=inst, ts=T0,
                        events=[p.Event(event_id=first_id + i, window_size=window, data=d)
                                for i, d in enumerate(datas)])


def loaded(*blocks: int) -> NativeNodeCache:
    c = NativeNodeCache()
    t = ts(T0 - 10)
    c.load([node_row("n")], [BlockRow("n", h, None, 0, 35, 4, None, 64, t, t) for h in blocks], ["n"])
    return c


def node_row(node: str) -> NodeRow:
    return NodeRow(node_id=node, instance_id="i", last_event_id=9, status=LIVE, instance_started_at=ts(T0 - 100))


def stored(parent: int | None, *hashes: int) -> p.Stored:
    return p.Stored(parent_hash=parent, blocks=[p.StoredBlock(block_hash=h, num_tokens=4) for h in hashes])


@pytest.mark.parametrize(("why", "take"), [
    ("a node not in the cache", [batch("other", "i", 0, stored(None, 1))]),
    ("another instance", [batch("n", "j", 0, stored(None, 1))]),
    ("a gap", [batch("n", "i", 11, stored(None, 1))]),
    ("a redelivery", [batch("n", "i", 9, stored(None, 1))]),
    ("created", [batch("n", "i", 10, p.Created(num_blocks_per_cache_level=[8]))]),
    ("a snapshot", [batch("n", "i", 10, p.Snapshot(blocks=[]))]),
    ("stored twice", [batch("n", "i", 10, stored(None, 5))]),
    ("removed unknown", [batch("n", "i", 10, p.Removed(block_hashes=[6]))]),
    ("updated unknown", [batch("n", "i", 10, p.Updated(block_hash=6, priority=p.PriorityDiff(old=35, new=1)))]),
    ("window beyond integer", [batch("n", "i", 10, stored(None, 1), window=p.MAX_WINDOW_SIZE)]),
    ("the second batch", [batch("n", "i", 10, stored(None, 1)), batch("n", "i", 11, p.Removed(block_hashes=[2]))]),
])
def test_takes_outside_the_hot_path_leave_the_cache_untouched(why, take):
    c = loaded(5)
    before = (dict(c.nodes), c.blocks_of("n"))
    assert plan_fast(c, take) is None, why
    assert (dict(c.nodes), c.blocks_of("n")) == before


def test_a_plain_take_rows_and_the_store_after_it():
    c = loaded(5, 9)
    big = (1 << 64) - 1  # wire hashes are unsigned; SQL's are the same bits, signed
    take = [batch("n", "i", 10, stored(5, 7, big), p.Updated(block_hash=5, cache_level=p.LevelDiff(old=0, new=1)),
                  p.Removed(block_hashes=[7, 9]))]
    pl = plan_fast(c, take)
    assert isinstance(pl, CompiledPlan)
    t, old = ts(T0), ts(T0 - 10)
    history, inserts, updates, upserts, deletes = rows_of(pl)
    assert history == [
        ("n", "i", 10, 0, "stored", 7, 5, None, 0, None, 35, 4, None, None, t),
        ("n", "i", 10, 1, "stored", -1, 7, None, 0, None, 35, 4, None, None, t),
        ("n", "i", 11, 0, "updated", 5, None, 0, 1, 35, 35, 4, None, old, t),  # an offload has its priority
        ("n", "i", 12, 0, "removed", 7, 5, 0, None, 35, None, 4, None, t, t),
        ("n", "i", 12, 1, "removed", 9, None, 0, None, 35, None, 4, None, old, t),
    ]
    # 7 was stored and removed within the take: node_blocks never sees it.
    assert inserts == {("n", -1): BlockRow("n", -1, 7, 0, 35, 4, None, 64, t, t)}
    assert updates == {("n", 5): BlockRow("n", 5, None, 1, 35, 4, None, 64, old, t)}
    assert deletes == {("n", 9)}
    assert upserts == {}
    assert pl.nodes["n"].last_event_id == 12
    assert pl.counts.block_events == 5 and pl.counts.events == 3 and pl.counts.batches == 1
    assert set(c.blocks_of("n")) == {5, -1}
    assert [h for h, _ in c.store.blocks("n")] == [-1, 5]
    assert isinstance(history[0][14], datetime) and pg_micros(t) == pg_micros(history[0][14])
