"""The router's reads, through the read-only role: the nodes (cached briefly) and, per decision,
one indexed query for who holds which of the prompt's blocks (in each block size of the fleet);
for the pages, a node's cache by priority, the fleet's composition and hit rates. All of the
router's SQL is here.

When PostgreSQL cannot be reached, every read raises :class:`DatabaseUnavailable`, and for
``RETRY_S`` after a failure reads raise it at once, without trying; the last ``nodes`` rows read
stay in memory (``StateReader.last_nodes``) so the router can go on routing by load alone.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import asyncpg

from eventbus.protocol import DEFAULT_PRIORITY, NodeId
from routing_api.errors import Unavailable
from routing_api.scoring import PrefixMatch
from state_store.config import plain_dsn

log = logging.getLogger("kvflow.router")
T = TypeVar("T")

# stats_ts: the time the node took its latest heartbeat (NodeStats.ts, written to node_stats_samples
# in the transaction that wrote the row's load; the index of its primary key finds it).
NODES = """
SELECT node_id, instance_id, status, url, model, block_size, capacity_gpu, capacity_host, used_gpu, used_host,
       active_requests, queued_requests, active_blocks, last_event_id, last_seen, counters, engine,
       extract(epoch FROM now() - last_seen) AS silent_s,
       extract(epoch FROM (SELECT max(s.ts) FROM node_stats_samples s WHERE s.node_id = n.node_id)) AS stats_ts
