"""Applying a :class:`~state_store.apply.Plan` to PostgreSQL, in one transaction, with asyncpg.

Batched statements only: ``COPY`` for the history, array (``unnest``) statements for
``node_blocks`` and ``nodes``; the compiled hot path's ``node_blocks`` rows come as ``COPY`` data
too (:func:`_write_native`). The node rows are locked (``SELECT … FOR UPDATE``) before the plan is
made, so two materializer workers that briefly both own a partition (during a rebalance) apply a
node's batches one after the other, and the second sees the first one's ``last_event_id``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import asyncpg

from eventbus.protocol import EventBatch
from state_store.apply import (
    HISTORY_COLUMNS,
    BlockRow,
    NativeWrites,
    NodeRow,
    Plan,
    blocks_to_look_up,
    plan,
)
from state_store.config import plain_dsn
from state_store.pgtime import from_pg_micros, pg_micros

log = logging.getLogger("kvflow.materializer")
T = TypeVar("T")

#: Errors after which the same transaction may succeed later (the database is down, restarting,
#: overloaded, or the transaction lost a race). Anything else is a problem with the data.
TRANSIENT = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.SerializationError,
    asyncpg.DeadlockDetectedError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.QueryCanceledError,
)

LOCK_NODES = """
INSERT INTO nodes (node_id, instance_id) SELECT unnest($1::text[]), '' ON CONFLICT (node_id) DO NOTHING;
"""
READ_NODES = """
SELECT node_id, instance_id, last_event_id, status, instance_started_at, window_size, capacity_gpu, capacity_host
FROM nodes WHERE node_id = ANY($1::text[]) ORDER BY node_id
"""
SELECT_NODES = READ_NODES + " FOR UPDATE"
SELECT_BLOCKS = """
SELECT nb.node_id, nb.block_hash, nb.parent_hash, nb.cache_level, nb.priority, nb.num_tokens, nb.lora_id,
       nb.window_size, nb.stored_at, nb.updated_at
FROM node_blocks nb JOIN unnest($1::text[], $2::bigint[]) AS k(node_id, block_hash)
  ON nb.node_id = k.node_id AND nb.block_hash = k.block_hash
"""
RESET_BLOCKS = "DELETE FROM node_blocks WHERE node_id = ANY($1::text[])"
DELETE_BLOCKS = """
DELETE FROM node_blocks nb USING unnest($1::text[], $2::bigint[]) AS d(node_id, block_hash)
WHERE nb.node_id = d.node_id AND nb.block_hash = d.block_hash
"""
BLOCK_COLUMNS = ("node_id", "block_hash", "parent_hash", "cache_level", "priority", "num_tokens", "lora_id",
                 "window_size", "stored_at", "updated_at")
UPSERT_BLOCKS = f"""
INSERT INTO node_blocks ({", ".join(BLOCK_COLUMNS)})
SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::smallint[], $5::smallint[], $6::integer[],
                     $7::bigint[], $8::integer[], $9::timestamptz[], $10::timestamptz[])
ON CONFLICT (node_id, block_hash) DO UPDATE SET
  parent_hash = EXCLUDED.parent_hash, cache_level = EXCLUDED.cache_level, priority = EXCLUDED.priority,
  num_tokens = EXCLUDED.num_tokens, lora_id = EXCLUDED.lora_id, window_size = EXCLUDED.window_size,
  stored_at = EXCLUDED.stored_at, updated_at = EXCLUDED.updated_at
"""
# The compiled hot path's node_blocks changes arrive as COPY data: new rows straight into
# node_blocks, changed rows and deleted keys into per-connection staging tables (emptied at every
# commit) that one statement each applies. (Made with each connection, once the schema is there; a
# connection without them fails its hot-path write, which is replanned.)
CREATE_STAGING = """
DO $$ BEGIN
  IF to_regclass('node_blocks') IS NOT NULL THEN
    CREATE TEMP TABLE IF NOT EXISTS kvflow_stage_updates (LIKE node_blocks) ON COMMIT DELETE ROWS;
    CREATE TEMP TABLE IF NOT EXISTS kvflow_stage_deletes (node_id text NOT NULL, block_hash bigint NOT NULL)
      ON COMMIT DELETE ROWS;
  END IF;
END $$
"""
UPDATE_NODES = """
UPDATE nodes n SET
  instance_id = u.instance_id, last_event_id = u.last_event_id,
  status_changed_at = CASE WHEN n.status <> u.status THEN now() ELSE n.status_changed_at END,
  status = u.status, instance_started_at = u.instance_started_at, window_size = u.window_size,
  capacity_gpu = u.capacity_gpu, capacity_host = u.capacity_host, last_seen = now(), updated_at = now()
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::timestamptz[], $6::integer[],
            $7::integer[], $8::integer[])
     AS u(node_id, instance_id, last_event_id, status, instance_started_at, window_size, capacity_gpu, capacity_host)
