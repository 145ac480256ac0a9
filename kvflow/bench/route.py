"""``kvflow bench route``: routing decisions through the HTTP API, next to the bare SQL query.

A fresh database holds 32 live nodes × 50k cached blocks. 128 prompts of 2k–32k tokens are each
cached (a prefix of 50–100 %) on one to three nodes; the rest of every node is filler. A
``kvflow router`` process answers ``POST /v1/route`` for those prompts, as text, from a client
with a few requests in flight. Figures: client-side latency p50 / p99 and decisions per second;
baseline: the router's one SQL query alone (asyncpg, same prompts), p50. Goals on this 2-core
machine: p50 ≤ 2 ms, p99 ≤ 10 ms, ≥ 1,000 decisions/s.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import httpx

from eventbus.hashing import prompt_block_hashes
from eventbus.protocol import to_sql
from kvflow.bench.harness import BenchResult, percentile
from kvflow.stack import free_port
from routing_api.queries import PREFIX_MATCHES
from state_store.config import DatabaseSettings, plain_dsn
from state_store.scratch import scratch_database

PROJECT = Path(__file__).resolve().parents[2]


def make_prompts(n: int, rng: random.Random, lo: int = 2048, hi: int = 32768) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz ,."
    return ["".join(rng.choice(letters) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


async def _fill(url: str, nodes: int, blocks_per_node: int, prompts: list[str], rng: random.Random) -> None:
    now = datetime.now(tz=UTC)
    conn = await asyncpg.connect(plain_dsn(url))
    try:
        await conn.copy_records_to_table(
            "nodes", columns=["node_id", "instance_id", "status", "url", "model", "block_size", "capacity_gpu",
                              "capacity_host", "last_event_id", "last_seen"],
            records=[(f"node-{i:02d}", f"inst-{i}", "live", f"http://127.0.0.1:{9000 + i}", "bench", 32, 65536,
                      0, 0, now) for i in range(nodes)])
        held: dict[int, set[int]] = {i: set() for i in range(nodes)}
        for p in prompts:
            hashes = [to_sql(h) for h in prompt_block_hashes(list(p.encode()), 32)]
            for node in rng.sample(range(nodes), rng.randint(1, 3)):
                k = max(1, int(len(hashes) * rng.uniform(0.5, 1.0)))
                held[node].update(hashes[:k])
        rows: list[tuple[object, ...]] = []
        for node, hs in held.items():
            while len(hs) < blocks_per_node:
                hs.add(rng.randrange(-(1 << 63), 1 << 63))
            prios = (35, 35, 35, 100, 10)
            rows.extend((f"node-{node:02d}", h, 0, prios[h % 5], 32, now, now) for h in list(hs)[:blocks_per_node])
        await conn.copy_records_to_table("node_blocks", records=rows, columns=[
            "node_id", "block_hash", "cache_level", "priority", "num_tokens", "stored_at", "updated_at"])
        await conn.execute("ANALYZE node_blocks")
    finally:
        await conn.close()


async def _sql_baseline(url: str, prompts: list[str], rounds: int) -> list[float]:
    conn = await asyncpg.connect(plain_dsn(url))
    try:
        hashes = [[to_sql(h) for h in prompt_block_hashes(list(p.encode()), 32)] for p in prompts]
        out = []
        for i in range(rounds):
            t0 = time.perf_counter()
            await conn.fetch(PREFIX_MATCHES, hashes[i % len(hashes)])
            out.append(time.perf_counter() - t0)
        return out
    finally:
        await conn.close()


async def _load(base: str, prompts: list[str], n: int, concurrency: int) -> tuple[list[float], list[float], float]:
    latencies: list[float] = []
    server: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                t0 = time.perf_counter()
                r = await client.post("/v1/route", json={"prompt": prompts[i % len(prompts)]})
                latencies.append(time.perf_counter() - t0)
                r.raise_for_status()
                server.append(r.json()["decision_ms"] / 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return latencies, server, elapsed


def bench_route(*, nodes: int = 32, blocks_per_node: int = 50_000, prompts: int = 128, requests: int = 3000,
                concurrency: int = 4, say: Callable[[str], None] = lambda _m: None) -> BenchResult:
    res = BenchResult("route")
    rng = random.Random(21)
    texts = make_prompts(prompts, rng)
    admin = DatabaseSettings()
    with scratch_database(admin.writer(), "kvflow_bench_route") as url:
        say(f"filling PostgreSQL: {nodes} nodes x {blocks_per_node:,} blocks …")
        asyncio.run(_fill(url, nodes, blocks_per_node, texts, rng))
        from sqlalchemy.engine import make_url

        reader = make_url(admin.reader()).set(database=make_url(url).database).render_as_string(hide_password=False)
        say("bare SQL: the router's query alone …")
        _sql_baseline_warm = asyncio.run(_sql_baseline(reader, texts, 50))
        sql = asyncio.run(_sql_baseline(reader, texts, 400))
        del _sql_baseline_warm
        port = free_port()
        env = {**os.environ, "KVFLOW_DATABASE_READER_URL": reader}
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvflow-bench-route-{port}.log"
        proc = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "router", "--port", str(port),
                                 "--log-level", "warning"], env=env, cwd=PROJECT, stdout=log.open("ab"),
                                stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the router did not start; see {log}")
                time.sleep(0.2)
            say(f"{requests:,} decisions through the HTTP API, {concurrency} in flight …")
            asyncio.run(_load(base, texts, 200, concurrency))  # warm-up
            lat, server, elapsed = asyncio.run(_load(base, texts, requests, concurrency))
        finally:
            proc.terminate()
            proc.wait(30)
    res.figures.update({
        "p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
        "decisions_per_s": len(lat) / elapsed,
        "server_decision_p50_ms": percentile(server, 50) * 1000,
        "server_decision_p99_ms": percentile(server, 99) * 1000,
    })
    res.baseline.update({"sql_p50_ms": percentile(sql, 50) * 1000, "sql_p99_ms": percentile(sql, 99) * 1000})
    res.ratios["p50_vs_sql_p50"] = res.figures["p50_ms"] / res.baseline["sql_p50_ms"]
    res.goals.update({"p50_ms": "<= 2", "p99_ms": "<= 10", "decisions_per_s": ">= 1000"})
    res.details.update({"nodes": nodes, "blocks_per_node": blocks_per_node, "prompts": prompts,
                        "prompt_tokens_mean": sum(map(len, texts)) / len(texts), "requests": requests,
                        "concurrency": concurrency})
    return res