FROM nodes n ORDER BY node_id
"""
# Each node's contiguous cached prefix of the prompt, in one round trip: kvflow_prefix_matches()
# (migrations 0002, 0003) bisects over the prompt's blocks with probes of node_blocks_block_hash_idx.
# Its argument is the prompt's hashes packed 8 bytes each (eventbus.hashing.prompt_hash_heads).
# routing_api.scoring.prefix_match is the same computation in Python (tests compare the two).
PREFIX_MATCHES = "SELECT node_id, blocks, gpu, leaf_priority FROM kvflow_prefix_matches($1::bytea)"
# The same for a fleet of several block sizes, in one round trip: the prompt hashed in each size
# ($2[i] in blocks of $1[i]), each matched by kvflow_prefix_matches (measured against one query per
# size, run one after the other or at once on two connections: docs/research/2026-12-router-mixed-block-size-query.md).
PREFIX_MATCHES_BY_SIZE = """
SELECT s.size, m.node_id, m.blocks, m.gpu, m.leaf_priority
FROM unnest($1::integer[], $2::bytea[]) AS s(size, hashes) CROSS JOIN LATERAL kvflow_prefix_matches(s.hashes) AS m
"""
# One node's cache by tier and priority (GET /v1/nodes/{node_id}).
CACHE_BY_PRIORITY = """
SELECT cache_level, priority, blocks, tokens FROM node_cache_by_priority WHERE node_id = $1
ORDER BY cache_level, priority DESC
"""
# Every node's cache by tier and priority (the dashboard's bars).
COMPOSITION = "SELECT node_id, cache_level, priority, blocks FROM node_cache_by_priority"
# Prompt-token hit rate per node and minute, the last 30 minutes, oldest first (the dashboard's chart).
HIT_RATES = """
SELECT node_id, extract(epoch FROM minute) AS t, hit_rate FROM node_hit_rates
WHERE minute > now() - interval '30 minutes' ORDER BY minute
"""


#: After a failed read, how long reads fail at once before one tries PostgreSQL again.
RETRY_S = 1.0

#: What a lost or unreachable PostgreSQL raises: refused or broken connections, timeouts, a
#: server shutting down or starting (class 57), a connection failure (class 08), too many clients,
#: and a connection caught by the server's goodbye in the middle of a query (``InternalClientError``:
#: "cannot switch to state …; another operation is in progress", seen when PostgreSQL stops).
DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.InternalClientError, asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError, asyncpg.exceptions.InsufficientResourcesError)


class DatabaseUnavailable(Unavailable):
    """PostgreSQL could not be reached or went away mid-query (503 on the endpoints that read it)."""


def pack_sql_hashes(sql_hashes: Sequence[int]) -> bytes:
    """SQL ``bigint`` hashes packed as ``kvflow_prefix_matches`` takes them (8 bytes, big-endian)."""
    return struct.pack(f">{len(sql_hashes)}q", *sql_hashes)


async def _no_reset(conn: asyncpg.Connection) -> None:
    """The router sets no session state, so a connection returned to the pool needs no RESET ALL."""


class HotConnections:
    """Connections for the one query of every decision: at most ``size`` at once, idle ones reused.

    asyncpg's ``Pool`` spends ~80 µs of CPU per call (a shielded release task, holder
    bookkeeping): 8 % of a decision. Here a call takes a semaphore and pops an idle connection.
    A connection whose query failed in any way (broken, cancelled mid-query, an error) is
    terminated rather than reused; a new one is opened on demand.
    """

    def __init__(self, connect: Callable[[], Awaitable[asyncpg.Connection]], size: int) -> None:
        self._connect = connect
        self._slots = asyncio.Semaphore(size)
        self._idle: list[asyncpg.Connection] = []

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        async with self._slots:  # idle + in use <= size
            conn = None
            while self._idle and conn is None:
                conn = self._idle.pop()
                if conn.is_closed():
                    conn = None
            if conn is None:
                conn = await self._connect()
            try:
                rows: list[asyncpg.Record] = await conn.fetch(sql, *args)
            except BaseException:
                conn.terminate()
                raise
            self._idle.append(conn)
            return rows

    def reset(self) -> None:
        """Drop every idle connection (the server they talk to went away); new ones open on demand."""
        idle, self._idle = self._idle, []
        for c in idle:
            c.terminate()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        await asyncio.gather(*(c.close(timeout=5) for c in idle), return_exceptions=True)


class StateReader:
    """The router's reads: the ``nodes`` table (cached ``nodes_cache_s``), each decision's prefix
    query (on :class:`HotConnections`), and the pages' reads (on an asyncpg pool).

    A read that fails for want of PostgreSQL (:data:`DATABASE_ERRORS`) raises
    :class:`DatabaseUnavailable`, drops every connection, and makes the reads of the next
    ``RETRY_S`` raise it at once (no connection attempt, no wait); the first read after that tries
    again, and its success ends the outage. ``last_nodes`` keeps the last rows read.

    Attributes:
        down_since: ``time.monotonic()`` of the failure that started the outage; None while up.
        known: whether a read of ``nodes`` has ever succeeded (``last_nodes`` is a fleet).
    """

    def __init__(self, url: str, nodes_cache_s: float = 0.5, pool_size: int = 8,
                 statement_timeout_ms: int = 10_000) -> None:
        self.dsn = plain_dsn(url)
        self.nodes_cache_s = nodes_cache_s
        self.pool_size = pool_size
        self.statement_timeout_ms = statement_timeout_ms
        self._pool: asyncpg.Pool | None = None
        self._hot = HotConnections(self._connect, pool_size)
        self._nodes: list[asyncpg.Record] = []
        self._nodes_at = 0.0
        self._lock = asyncio.Lock()
        self.known = False
        self.down_since: float | None = None
        self.down_error = ""
        self._retry_at = 0.0
        self._outages = 0  # a read that began before the latest outage began cannot end it

    @property
    def last_nodes(self) -> list[asyncpg.Record]:
        """The rows of the last successful read of ``nodes`` (none before the first)."""
        return self._nodes

    def _check(self) -> None:
        """Raise :class:`DatabaseUnavailable` at once during an outage, until it is time to try again."""
        if self.down_since is not None and time.monotonic() < self._retry_at:
            raise DatabaseUnavailable(f"database unavailable: {self.down_error}")

    def _lost(self, exc: BaseException) -> DatabaseUnavailable:
        """Note a failed read: the outage starts (logged once) or goes on; every connection is dropped."""
        now = time.monotonic()
        self.down_error = f"{type(exc).__name__}: {exc}".strip().rstrip(":")[:300]
        self._retry_at = now + RETRY_S
        if self.down_since is None:
            self.down_since = now
            self._outages += 1
            log.warning("PostgreSQL unreachable (%s): routing by load alone on the last known fleet; "
                        "read endpoints answer 503", self.down_error)
        self._hot.reset()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
        return DatabaseUnavailable(f"database unavailable: {self.down_error}")

    def _back(self, outages: int) -> None:
        """A read that began during the outage (not before it) succeeded: the outage is over."""
        if self.down_since is not None and outages == self._outages:
            log.warning("PostgreSQL reachable again after %.1f s", time.monotonic() - self.down_since)
            self.down_since = None

    async def _run(self, read: Callable[[], Awaitable[T]]) -> T:
        """``read()``, with what a lost PostgreSQL raises turned into :class:`DatabaseUnavailable`."""
        self._check()
        outages = self._outages
        try:
            out = await read()
        except DATABASE_ERRORS as exc:
            raise self._lost(exc) from exc
        self._back(outages)
        return out

    def _connect_args(self) -> dict[str, Any]:
        timeout_ms = self.statement_timeout_ms
        return {"server_settings": {"application_name": "kvflow-router", "default_transaction_read_only": "on",
                                    "statement_timeout": str(timeout_ms)},
                "command_timeout": timeout_ms / 1000 + 1 if timeout_ms else None}

    async def _connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.dsn, timeout=10, **self._connect_args())

    async def pool(self) -> asyncpg.Pool:
        """For everything but the per-decision query (nodes, dashboard, node details)."""
        if self._pool is None:
            # min_size 0: no connection floor for asyncpg to restore in the background while
            # PostgreSQL is away (reads open what they need, and it stays open while in use)
            self._pool = await asyncpg.create_pool(self.dsn, min_size=0, max_size=self.pool_size, reset=_no_reset,
                                                   **self._connect_args())
        return self._pool

    async def close(self) -> None:
        await self._hot.close()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def nodes(self, fresh: bool = False) -> list[asyncpg.Record]:
        """The ``nodes`` rows (with ``silent_s`` and ``stats_ts``), read at most every ``nodes_cache_s``.

        Args:
            fresh: read the table now, whatever the cache holds.

        Raises:
            DatabaseUnavailable: PostgreSQL could not be read (``last_nodes`` still holds the last rows).
        """
        if not fresh and time.monotonic() - self._nodes_at < self.nodes_cache_s:
            return self._nodes
        self._check()
        if self.down_since is not None and self._lock.locked():
            raise DatabaseUnavailable(f"database unavailable: {self.down_error}")  # a retry is under way
        async with self._lock:
            if fresh or time.monotonic() - self._nodes_at >= self.nodes_cache_s:
                self._nodes = await self._run(self._read_nodes)
                self._nodes_at = time.monotonic()
                self.known = True
        return self._nodes

    async def _read_nodes(self) -> list[asyncpg.Record]:
        pool = await self.pool()
        return list(await pool.fetch(NODES))

    async def prefix_matches(self, hashes: bytes | Sequence[int]) -> dict[NodeId, PrefixMatch]:
        """Each node's contiguous cached prefix of the prompt (one round trip).

        ``hashes``: the prompt's hashes packed (``prompt_hash_heads``), or as SQL ``bigint``s."""
        if not isinstance(hashes, bytes):
            hashes = pack_sql_hashes(hashes)
        if not hashes:
            return {}
        rows = await self._hot_fetch(PREFIX_MATCHES, hashes)
        return {r[0]: PrefixMatch(gpu=r[2], host=r[1] - r[2], leaf_low=r[3] < DEFAULT_PRIORITY) for r in rows}

    async def prefix_matches_by_size(self, hashes: Mapping[int, bytes]) -> dict[int, dict[NodeId, PrefixMatch]]:
        """The prompt's cached prefixes in each block size it was hashed in (one round trip).

        Args:
            hashes: block size → the prompt's hashes packed in blocks of that size (``prompt_hash_heads``).

        Returns:
            block size → node id → the node's contiguous cached prefix of the prompt so hashed
            (every size of ``hashes`` is a key; a prompt shorter than a block finds nothing).
        """
        hashed = {b: h for b, h in hashes.items() if h}
        out: dict[int, dict[NodeId, PrefixMatch]] = {b: {} for b in hashes}
        if len(hashed) == 1:  # one size (a fleet of one block size): the query of every decision
            (b, h), = hashed.items()
            out[b] = await self.prefix_matches(h)
        elif hashed:
            rows = await self._hot_fetch(PREFIX_MATCHES_BY_SIZE, list(hashed), list(hashed.values()))
            for r in rows:
                out[r[0]][r[1]] = PrefixMatch(gpu=r[3], host=r[2] - r[3], leaf_low=r[4] < DEFAULT_PRIORITY)
        return out

    async def _hot_fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        """A per-decision query on :class:`HotConnections`, as :meth:`_run` (no ``asyncpg.Pool``)."""
        self._check()
        outages = self._outages
        try:
            rows = await self._hot.fetch(sql, *args)
        except DATABASE_ERRORS as exc:
            raise self._lost(exc) from exc
        if self.down_since is not None:
            self._back(outages)
        return rows

    async def cache_by_priority(self, node_id: NodeId) -> list[dict[str, Any]]:
        """One node's cached blocks and tokens per (cache level, priority): GPU first, high priority first.

        Returns:
            ``{"cache_level", "priority", "blocks", "tokens"}`` rows; none for an unknown node.
        """
        return [dict(r) for r in await self._fetch(CACHE_BY_PRIORITY, node_id)]

    async def composition(self) -> list[dict[str, Any]]:
        """Every node's cached blocks per (cache level, priority), in no particular order.

        Returns:
            ``{"node_id", "cache_level", "priority", "blocks"}`` rows.
        """
        return [dict(r) for r in await self._fetch(COMPOSITION)]

    async def hit_rates(self) -> list[dict[str, Any]]:
        """Each node's prompt-token hit rate per minute over the last 30 minutes, oldest first.

        Returns:
            ``{"node_id", "t" (the minute, epoch seconds), "hit_rate" (0..1, None: no prompt tokens)}``.
        """
        return [{"node_id": r["node_id"], "t": float(r["t"]),
                 "hit_rate": float(r["hit_rate"]) if r["hit_rate"] is not None else None}
                for r in await self._fetch(HIT_RATES)]

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        async def read() -> list[asyncpg.Record]:
            pool = await self.pool()
            return list(await pool.fetch(sql, *args))

        return await self._run(read)
