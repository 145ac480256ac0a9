"""The router's reads, through the read-only role: the nodes (cached briefly) and, per decision,
one indexed query for who holds which of the prompt's blocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import asyncpg

from state_store.config import plain_dsn

NODES = """
SELECT node_id, instance_id, status, url, model, block_size, capacity_gpu, capacity_host, used_gpu, used_host,
       active_requests, queued_requests, active_blocks, last_event_id, last_seen, counters,
       extract(epoch FROM now() - last_seen) AS silent_s
FROM nodes ORDER BY node_id
"""
# Index-only scan of node_blocks_block_hash_idx (block_hash) INCLUDE (node_id, cache_level, priority).
HOLDINGS = """
SELECT node_id, block_hash, cache_level, priority FROM node_blocks WHERE block_hash = ANY($1::bigint[])
"""


class StateReader:
    def __init__(self, url: str, nodes_cache_s: float = 0.5, pool_size: int = 8) -> None:
        self.dsn = plain_dsn(url)
        self.nodes_cache_s = nodes_cache_s
        self.pool_size = pool_size
        self._pool: asyncpg.Pool | None = None
        self._nodes: list[asyncpg.Record] = []
        self._nodes_at = 0.0
        self._lock = asyncio.Lock()

    async def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            self._pool = await asyncpg.create_pool(
                self.dsn, min_size=1, max_size=self.pool_size, command_timeout=10,
                server_settings={"application_name": "kvflow-router", "default_transaction_read_only": "on"})
        return self._pool

    async def close(self) -> None:
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

    async def holdings(self, sql_hashes: Sequence[int]) -> dict[str, dict[int, tuple[int, int]]]:
        out: dict[str, dict[int, tuple[int, int]]] = {}
        if not sql_hashes:
            return out
        pool = await self.pool()
        for r in await pool.fetch(HOLDINGS, list(sql_hashes)):
            out.setdefault(r[0], {})[r[1]] = (r[2], r[3])
        return out

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        pool = await self.pool()
        return list(await pool.fetch(sql, *args))
