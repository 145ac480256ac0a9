"""The one wire schema of kvflow (docs/architecture.md#kafka): ``EventBatch`` and ``NodeStats``.

Every producer (inference nodes) and consumer (materializer, ``kvflow events tail``, your own
consumers) imports this module; nobody copies it. The same structures are published as JSON
Schema in ``docs/schema/`` (:func:`json_schemas`; a test keeps the files in step).

Identifiers (the only place that documents them):

===================  ============================================================================
``BlockHash``        unsigned 64-bit integer: the first 8 bytes (big-endian) of a block's
                     cryptographic digest (``eventbus.hashing``). What the wire and SQL carry.
``SqlBlockHash``     the same 64 bits read as a signed ``bigint`` (PostgreSQL has no unsigned
                     type). In Python ``to_sql``/``to_sql_list``/``from_sql`` convert; the same
                     bits are read signed by the compiled hot path (``native/src``: ``u64 as
                     i64``) and by ``kvflow_prefix_matches`` from the router's packed digest
                     heads (``eventbus.hashing.prompt_hash_heads``).
``BlockDigest``      the full 32-byte BLAKE2b digest: the key of reuse inside a node (never 64
                     bits there, so crafted collisions cannot leak one tenant's KV to another).
``NodeId``           a node's stable name (e.g. ``node-a``): the Kafka message key.
``InstanceId``       a random id per node process start; ``event_id`` restarts at 0 with it.
``EventId``          per instance, increasing by exactly 1; a gap means events were missed.
===================  ============================================================================

The wire structs carry these types (``EventBatch.node_id`` is a ``NodeId``, a block hash a
``BlockHash``), and so do the records that cross module boundaries: the node's publisher and
engine, the materializer's rows and plans (``state_store.plans``), the router's views and
matches (``routing_api.scoring``). A string from outside (settings, SQL rows, a URL) becomes one
where it enters (``NodeId(settings.node_id)``). On the hottest paths a value is not wrapped per
element (a ``NewType`` call costs a function call); those lines say so with a ``NOTE``.

Decoding is strict (wrong types, unknown fields, out-of-range values and oversized messages are
refused) and every refusal is a :class:`ProtocolError` with a short machine-readable ``reason``
(used as the DLQ header) and a human message.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Final, Literal, NewType

import msgspec
from msgspec import Meta, Struct

SCHEMA_VERSION: Final = 1

#: Largest encoded EventBatch a consumer accepts (Kafka's message.max.bytes is 10 MiB here).
MAX_BATCH_BYTES: Final = 8 * 1024 * 1024
#: Largest number of events in one batch, and of blocks in one event.
MAX_EVENTS_PER_BATCH: Final = 100_000
MAX_BLOCKS_PER_EVENT: Final = 1_000_000
#: Blocks a producer puts in one ``snapshot`` part or one ``removed`` event at most: ~2 MiB of
#: JSON, so that any event fits in a batch a consumer accepts, whatever the cache size.
EVENT_BLOCKS_CHUNK: Final = 16_384
#: Encoded size a producer keeps its batches under (half of what consumers accept).
PUBLISH_BATCH_BYTES: Final = MAX_BATCH_BYTES // 2
#: Bounds that catch absurd values early (a block of a million tokens is a bug, not a model).
MAX_BLOCK_TOKENS: Final = 1 << 16
MAX_WINDOW_SIZE: Final = 1 << 31
MAX_CACHE_LEVEL: Final = 1
#: ``NodeStats.engine``: kvflow's node (the default, left out of the JSON), or an engine behind a
#: bridge (``vllm``, ``vllm+kvflow``, ``sglang``, ``trtllm``; others are accepted and get no retention)
ENGINE_KVFLOW: Final = "kvflow"
ENGINE_PATTERN: Final = r"^[a-z0-9][a-z0-9_.+-]*$"
U64_MAX: Final = (1 << 64) - 1

#: Cache levels (the wire's ``cache_level``): the GPU's block pool and the host-memory tier.
GPU: Final = 0
HOST: Final = 1

DEFAULT_PRIORITY: Final = 35
MIN_PRIORITY: Final = 0
MAX_PRIORITY: Final = 100

BlockHash = NewType("BlockHash", int)
SqlBlockHash = NewType("SqlBlockHash", int)
BlockDigest = NewType("BlockDigest", bytes)
NodeId = NewType("NodeId", str)
InstanceId = NewType("InstanceId", str)
EventId = NewType("EventId", int)

# NOTE: msgspec cannot express bounds beyond int64 in Meta; the upper bound of U64 is checked by
# decode_batch (_check_hashes) at the trust boundary, not on every construction by a producer.
U64 = Annotated[BlockHash, Meta(ge=0, description="Unsigned 64-bit block hash (0 .. 2**64-1).")]
NonNegInt = Annotated[int, Meta(ge=0)]
Priority = Annotated[int, Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY, description="0 (evict first) to 100.")]
CacheLevel = Annotated[int, Meta(ge=0, le=MAX_CACHE_LEVEL, description="0 = GPU, 1 = host memory.")]
NumTokens = Annotated[int, Meta(ge=1, le=MAX_BLOCK_TOKENS)]
WindowSize = Annotated[int, Meta(ge=0, le=MAX_WINDOW_SIZE)]
TokenId = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
LoraId = Annotated[int, Meta(ge=0, le=(1 << 63) - 1, description="LoRA adapter id; null = base model.")]
_NAME = Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$")
NodeName = Annotated[NodeId, _NAME]
InstanceName = Annotated[InstanceId, _NAME]


def to_sql(h: int) -> SqlBlockHash:
    """A wire ``block_hash`` (unsigned 64-bit) as PostgreSQL ``bigint`` (the same bits, signed)."""
    return SqlBlockHash(h - (1 << 64) if h >= (1 << 63) else h)


def to_sql_list(hashes: Iterable[int]) -> list[SqlBlockHash]:
    """:func:`to_sql` of many hashes in one call (the materializer converts an event's hashes at once).

    NOTE: the arithmetic of :func:`to_sql` in one comprehension, not a call per hash: the
    materializer's planner converts hundreds of thousands of hashes a second."""
    return [h - (1 << 64) if h >= (1 << 63) else h for h in hashes]  # type: ignore[misc]


def from_sql(v: int) -> BlockHash:
    """The inverse of :func:`to_sql`."""
    return BlockHash(v + (1 << 64) if v < 0 else v)


class _Strict(Struct, forbid_unknown_fields=True, omit_defaults=False, gc=False):
    """Strict decoding. ``gc=False``: messages hold no reference cycles, so the cyclic garbage
    collector need not track them (a node queues many thousands)."""


class StoredBlock(_Strict):
    """A block in a ``stored`` event; its parent is the previous block (or the event's parent)."""

    block_hash: U64
    num_tokens: NumTokens
    lora_id: LoraId | None = None
    cache_level: CacheLevel = 0
    priority: Priority = DEFAULT_PRIORITY
    token_ids: Annotated[list[TokenId], Meta(max_length=MAX_BLOCK_TOKENS)] | None = None


class SnapshotBlock(_Strict):
    """A block of a ``snapshot``: the whole state of one cached block."""

    block_hash: U64
    parent_hash: U64 | None
    num_tokens: NumTokens
    lora_id: LoraId | None = None
    cache_level: CacheLevel = 0
    priority: Priority = DEFAULT_PRIORITY


class Created(_Strict, tag="created", tag_field="type"):
    """A node instance started with this many blocks per cache level (GPU, host). Clears state."""

    num_blocks_per_cache_level: Annotated[list[NonNegInt], Meta(min_length=1, max_length=MAX_CACHE_LEVEL + 1)]


class Stored(_Strict, tag="stored", tag_field="type"):
    """Blocks became cached: a chain, each block the child of the one before."""

    parent_hash: U64 | None
    blocks: Annotated[list[StoredBlock], Meta(min_length=1, max_length=MAX_BLOCKS_PER_EVENT)]


class Removed(_Strict, tag="removed", tag_field="type"):
    """Blocks left the cache (from whichever level they were on)."""

    block_hashes: Annotated[list[U64], Meta(min_length=1, max_length=MAX_BLOCKS_PER_EVENT)]


class LevelDiff(_Strict):
    old: CacheLevel
    new: CacheLevel


class PriorityDiff(_Strict):
    old: Priority
    new: Priority


class Updated(_Strict, tag="updated", tag_field="type"):
    """A cached block moved between levels (offload/onboard) and/or changed priority."""

    block_hash: U64
    cache_level: LevelDiff | None = None
    priority: PriorityDiff | None = None


class Snapshot(_Strict, tag="snapshot", tag_field="type"):
    """The node's whole cache as of this event (kvflow extension): replaces the node's state.

    A cache larger than :data:`EVENT_BLOCKS_CHUNK` blocks goes in ``parts`` consecutive events
    (consecutive event ids): part 0 replaces the state with its blocks and heals any gap before
    it; parts 1 … parts-1 add theirs, like any other event (a gap before one is a gap). The
    snapshot is whole after its last part; parents always come before their children.
    """

    blocks: Annotated[list[SnapshotBlock], Meta(max_length=MAX_BLOCKS_PER_EVENT)]
    part: Annotated[int, Meta(ge=0)] = 0
    parts: Annotated[int, Meta(ge=1)] = 1

    def __post_init__(self) -> None:
        if self.part >= self.parts:
            raise ValueError(f"snapshot part {self.part} of {self.parts}: parts are numbered 0 … parts-1")


EventData = Created | Stored | Removed | Updated | Snapshot


class Event(_Strict):
    event_id: Annotated[EventId, Meta(ge=0, le=(1 << 63) - 1)]
    window_size: WindowSize
    data: EventData


class EventBatch(_Strict):
    """One Kafka message on ``kv-events``, keyed by ``node_id``; events in ``event_id`` order."""

    schema_version: Literal[1]
    node_id: NodeName
    instance_id: InstanceName
    ts: Annotated[float, Meta(ge=0, description="Unix time (seconds) the node published the batch.")]
    events: Annotated[list[Event], Meta(min_length=1, max_length=MAX_EVENTS_PER_BATCH)]


class NodeCounters(Struct, forbid_unknown_fields=False):
    """Cumulative counters of a node instance (unknown extra counters are accepted and ignored)."""

    prompt_tokens: NonNegInt = 0
    cached_tokens: NonNegInt = 0
    hits: NonNegInt = 0
    misses: NonNegInt = 0
    requests: NonNegInt = 0
    evictions_by_priority: dict[str, NonNegInt] = msgspec.field(default_factory=dict)
    offloads_by_priority: dict[str, NonNegInt] = msgspec.field(default_factory=dict)
    events_published: NonNegInt = 0
    events_overflowed: NonNegInt = 0


class NodeStats(_Strict, omit_defaults=True):
    """Heartbeat on ``node-stats`` every ≤ 2 s, keyed by ``node_id``.

    Fields at their default are left out of the JSON (``active_blocks`` 0, ``status`` ``live``):
    a heartbeat carries ``status`` only when it says goodbye, so a consumer that decodes strictly
    and predates the field refuses only that last heartbeat.
    """

    schema_version: Literal[1]
    node_id: NodeName
    instance_id: InstanceName
    url: Annotated[str, Meta(max_length=2048)]
    model: Annotated[str, Meta(max_length=512)]
    block_size: Annotated[int, Meta(ge=1, le=MAX_BLOCK_TOKENS)]
    ts: Annotated[float, Meta(ge=0)]
    capacity: Annotated[list[NonNegInt], Meta(min_length=2, max_length=2, description="[gpu, host] blocks")]
    used: Annotated[list[NonNegInt], Meta(min_length=2, max_length=2, description="[gpu, host] blocks")]
    active_requests: NonNegInt
    queued_requests: NonNegInt
    last_event_id: Annotated[int, Meta(ge=-1, description="-1 before the first event")]
    active_blocks: Annotated[int, Meta(ge=0, description="GPU blocks held by running requests")] = 0
    counters: NodeCounters = msgspec.field(default_factory=NodeCounters)
    status: Annotated[Literal["live", "stopping"], Meta(
        description="stopping: the node's last heartbeat, sent as it stops (it is gone at once)")] = "live"
    engine: Annotated[str, Meta(max_length=64, pattern=ENGINE_PATTERN, description=(
        "What serves the node, and so which words its requests carry retention in (docs/router.md, "
        "\"Retention per engine\"): kvflow (kvflow's node), vllm, vllm+kvflow (vLLM with kvflow's "
        "retention plugin), sglang, trtllm; left out for kvflow"))] = ENGINE_KVFLOW


class ControlCommand(_Strict):
    """A command to one node on ``kv-control`` (keyed by the target node): ask for a snapshot."""

    schema_version: Literal[1]
    node_id: NodeName
    command: Literal["resync"]
    reason: Annotated[str, Meta(max_length=512)] = ""
    ts: Annotated[float, Meta(ge=0)] = 0.0


# ------------------------------------------------------------------------------------------
# Encoding and strict decoding


class ProtocolError(ValueError):
    """A message that does not follow the wire schema.

    Attributes:
        reason: short code for metrics and the DLQ header (``malformed_json``,
            ``unknown_schema_version``, ``invalid``, ``too_large``).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


_encoder = msgspec.json.Encoder()
_batch_decoder = msgspec.json.Decoder(EventBatch)
_stats_decoder = msgspec.json.Decoder(NodeStats)
_control_decoder = msgspec.json.Decoder(ControlCommand)


def encode(msg: EventBatch | NodeStats | ControlCommand) -> bytes:
    return _encoder.encode(msg)


def _decode(decoder: msgspec.json.Decoder[Any], raw: bytes | bytearray | memoryview | str,
            max_bytes: int) -> Any:
    if len(raw) > max_bytes:
        raise ProtocolError("too_large", f"message of {len(raw)} bytes exceeds {max_bytes}")
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if text.endswith("at `$.schema_version`"):
            raise ProtocolError("unknown_schema_version",
                                f"{text} (this consumer speaks schema_version {SCHEMA_VERSION})") from None
        raise ProtocolError("invalid", text) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError("malformed_json", str(exc)) from None


def decode_batch(raw: bytes | bytearray | memoryview | str, max_bytes: int = MAX_BATCH_BYTES) -> EventBatch:
    """Decode and validate one ``kv-events`` message, including the chain rules of the schema."""
    batch: EventBatch = _decode(_batch_decoder, raw, max_bytes)
    events = batch.events
    # The first event out of sequence, if any: a bad hash before it is reported first.
    first, gap = events[0].event_id, len(events)
    if list(map(_event_id, events)) != list(range(first, first + len(events))):
        gap = next(i for i in range(1, len(events)) if events[i].event_id != events[i - 1].event_id + 1)
    # The hash bound: in compiled code when kvflow_native is installed (~10x faster; it only
    # finds the first suspect event, the rule and its message are _check_hashes's).
    start = 0 if _first_beyond_u64 is None else _first_beyond_u64(events)
    if start >= 0:
        for i in range(start, gap):
            _check_hashes(events[i].data, i)
    if gap < len(events):
        raise ProtocolError("invalid", f"event_id {events[gap].event_id} at $.events[{gap}] does not follow "
                                       f"{events[gap - 1].event_id} (batches are contiguous)")
    return batch


_event_id = operator.attrgetter("event_id")


def _native_hash_check() -> Callable[[list[Event]], int] | None:
    """``kvflow_native.HashCheck(...).first_beyond_u64`` (the materializer's optional compiled
    extension, ``native/``), or None."""
    try:
        import kvflow_native
    except ImportError:
        return None
    return kvflow_native.HashCheck(Stored, Removed, Updated, Snapshot).first_beyond_u64  # type: ignore[no-any-return]


_first_beyond_u64 = _native_hash_check()


def _check_hashes(d: EventData, i: int) -> None:
    """The upper bound of U64 (JSON integers beyond 64 bits decode as Python ints)."""
    if isinstance(d, Stored):
        top = max(d.parent_hash or 0, max(b.block_hash for b in d.blocks))
    elif isinstance(d, Removed):
        top = max(d.block_hashes)
    elif isinstance(d, Updated):
        top = d.block_hash
    elif isinstance(d, Snapshot):
        top = max((max(b.block_hash, b.parent_hash or 0) for b in d.blocks), default=0)
    else:
        return
    if top > U64_MAX:
        raise ProtocolError("invalid", f"block hash {top} at $.events[{i}] does not fit in 64 bits")


def decode_stats(raw: bytes | bytearray | memoryview | str, max_bytes: int = 1 << 20) -> NodeStats:
    return _decode(_stats_decoder, raw, max_bytes)  # type: ignore[no-any-return]


def decode_control(raw: bytes | bytearray | memoryview | str, max_bytes: int = 1 << 16) -> ControlCommand:
    return _decode(_control_decoder, raw, max_bytes)  # type: ignore[no-any-return]


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema documents of the messages, for consumers in other languages."""
    out: dict[str, dict[str, Any]] = {}
    for name, tp in (("event_batch", EventBatch), ("node_stats", NodeStats), ("control_command", ControlCommand)):
        schema = msgspec.json.schema(tp)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["title"] = f"kvflow {tp.__name__} (schema_version {SCHEMA_VERSION})"
        out[name] = schema
    return out
