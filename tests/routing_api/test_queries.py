"""The router's SQL (kvflow_prefix_matches, by bisection) computes what prefix_match computes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from eventbus.hashing import prompt_block_hashes, prompt_hash_heads
from eventbus.protocol import to_sql
from routing_api.queries import StateReader
from routing_api.scoring import prefix_match
from state_store.config import plain_dsn

pytestmark = pytest.mark.integration

BLOCK_COLUMNS = ["node_id", "block_hash", "cache_level", "priority", "num_tokens", "stored_at", "updated_at"]


async def execute(url: str, *steps: Callable[[asyncpg.Connection], Awaitable[object]]) -> None:
    """Run each step on one connection as the owner (the router's role may not write)."""
    conn = await asyncpg.connect(plain_dsn(url))
    try:
        for step in steps:
            await step(conn)
    finally:
        await conn.close()


def node_cache(prompt: list[int], rng: random.Random, other_prompts: list[list[int]]) -> dict[int, tuple[int, int]]:
    """A cache a node can have: prefix-closed, GPU blocks before host blocks along any prefix."""
    held: dict[int, tuple[int, int]] = {}
    chains = [prompt, *other_prompts]
    for p in chains:
        n = rng.choice([0, 1, 2, rng.randrange(len(p) + 1), len(p)])
        g = rng.randrange(n + 1)
        for i, h in enumerate(p[:n]):
            held[h] = (0 if i < g else 1, rng.choice([0, 10, 35, 50, 100]))
    for p in chains:  # every ancestor of a GPU block is on the GPU
        last_gpu = max((i for i, h in enumerate(p) if held.get(h, (1, 0))[0] == 0), default=-1)
        for h in p[:max(last_gpu, 0)]:
            held[h] = (0, held[h][1])
    return held


def test_sql_prefix_matches_equal_the_python_reference(migrated_database_url, reader_url):
    rng = random.Random(9)
    prompts = [[rng.randrange(-(1 << 63), 1 << 63) for _ in range(rng.randint(1, 80))] for _ in range(12)]
    shared = [rng.randrange(-(1 << 63), 1 << 63) for _ in range(5)]
    prompts = [shared + p for p in prompts]  # a common "system prompt"
    caches = {f"n{i}": node_cache(prompts[i % 4], rng, rng.sample(prompts, 3)) for i in range(10)}
    now = datetime.now(tz=UTC)

    records = [(n, h, lvl, prio, 32, now, now) for n, held in caches.items() for h, (lvl, prio) in held.items()]

    async def query() -> list[dict]:
        reader = StateReader(reader_url)
        try:
            return [await reader.prefix_matches(p) for p in prompts]
        finally:
            await reader.close()

    asyncio.run(execute(migrated_database_url,
                        lambda c: c.copy_records_to_table("node_blocks", columns=BLOCK_COLUMNS, records=records)))
    got = asyncio.run(query())
    for p, matches in zip(prompts, got, strict=True):
        expected = {n: m for n, c in caches.items() if (m := prefix_match(p, c)).gpu + m.host > 0}
        assert matches == expected
    assert any(m.host for ms in got for m in ms.values())
    assert any(m.leaf_low for ms in got for m in ms.values())
    assert asyncio.run(StateReader(reader_url).prefix_matches([])) == {}


def test_one_round_trip_matches_the_prompt_in_every_block_size_as_one_query_per_size(migrated_database_url,
                                                                                   reader_url):
    """``prefix_matches_by_size`` (one query for several sizes) finds what ``prefix_matches`` finds
    in each size alone; a size in which the prompt has no full block finds nothing, without a query."""
    rng = random.Random(4)
    tokens = [rng.randrange(50_000) for _ in range(300)]
    at = {b: prompt_block_hashes(tokens, b) for b in (8, 16, 32)}
    caches = {f"n{b}-{i}": node_cache([to_sql(h) for h in at[b]], rng, []) for b in at for i in range(3)}
    now = datetime.now(tz=UTC)
    records = [(n, h, lvl, prio, 16, now, now) for n, held in caches.items() for h, (lvl, prio) in held.items()]

    async def query() -> tuple:
        reader = StateReader(reader_url)
        try:
            packed = {b: prompt_hash_heads(tokens, b) for b in at}
            both = await reader.prefix_matches_by_size(packed)
            alone = {b: await reader.prefix_matches(h) for b, h in packed.items()}
            one = await reader.prefix_matches_by_size({16: packed[16]})
            short = await reader.prefix_matches_by_size({16: prompt_hash_heads(tokens[:20], 16),
                                                         512: prompt_hash_heads(tokens[:20], 512)})
            return both, alone, one, short
        finally:
            await reader.close()

    asyncio.run(execute(migrated_database_url,
                        lambda c: c.copy_records_to_table("node_blocks", columns=BLOCK_COLUMNS, records=records)))
    both, alone, one, short = asyncio.run(query())
    assert both == alone and one == {16: alone[16]}
    for b in at:
        expected = {n: m for n, c in caches.items() if (m := prefix_match([to_sql(h) for h in at[b]], c)).gpu + m.host}
        assert both[b] == expected and all(n.startswith(f"n{b}-") for n in both[b])
    assert sum(map(len, both.values())) >= 6
    assert set(short) == {16, 512} and short[512] == {}


def test_sql_prefix_matches_refuses_a_partial_hash(reader_url):
    async def query() -> None:
        reader = StateReader(reader_url)
        try:
            with pytest.raises(asyncpg.InvalidParameterValueError, match="not a whole number of 8-byte hashes"):
                await reader.prefix_matches(b"\x00" * 12)
        finally:
            await reader.close()

    asyncio.run(query())


def test_hot_connections_bound_reuse_and_replace_broken_ones(migrated_database_url):
    """At most ``size`` connections; idle ones reused; one that failed or died is never reused."""
    from routing_api.queries import HotConnections

    dsn = plain_dsn(migrated_database_url)

    async def scenario() -> None:
        opened: list[asyncpg.Connection] = []

        async def connect() -> asyncpg.Connection:
            conn = await asyncpg.connect(dsn)
            opened.append(conn)
            return conn

        hot = HotConnections(connect, size=2)
        try:
            pids = await asyncio.gather(*(hot.fetch("SELECT pg_backend_pid(), pg_sleep(0.05)") for _ in range(6)))
            assert len(opened) == 2 and len({r[0][0] for r in pids}) == 2  # 6 queries, 2 connections
            with pytest.raises(asyncpg.DivisionByZeroError):
                await hot.fetch("SELECT 1 / 0")
            assert sum(c.is_closed() for c in opened) == 1  # the failed one is gone, not pooled
            # a connection the server ended while idle: once the client has seen it close, it is
            # skipped, and the query answers on a new one
            admin = await asyncpg.connect(dsn)
            ended = [c for c in opened if not c.is_closed()]
            try:
                for c in ended:
                    await admin.execute("SELECT pg_terminate_backend($1)", c.get_server_pid())
            finally:
                await admin.close()
            deadline = asyncio.get_running_loop().time() + 10
            while not all(c.is_closed() for c in ended):  # the server's goodbye, read by the event loop
                assert asyncio.get_running_loop().time() < deadline, "the ended connection never closed"
                await asyncio.sleep(0.01)
            before = len(opened)
            assert (await hot.fetch("SELECT 41 + 1"))[0][0] == 42
            assert len(opened) == before + 1
        finally:
            await hot.close()

    asyncio.run(scenario())


class FakeConnection:
    """A connection whose server is gone although the client does not know it yet (or is fine)."""

    def __init__(self, dead: bool) -> None:
        self.dead = dead
        self.terminated = False

    def is_closed(self) -> bool:
        return self.terminated

    async def fetch(self, sql: str, *args: object) -> list[tuple[int]]:
        if self.dead:
            raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation")
        return [(42,)]

    def terminate(self) -> None:
        self.terminated = True


def test_hot_connections_a_dead_connection_not_known_closed_fails_once_and_is_replaced():
    """The other order of events, driven: the query runs on a connection whose server has gone
    before the client noticed; that query fails, the connection is dropped, the next opens anew."""
    from routing_api.queries import HotConnections

    conns = [FakeConnection(dead=True), FakeConnection(dead=False)]

    async def connect() -> FakeConnection:
        return conns.pop(0)

    async def scenario() -> None:
        hot = HotConnections(connect, size=2)  # type: ignore[arg-type]
        first = conns[0]
        with pytest.raises(asyncpg.ConnectionDoesNotExistError):
            await hot.fetch("SELECT 42")
        assert first.terminated and conns  # dropped, and not reused
        assert await hot.fetch("SELECT 42") == [(42,)]
        assert not conns and await hot.fetch("SELECT 42") == [(42,)]  # the good one is reused
        hot.reset()  # an outage: every idle connection is dropped
        assert hot._idle == []

    asyncio.run(scenario())


def test_the_pages_reads_cache_by_priority_composition_and_hit_rates(migrated_database_url, reader_url):
    now = datetime.now(tz=UTC)
    blocks = [("a", 1, 0, 100, 32), ("a", 2, 0, 100, 32), ("a", 3, 0, 35, 16), ("a", 4, 1, 35, 32),
              ("b", 5, 0, 10, 32)]
    # (node, instance, seconds before hh:mm:30 of this minute, prompt tokens, cached tokens), cumulative
    samples = [("a", "i1", 190, 0, 0), ("a", "i1", 130, 1000, 500), ("a", "i1", 70, 2000, 1250),
               ("a", "i2", 60, 10, 0),                            # a restart: no delta from i1
               ("b", "i1", 50, 0, 0), ("b", "i1", 40, 0, 0),      # b: no prompt tokens, no rate
               ("c", "i1", 3600, 0, 0), ("c", "i1", 3590, 500, 500)]  # an hour ago: left out

    minute = now.replace(second=30, microsecond=0)
    stats = [(n, i, minute - timedelta(seconds=ago), p, c) for n, i, ago, p, c in samples]
    insert_stats = ("INSERT INTO node_stats_samples (node_id, instance_id, ts, capacity_gpu, capacity_host, used_gpu,"
                    " used_host, active_requests, queued_requests, prompt_tokens, cached_tokens)"
                    " VALUES ($1, $2, $3, 1, 1, 0, 0, 0, 0, $4, $5)")
    records = [(n, h, lvl, prio, tokens, now, now) for n, h, lvl, prio, tokens in blocks]

    async def query() -> tuple:
        reader = StateReader(reader_url)
        try:
            return (await reader.cache_by_priority("a"), await reader.cache_by_priority("nobody"),
                    await reader.composition(), await reader.hit_rates())
        finally:
            await reader.close()

    asyncio.run(execute(migrated_database_url,
                        lambda c: c.copy_records_to_table("node_blocks", columns=BLOCK_COLUMNS, records=records),
                        lambda c: c.executemany(insert_stats, stats)))
    by_priority, nobody, composition, hit_rates = asyncio.run(query())
    assert by_priority == [{"cache_level": 0, "priority": 100, "blocks": 2, "tokens": 64},
                           {"cache_level": 0, "priority": 35, "blocks": 1, "tokens": 16},
                           {"cache_level": 1, "priority": 35, "blocks": 1, "tokens": 32}]
    assert nobody == []
    assert sorted(composition, key=lambda r: (r["node_id"], r["cache_level"], -r["priority"])) == [
        {"node_id": "a", "cache_level": 0, "priority": 100, "blocks": 2},
        {"node_id": "a", "cache_level": 0, "priority": 35, "blocks": 1},
        {"node_id": "a", "cache_level": 1, "priority": 35, "blocks": 1},
        {"node_id": "b", "cache_level": 0, "priority": 10, "blocks": 1}]
    a_rates = [r for r in hit_rates if r["node_id"] == "a"]
    assert [r["hit_rate"] for r in a_rates] == [0.5, 0.75]  # oldest first
    assert a_rates[1]["t"] - a_rates[0]["t"] == 60.0 and all(isinstance(r["t"], float) for r in a_rates)
    assert a_rates[1]["t"] % 60 == 0 and abs(a_rates[1]["t"] - (now.timestamp() - 120)) < 90
    assert [r["hit_rate"] for r in hit_rates if r["node_id"] == "b"] == [None]
    assert {r["node_id"] for r in hit_rates} == {"a", "b"}
    assert list(hit_rates[0]) == ["node_id", "t", "hit_rate"]
