"""`kvflow trace export`: block_events rows back into requests (pure), and the command on a real database."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kvflow.trace_export import EventRow, TraceBuilder, parse_time, rows_to_trace
from kvflow.traces import TraceRequest, load_trace, replay_core, trace_prompts
from tests.support import ROOT

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
DOC = ROOT / "docs" / "traces.md"


def event(node: str, eid: int, blocks: list[int], parent: int | None, at_s: float, *, instance: str = "i1",
          kind: str = "stored", tokens: int = 16) -> list[EventRow]:
    """The rows the materializer writes for one event: seq 0 links to ``parent``, each next row to the one before."""
    rows, p = [], parent
    for seq, h in enumerate(blocks):
        rows.append(EventRow(node, instance, eid, seq, kind, h, p, tokens, T0 + timedelta(seconds=at_s)))
        p = h
    return rows


def in_query_order(*events: list[EventRow]) -> list[EventRow]:
    rows = [r for e in events for r in e]
    return sorted(rows, key=lambda r: (r.node_id, r.instance_id, r.event_id, r.seq))


HISTORY = in_query_order(
    event("a", 1, [10, 11, 12], None, 0.0),      # a prompt, nothing cached: 3 blocks
    event("a", 2, [13, 14], 12, 1.5),            # the next turn: two blocks after it
    event("a", 3, [20, 21], 11, 2.0004),         # a partial hit: shares 10, 11
    event("a", 4, [22], 21, 2.5),                # decode: one block after event 3's last
    event("a", 5, [23], 22, 2.6),                # decode again
    event("a", 6, [24, 25], 23, 4.0),            # the next turn, through the decode blocks
    event("a", 7, [30], 10, 4.5),                # one block, but after a block that ends no event
    event("b", 1, [10, 11, 40], None, 1.0),      # another node, the same first blocks
    event("b", 2, [41], 99, 3.0),                # a parent no row holds: a gap
    event("a", 1, [50], 12, 5.0, instance="i2"),  # a new instance: the old one's blocks are gone
    event("c", 1, [60, 61], None, 0.5, kind="snapshot"),  # a resync: a snapshot, not requests
    event("c", 2, [62], 61, 6.0),                # after a snapshotted block (no event ended there)
)


def test_stored_events_become_requests_with_their_ancestor_chains():
    b = TraceBuilder()
    for r in HISTORY:
        b.add(r)
    trace = b.finish()
    # ids by first appearance in time order: 10 11 12 | 10 11 40 | 13 14 | 20 21 | 41 | 22 23 24 25 | 30 | 50 | 60 61 62
    assert trace == [
        TraceRequest(0.0, 48, 0, (0, 1, 2)),                  # a 1: 10 11 12
        TraceRequest(1.0, 48, 0, (0, 1, 3)),                  # b 1: 10 11 40 (same ids as node a's)
        TraceRequest(1.5, 80, 0, (0, 1, 2, 4, 5)),            # a 2: the chain back to 10
        TraceRequest(2.0, 64, 0, (0, 1, 6, 7)),               # a 3: to the millisecond, rounded down
        TraceRequest(3.0, 16, 0, (8,)),                       # b 2: the chain stops at the unknown 99
        TraceRequest(4.0, 128, 0, (0, 1, 6, 7, 9, 10, 11, 12)),  # a 6: 10 11 20 21 22 23 24 25
        TraceRequest(4.5, 32, 0, (0, 13)),                    # a 7: 10 30
        TraceRequest(5.0, 16, 0, (14,)),                      # a/i2 1: 12 belongs to instance i1
        TraceRequest(6.0, 48, 0, (15, 16, 17)),               # c 2: 60 61 from the snapshot, then 62
    ]
    s = b.stats
    assert (s.stored_events, s.requests, s.decode_continuations, s.partial_chains) == (11, 9, 2, 2)
    assert rows_to_trace(HISTORY) == trace


def test_since_keeps_the_ancestors_and_until_drops_rows():
    trace = rows_to_trace(HISTORY, since=T0 + timedelta(seconds=4))
    assert trace == [TraceRequest(0.0, 128, 0, (0, 1, 2, 3, 4, 5, 6, 7)),  # a 6: its whole chain
                     TraceRequest(0.5, 32, 0, (0, 8)),
                     TraceRequest(1.0, 16, 0, (9,)),
                     TraceRequest(2.0, 48, 0, (10, 11, 12))]
    b = TraceBuilder(since=T0 + timedelta(seconds=4))
    for r in HISTORY:
        b.add(r)
    b.finish()
    assert b.stats.before_since == 5
    until = rows_to_trace(HISTORY, until=T0 + timedelta(seconds=2.5))
    assert [r.hash_ids for r in until] == [(0, 1, 2), (0, 1, 3), (0, 1, 2, 4, 5), (0, 1, 6, 7)]


def test_a_decode_chain_is_cut_by_a_request_and_a_cycle_stops_the_walk():
    rows = in_query_order(
        event("a", 1, [1, 2], None, 0.0),
        event("a", 2, [3], 2, 1.0),          # decode after event 1
        event("a", 3, [4, 5, 6], 3, 2.0),    # a request after the decode block: its chain includes it
        event("a", 4, [7], 5, 3.0),          # 5 ends no event: a request
        event("a", 5, [8], 6, 4.0),          # 6 ends event 3: decode
    )
    assert [r.hash_ids for r in rows_to_trace(rows)] == [(0, 1), (0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 6)]
    looped = in_query_order(event("a", 1, [1], 2, 0.0), event("a", 2, [2, 3], 1, 1.0),
                            event("a", 3, [4, 5], 2, 2.0))
    # corrupt rows (1's parent is 2 and 2's is 1): the walk stops where the chain would repeat
    assert [r.hash_ids for r in rows_to_trace(looped)] == [(0,), (0, 1, 2), (0, 1, 3, 4)]


def test_times_parse_as_iso_and_default_to_utc():
    assert parse_time("2026-12-01T12:00:00") == T0
    assert parse_time("2026-12-01T13:00:00+01:00") == T0
    assert parse_time("2026-12-01T12:00:00Z") == T0
    with pytest.raises(ValueError, match="Invalid isoformat"):
        parse_time("yesterday")


def test_the_command_refuses_a_bad_time(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvflow.cli", "trace", "export", "--out", str(tmp_path / "t"),
                           "--since", "yesterday"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          check=False)
    assert proc.returncode == 1 and "not an ISO 8601 time" in proc.stderr
    assert not (tmp_path / "t").exists()


# --------------------------------------------------------------------------- integration

BS = 4  # tokens per block of the cores below


class Fleet:
    """Two KV cores publishing into memory, driven request by request with known times; what each
    request stored is kept, so the expected trace follows from the workload (not from the rows)."""

    def __init__(self) -> None:
        from eventbus.publisher import InMemorySink, Publisher
        from inference_node.kv.clock import ManualClock
        from inference_node.kv.manager import KvCacheConfig, KVCacheManager

        self.now = 1_800_000_000.0
        self.cores, self.pubs, self.sinks = {}, {}, {}
        for node in ("node-a", "node-b"):
            core = KVCacheManager(KvCacheConfig(num_gpu_blocks=64, num_host_blocks=0, block_size=BS),
                                  clock=ManualClock())
            self.cores[node], self.sinks[node] = core, InMemorySink()
            self.pubs[node] = Publisher(core, self.sinks[node], node, f"{node}-i1", clock=lambda: self.now)
        self.tips: dict[str, set[int]] = {"node-a": set(), "node-b": set()}
        self.expected: list[tuple[float, str, tuple[int, ...]]] = []  # (time, node, prompt's block hashes)
        self.decode = 0
        self.n = 0

    def request(self, node: str, tokens: list[int], *, generate: Sequence[int] = ()) -> None:
        from eventbus.hashing import prompt_block_hashes
        from eventbus.protocol import to_sql
        from inference_node.kv.prompt import Prompt

        self.now += 0.25
        core, rid = self.cores[node], f"r{self.n}"
        self.n += 1
        hashes = [to_sql(h) for h in prompt_block_hashes(tokens + list(generate), BS)]
        full = len(tokens) // BS
        alloc = core.allocate(rid, Prompt.from_tokens(tokens, BS))
        new = hashes[alloc.num_cached_tokens // BS:full]
        if new:
            decode = len(new) == 1 and full > 1 and hashes[full - 2] in self.tips[node]
            self.tips[node].add(new[-1])
            if not decode:
                self.expected.append((self.now, node, tuple(hashes[:full])))
        self.pubs[node].pump()
        for i, t in enumerate(generate):
            core.append_token(rid, t)
            if (len(tokens) + i + 1) % BS == 0:  # a decode block filled: stored, after a tip
                self.now += 0.25
                self.decode += 1
                self.tips[node].add(hashes[(len(tokens) + i + 1) // BS - 1])
                self.pubs[node].pump()
        core.free(rid)
        self.pubs[node].pump()

    def expected_trace(self, since: float | None = None) -> list[TraceRequest]:
        reqs = sorted((r for r in self.expected if since is None or r[0] >= since), key=lambda r: (r[0], r[1]))
        ids: dict[int, int] = {}
        return [TraceRequest(round((t - reqs[0][0]) * 1000) / 1000, len(hs) * BS, 0,
                             tuple(ids.setdefault(h, len(ids)) for h in hs)) for t, _, hs in reqs]

    async def materialize(self, url: str) -> None:
        from state_store.writer import Writer

        writer = Writer(url)
        try:
            for sink in self.sinks.values():
                for batch in sink.batches:
                    await writer.apply([batch])
        finally:
            await writer.close()


def conversation_workload() -> Fleet:
    f = Fleet()
    system = list(range(100, 112))                       # 3 blocks, on both nodes
    u1 = system + list(range(200, 210))                  # 5 full blocks + 2 tokens
    f.request("node-a", u1, generate=[7, 7, 7, 7, 7, 7])  # fills 2 decode blocks
    f.request("node-b", system + list(range(300, 309)))  # the same system prompt elsewhere
    turn2 = u1 + [7] * 6 + list(range(400, 409))          # history + answer + question: 2 new blocks
    f.request("node-a", turn2)
    f.request("node-a", system + list(range(500, 512)))  # a partial hit: 3 new blocks
    f.request("node-a", system + [1])                    # all cached: stores nothing, not in the trace
    f.request("node-b", list(range(600, 605)))           # a fresh 1-block prompt (no parent): a request
    f.request("node-b", system + list(range(300, 312)))  # one block after a tip: read as decode (a limit)
    f.request("node-a", turn2 + list(range(700, 712)), generate=[9] * 4)  # 3 new blocks, then decode
    return f


def export(args: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvflow.cli", "trace", "export", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)


def doc_sql() -> str:
    (query,) = re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)
    return query


async def run_doc_sql(url: str) -> list[dict[str, object]]:
    import asyncpg

    from state_store.config import plain_dsn

    conn = await asyncpg.connect(plain_dsn(url))
    try:
        async with conn.transaction(readonly=True):
            return [json.loads(r[0]) for r in await conn.fetch(doc_sql())]
    finally:
        await conn.close()


def prefix_hits(trace: list[TraceRequest]) -> int:
    """Blocks an unbounded cache serves: prefix-remapped ids, so a request hits its run of seen ids."""
    seen: set[int] = set()
    hits = 0
    for r in trace:
        for h in r.hash_ids:
            if h not in seen:
                break
            hits += 1
        seen.update(r.hash_ids)
    return hits


@pytest.mark.integration
def test_the_command_exports_what_the_fleet_did_and_the_sql_agrees(migrated_database_url, reader_url, tmp_path):
    fleet = conversation_workload()
    asyncio.run(fleet.materialize(migrated_database_url))
    expected = fleet.expected_trace()
    assert len(expected) == 6 and fleet.decode == 3

    out = tmp_path / "fleet.jsonl"
    proc = export(["--database-url", reader_url], out)
    assert proc.returncode == 0, proc.stderr
    assert "6 requests from 10 stored events (4 decode continuations, 0 with an unknown ancestor" in proc.stdout
    trace = load_trace(out)
    assert trace == expected
    assert trace[0].hash_ids[:3] == trace[1].hash_ids[:3] == (0, 1, 2)  # the system prompt, on both nodes

    # The documented SQL gives the same lines.
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert asyncio.run(run_doc_sql(reader_url)) == lines

    # One node; from a time on (the ancestors still found).
    proc = export(["--database-url", reader_url, "--node", "node-b"], tmp_path / "b.jsonl")
    assert proc.returncode == 0, proc.stderr
    b_only = [r for r in fleet.expected if r[1] == "node-b"]
    assert [len(r.hash_ids) for r in load_trace(tmp_path / "b.jsonl")] == [len(r[2]) for r in b_only]
    since = fleet.expected[2][0]
    iso = datetime.fromtimestamp(since, UTC).isoformat()
    proc = export(["--database-url", reader_url, "--since", iso], tmp_path / "s.jsonl")
    assert proc.returncode == 0, proc.stderr
    assert load_trace(tmp_path / "s.jsonl") == fleet.expected_trace(since)

    # The trace replays as `kvflow bench kv --trace` replays one: on the real KV core.
    prompts = trace_prompts(trace)
    assert replay_core(trace, prompts, 10_000).hit_blocks == prefix_hits(trace) > 0
