"""The router's reads, through the read-only role: the nodes (cached briefly) and, per decision,
one indexed query for who holds which of the prompt's blocks; for the pages, a node's cache by
priority, the fleet's composition and hit rates. All of the router's SQL is here."""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg

from eventbus.protocol import DEFAULT_PRIORITY, NodeId
from routing_api.scoring import PrefixMatch
from state_store.config import plain_dsn

NODES = """
SELECT node_id, instance_id, status, url, model, block_size, capacity_gpu, capacity_host, used_gpu, used_host,
       active_requests, queued_requests, active_blocks, last_event_id, last_seen, counters,
       extract(epoch FROM now() - last_seen) AS silent_s
FROM nodes ORDER BY node_id
"""
# Each node's contiguous cached prefix of the prompt, in one round trip: kvflow_prefix_matches()
# (migrations 0002, 0003) bisects over the prompt's blocks with probes of node_blocks_block_hash_idx.
# Its argument is the prompt's hashes packed 8 bytes each (eventbus.hashing.prompt_hash_heads).
# routing_api.scoring.prefix_match is the same computation in Python (tests compare the two).
PREFIX_MATCHES = "SELECT node_id, blocks, gpu, leaf_priority FROM kvflow_prefix_matches($1::bytea)"
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

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        await asyncio.gather(*(c.close(timeout=5) for c in idle), return_exceptions=True)


class StateReader:
    """The router's reads: the ``nodes`` table (cached ``nodes_cache_s``), each decision's prefix
    query (on :class:`HotConnections`), and the pages' reads (on an asyncpg pool)."""

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
            self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=self.pool_size, reset=_no_reset,
                                                   **self._connect_args())
        return self._pool

    async def close(self) -> None:
        await self._hot.close()
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def nodes(self, fresh: bool = False) -> list[asyncpg.Record]:
        if not fresh and time.monotonic() - self._nodes_at < self.nodes_cache_s:
            return self._nodes
        async with self._lock:
            if fresh or time.monotonic() - self._nodes_at >= self.nodes_cache_s:
                pool = await self.pool()
                self._nodes = list(await pool.fetch(NODES))
                self._nodes_at = time.monotonic()
        return self._nodes

    async def prefix_matches(self, hashes: bytes | Sequence[int]) -> dict[NodeId, PrefixMatch]:
        """Each node's contiguous cached prefix of the prompt (one round trip).

        ``hashes``: the prompt's hashes packed (``prompt_hash_heads``), or as SQL ``bigint``s."""
        if not isinstance(hashes, bytes):
            hashes = pack_sql_hashes(hashes)
        if not hashes:
            return {}
        return {r[0]: PrefixMatch(gpu=r[2], host=r[1] - r[2], leaf_low=r[3] < DEFAULT_PRIORITY)
                for r in await self._hot.fetch(PREFIX_MATCHES, hashes)}

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
        pool = await self.pool()
        return list(await pool.fetch(sql, *args))
