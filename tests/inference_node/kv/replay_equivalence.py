"""Replays of the conversation trace and every generated family through the KV core, reduced to
one SHA-256 per (workload, setting) over the whole event stream, every allocation's answer and
the final cache.

The digests in ``replay_golden.json`` were recorded with the core as it was before the eviction
policy moved behind :class:`~inference_node.kv.policy.EvictionPolicy` (commit 69e7577): the test
``test_replay_equivalence.py`` replays again and asserts the same digests, byte for byte, so a
change of the core that changes one decision, one event or one event's place fails it.

Regenerate (only when a change of behaviour is intended, and say so in the commit):

    .venv/bin/python -m tests.inference_node.kv.replay_equivalence --write
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import msgspec

from inference_node.kv.adaptive import AdaptivePolicy
from inference_node.kv.clock import ManualClock
from inference_node.kv.manager import KvCacheConfig, KVCacheManager, OutOfBlocks
from inference_node.kv.prompt import Prompt
from inference_node.kv.retention import KvCacheRetentionConfig, TokenRange

GOLDEN = Path(__file__).with_name("replay_golden.json")
#: Tokens per block in these replays (each workload key becomes one block of this many tokens).
BLOCK_SIZE = 4
#: Requests of each workload replayed (the trace's first ones; each family's first ones).
REQUESTS = 1500
#: Requests in flight at once: a request is freed this many admissions after its own.
IN_FLIGHT = 4
#: Generated tokens per request at most (the decode path: new blocks, decode retention).
MAX_DECODE = 9
CAPACITY = 600
#: The whole conversation trace (12,031 requests) is replayed in these settings too.
FULL_TRACE_SETTINGS = ("lru", "adaptive")
WORKLOADS = ("trace_full", "trace", "system_prompt", "multi_turn", "agentic", "rag", "scan", "shifting_mix",
             "hot_prefixes", "one_shot")

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class Setting:
    """How a replay runs: the cache's configuration and which retention requests carry."""

    host_blocks: int = 0
    capacity: int = CAPACITY
    adaptive: AdaptivePolicy | None = None
    #: Requests carry the workload's client retention (pinned system prompts), with durations.
    hinted: bool = False


#: The adaptive policy the digests were recorded with: the defaults of the time (the ghosts were
#: 4 caches' worth until 2026-12-07, when 3.5 became the default, and the life tables' guard came;
#: with 4.0 and without the guard every digest is the same).
_RECORDED = AdaptivePolicy(ghost_caches=4.0, strict_guard=False)