WHERE n.node_id = u.node_id
"""
# The hot path's staged deletes and updates and its node rows, in one statement (one round trip):
# how many rows each touched, for the caller to check.
APPLY_STAGED = f"""
WITH deleted AS (
  DELETE FROM node_blocks nb USING kvflow_stage_deletes s
  WHERE nb.node_id = s.node_id AND nb.block_hash = s.block_hash
  RETURNING 1
), updated AS (
  UPDATE node_blocks nb SET
    parent_hash = s.parent_hash, cache_level = s.cache_level, priority = s.priority, num_tokens = s.num_tokens,
    lora_id = s.lora_id, window_size = s.window_size, stored_at = s.stored_at, updated_at = s.updated_at
  FROM kvflow_stage_updates s WHERE nb.node_id = s.node_id AND nb.block_hash = s.block_hash
  RETURNING 1
), node_rows AS ({UPDATE_NODES.strip()}
  RETURNING 1
)
SELECT (SELECT count(*) FROM deleted), (SELECT count(*) FROM updated), (SELECT count(*) FROM node_rows)
"""
# Ask a node for a snapshot at most once per cooldown: returns the nodes to ask now.
MARK_RESYNC = """
UPDATE nodes SET resync_requested_at = now()
WHERE node_id = ANY($1::text[])
  AND (resync_requested_at IS NULL OR resync_requested_at < now() - make_interval(secs => $2))
RETURNING node_id
"""


SELECT_NODE_BLOCKS = """
SELECT node_id, block_hash, parent_hash, cache_level, priority, num_tokens, lora_id, window_size, stored_at,
       updated_at
FROM node_blocks WHERE node_id = ANY($1::text[])
"""


@dataclass
class Applied:
    plan: Plan
    resync_now: list[str]


class StaleCache(Exception):
    """The database is not where the worker's cache said it was (another worker wrote there)."""


def _timestamptz_encode(value: datetime) -> tuple[int]:
    return (pg_micros(value),)


def _timestamptz_decode(value: tuple[int]) -> datetime:
    return from_pg_micros(value[0])


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("timestamptz", schema="pg_catalog", encoder=_timestamptz_encode,
                              decoder=_timestamptz_decode, format="tuple")
    await conn.execute(CREATE_STAGING)


