"""The hot path's writes against real PostgreSQL: new rows are inserted, held rows updated or
deleted, a block stored and removed within a take is never written, and a database that is not
where the worker's cache says is caught (StaleCache) with nothing written."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

import state_store.native
from eventbus import protocol as p
from state_store.config import plain_dsn
from state_store.native import NativeNodeCache, plan_fast
from state_store.writer import StaleCache, Writer

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not state_store.native.available(), reason="kvflow_native is not installed")]

T0 = 1_700_000_000.0


def batch(first_id: int, *datas: p.EventData) -> p.EventBatch:
    return p.EventBatch(schema_version=1, node_id="n", instance_id="i", ts=T0 + first_id,
                        events=[p.Event(event_id=first_id + i, window_size=64, data=d) for i, d in enumerate(datas)])


def stored(parent: int | None, *hashes: int) -> p.Stored:
    return p.Stored(parent_hash=parent, blocks=[p.StoredBlock(block_hash=h, num_tokens=4) for h in hashes])


async def sql_state(conn: asyncpg.Connection) -> tuple[dict[int, tuple[Any, ...]], int]:
    rows = await conn.fetch("SELECT block_hash, parent_hash, cache_level, priority FROM node_blocks "
                            "WHERE node_id = 'n'")
    last = await conn.fetchval("SELECT last_event_id FROM nodes WHERE node_id = 'n'")
    return {r[0]: tuple(r[1:]) for r in rows}, last


async def scenario(url: str) -> None:
    writer = Writer(url)
    plain = await asyncpg.connect(plain_dsn(url))
    try:
        # The node starts (the reference planner, from the database): blocks 1 <- 2 <- 3.
        await writer.apply([batch(0, p.Created(num_blocks_per_cache_level=[8, 4]), stored(None, 1, 2, 3))])
        cache = NativeNodeCache()
        nodes, blocks = await writer.load(["n"])
        cache.load(nodes, blocks, ["n"])

        async def write(*b: p.EventBatch) -> None:
            pl = plan_fast(cache, list(b))
            assert pl is not None
            expected = cache.expected(["n"])
            cache.apply(pl)
            await writer.apply_planned(pl, expected)

        # 4 is new (inserted), 2 changes level (updated), 3 goes (deleted), 5 comes and goes (neither).
        await write(batch(2, stored(2, 4), p.Updated(block_hash=2, cache_level=p.LevelDiff(old=0, new=1)),
                          p.Removed(block_hashes=[3]), stored(4, 5), p.Removed(block_hashes=[5])))
        blocks_now, last = await sql_state(plain)
        assert blocks_now == {1: (None, 0, 35), 2: (1, 1, 35), 4: (2, 0, 35)}
        assert last == 6
        assert await plain.fetchval("SELECT count(*) FROM block_events WHERE node_id = 'n'") == 4 + 5

        # Behind the worker's back: block 1 gone, block 9 there. Each take that relies on the cache
        # is refused, and writes nothing.
        await plain.execute("DELETE FROM node_blocks WHERE node_id = 'n' AND block_hash = 1")
        await plain.execute("INSERT INTO node_blocks (node_id, block_hash, cache_level, priority, num_tokens, "
                            "stored_at, updated_at) VALUES ('n', 9, 0, 35, 4, now(), now())")
        before = await sql_state(plain)
        history = await plain.fetchval("SELECT count(*) FROM block_events")
        for take in (batch(7, p.Removed(block_hashes=[1])),
                     batch(7, p.Updated(block_hash=1, priority=p.PriorityDiff(old=35, new=80))),
                     batch(7, stored(4, 9))):
            cache.clear()
            nodes, blocks = await writer.load(["n"])
            cache.load(nodes, [b for b in blocks if b.block_hash != 9] + [
                b._replace(block_hash=1) for b in blocks if b.block_hash == 9], ["n"])  # the stale view
            with pytest.raises(StaleCache):
                await write(take)
            assert await sql_state(plain) == before
            assert await plain.fetchval("SELECT count(*) FROM block_events") == history

        # The node's row itself gone (the cache still has it): refused too.
        await plain.execute("DELETE FROM nodes WHERE node_id = 'n'")
        cache.clear()
        cache.load(nodes, blocks, ["n"])
        with pytest.raises(StaleCache, match="node rows missing"):
            await write(batch(7, stored(4, 10)))
        assert await plain.fetchval("SELECT count(*) FROM block_events") == history
    finally:
        await plain.close()
        await writer.close()


def test_hot_path_writes_are_exact_and_a_stale_cache_is_caught(migrated_database_url):
    asyncio.run(scenario(migrated_database_url))
