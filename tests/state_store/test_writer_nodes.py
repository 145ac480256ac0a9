"""A node's life in the ``nodes`` table, against real PostgreSQL: its goodbye (a stopping
heartbeat), snapshot requests repeated with backoff while it resyncs, its row pruned long after it
went (its history stays)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import msgspec
import pytest

from eventbus import protocol as p
from state_store.apply import NodeCache, Planner
from state_store.config import plain_dsn
from state_store.writer import StaleCache, Writer

pytestmark = pytest.mark.integration


def batch(node: str, inst: str, first_id: int, *datas: p.EventData) -> p.EventBatch:
    return p.EventBatch(schema_version=1, node_id=node, instance_id=inst, ts=time.time(),
                        events=[p.Event(event_id=first_id + i, window_size=64, data=d) for i, d in enumerate(datas)])


def stored(parent: int | None, *hashes: int) -> p.Stored:
    return p.Stored(parent_hash=parent, blocks=[p.StoredBlock(block_hash=h, num_tokens=4) for h in hashes])


CREATED = p.Created(num_blocks_per_cache_level=[8, 4])


def heartbeat(node: str, inst: str, status: str = "live") -> p.NodeStats:
    return p.NodeStats(schema_version=1, node_id=node, instance_id=inst, url="http://n", model="m", block_size=4,
                       ts=time.time(), capacity=[8, 4], used=[1, 0], active_requests=0, queued_requests=0,
                       last_event_id=0, status=status)  # type: ignore[arg-type]


class Db:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    async def node(self, node: str) -> dict[str, Any] | None:
        r = await self.conn.fetchrow("SELECT * FROM nodes WHERE node_id = $1", node)
        return dict(r) if r else None

    async def count(self, table: str, node: str) -> int:
        return int(await self.conn.fetchval(f"SELECT count(*) FROM {table} WHERE node_id = $1", node))


def run(url: str, scenario: Any) -> None:
    async def main() -> None:
        writer = Writer(url)
        conn = await asyncpg.connect(plain_dsn(url))
        try:
            await scenario(writer, Db(conn))
        finally:
            await conn.close()
            await writer.close()

    asyncio.run(main())


def test_a_goodbye_makes_the_node_gone_at_once_and_its_late_events_are_history_only(migrated_database_url):
    async def scenario(writer: Writer, db: Db) -> None:
        await writer.apply([batch("a", "i1", 0, CREATED, stored(None, 1, 2))])
        assert await writer.apply_stats([heartbeat("a", "i1")]) == []
        history = await db.count("block_events", "a")
        # The worker's cache of the node, as it was before the goodbye.
        cache = NodeCache()
        cache.load(*await writer.load(["a"]), ["a"])
        expected = cache.expected(["a"])

        assert await writer.apply_stats([heartbeat("a", "i1", "stopping")]) == ["a"]
        row = await db.node("a")
        assert row is not None and row["status"] == "gone" and row["stopped_at"] is not None
        assert await db.count("node_blocks", "a") == 0
        assert await db.count("block_events", "a") == history  # the history stays
        assert await db.count("node_stats_samples", "a") == 2
        assert await writer.apply_stats([heartbeat("a", "i1", "stopping")]) == []  # once per instance

        # A plan made from the cache of before is refused (the node's blocks were cleared).
        planner = Planner(cache.nodes, cache)
        planner.add(batch("a", "i1", 3, stored(2, 3)))
        with pytest.raises(StaleCache):
            await writer.apply_planned(planner.finish(), expected)
        # Its last events, consumed after the goodbye: recorded, not applied, nothing asked.
        applied = await writer.apply([batch("a", "i1", 3, stored(2, 3), p.Removed(block_hashes=[1]))])
        assert applied.resync_now == [] and applied.plan.resync == set()
        row = await db.node("a")
        assert row is not None and (row["status"], row["last_event_id"]) == ("gone", 4)
        assert await db.count("node_blocks", "a") == 0
        assert await db.count("block_events", "a") == history + 2
        # Heartbeats of the same instance do not bring it back; a new instance does.
        await writer.apply_stats([heartbeat("a", "i1")])
        assert (await db.node("a") or {})["status"] == "gone"
        await writer.apply([batch("a", "i2", 0, CREATED, stored(None, 7))])
        row = await db.node("a")
        assert row is not None and (row["status"], row["instance_id"], row["stopped_at"]) == ("live", "i2", None)
        assert await db.count("node_blocks", "a") == 1

    run(migrated_database_url, scenario)


def test_a_goodbye_counts_only_for_the_instance_the_row_holds(migrated_database_url):
    async def scenario(writer: Writer, db: Db) -> None:
        # b restarted: the old instance's goodbye is consumed after the new one's first events.
        await writer.apply([batch("b", "new", 0, CREATED, stored(None, 1))])
        assert await writer.apply_stats([heartbeat("b", "old", "stopping")]) == []
        row = await db.node("b")
        assert row is not None and row["status"] == "live" and row["stopped_at"] is None
        assert await db.count("node_blocks", "b") == 1
        # A stale node's goodbye does not make it live first; a node first heard of by its goodbye
        # is gone.
        await writer.apply([batch("c", "i", 0, CREATED)])
        await db.conn.execute("UPDATE nodes SET status = 'stale' WHERE node_id = 'c'")
        assert await writer.apply_stats([heartbeat("c", "i", "stopping"), heartbeat("d", "j", "stopping")]) == [
            "c", "d"]
        assert [(await db.node(n) or {})["status"] for n in "cd"] == ["gone", "gone"]
        # Of several heartbeats of a node in one take, the newest counts.
        bye, back = heartbeat("b", "new", "stopping"), heartbeat("b", "new")
        assert await writer.apply_stats([bye, msgspec.structs.replace(back, ts=bye.ts + 1)]) == []

    run(migrated_database_url, scenario)


def test_snapshot_requests_repeat_with_a_doubling_backoff_while_the_node_resyncs(migrated_database_url):
    async def scenario(writer: Writer, db: Db) -> None:
        await writer.apply([batch("n", "i", 0, CREATED, stored(None, 1))])
        applied = await writer.apply([batch("n", "i", 5, stored(1, 2))])  # a gap
        assert applied.resync_now == ["n"]
        assert (await db.node("n") or {})["resync_attempts"] == 1

        async def asked_after(seconds_ago: float) -> list[tuple[str, int]]:
            await db.conn.execute("UPDATE nodes SET resync_requested_at = now() - make_interval(secs => $1)",
                                  seconds_ago)
            return await writer.repeat_resyncs(1.0, 4.0)

        assert await writer.repeat_resyncs(1.0, 4.0) == []  # just asked
        assert await asked_after(1.1) == [("n", 2)]  # 1 s after the first request
        assert await asked_after(1.9) == []  # 2 s after the second
        assert await asked_after(2.1) == [("n", 3)]
        assert await asked_after(3.9) == []  # 4 s after the third
        assert await asked_after(4.1) == [("n", 4)]
        assert await asked_after(4.1) == [("n", 5)]  # at most 4 s (8 s capped)
        # The snapshot heals it: no more requests, and the count starts again.
        await writer.apply([batch("n", "i", 6, p.Snapshot(blocks=[]))])
        row = await db.node("n")
        assert row is not None and (row["status"], row["resync_attempts"]) == ("live", 0)
        assert await asked_after(100) == []

    run(migrated_database_url, scenario)


def test_long_gone_nodes_rows_are_pruned_their_history_stays_and_one_back_is_new(migrated_database_url):
    async def scenario(writer: Writer, db: Db) -> None:
        for node in ("old", "recent", "silent"):
            await writer.apply([batch(node, "i", 0, CREATED, stored(None, 1))])
            await writer.apply_stats([heartbeat(node, "i")])
        await db.conn.execute("""UPDATE nodes SET status = CASE WHEN node_id = 'silent' THEN 'stale' ELSE 'gone' END,
                                 status_changed_at = now() - interval '2 hours',
                                 last_seen = now() - interval '2 hours' WHERE node_id <> 'recent'""")
        await db.conn.execute("UPDATE nodes SET status = 'gone' WHERE node_id = 'recent'")
        history = await db.count("block_events", "old")
        assert await writer.prune_gone(3600) == ["old"]
        assert await db.node("old") is None and await db.count("node_blocks", "old") == 0
        assert await db.count("block_events", "old") == history
        assert await db.count("node_stats_samples", "old") == 1
        assert {n for n in ("recent", "silent") if await db.node(n)} == {"recent", "silent"}
        assert await writer.prune_gone(3600) == []
        # The same instance speaks again: to the materializer a new node that missed its start.
        first_seen = (await db.node("recent") or {})["first_seen"]
        await writer.apply([batch("old", "i", 2, stored(1, 2))])
        row = await db.node("old")
        assert row is not None and row["status"] == "resyncing" and row["first_seen"] > first_seen

    run(migrated_database_url, scenario)
