"""``kvflow bench route --fleet N``: the routing decision as ``node_blocks`` grows.

One fresh database grows through three fleets, in the same run: 32 nodes × 50k blocks, N × 50k,
N × 200k (N = 128: 1.6M, 6.4M and 25.6M rows). The same 64 prompts (2k–32k tokens, as text) are
cached (50–100 %) on one to three of the first 32 nodes from the start, so every step answers the
same decisions over a larger table: what grows is the cost of finding them. Filler rows are made by
PostgreSQL itself (``INSERT … SELECT`` over ``generate_series``, hashes by ``hashint8extended``),
with the table's two indexes dropped during the load and built again after it (then ``VACUUM
(ANALYZE)``, so that probes are index-only as in a table in service).

At each step a one-process ``kvflow router`` answers ``requests`` decisions one at a time
(``p50_ms_by_rows``, ``p99_ms_by_rows``: client side, as ``kvflow bench route``'s ``p50_ms``), and
the router's query alone is timed on one asyncpg connection (``sql_p50_ms_by_rows``). Goal: p50
grows by less than 2× from the first fleet to the last (``ratios.p50_growth``). ``--quick``: the
block counts divided by 50.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import msgspec

from eventbus.hashing import prompt_block_hashes
from eventbus.protocol import to_sql
from kvflow.bench.harness import BenchResult, percentile
from kvflow.bench.route import _sql_baseline, make_prompts
from kvflow.bench.route_load import _load, _router
from kvflow.bench.scratch import scratch_database
from state_store.config import DatabaseSettings, plain_dsn

#: The three fleets of the issue: (nodes, blocks per node); the middle and last use ``--fleet N``.
FIRST_NODES = 32
BLOCKS = (50_000, 200_000)
INDEXES_DROP = """
ALTER TABLE node_blocks DROP CONSTRAINT IF EXISTS node_blocks_pkey;
DROP INDEX IF EXISTS node_blocks_block_hash_idx;
"""
INDEXES_BUILD = """
ALTER TABLE node_blocks ADD PRIMARY KEY (node_id, block_hash);
CREATE INDEX node_blocks_block_hash_idx ON node_blocks (block_hash) INCLUDE (node_id, cache_level, priority);
"""
# Filler blocks b in [$3, $4] of nodes [$1, $2]: distinct pseudo-random hashes, the priorities of
# kvflow bench route's filler.
FILLER = """
INSERT INTO node_blocks (node_id, block_hash, cache_level, priority, num_tokens, stored_at, updated_at)
SELECT 'node-' || lpad(n::text, 3, '0'), hashint8extended(n::bigint * 1000000007 + b, 20261201),
       0, (ARRAY[35, 35, 35, 100, 10])[1 + b % 5], 32, now(), now()
FROM generate_series($1::integer, $2::integer) AS n CROSS JOIN generate_series($3::integer, $4::integer) AS b
"""


def fleets(top_nodes: int, quick: bool) -> list[tuple[int, int]]:
    """(nodes, blocks per node) of each step."""
    div = 50 if quick else 1
    return [(FIRST_NODES, BLOCKS[0] // div), (top_nodes, BLOCKS[0] // div), (top_nodes, BLOCKS[1] // div)]


async def _grow(url: str, before: tuple[int, int], after: tuple[int, int]) -> dict[str, float]:
    """From ``before`` (nodes, blocks per node; (0, 0): empty) to ``after``: the new nodes' rows,
    their filler, the old nodes' extra filler; indexes dropped and built again. Returns seconds."""
    (n0, b0), (n1, b1) = before, after
    conn = await asyncpg.connect(plain_dsn(url), command_timeout=3600)
    try:
        await conn.execute("SET maintenance_work_mem = '512MB'")
        now = datetime.now(tz=UTC)
        await conn.copy_records_to_table(
            "nodes", columns=["node_id", "instance_id", "status", "url", "model", "block_size", "capacity_gpu",
                              "capacity_host", "last_event_id", "last_seen"],
            records=[(f"node-{i:03d}", f"inst-{i}", "live", f"http://127.0.0.1:{9000 + i}", "bench", 32, 1 << 20,
                      0, 0, now) for i in range(n0, n1)])
        t0 = time.perf_counter()
        await conn.execute(INDEXES_DROP)
        if n0 and b1 > b0:
            await conn.execute(FILLER, 0, n0 - 1, b0 + 1, b1)
        if n1 > n0:
            await conn.execute(FILLER, n0, n1 - 1, 1, b1)
        t1 = time.perf_counter()
        await conn.execute(INDEXES_BUILD)
        t2 = time.perf_counter()
        await conn.execute("VACUUM (ANALYZE) node_blocks")
        return {"insert_s": t1 - t0, "index_s": t2 - t1, "vacuum_s": time.perf_counter() - t2}
    finally:
        await conn.close()


