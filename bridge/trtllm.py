"""TensorRT-LLM: ``trtllm-serve``'s ``POST /kv_cache_events``, polled and translated.

Each call returns the events queued since the last one as a JSON list, and drains them
(``tensorrt_llm/serve/openai_server.py``; the shapes are ``KVCacheEventSerializer``'s in
``tensorrt_llm/_utils.py``)::

    {"event_id": 7, "window_size": 4096, "data": {"type": "stored", "parent_hash": 12 | null,
      "blocks": [{"type": "stored_block", "block_hash": 34, "tokens": [{"type": "unique_token",
        "token_id": 1, "token_extra_id": 0}, …], "cache_level": 0, "priority": 35}, …]}}
    {"event_id": 8, "data": {"type": "removed", "block_hashes": [34, …]}}
    {"event_id": 9, "data": {"type": "updated", "block_hash": 34,
      "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
      "priority": {"type": "event_diff", "new_value": 80, "old_value": 35}}}
    {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [4096, 8192]}}

TensorRT-LLM is the one engine with kvflow's own retention vocabulary: its ``priority`` (0–100)
and ``cache_level`` (0 GPU, 1 host) go into kvflow unchanged, so the router can credit them.
``event_id`` counts events; a gap (the engine's queue overflowed, or another client drained it)
cannot be replayed: the node starts a new, partial instance. A ``created`` event is an engine
start: a new, exact instance with its capacities. Unknown event types are counted and skipped.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from bridge.service import Bridge
from eventbus.protocol import DEFAULT_PRIORITY

log = logging.getLogger("kvflow.bridge")


def _tokens(block: dict[str, Any]) -> list[int]:
    return [int(t["token_id"]) if isinstance(t, dict) else int(t) for t in block.get("tokens") or []]


def _new(diff: Any) -> int | None:
    if isinstance(diff, dict):
        v = diff.get("new_value", diff.get("new"))
        return int(v) if v is not None else None
    return int(diff) if isinstance(diff, int) else None


def apply_events(bridge: Bridge, events: list[dict[str, Any]]) -> None:
    """Translate one poll's events, in ``event_id`` order."""
    for ev in sorted(events, key=lambda e: int(e.get("event_id", 0))):
        eid = int(ev.get("event_id", 0))
        data = ev.get("data") or {}
        kind = data.get("type")
        if kind == "created":
            bridge.s.num_blocks = bridge.s.num_blocks or int((data.get("num_blocks_per_cache_level") or [0])[0])
            bridge.new_instance(partial=False, reason="engine started (created)")
            bridge.expected = eid + 1
            continue
        if bridge.expected is None:
            bridge.expected = eid  # attached late: what came before is not known
            bridge.translator.partial = eid > 0  # type: ignore[union-attr]
        elif eid < bridge.expected:
            continue  # seen
        elif eid > bridge.expected:
            bridge.new_instance(partial=True, reason="event ids skipped")
        bridge.expected = eid + 1
        _apply_one(bridge, kind, data)
    bridge.maybe_reset_engine()


def _apply_one(bridge: Bridge, kind: Any, data: dict[str, Any]) -> None:
    t = bridge.translator
    assert t is not None
    bridge.stats.batches += 1
    if kind == "stored":
        parent = data.get("parent_hash")
        for b in data.get("blocks") or []:
            tokens = _tokens(b)
            if bridge.block_size is None and tokens:
                bridge.block_size = len(tokens)
            lora = b.get("lora_id", data.get("lora_id"))
            t.stored([b["block_hash"]], parent, tokens, len(tokens), lora_id=lora, cache_salt=data.get("cache_salt"),
                     level=int(b.get("cache_level", 0)), priorities=[int(b.get("priority", DEFAULT_PRIORITY))])
            parent = b["block_hash"]
    elif kind == "removed":
        t.removed(list(data.get("block_hashes") or []), None)
    elif kind == "updated":
        t.updated(data["block_hash"], level=_new(data.get("cache_level")), priority=_new(data.get("priority")))
    else:
        name = f"type:{kind}"
        bridge.stats.skipped[name] = bridge.stats.skipped.get(name, 0) + 1


class TrtllmPoller:
    """Fetches ``POST /kv_cache_events`` every ``poll_s`` for a :class:`Bridge` without a ZMQ source."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        self.url = f"{bridge.engine.url}/kv_cache_events"
        self.failures = 0

    def poll(self) -> int:
        """One fetch; the events it returned (0 when the engine did not answer)."""
        try:
            r = self.bridge.engine.http.post(self.url)
            r.raise_for_status()
            events = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.failures += 1
            log.warning("TensorRT-LLM events %s: %s", self.url, exc)
            return 0
        if not isinstance(events, list):
            return 0
        apply_events(self.bridge, [e for e in events if isinstance(e, dict)])
        return len(events)
