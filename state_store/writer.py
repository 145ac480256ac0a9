"""The materializer's database side, with asyncpg: a take's :data:`~state_store.plans.Plan` in
one transaction, and the heartbeats, liveness and maintenance statements (the SQL text of all of
them is in :mod:`state_store.sql`).

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
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg
import msgspec

from eventbus.protocol import EventBatch, NodeId, NodeStats
from state_store import sql
from state_store.apply import blocks_to_look_up, plan
from state_store.config import plain_dsn
from state_store.pgtime import from_pg_micros, pg_micros
from state_store.plans import (
    GONE,
    HISTORY_COLUMNS,
    BlockKey,
    BlockRow,
    CompiledPlan,
    Expected,
    NativeWrites,
    NodeRow,
    PartsPlan,
    Plan,
    RowsPlan,
)

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
    # a connection broken mid-operation (PostgreSQL went away under a query), raised when the pool
    # resets it on release: the pool drops it, and the next try gets a new one. Seen in a
    # fresh-clone run, crashing the worker through its liveness timer while PostgreSQL restarted.
    asyncpg.InternalClientError,
)


@dataclass
class Applied:
    """A committed take: its plan, and the nodes to ask for a snapshot now (at most once per
    cooldown each)."""

    plan: Plan
    resync_now: list[NodeId]


class StaleCache(Exception):
    """The database is not where the worker's cache said it was (another worker wrote there)."""


def _timestamptz_encode(value: datetime) -> tuple[int]:
    return (pg_micros(value),)


