"""``kvflow bench route``: routing decisions through the HTTP API, next to the bare SQL query.

A fresh database holds 32 live nodes × 50k cached blocks. 128 prompts of 2k–32k tokens are each
cached (a prefix of 50–100 %) on one to three nodes; the rest of every node is filler. A
``kvflow router`` answers ``POST /v1/route`` for those prompts, as text, sent by a lean
keep-alive HTTP client (``kvflow.bench.httpload``: httpx alone would take as much CPU as the
router). Two phases: latency, one decision at a time (``p50_ms``, ``p99_ms``, client side); then
throughput, ``concurrency`` connections in flight to a router of ``workers`` processes (2: one per
core), in 3 rounds of a third of the requests (``decisions_per_s``: the median round, every round
in ``details``; that phase's latencies are ``loaded_p50_ms`` / ``loaded_p99_ms``); then the same
against one router process (``one_process_decisions_per_s``). Baseline: the router's one SQL
query alone (asyncpg, same prompts), p50. Goals on this 2-core machine: p50 ≤ 2 ms, p99 ≤ 10 ms,
≥ 1,000 decisions/s.

Then the same fleet with a real subword tokenizer (``bpe_*``): a byte-level BPE of 32,768 ids
trained here (``kvflow.bench.bpe``; kept under ``$TMPDIR/kvflow-bench-bpe``), a one-process
router with it (``KVFLOW_ROUTER_TOKENIZER_DIR``), multi-turn prompts of 2k–8k tokens whose
previous turn it routed (``bpe_p50_ms``, ``bpe_p99_ms``: its prefix cache hits; goal p50 ≤ 2.5 ms)
and cold prompts (``bpe_cold_p50_ms``), next to ``tokenizers`` alone on the cold ones (the limit)
and the same prompts through a router without the prefix cache (``bpe_uncached_p50_ms``, the
baseline); ``bpe_tokenize_share``: tokenizing and hashing (replayed in this process, same prompts,
same order) over the router's ``decision_ms``.

Then ``multi_turn_cached_share`` (``kvflow.bench.multiturn``, real nodes): the share of prompt
tokens cached over 6-turn conversations sent back to back through the router (goal ≥ 0.9), with,
as its baseline, the same through a router that ignores the requests it saw finish.

The router under load (a ``kvflow router`` subprocess, the keep-alive load generator) is in
:mod:`kvflow.bench.route_load`, the BPE tokenizer's run in :mod:`kvflow.bench.route_bpe`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import asyncpg
import msgspec

from eventbus.hashing import prompt_block_hashes, prompt_hash_heads
from eventbus.protocol import to_sql
from kvflow.bench.harness import BenchResult, percentile
from kvflow.bench.httpload import LoadResult
from kvflow.bench.route_bpe import _bpe_prepare, _bpe_report, _bpe_routers
from kvflow.bench.route_load import _load, _router
from kvflow.bench.scratch import scratch_database
from routing_api.queries import PREFIX_MATCHES
from state_store.config import DatabaseSettings, plain_dsn


def make_prompts(n: int, rng: random.Random, lo: int = 2048, hi: int = 32768) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz ,."
    return ["".join(rng.choice(letters) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


async def _fill(url: str, nodes: int, blocks_per_node: int, prompts: list[str], rng: random.Random,
                token_prompts: Sequence[Sequence[int]] = ()) -> None:
    """The fleet: each prompt (bytes as tokens; then ``token_prompts``, already tokenized) 50–100 %
    cached on one to three nodes, the rest of every node filler."""
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
        placement = random.Random(22)  # its own: the byte prompts are placed as before
        for ids in token_prompts:
            hashes = [to_sql(h) for h in prompt_block_hashes(list(ids), 32)]
            for node in placement.sample(range(nodes), placement.randint(1, 3)):
                held[node].update(hashes[:max(1, int(len(hashes) * placement.uniform(0.5, 1.0)))])
        rows: list[tuple[object, ...]] = []
        for node, hs in held.items():
            while len(hs) < blocks_per_node:
                hs.add(rng.randrange(-(1 << 63), 1 << 63))
            prios = (35, 35, 35, 100, 10)
            rows.extend((f"node-{node:02d}", h, 0, prios[h % 5], 32, now, now) for h in list(hs)[:blocks_per_node])
        await conn.copy_records_to_table("node_blocks", records=rows, columns=[
            "node_id", "block_hash", "cache_level", "priority", "num_tokens", "stored_at", "updated_at"])
        # As a table in service is (autovacuum): visibility map set, so probes are index-only, and
        # no vacuum of the fresh 1.6M rows starts in the middle of the measurement.
        await conn.execute("VACUUM (ANALYZE) node_blocks")
    finally:
        await conn.close()


async def _sql_baseline(url: str, prompts: list[str], rounds: int) -> list[float]:
    conn = await asyncpg.connect(plain_dsn(url))
    try:
        hashes = [prompt_hash_heads(p.encode(), 32) for p in prompts]
        out = []
        for i in range(rounds):
            t0 = time.perf_counter()
            await conn.fetch(PREFIX_MATCHES, hashes[i % len(hashes)])
            out.append(time.perf_counter() - t0)
        return out
    finally:
        await conn.close()


def _throughput(port: int, bodies: list[bytes], requests: int,
                concurrency: int) -> list[tuple[LoadResult, list[float]]]:
    """3 rounds of a third of ``requests`` each, after a warm-up."""
    _load(port, bodies, 200, concurrency)
    return [_load(port, bodies, max(1, requests // 3), concurrency) for _ in range(3)]


def bench_route(*, nodes: int = 32, blocks_per_node: int = 50_000, prompts: int = 128, requests: int = 3000,
                concurrency: int = 4, workers: int = 2, multi_turn: int | None = None, bpe: int | None = None,
                say: Callable[[str], None] = lambda _m: None) -> BenchResult:
    """The decisions' latency and throughput, then the BPE tokenizer's run (:func:`_bpe_prepare`)
    with ``bpe`` conversations (None: 32, or 3 with fewer than 1,000 requests, as ``--quick``; 0:
    none), then the multi-turn scenario (``kvflow.bench.multiturn``) with ``multi_turn``
    conversations per router (None: 4, or 1 with fewer than 1,000 requests; 0: none)."""
    res = BenchResult("route")
    rng = random.Random(21)
    texts = make_prompts(prompts, rng)
    admin = DatabaseSettings()
    bodies = [msgspec.json.encode({"prompt": t}) for t in texts]
    bpe_conversations = bpe if bpe is not None else 32 if requests >= 1000 else 3
    work = _bpe_prepare(bpe_conversations, requests < 1000, say) if bpe_conversations else None
    with scratch_database(admin.writer(), "kvflow_bench_route") as url:
        say(f"filling PostgreSQL: {nodes} nodes x {blocks_per_node:,} blocks …")
        asyncio.run(_fill(url, nodes, blocks_per_node, texts, rng, work.placed if work else ()))
        from sqlalchemy.engine import make_url

        reader = make_url(admin.reader()).set(database=make_url(url).database).render_as_string(hide_password=False)
        say("bare SQL: the router's query alone …")
        _sql_baseline_warm = asyncio.run(_sql_baseline(reader, texts, 50))
        sql = asyncio.run(_sql_baseline(reader, texts, 400))
        del _sql_baseline_warm
        with _router(reader, workers) as port:
            _load(port, bodies, 200, 1)  # warm-up
            say(f"{requests:,} decisions through the HTTP API, one at a time (latency) …")
            serial, serial_server = _load(port, bodies, requests, 1)
            say(f"{requests:,} decisions, {concurrency} in flight, {workers} router processes, 3 rounds …")
            rounds = _throughput(port, bodies, requests, concurrency)
        if workers != 1:
            with _router(reader, 1) as port:
                say(f"{requests:,} decisions, {concurrency} in flight, one router process, 3 rounds …")
                one = _throughput(port, bodies, requests, concurrency)
        else:
            one = rounds
        routed = _bpe_routers(reader, work, say) if work else None
    lat = serial.latencies
    rates = [r.per_second for r, _ in rounds]
    one_rates = [r.per_second for r, _ in one]
    loaded_lat = [x for r, _ in rounds for x in r.latencies]
    loaded_server = [x for _, srv in rounds for x in srv]
    res.figures.update({
        "p50_ms": percentile(lat, 50) * 1000, "p99_ms": percentile(lat, 99) * 1000,
        "decisions_per_s": sorted(rates)[1],
        "one_process_decisions_per_s": sorted(one_rates)[1],
        "serial_decisions_per_s": serial.per_second,
        "loaded_p50_ms": percentile(loaded_lat, 50) * 1000,
        "loaded_p99_ms": percentile(loaded_lat, 99) * 1000,
        "server_decision_p50_ms": percentile(serial_server, 50) * 1000,
        "server_decision_p99_ms": percentile(serial_server, 99) * 1000,
        "loaded_server_decision_p50_ms": percentile(loaded_server, 50) * 1000,
    })
    res.baseline.update({"sql_p50_ms": percentile(sql, 50) * 1000, "sql_p99_ms": percentile(sql, 99) * 1000})
    res.ratios["p50_vs_sql_p50"] = res.figures["p50_ms"] / res.baseline["sql_p50_ms"]
    res.goals.update({"p50_ms": "<= 2", "p99_ms": "<= 10", "decisions_per_s": ">= 1000"})
    res.details.update({"nodes": nodes, "blocks_per_node": blocks_per_node, "prompts": prompts,
                        "prompt_tokens_mean": sum(map(len, texts)) / len(texts), "requests": requests,
                        "concurrency": concurrency, "router_processes": workers,
                        "throughput_rounds_per_s": [round(r, 1) for r in rates],
                        "one_process_rounds_per_s": [round(r, 1) for r in one_rates]})
    if work and routed:
        _bpe_report(res, work, routed)
    conversations = multi_turn if multi_turn is not None else 4 if requests >= 1000 else 1
    if conversations:
        from kvflow.bench.multiturn import bench_multi_turn

        mt = bench_multi_turn(conversations=conversations, say=say)
        res.figures["multi_turn_cached_share"] = mt["multi_turn_cached_share"]
        res.baseline["multi_turn_cached_share"] = mt["multi_turn_cached_share_baseline"]
        res.goals["multi_turn_cached_share"] = ">= 0.9"
        res.details["multi_turn"] = mt["details"]
    return res