async def _place(url: str, texts: list[str], rng: random.Random) -> int:
    """Each prompt 50–100 % cached on one to three of the first nodes; returns the rows."""
    now = datetime.now(tz=UTC)
    held: dict[int, set[int]] = {}
    for p in texts:
        hashes = [to_sql(h) for h in prompt_block_hashes(list(p.encode()), 32)]
        for node in rng.sample(range(FIRST_NODES), rng.randint(1, 3)):
            held.setdefault(node, set()).update(hashes[:max(1, int(len(hashes) * rng.uniform(0.5, 1.0)))])
    rows = [(f"node-{n:03d}", h, 0, 35, 32, now, now) for n, hs in held.items() for h in hs]
    conn = await asyncpg.connect(plain_dsn(url))
    try:
        await conn.copy_records_to_table("node_blocks", records=rows, columns=[
            "node_id", "block_hash", "cache_level", "priority", "num_tokens", "stored_at", "updated_at"])
    finally:
        await conn.close()
    return len(rows)


async def _table(url: str) -> dict[str, float]:
    conn = await asyncpg.connect(plain_dsn(url))
    try:
        r = await conn.fetchrow("SELECT count(*) AS rows, pg_table_size('node_blocks') AS heap, "
                                "pg_indexes_size('node_blocks') AS indexes FROM node_blocks")
        return {"rows": int(r["rows"]), "heap_mib": r["heap"] / 2**20, "indexes_mib": r["indexes"] / 2**20}
    finally:
        await conn.close()


def bench_fleet(*, top_nodes: int = 128, prompts: int = 64, requests: int = 1000, quick: bool = False,
                say: Callable[[str], None] = lambda _m: None) -> BenchResult:
    """The figures of the module's docstring."""
    res = BenchResult("route")
    rng = random.Random(31)
    texts = make_prompts(prompts, rng)
    bodies = [msgspec.json.encode({"prompt": t}) for t in texts]
    admin = DatabaseSettings()
    steps: list[dict[str, Any]] = []
    with scratch_database(admin.writer(), "kvflow_bench_fleet") as url:
        from sqlalchemy.engine import make_url

        reader = make_url(admin.reader()).set(database=make_url(url).database).render_as_string(hide_password=False)
        placed = asyncio.run(_place(url, texts, rng))
        before = (0, 0)
        for nodes, blocks in fleets(top_nodes, quick):
            say(f"growing node_blocks to {nodes} nodes x {blocks:,} blocks …")
            load = asyncio.run(_grow(url, before, (nodes, blocks)))
            before = (nodes, blocks)
            table = asyncio.run(_table(url))
            say(f"{table['rows']:,} rows: {requests:,} decisions one at a time, then the query alone …")
            with _router(reader, 1) as port:
                _load(port, bodies, 100, 1)  # warm-up
                serial, server = _load(port, bodies, requests, 1)
            asyncio.run(_sql_baseline(reader, texts, 50))
            sql = asyncio.run(_sql_baseline(reader, texts, 300))
            steps.append({"nodes": nodes, "blocks_per_node": blocks, **table, **load,
                          "p50_ms": percentile(serial.latencies, 50) * 1000,
                          "p99_ms": percentile(serial.latencies, 99) * 1000,
                          "server_p50_ms": percentile(server, 50) * 1000,
                          "sql_p50_ms": percentile(sql, 50) * 1000, "sql_p99_ms": percentile(sql, 99) * 1000})
    by = {str(s["rows"]): s for s in steps}
    res.figures.update({
        "p50_ms_by_rows": {k: round(s["p50_ms"], 3) for k, s in by.items()},  # type: ignore[dict-item]
        "p99_ms_by_rows": {k: round(s["p99_ms"], 3) for k, s in by.items()},  # type: ignore[dict-item]
        "p50_ms_smallest": steps[0]["p50_ms"], "p50_ms_largest": steps[-1]["p50_ms"],
        "p99_ms_largest": steps[-1]["p99_ms"],
    })
    res.baseline["sql_p50_ms_by_rows"] = {k: round(s["sql_p50_ms"], 3) for k, s in by.items()}  # type: ignore[assignment]
    res.ratios["p50_growth"] = steps[-1]["p50_ms"] / steps[0]["p50_ms"]
    res.ratios["sql_p50_growth"] = steps[-1]["sql_p50_ms"] / steps[0]["sql_p50_ms"]
    res.ratios["rows_growth"] = steps[-1]["rows"] / steps[0]["rows"]
    res.goals["p50_growth"] = "< 2"
    res.details.update({"steps": steps, "prompts": prompts, "prompt_rows": placed, "requests": requests,
                        "prompt_tokens_mean": sum(map(len, texts)) / len(texts), "quick": quick})
    return res
