"""``prompt_cache_key``: requests with the same key go to the same node while the load bounds allow.

A key is scoped to its tenant (the API key's tenant; '' on an open router): one tenant's key
never steers, or shows, another's requests. The key's node is the one its last request went to,
kept in PostgreSQL (``prompt_cache_keys``, migration 0005), so every router replica and a
restarted router agree; this process also keeps what it wrote (read when PostgreSQL is away).

In the decision the key weighs like a cached prefix the router cannot see yet: the key's node is
credited as if it held all of the prompt's full blocks (the client says the key's requests are
alike: what the first computed, the next will find). The load and work bounds still apply, so a
busy key's node is passed over as any other would be, and the key then moves with its requests.

The router writes the key's row after each proxied answer (node, requests, prompt and cached
tokens from the usage when the answer carried one: a stream reports it only with
``stream_options.include_usage``). Writes run in the background; one that fails (a read-only
standby as the reader, PostgreSQL away) is logged once and counted, never fails the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

import asyncpg

from routing_api.queries import DatabaseUnavailable, StateReader

log = logging.getLogger("kvflow.router")

KEY_NODE = """
SELECT node_id FROM prompt_cache_keys WHERE tenant = $1 AND model = $2 AND cache_key = $3
"""

#: Keys this process remembers itself (its writes: read when PostgreSQL cannot be), the latest.
LOCAL_KEYS = 100_000

UPSERT = """
INSERT INTO prompt_cache_keys AS k (tenant, model, cache_key, node_id, requests, prompt_tokens, cached_tokens)
VALUES ($1, $2, $3, $4, 1, $5, $6)
ON CONFLICT (tenant, model, cache_key) DO UPDATE
SET node_id = EXCLUDED.node_id, last_used = now(), requests = k.requests + 1,
    prompt_tokens = k.prompt_tokens + EXCLUDED.prompt_tokens, cached_tokens = k.cached_tokens + EXCLUDED.cached_tokens
"""

KEY_STATS = """
SELECT tenant, model, cache_key, node_id, requests, prompt_tokens, cached_tokens, hit_rate,
       extract(epoch FROM last_used) AS last_used
FROM prompt_cache_key_hit_rates WHERE $2::text IS NULL OR tenant = $2 ORDER BY last_used DESC LIMIT $1
"""


class CacheKeys:
    """The keys' nodes: PostgreSQL first, this process's own writes when it cannot be read."""

    def __init__(self, reader: StateReader) -> None:
        self.reader = reader
        #: (tenant, model, key) → the node of the key's last request this process proxied
        self.local: OrderedDict[tuple[str, str, str], str] = OrderedDict()
        self.write_failures = 0
        self.read_failures = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def lookup(self, tenant: str | None, model: str, key: str) -> str | None:
        """The node of the key's last request (None: a key not seen)."""
        scope = (tenant or "", model, key)
        try:
            rows = await self.reader._fetch(KEY_NODE, *scope)
        except DatabaseUnavailable:
            return self.local.get(scope)
        except asyncpg.PostgresError as exc:  # e.g. a database not upgraded to 0005: keys by this process only
            self._schema_missing(exc)
            return self.local.get(scope)
        return str(rows[0]["node_id"]) if rows else self.local.get(scope)

    def record(self, tenant: str | None, model: str, key: str, node: str, usage: dict[str, Any] | None) -> None:
        """Note the key's request answered by ``node`` (with its usage, if the answer had one)."""
        scope = (tenant or "", model, key)
        prompt = cached = 0
        if usage:
            prompt = int(usage.get("prompt_tokens") or 0)
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.local[scope] = node
        self.local.move_to_end(scope)
        if len(self.local) > LOCAL_KEYS:
            self.local.popitem(last=False)
        task = asyncio.get_running_loop().create_task(self._write(scope, node, prompt, cached))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, scope: tuple[str, str, str], node: str, prompt: int, cached: int) -> None:
        try:
            pool = await self.reader.pool()
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SET TRANSACTION READ WRITE")  # the reader role's sessions are read-only
                await conn.execute(UPSERT, *scope, node, prompt, cached)
        except Exception as exc:  # never fails the request: counted, logged once
            self.write_failures += 1
            if self.write_failures == 1:
                log.warning("cannot record prompt_cache_key rows in PostgreSQL (%s: %s): keys are kept by this "
                            "router process only", type(exc).__name__, exc)

    async def drain(self) -> None:
        """Wait for the writes under way (tests; shutdown)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def stats(self, tenant: str | None, limit: int = 100) -> list[dict[str, Any]]:
        """The most recently used keys with their node and hit rate (the dashboard's table): a
        tenant's key sees its own tenant's keys only (None: every tenant's, an open router's or an
        operator's key)."""
        try:
            rows = await self.reader._fetch(KEY_STATS, limit, tenant)
        except asyncpg.PostgresError as exc:
            self._schema_missing(exc)
            return []
        return [{k: (float(v) if k in ("hit_rate", "last_used") and v is not None else v) for k, v in r.items()}
                for r in rows]

    def _schema_missing(self, exc: BaseException) -> None:
        if not self.read_failures:
            log.warning("cannot read prompt_cache_keys (%s: %s; is the database at migration 0005? kvflow db "
                        "upgrade): keys are kept by this router process only", type(exc).__name__, exc)
        self.read_failures += 1