class Writer:
    """Owns a connection pool of the writer role and applies plans."""

    def __init__(self, url: str, *, pool_size: int = 2, resync_cooldown_s: float = 5.0,
                 statement_timeout_ms: int = 60_000) -> None:
        self.dsn = plain_dsn(url)
        self.pool_size = pool_size
        self.resync_cooldown_s = resync_cooldown_s
        self.statement_timeout_ms = statement_timeout_ms
        self._pool: asyncpg.Pool | None = None

    async def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            self._pool = await asyncpg.create_pool(
                self.dsn, min_size=1, max_size=self.pool_size, timeout=10, command_timeout=120,
                server_settings={"application_name": "kvflow-materializer",
                                 "statement_timeout": str(self.statement_timeout_ms)},
                init=_init_connection,
            )
        return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def reset_pool(self) -> None:
        """Drop every connection (after a database restart) and reconnect lazily."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.terminate()

    async def apply(self, batches: Sequence[EventBatch]) -> Applied:
        """One transaction: lock the nodes, read what the plan needs, write the plan."""
        pool = await self.pool()
        async with pool.acquire() as conn, conn.transaction():
            node_ids = sorted({b.node_id for b in batches})
            await conn.execute(LOCK_NODES, node_ids)
            nodes = {r["node_id"]: NodeRow(*r) for r in await conn.fetch(SELECT_NODES, node_ids)}
            for n, row in list(nodes.items()):
                if row.instance_id == "":  # a placeholder inserted just now
                    nodes.pop(n)
            keys = blocks_to_look_up(batches)
            known: dict[tuple[str, int], BlockRow] = {}
            if keys:
                kn, kh = zip(*keys, strict=True)
                for r in await conn.fetch(SELECT_BLOCKS, list(kn), list(kh)):
                    known[(r["node_id"], r["block_hash"])] = BlockRow(*r)
            p = plan(batches, nodes, known)
            return await self._write(conn, p)

    async def load(self, node_ids: Sequence[str]) -> tuple[list[NodeRow], list[BlockRow]]:
        """The complete state of some nodes, for a worker's NodeCache."""
        pool = await self.pool()
        async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            nodes = [NodeRow(*r) for r in await conn.fetch(READ_NODES, node_ids) if r["instance_id"] != ""]
            blocks = [BlockRow(*r) for r in await conn.fetch(SELECT_NODE_BLOCKS, node_ids)]
        return nodes, blocks

    async def apply_planned(self, p: Plan, expected: dict[str, tuple[str, int] | None]) -> Applied:
        """Write a plan made from a NodeCache, after checking under lock that the database is where
        the cache was (``expected``: node -> (instance_id, last_event_id), None: no row).

        Raises:
            StaleCache: it is not; nothing was written.
        """
        pool = await self.pool()
        async with pool.acquire() as conn, conn.transaction():
            node_ids = sorted(expected)
            if None in expected.values():  # a row to lock for a node the cache says has none
                await conn.execute(LOCK_NODES, node_ids)
            rows = await conn.fetch(SELECT_NODES, node_ids)
            for r in rows:
                have = None if r["instance_id"] == "" else (r["instance_id"], r["last_event_id"])
                if have != expected[r["node_id"]]:
                    raise StaleCache(f"{r['node_id']}: database at {have}, cache at {expected[r['node_id']]}")
            if len(rows) != len(node_ids):
                raise StaleCache(f"node rows missing: {sorted(set(node_ids) - {r['node_id'] for r in rows})}")
            return await self._write(conn, p)

    async def _write(self, conn: asyncpg.Connection, p: Plan) -> Applied:
        await write(conn, p)
        resync_now: list[str] = []
        if p.resync:  # ask each node at most once per cooldown
            resync_now = [r["node_id"] for r in await conn.fetch(MARK_RESYNC, sorted(p.resync),
                                                                 self.resync_cooldown_s)]
        return Applied(p, resync_now)

    async def run(self, fn: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        pool = await self.pool()
        async with pool.acquire() as conn:
            return await fn(conn)


async def write(conn: asyncpg.Connection, p: Plan) -> None:
    for part in p.after:
        await write(conn, part)
    if p.native is not None:  # nothing else: FastPlanner.finish
        await _write_native(conn, p.native, p.nodes)
        return
    if p.resets:
        await conn.execute(RESET_BLOCKS, sorted(p.resets))
    if p.deletes:
        dn, dh = zip(*p.deletes, strict=True)
        _expect(await conn.execute(DELETE_BLOCKS, list(dn), list(dh)), len(dn))
    if p.upserts:
        # BlockRow's fields are UPSERT_BLOCKS's parameters, in order: columns by one zip (in C).
        await conn.execute(UPSERT_BLOCKS, *map(list, zip(*p.upserts.values(), strict=True)))
    if p.history:
        await conn.copy_records_to_table("block_events", records=p.history, columns=HISTORY_COLUMNS)
    await _write_nodes(conn, p)


async def _write_native(conn: asyncpg.Connection, n: NativeWrites, nodes: dict[str, NodeRow]) -> None:
    """The hot path's writes. Its deletes and updates are of rows the worker's cache holds, its
    inserts of rows it does not: each must touch exactly its rows, or the database is not where
    the cache said (StaleCache: the take is replanned from the database)."""
    if n.delete_rows:
        await _copy(conn, "kvflow_stage_deletes", n.deletes, ("node_id", "block_hash"))
    if n.update_rows:
        await _copy(conn, "kvflow_stage_updates", n.updates, BLOCK_COLUMNS)
    if n.insert_rows:
        try:
            await _copy(conn, "node_blocks", n.inserts, BLOCK_COLUMNS)
        except asyncpg.UniqueViolationError as exc:
            raise StaleCache(f"a block the cache did not hold is in node_blocks: {exc}") from exc
    if n.history_rows:
        await _copy(conn, "block_events", n.history, HISTORY_COLUMNS)
    done = tuple(await conn.fetchrow(APPLY_STAGED, *_node_columns(nodes)))
    if done != (n.delete_rows, n.update_rows, len(nodes)):
        raise StaleCache(f"deleted, updated, node rows: {done}, planned {(n.delete_rows, n.update_rows, len(nodes))}")


def _expect(status: str, rows: int) -> None:
    """``status``: a command tag such as ``DELETE 12``."""
    done = int(status.rsplit(" ", 1)[1])
    if done != rows:
        raise StaleCache(f"{status}: {rows} rows expected")


async def _copy(conn: asyncpg.Connection, table: str, data: bytes, columns: Sequence[str]) -> None:
    """COPY … FROM STDIN (FORMAT binary) of data already in that form."""
    async def chunks() -> AsyncIterator[memoryview]:
        view = memoryview(data)
        for i in range(0, len(view), _COPY_CHUNK):
            yield view[i:i + _COPY_CHUNK]

    await conn.copy_to_table(table, source=chunks(), columns=list(columns), format="binary")


_COPY_CHUNK = 1 << 20


async def _write_nodes(conn: asyncpg.Connection, p: Plan) -> None:
    if p.nodes:
        await conn.execute(UPDATE_NODES, *_node_columns(p.nodes))


def _node_columns(nodes: dict[str, NodeRow]) -> list[list[Any]]:
    """UPDATE_NODES's parameters."""
    rows = list(nodes.values())
    return [[r.node_id for r in rows], [r.instance_id for r in rows], [r.last_event_id for r in rows],
            [r.status for r in rows], [r.instance_started_at for r in rows], [r.window_size for r in rows],
            [r.capacity_gpu for r in rows], [r.capacity_host for r in rows]]


async def with_retry(fn: Callable[[], Awaitable[T]], *, on_retry: Callable[[BaseException, float], Any],
                     reconnect: Callable[[], Awaitable[None]], max_backoff_s: float = 5.0) -> T:
    """Run fn until it succeeds, backing off (with jitter) on transient database errors.

    Non-transient errors propagate: retrying the same data would fail the same way.
    """
    delay = 0.1
    while True:
        try:
            return await fn()
        except TRANSIENT as exc:
            on_retry(exc, delay)
            await reconnect()
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(max_backoff_s, delay * 2)
