"""The KV event wire of vLLM and SGLang, read with kvflow's own msgspec structs (no engine import).

Both engines publish on a ZMQ PUB socket three frames per batch: the topic (UTF-8, default ""),
the batch's sequence number (8 bytes, big-endian, from 0 at each publisher start) and a msgpack
payload ``[ts, events, dp_rank]`` (``KVEventBatch``, ``array_like``). vLLM 0.33 encodes each event
as a **map** tagged ``"type": "<ClassName>"`` with its named fields (fields at their default
left out); older vLLM and some publishers send **positional arrays** ``["BlockStored", f1, f2,
…]``. Both are read here (``docs/bridges.md`` has the field lists):

* ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids`` (every block's tokens,
  concatenated), ``block_size``, ``lora_id``, ``medium``, ``lora_name`` (vLLM), ``cache_salt``
  (SGLang);
* ``BlockRemoved``: ``block_hashes``, ``medium``;
* ``AllBlocksCleared``.

A hash is whatever the engine sends — vLLM's uint64 (the digest's last 8 bytes) or its full
32 bytes, SGLang's signed int64 — and is only ever used as an opaque key (:data:`EngineKey`).
Unknown event types and unknown fields are counted and skipped, never fatal; a payload that is
not a batch at all raises :class:`WireError`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Final

import msgspec

#: An engine's block hash as sent: an int (signed or unsigned 64-bit) or bytes.
EngineKey = int | bytes

#: The replay socket's end marker: seq -1 (8 bytes 0xff).
END_SEQ: Final = (1 << 64) - 1


class WireError(ValueError):
    """A payload or frame set that is not a KV event batch."""


class BlockStored(msgspec.Struct, kw_only=True):
    block_hashes: list[EngineKey]
    parent_block_hash: EngineKey | None = None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    #: each block's retention priority (0-100): vLLM with kvflow's plugin (docs/vllm-retention.md)
    #: sends it; None (stock vLLM, SGLang): the default priority. Untyped here, so that a malformed
    #: list costs the priorities (``bridge.service``), not the event.
    priorities: list[Any] | None = None
    #: True: not new blocks, but blocks the engine holds, re-reported because their priorities
    #: changed (kvflow's vLLM plugin: a request raised the priority of blocks it reuses)
    priority_update: bool = False


class BlockRemoved(msgspec.Struct, kw_only=True):
    block_hashes: list[EngineKey]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, kw_only=True):
    pass


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared

#: Fields in the engines' declaration order (for positional events).
_POSITIONAL: Final[dict[str, tuple[type[msgspec.Struct], tuple[str, ...]]]] = {
    "BlockStored": (BlockStored, ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                  "medium", "lora_name")),
    "BlockRemoved": (BlockRemoved, ("block_hashes", "medium")),
    "AllBlocksCleared": (AllBlocksCleared, ()),
}


class EngineBatch(msgspec.Struct):
    """One decoded batch: its sequence number, time, events, data-parallel rank, and what was skipped."""

    seq: int
    ts: float
    events: list[EngineEvent]
    dp_rank: int | None = None
    #: event types and fields skipped, by name (``type:Foo``, ``field:BlockStored.extra_keys``)
    skipped: dict[str, int] = msgspec.field(default_factory=dict)


_decoder = msgspec.msgpack.Decoder()


def _event(raw: Any, skipped: Counter[str]) -> EngineEvent | None:
    if isinstance(raw, dict):
        name = raw.get("type")
        fields = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        name = raw[0]
        known = _POSITIONAL.get(name)
        if known is None:
            skipped[f"type:{name}"] += 1
            return None
        order = known[1]
        if len(raw) - 1 > len(order):
            skipped[f"field:{name}.#{len(order)}+"] += 1
        fields = dict(zip(order, raw[1:], strict=False))
    else:
        skipped["type:?"] += 1
        return None
    known = _POSITIONAL.get(name) if isinstance(name, str) else None
    if known is None:
        skipped[f"type:{name}"] += 1
        return None
    cls, order = known
    for extra in fields.keys() - set(cls.__struct_fields__):
        skipped[f"field:{name}.{extra}"] += 1
        del fields[extra]
    try:
        event: EngineEvent = msgspec.convert(fields, cls)  # type: ignore[assignment]  # cls is one of them
        return event
    except msgspec.ValidationError:
        skipped[f"invalid:{name}"] += 1
        return None


def decode_payload(seq: int, payload: bytes) -> EngineBatch:
    """One batch from its msgpack payload.

    Raises:
        WireError: not msgpack, or not ``[ts, events, dp_rank]``.
    """
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"batch {seq}: not msgpack: {exc}") from exc
    if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[0], int | float) \
            or not isinstance(raw[1], list | tuple):
        raise WireError(f"batch {seq}: not [ts, events, dp_rank]")
    skipped: Counter[str] = Counter()
    events = [e for e in (_event(r, skipped) for r in raw[1]) if e is not None]
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return EngineBatch(seq, float(raw[0]), events, rank, dict(skipped))


def decode_frames(frames: list[bytes]) -> EngineBatch:
    """A PUB message ``[topic, seq, payload]`` (or a replayed one, ``[topic, seq, payload]`` after
    the DEALER's empty delimiter is stripped).

    A payload that is not a batch under a good seq is a batch *without events* (``skipped``
    ``garbage``): its seq came, so it is no gap, and replaying it would give the same bytes.

    Raises:
        WireError: another frame count, or a seq that is not 8 bytes.
    """
    if len(frames) != 3:
        raise WireError(f"{len(frames)} frames, not 3 (topic, seq, payload)")
    seq = decode_seq(frames[1])
    try:
        return decode_payload(seq, frames[2])
    except WireError:
        return EngineBatch(seq, 0.0, [], None, {"garbage": 1})


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"a seq frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big")
