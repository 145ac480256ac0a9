"""Every query in docs/sql.md runs, with the read-only role, on a materialized workload."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import asyncpg
import pytest

from eventbus import protocol as p
from state_store.config import plain_dsn
from state_store.writer import Writer
from tests.support import CoreNode, fetch

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "sql.md"


def doc_queries() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)


async def populate(url: str) -> None:
    writer = Writer(url)
    try:
        for i in range(2):
            node = CoreNode(None, f"node-{i}", seed=i)
            node.run(300)
            for rid in node.active:
                node.core.free(rid)
            node.publisher.pump()
            for b in node.sink.batches:
                await writer.apply([b])
            now = time.time()
            stats = [p.NodeStats(schema_version=1, node_id=node.node_id, instance_id=node.instance_id, url="u",
                                 model="m", block_size=4, ts=now - 120 + k * 30, capacity=[24, 16], used=[3, 1],
                                 active_requests=k, queued_requests=0, last_event_id=node.core.last_event_id,
                                 counters=p.NodeCounters(prompt_tokens=100 * k, cached_tokens=40 * k))
                     for k in range(5)]
            await writer.apply_stats(stats)
    finally:
        await writer.close()


def test_every_documented_query_runs_as_the_reader(migrated_database_url, reader_url):
    asyncio.run(populate(migrated_database_url))
    queries = doc_queries()
    assert len(queries) >= 9

    async def run_all() -> list[list[asyncpg.Record]]:
        conn = await asyncpg.connect(plain_dsn(reader_url))
        try:
            return [await conn.fetch(q) for q in queries]
        finally:
            await conn.close()

    results = asyncio.run(run_all())
    summary, composition = results[0], results[1]
    assert [r["node_id"] for r in summary] == ["node-0", "node-1"]
    assert sum(r["blocks"] for r in composition) == fetch(migrated_database_url,
                                                          "SELECT count(*) AS c FROM node_blocks")[0]["c"]
    evictions = results[4]
    assert evictions, "the workload evicts"
    hit_rates = results[8]
    assert hit_rates and all(r["hit_rate"] is None or 0 <= r["hit_rate"] <= 1 for r in hit_rates)
