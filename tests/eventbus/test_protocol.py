"""The wire schema: exact round trips, strict refusals with reasons, the published JSON Schema."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import msgspec
import pytest

from eventbus import protocol as p

DOCS = Path(__file__).resolve().parents[2] / "docs" / "schema"
NATIVE_CHECK = p._native_hash_check()


@pytest.fixture(params=["python", "native"])
def hash_check(request, monkeypatch):
    """decode_batch with the block-hash bound checked in Python, then by kvflow_native."""
    if request.param == "native":
        if NATIVE_CHECK is None:
            if os.environ.get("KVFLOW_REQUIRE_NATIVE") == "1":
                pytest.fail("kvflow_native is not installed (make install builds it)", pytrace=False)
            pytest.skip("kvflow_native is not installed")
        monkeypatch.setattr(p, "_first_beyond_u64", NATIVE_CHECK)
    else:
        monkeypatch.setattr(p, "_first_beyond_u64", None)
    return request.param

EXAMPLE = {  # docs/architecture.md#eventbatch's example, verbatim in shape
    "schema_version": 1, "node_id": "node-a", "instance_id": "6f1c0a", "ts": 1764412345.123,
    "events": [
        {"event_id": 0, "window_size": 4096, "data": {"type": "created", "num_blocks_per_cache_level": [4096, 16384]}},
        {"event_id": 1, "window_size": 4096, "data": {"type": "stored", "parent_hash": None, "blocks": [
            {"block_hash": 1234, "num_tokens": 32, "lora_id": None, "cache_level": 0, "priority": 100}]}},
        {"event_id": 2, "window_size": 4096, "data": {"type": "removed", "block_hashes": [1234]}},
        {"event_id": 3, "window_size": 4096, "data": {"type": "updated", "block_hash": 99,
                                                      "cache_level": {"old": 0, "new": 1}, "priority": None}},
        {"event_id": 4, "window_size": 4096, "data": {"type": "snapshot", "blocks": [
            {"block_hash": 99, "parent_hash": None, "num_tokens": 32, "lora_id": None, "cache_level": 1,
             "priority": 35}]}},
    ],
}


def test_the_design_example_decodes_and_round_trips():
    raw = json.dumps(EXAMPLE).encode()
    batch = p.decode_batch(raw)
    assert [type(e.data) for e in batch.events] == [p.Created, p.Stored, p.Removed, p.Updated, p.Snapshot]
    assert batch.events[1].data.blocks[0] == p.StoredBlock(block_hash=1234, num_tokens=32, priority=100)
    assert p.decode_batch(p.encode(batch)) == batch
    again = json.loads(p.encode(batch))
    assert again["events"][1]["data"]["blocks"][0]["token_ids"] is None
    assert again["events"][3]["data"] == EXAMPLE["events"][3]["data"]


def _mutated(path: list, value) -> bytes:
    doc = json.loads(json.dumps(EXAMPLE))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("raw", "reason", "fragment"), [
    (b"{not json", "malformed_json", "malformed"),
    (b"", "malformed_json", "truncated"),
    (_mutated(["schema_version"], 2), "unknown_schema_version", "this consumer speaks schema_version 1"),
    (_mutated(["node_id"], 7), "invalid", "Expected `str`, got `int` - at `$.node_id`"),
    (_mutated(["events", 1, "data", "blocks", 0, "block_hash"], -1), "invalid", "Expected `int` >= 0"),
    (_mutated(["events", 1, "data", "blocks", 0, "block_hash"], 1 << 64), "invalid", "does not fit in 64 bits"),
    (_mutated(["events", 2, "data", "block_hashes"], [1, 1 << 70]), "invalid", "does not fit in 64 bits"),
    (_mutated(["events", 1, "data", "blocks", 0, "priority"], 101), "invalid", "Expected `int` <= 100"),
    (_mutated(["events", 1, "data", "blocks", 0, "cache_level"], 2), "invalid", "Expected `int` <= 1"),
    (_mutated(["events", 1, "data", "blocks", 0, "num_tokens"], 1 << 20), "invalid", "<= 65536"),
    (_mutated(["events", 1, "data", "type"], "deleted"), "invalid", "Invalid value 'deleted'"),
    (_mutated(["events", 1, "data", "extra"], 1), "invalid", "unknown field `extra`"),
    (_mutated(["events", 2, "event_id"], 7), "invalid", "event_id 7 at $.events[2] does not follow 1"),
    (_mutated(["events"], []), "invalid", "Expected `array` of length >= 1"),
    (_mutated(["node_id"], "bad id with spaces"), "invalid", "Expected `str` matching regex"),
])
def test_bad_messages_are_refused_with_a_reason(raw, reason, fragment, hash_check):
    with pytest.raises(p.ProtocolError) as info:
        p.decode_batch(raw)
    assert info.value.reason == reason
    assert fragment in info.value.message


def test_the_hash_bound_and_the_sequence_are_checked_alike_in_python_and_compiled(monkeypatch):
    """Random batches with hashes around 2**64 anywhere (parents, blocks, removed, updated,
    snapshots) and the odd gap: both checks refuse the same ones, with the same message."""
    if NATIVE_CHECK is None:
        pytest.skip("kvflow_native is not installed")
    rng = random.Random(7)

    def h() -> int | None:
        return rng.choice([0, 1, (1 << 64) - 1, 1 << 64, (1 << 64) + 5, 1 << 70, rng.randrange(1 << 64)])

    def event(i: int) -> dict:
        kind = rng.choice(["stored", "removed", "updated", "snapshot", "created"])
        if kind == "stored":
            data = {"type": kind, "parent_hash": rng.choice([None, h()]),
                    "blocks": [{"block_hash": h(), "num_tokens": 4} for _ in range(rng.randint(1, 4))]}
        elif kind == "removed":
            data = {"type": kind, "block_hashes": [h() for _ in range(rng.randint(1, 4))]}
        elif kind == "updated":
            data = {"type": kind, "block_hash": h()}
        elif kind == "snapshot":
            data = {"type": kind, "blocks": [{"block_hash": h(), "parent_hash": rng.choice([None, h()]),
                                              "num_tokens": 4} for _ in range(rng.randint(0, 3))]}
        else:
            data = {"type": kind, "num_blocks_per_cache_level": [8]}
        return {"event_id": i + (rng.random() < 0.05), "window_size": 64, "data": data}

    outcomes = {"ok": 0, "hash": 0, "sequence": 0}
    for _ in range(3000):
        doc = {"schema_version": 1, "node_id": "n", "instance_id": "i", "ts": 1.0,
               "events": [event(i) for i in range(rng.randint(1, 6))]}
        raw = json.dumps(doc).encode()
        results = []
        for check in (None, NATIVE_CHECK):
            monkeypatch.setattr(p, "_first_beyond_u64", check)
            try:
                results.append(p.decode_batch(raw))
            except p.ProtocolError as exc:
                results.append((exc.reason, exc.message))
        assert results[0] == results[1]
        kind = "ok" if isinstance(results[0], p.EventBatch) else (
            "sequence" if "does not follow" in results[0][1] else "hash")
        outcomes[kind] += 1
    assert min(outcomes.values()) > 50, outcomes


def test_oversized_messages_are_refused_before_parsing():
    with pytest.raises(p.ProtocolError) as info:
        p.decode_batch(b" " * (p.MAX_BATCH_BYTES + 1))
    assert info.value.reason == "too_large"


def test_sql_mapping_of_hashes_is_a_bijection_on_64_bits():
    for h in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 0xDEADBEEFCAFEBABE):
        v = p.to_sql(h)
        assert -(1 << 63) <= v < (1 << 63)
        assert p.from_sql(v) == h
    assert p.to_sql((1 << 64) - 1) == -1


def test_node_stats_and_control_round_trip():
    stats = p.NodeStats(schema_version=1, node_id="node-a", instance_id="i1", url="http://localhost:8101",
                        model="tiny-llama", block_size=32, ts=1.5, capacity=[10, 20], used=[3, 0],
                        active_requests=1, queued_requests=0, last_event_id=5,
                        counters=p.NodeCounters(prompt_tokens=100, cached_tokens=64, evictions_by_priority={"35": 2}))
    assert p.decode_stats(p.encode(stats)) == stats
    cmd = p.ControlCommand(schema_version=1, node_id="node-a", command="resync", reason="gap")
    assert p.decode_control(p.encode(cmd)) == cmd
    with pytest.raises(p.ProtocolError):
        p.decode_stats(p.encode(stats).replace(b'"capacity":[10,20]', b'"capacity":[10]'))


def test_a_heartbeat_says_stopping_only_in_a_goodbye():
    """NodeStats.status: "live" by default and then left out of the JSON (a consumer that decodes
    strictly and predates the field accepts every heartbeat but the goodbye); "stopping" is the
    last heartbeat of a node that stops."""
    stats = p.NodeStats(schema_version=1, node_id="node-a", instance_id="i1", url="http://n", model="m",
                        block_size=32, ts=1.5, capacity=[10, 0], used=[3, 0], active_requests=0, queued_requests=0,
                        last_event_id=5, active_blocks=2)
    assert stats.status == "live"
    assert b'"status"' not in p.encode(stats) and b'"active_blocks":2' in p.encode(stats)
    bye = msgspec.structs.replace(stats, status="stopping")
    assert json.loads(p.encode(bye))["status"] == "stopping"
    assert p.decode_stats(p.encode(bye)) == bye
    assert p.decode_stats(p.encode(stats)) == stats
    with pytest.raises(p.ProtocolError) as info:
        p.decode_stats(p.encode(stats)[:-1] + b',"status":"gone"}')
    assert info.value.reason == "invalid"
    # As a consumer of the schema before the field decodes: every heartbeat but the goodbye.
    old = msgspec.defstruct("OldNodeStats", [(f, t, d) if d is not msgspec.NODEFAULT else (f, t)
                                             for f, t, d in _fields(p.NodeStats) if f != "status"],
                            forbid_unknown_fields=True)
    msgspec.json.decode(p.encode(stats), type=old)
    with pytest.raises(msgspec.ValidationError, match="status"):
        msgspec.json.decode(p.encode(bye), type=old)


def _fields(tp: type) -> list[tuple[str, object, object]]:
    """(name, type, default) of a struct's fields, for msgspec.defstruct."""
    out: list[tuple[str, object, object]] = []
    for f in msgspec.structs.fields(tp):
        if f.default is not msgspec.NODEFAULT:
            out.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            out.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            out.append((f.name, f.type, msgspec.NODEFAULT))
    return out


def test_published_json_schemas_are_up_to_date():
    """docs/schema/*.json are generated from this module: regenerate with `kvflow schema export`."""
    for name, schema in p.json_schemas().items():
        path = DOCS / f"{name}.schema.json"
        assert path.is_file(), f"missing {path}; run `kvflow schema export`"
        assert json.loads(path.read_text()) == schema, f"{path} is stale; run `kvflow schema export`"