def _timestamptz_decode(value: tuple[int]) -> datetime:
    return from_pg_micros(value[0])


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("timestamptz", schema="pg_catalog", encoder=_timestamptz_encode,
                              decoder=_timestamptz_decode, format="tuple")
    await conn.execute(sql.CREATE_STAGING)


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
                # min_size 0: with a minimum, asyncpg restores the pool's floor in the background and
                # logs a traceback per attempt while PostgreSQL is down (with_retry reconnects anyway).
                self.dsn, min_size=0, max_size=self.pool_size, timeout=10, command_timeout=120,
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
            await conn.execute(sql.LOCK_NODES, node_ids)
            nodes = {r["node_id"]: NodeRow(*r) for r in await conn.fetch(sql.SELECT_NODES, node_ids)}
            for n, row in list(nodes.items()):
                if row.instance_id == "":  # a placeholder inserted just now
                    nodes.pop(n)
            keys = blocks_to_look_up(batches)
            known: dict[BlockKey, BlockRow] = {}
            if keys:
                kn, kh = zip(*keys, strict=True)
                for r in await conn.fetch(sql.SELECT_BLOCKS, list(kn), list(kh)):
                    known[(r["node_id"], r["block_hash"])] = BlockRow(*r)
            p = plan(batches, nodes, known)
            return await self._write(conn, p)

    async def load(self, node_ids: Sequence[NodeId]) -> tuple[list[NodeRow], list[BlockRow]]:
        """The complete state of some nodes, for a worker's NodeCache."""
        pool = await self.pool()
        async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            nodes = [NodeRow(*r) for r in await conn.fetch(sql.READ_NODES, node_ids) if r["instance_id"] != ""]
            blocks = [BlockRow(*r) for r in await conn.fetch(sql.SELECT_NODE_BLOCKS, node_ids)]
        return nodes, blocks

    async def apply_planned(self, p: Plan, expected: Expected) -> Applied:
        """Write a plan made from a NodeCache, after checking under lock that the database is where
        the cache was (``expected``: node -> (instance_id, last_event_id, gone), None: no row). A
        node the database has marked gone (silent, or it said goodbye) since the cache saw it is
        not where the cache was: its blocks were cleared.

        Raises:
            StaleCache: it is not; nothing was written.
        """
        pool = await self.pool()
        async with pool.acquire() as conn, conn.transaction():
            node_ids = sorted(expected)
            if None in expected.values():  # a row to lock for a node the cache says has none
                await conn.execute(sql.LOCK_NODES, node_ids)
            rows = await conn.fetch(sql.SELECT_NODES, node_ids)
            for r in rows:
                have = None if r["instance_id"] == "" else (r["instance_id"], r["last_event_id"], r["status"] == GONE)
                if have != expected[r["node_id"]]:
                    raise StaleCache(f"{r['node_id']}: database at {have}, cache at {expected[r['node_id']]}")
            if len(rows) != len(node_ids):
                raise StaleCache(f"node rows missing: {sorted(set(node_ids) - {r['node_id'] for r in rows})}")
            return await self._write(conn, p)

    async def _write(self, conn: asyncpg.Connection, p: Plan) -> Applied:
        await write(conn, p)
        resync_now: list[NodeId] = []
        if p.resync:  # ask each node at most once per cooldown
            resync_now = [NodeId(r["node_id"]) for r in await conn.fetch(sql.MARK_RESYNC, sorted(p.resync),
                                                                 self.resync_cooldown_s)]
        return Applied(p, resync_now)

    async def run(self, fn: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        """``fn`` with a connection of the pool."""
        pool = await self.pool()
        async with pool.acquire() as conn:
            return await fn(conn)

    async def apply_stats(self, stats: Sequence[NodeStats]) -> list[NodeId]:
        """Heartbeats, in one transaction: each node's newest into ``nodes``, every one into
        ``node_stats_samples``. A node whose newest says ``stopping`` is gone at once (its blocks
        cleared; once per instance, and only for the instance its row holds). Returns the nodes
        gone now."""
        latest: dict[str, NodeStats] = {}
        for s in stats:
            if s.node_id not in latest or s.ts >= latest[s.node_id].ts:
                latest[s.node_id] = s
        rows = list(latest.values())
        pool = await self.pool()
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(
                sql.STATS_UPSERT, [s.node_id for s in rows], [s.instance_id for s in rows], [s.url for s in rows],
                [s.model for s in rows], [s.block_size for s in rows], [s.capacity[0] for s in rows],
                [s.capacity[1] for s in rows], [s.used[0] for s in rows], [s.used[1] for s in rows],
                [s.active_requests for s in rows], [s.queued_requests for s in rows],
                [s.last_event_id for s in rows], [_json(s.counters) for s in rows], [s.active_blocks for s in rows],
                [s.status == "stopping" for s in rows], [s.engine for s in rows])
            await conn.execute(
                sql.STATS_SAMPLES, [s.node_id for s in stats], [s.instance_id for s in stats],
                [datetime.fromtimestamp(s.ts, tz=UTC) for s in stats], [s.capacity[0] for s in stats],
                [s.capacity[1] for s in stats], [s.used[0] for s in stats], [s.used[1] for s in stats],
                [s.active_requests for s in stats], [s.queued_requests for s in stats],
                [s.counters.prompt_tokens for s in stats], [s.counters.cached_tokens for s in stats],
                [_json(s.counters) for s in stats])
            bye = [s for s in rows if s.status == "stopping"]
            if not bye:
                return []
            return [NodeId(r["node_id"]) for r in await conn.fetch(
                sql.GOODBYE, [s.node_id for s in bye], [s.instance_id for s in bye])]

    async def mark_liveness(self, stale_after_s: float, gone_after_s: float) -> list[NodeId]:
        """live/resyncing → stale after ``stale_after_s`` of silence; stale → gone (blocks
        cleared) after ``gone_after_s``. Returns the nodes gone now."""
        pool = await self.pool()
        async with pool.acquire() as conn:
            return [NodeId(r["node_id"]) for r in await conn.fetch(sql.LIVENESS, stale_after_s, gone_after_s)]

    async def prune_gone(self, after_s: float) -> list[NodeId]:
        """Delete the rows of nodes gone and silent for ``after_s`` (their history stays; one
        that comes back is a new node). Returns the nodes pruned."""
        pool = await self.pool()
        async with pool.acquire() as conn:
            return [NodeId(r["node_id"]) for r in await conn.fetch(sql.PRUNE_GONE, after_s)]

    async def repeat_resyncs(self, retry_s: float, retry_max_s: float) -> list[tuple[NodeId, int]]:
        """The nodes still resyncing whose last snapshot request is older than its backoff
        (``retry_s`` doubled per request sent, at most ``retry_max_s``), claimed for a request
        now: (node, the number of that request)."""
        pool = await self.pool()
        async with pool.acquire() as conn:
            return [(NodeId(r["node_id"]), r["resync_attempts"])
                    for r in await conn.fetch(sql.REPEAT_RESYNC, retry_s, retry_max_s)]

    async def run_maintenance(self, retention_days: float) -> None:
        """Partitions ahead and retention, by one worker at a time (advisory lock)."""
        pool = await self.pool()
        async with pool.acquire() as conn, conn.transaction():
            if await conn.fetchval(sql.MAINTENANCE_LOCK):
                await conn.execute(sql.ENSURE_PARTITIONS)
                await conn.execute(sql.APPLY_RETENTION, retention_days * 86400.0)

    async def ping(self, timeout_s: float = 1.0) -> None:
        """``SELECT 1`` within ``timeout_s``, on a connection of its own (the pool's may all be
        held by a transaction being retried).

        Raises:
            Exception: the database did not answer (``TimeoutError``, ``OSError``, …).
        """
        async with asyncio.timeout(timeout_s):
            conn = await asyncpg.connect(self.dsn, timeout=timeout_s)
            try:
                await conn.fetchval(sql.PING)
            finally:
                await conn.close()


def _json(counters: Any) -> str:
    return msgspec.json.encode(counters).decode()


async def write(conn: asyncpg.Connection, p: Plan) -> None:
    """Write a plan with ``conn`` (in the caller's transaction), by its kind."""
    if isinstance(p, PartsPlan):
        for part in p.parts:
            await write(conn, part)
    elif isinstance(p, CompiledPlan):
        await _write_native(conn, p.writes, p.nodes)
    else:
        await _write_rows(conn, p)


async def _write_rows(conn: asyncpg.Connection, p: RowsPlan) -> None:
    if p.resets:
        await conn.execute(sql.RESET_BLOCKS, sorted(p.resets))
    if p.deletes:
        dn, dh = zip(*p.deletes, strict=True)
        _expect(await conn.execute(sql.DELETE_BLOCKS, list(dn), list(dh)), len(dn))
    if p.upserts:
        # BlockRow's fields are sql.UPSERT_BLOCKS's parameters, in order: columns by one zip (in C).
        await conn.execute(sql.UPSERT_BLOCKS, *map(list, zip(*p.upserts.values(), strict=True)))
    if p.history:
        await conn.copy_records_to_table("block_events", records=p.history, columns=HISTORY_COLUMNS)
    if p.nodes:
        await conn.execute(sql.UPDATE_NODES, *_node_columns(p.nodes))


async def _write_native(conn: asyncpg.Connection, n: NativeWrites, nodes: dict[NodeId, NodeRow]) -> None:
    """The hot path's writes. Its deletes and updates are of rows the worker's cache holds, its
    inserts of rows it does not: each must touch exactly its rows, or the database is not where
    the cache said (StaleCache: the take is replanned from the database)."""
    if n.delete_rows:
        await _copy(conn, "kvflow_stage_deletes", n.deletes, ("node_id", "block_hash"))
    if n.update_rows:
        await _copy(conn, "kvflow_stage_updates", n.updates, sql.BLOCK_COLUMNS)
    if n.insert_rows:
        try:
            await _copy(conn, "node_blocks", n.inserts, sql.BLOCK_COLUMNS)
        except asyncpg.UniqueViolationError as exc:
            raise StaleCache(f"a block the cache did not hold is in node_blocks: {exc}") from exc
    if n.history_rows:
        await _copy(conn, "block_events", n.history, HISTORY_COLUMNS)
    done = tuple(await conn.fetchrow(sql.APPLY_STAGED, *_node_columns(nodes)))
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


def _node_columns(nodes: dict[NodeId, NodeRow]) -> list[list[Any]]:
    """sql.UPDATE_NODES's parameters."""
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
