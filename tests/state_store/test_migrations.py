"""Migration round trip on a real PostgreSQL, the reader role's rights, models vs. schema."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from sqlalchemy.dialects import postgresql

from migrations import current, downgrade, upgrade
from state_store.config import plain_dsn
from state_store.models import Base

pytestmark = pytest.mark.integration

TABLES = {"nodes", "node_blocks", "block_events", "node_stats_samples", "prompt_cache_keys"}
VIEWS = {"node_cache_summary", "node_cache_by_priority", "evictions_by_priority",
         "block_residency", "node_hit_rates", "prompt_cache_key_hit_rates"}


async def _fetch(url: str, sql: str, *args):
    conn = await asyncpg.connect(plain_dsn(url))
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


def _objects(url: str) -> tuple[set[str], set[str]]:
    rows = asyncio.run(_fetch(url, """
        SELECT c.relname, c.relkind::text AS relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v') AND NOT c.relispartition"""))
    return ({r["relname"] for r in rows if r["relkind"] in "rp"} - {"alembic_version"},
            {r["relname"] for r in rows if r["relkind"] == "v"})


def test_upgrade_downgrade_upgrade(database_url):
    upgrade("head", url=database_url)
    assert _objects(database_url) == (TABLES, VIEWS)
    assert asyncio.run(current(url=database_url)) == "0006"

    downgrade("base", url=database_url)
    assert _objects(database_url) == (set(), set())
    assert asyncio.run(current(url=database_url)) is None

    upgrade("head", url=database_url)
    assert _objects(database_url) == (TABLES, VIEWS)


def test_0004_adds_and_drops_the_nodes_resync_and_goodbye_columns(database_url):
    def columns() -> set[str]:
        rows = asyncio.run(_fetch(database_url, """SELECT column_name FROM information_schema.columns
                                                   WHERE table_name = 'nodes'"""))
        return {r["column_name"] for r in rows}

    upgrade("0003", url=database_url)
    asyncio.run(_fetch(database_url, "INSERT INTO nodes (node_id, instance_id) VALUES ('n', 'i') RETURNING 1"))
    assert not columns() & {"resync_attempts", "stopped_at"}
    upgrade("head", url=database_url)
    assert {"resync_attempts", "stopped_at"} <= columns()
    row = asyncio.run(_fetch(database_url, "SELECT resync_attempts, stopped_at FROM nodes"))[0]
    assert (row["resync_attempts"], row["stopped_at"]) == (0, None)  # existing rows get the defaults
    downgrade("0003", url=database_url)
    assert not columns() & {"resync_attempts", "stopped_at"}
    assert asyncio.run(current(url=database_url)) == "0003"


def test_0006_says_what_engine_serves_each_node_kvflow_for_existing_rows(database_url):
    upgrade("0005", url=database_url)
    asyncio.run(_fetch(database_url, "INSERT INTO nodes (node_id, instance_id) VALUES ('n', 'i') RETURNING 1"))
    upgrade("head", url=database_url)
    assert [r["engine"] for r in asyncio.run(_fetch(database_url, "SELECT engine FROM nodes"))] == ["kvflow"]
    downgrade("0005", url=database_url)
    rows = asyncio.run(_fetch(database_url, "SELECT column_name FROM information_schema.columns "
                                            "WHERE table_name = 'nodes' AND column_name = 'engine'"))
    assert rows == []


def test_block_events_is_partitioned_by_day_and_late_partitions_adopt_default_rows(migrated_database_url):
    url = migrated_database_url
    parts = asyncio.run(_fetch(url, """
        SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'block_events'::regclass ORDER BY 1"""))
    names = [r["relname"] for r in parts]
    assert "block_events_default" in names
    assert len(names) == 1 + 9  # yesterday .. today + 7, and the default

    async def scenario():
        conn = await asyncpg.connect(plain_dsn(url))
        try:
            # A row 30 days ahead lands in the default partition ...
            await conn.execute("""INSERT INTO block_events (node_id, instance_id, event_id, seq, kind, event_ts)
                                  VALUES ('n', 'i', 0, 0, 'created', current_date + 30)""")
            assert await conn.fetchval("SELECT count(*) FROM block_events_default") == 1
            # ... and moves into its day's partition when that partition is created.
            created = await conn.fetchval("SELECT kvflow_ensure_block_event_partitions(31)")
            assert created == 24
            assert await conn.fetchval("SELECT count(*) FROM block_events_default") == 0
            assert await conn.fetchval("SELECT count(*) FROM block_events") == 1
            # Retention drops whole old partitions.
            await conn.execute("""INSERT INTO block_events (node_id, instance_id, event_id, seq, kind, event_ts)
                                  VALUES ('n', 'i', 1, 0, 'created', now() - interval '1 day')""")
            # Keep everything from today's midnight on: yesterday's partition goes, whole.
            dropped = await conn.fetchval("SELECT kvflow_apply_retention(now() - current_date::timestamptz)")
            assert dropped == 1
            assert await conn.fetchval("SELECT count(*) FROM block_events") == 1
        finally:
            await conn.close()

    asyncio.run(scenario())


def test_reader_role_reads_but_cannot_write(reader_url):
    assert asyncio.run(_fetch(reader_url, "SELECT count(*) AS n FROM node_blocks"))[0]["n"] == 0
    assert asyncio.run(_fetch(reader_url, "SELECT * FROM node_cache_summary")) == []
    for sql in ("INSERT INTO nodes (node_id, instance_id) VALUES ('x', 'y')",
                "DELETE FROM node_blocks",
                "CREATE TABLE sneaky (x int)"):
        with pytest.raises(asyncpg.PostgresError) as info:
            asyncio.run(_fetch(reader_url, sql))
        assert isinstance(info.value, (asyncpg.ReadOnlySQLTransactionError, asyncpg.InsufficientPrivilegeError))
    # Even an explicit read-write transaction is refused by privileges.
    async def read_write_attempt():
        conn = await asyncpg.connect(plain_dsn(reader_url))
        try:
            await conn.execute("SET default_transaction_read_only = off")
            await conn.execute("INSERT INTO nodes (node_id, instance_id) VALUES ('x', 'y')")
        finally:
            await conn.close()

    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        asyncio.run(read_write_attempt())


def test_runtime_roles_are_not_superusers(migrated_database_url, reader_url):
    for url in (migrated_database_url, reader_url):
        assert asyncio.run(_fetch(url, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user"))[0][0] is False


def test_models_match_the_migrated_schema(migrated_database_url):
    rows = asyncio.run(_fetch(migrated_database_url, """
        SELECT table_name, column_name, data_type, is_nullable FROM information_schema.columns
        WHERE table_schema = 'public' AND table_name = ANY($1::text[])""", list(TABLES)))
    db = {(r["table_name"], r["column_name"]): (r["data_type"], r["is_nullable"] == "YES") for r in rows}
    model = {}
    for table in Base.metadata.sorted_tables:
        for col in table.columns:
            model[(table.name, col.name)] = (col.type.compile(dialect=postgresql.dialect()).lower(), col.nullable)
    assert set(model) == set(db)
    for key, (typ, nullable) in model.items():
        assert db[key][0] == typ, key
        assert db[key][1] == nullable, key