SETTINGS: dict[str, Setting] = {
    "lru": Setting(),
    "priority": Setting(hinted=True),
    "priority_host": Setting(host_blocks=CAPACITY // 2, hinted=True),
    "adaptive": Setting(adaptive=_RECORDED),
    "adaptive_python": Setting(adaptive=replace(_RECORDED, compiled=False)),
    "adaptive_host": Setting(host_blocks=CAPACITY // 2, adaptive=_RECORDED),
    "adaptive_routed": Setting(adaptive=replace(_RECORDED, frequency_horizons=2.0, soon_share=0.3)),
    "adaptive_hinted": Setting(adaptive=_RECORDED, hinted=True),
    # Small caches: requests refused (OutOfBlocks) and blocks given back by a failed admission.
    "priority_tight": Setting(capacity=160, host_blocks=40, hinted=True),
    "adaptive_tight": Setting(capacity=160, adaptive=_RECORDED),
}


@dataclass(frozen=True)
class Request:
    t: float
    prompt: Prompt
    decode: tuple[int, ...]
    retention: KvCacheRetentionConfig | None


def _retention(pinned_blocks: int, i: int) -> KvCacheRetentionConfig | None:
    """A client's config: the pinned blocks at 100 for 30 s (every third request: forever), the
    rest at 35; generated tokens at 20 for 5 s. None for requests with nothing pinned, except
    every fifth, which marks its whole prompt 60 for 2 s (durations that run out mid-replay)."""
    if pinned_blocks:
        end = pinned_blocks * BLOCK_SIZE
        return KvCacheRetentionConfig((TokenRange(0, end, 100, None if i % 3 == 0 else 30.0),
                                       TokenRange(end, None, 35)), decode_priority=20, decode_duration_s=5.0)
    if i % 5 == 0:
        return KvCacheRetentionConfig((TokenRange(0, None, 60, 2.0),))
    return None


@cache
def workload(name: str) -> tuple[Request, ...]:
    """The first :data:`REQUESTS` requests of a workload (``trace_full``: all of the trace) as token
    prompts of 4-token blocks."""
    from kvflow.sim.workloads import GENERATORS, mooncake

    if name == "trace_full":
        reqs = mooncake()
    else:
        reqs = mooncake(limit=REQUESTS) if name == "trace" else GENERATORS[name](REQUESTS)[:REQUESTS]
    out = []
    for i, r in enumerate(reqs):
        tokens = [t for k in r.keys for t in (k & 0xFFFF, (k >> 16) & 0xFFFF, k >> 32, 7)]
        tail = i % 3  # a partial last block for two requests in three
        tokens += [1000 + j for j in range(tail)]
        # Generated tokens: a function of the prompt's last key, so that requests with the same
        # prompt generate the same blocks (decode blocks shared by later prompts or duplicated).
        last = r.keys[-1] if r.keys else 0
        decode = tuple(2000 + (last + j) % 97 for j in range(min(MAX_DECODE, 1 + r.output_tokens % MAX_DECODE)))
        out.append(Request(r.t, Prompt.from_tokens(tokens, BLOCK_SIZE), decode, _retention(r.pinned_blocks, i)))
    return tuple(out)


def replay(name: str, setting: Setting, trace_events: Callable[[bytes], None] | None = None) -> str:
    """The digest of one replay: every event, every allocation's answer, the final cache."""
    clock = ManualClock()
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=setting.capacity, num_host_blocks=setting.host_blocks,
                                       block_size=BLOCK_SIZE, adaptive=setting.adaptive, emit_token_ids=True,
                                       max_queued_events=1 << 30), clock=clock)
    h = hashlib.sha256()
    running: deque[str] = deque()

    def drain() -> None:
        for e in mgr.drain_events():
            raw = _encode(e)
            h.update(raw)
            if trace_events is not None:
                trace_events(raw)

    for i, r in enumerate(workload(name)):
        clock.set(max(clock.now, r.t))
        rid = f"r{i}"
        try:
            alloc = mgr.allocate(rid, r.prompt, r.retention if setting.hinted else None)
        except OutOfBlocks:
            h.update(b"out-of-blocks")
        else:
            h.update(_encode([alloc.block_table, alloc.num_cached_tokens, alloc.gpu_hit_blocks,
                              alloc.host_hit_blocks, [(c.kind, c.src_slot, c.dst_slot) for c in alloc.copies]]))
            try:
                for tok in r.decode:
                    slot, copies = mgr.append_token(rid, tok)
                    h.update(_encode([slot, [(c.kind, c.src_slot, c.dst_slot) for c in copies]]))
            except OutOfBlocks:
                h.update(b"decode-out-of-blocks")
            running.append(rid)
        while len(running) > IN_FLIGHT:
            mgr.free(running.popleft())
        if i % 64 == 0:
            drain()
    while running:
        mgr.free(running.popleft())
    clock.advance(3600.0)
    mgr.tick()
    drain()
    h.update(_encode(mgr.cached_blocks()))
    h.update(_encode([mgr.used_blocks, mgr.evictable_blocks, mgr.stats.evictions_by_priority,
                      mgr.stats.offloads_by_priority, mgr.stats.expirations, mgr.stats.reprioritizations]))
    adaptive = mgr.adaptive
    if adaptive is not None:
        learned = dict(adaptive.describe())
        learned.pop("tables", None)  # compiled or python: the same state either way
        # the floor's own counters are newer than the recording; what it does shows in the events
        learned.pop("floor", None)
        learned.pop("strict", None)  # the life tables' guard's state (2026-12-07), off in these settings
        h.update(_encode(learned))
    return h.hexdigest()


def cases() -> list[tuple[str, str]]:
    """Every (workload, setting) replayed."""
    return [(w, s) for w in WORKLOADS for s in SETTINGS if w != "trace_full" or s in FULL_TRACE_SETTINGS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="record the digests into replay_golden.json")
    args = ap.parse_args()
    digests: dict[str, dict[str, str]] = {}
    for w, s in cases():
        t = time.perf_counter()
        digests.setdefault(w, {})[s] = replay(w, SETTINGS[s])
        print(f"{w:14} {s:16} {digests[w][s][:16]}  {time.perf_counter() - t:.2f} s", file=sys.stderr)
    if args.write:
        GOLDEN.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN}", file=sys.stderr)


if __name__ == "__main__":
    main()
