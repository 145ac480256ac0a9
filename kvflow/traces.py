"""Request traces in the Mooncake format, and single-cache replays of them.

A trace is JSON lines with ``timestamp`` (ms from the start), ``input_length``,
``output_length`` and ``hash_ids`` (one id per 512-token block; equal ids are reusable blocks,
prefix-remapped so that equal id prefixes are equal prompt prefixes). ``../shared/traces/``
holds the Mooncake conversation trace (12,031 requests, one hour of production traffic).

Replays here drive *the real KV core* (``inference_node.kv``) one request at a time: allocate
its prompt (reusing the cached prefix), then free it. The hit rate is the share of prompt blocks
served from the cache, with prefix semantics (hits stop at the first missing block). Belady's
MIN, the offline optimum, is replayed by :func:`belady_hit_rate` for comparison.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from inference_node.kv.adaptive import AdaptivePolicy
from inference_node.kv.clock import ManualClock
from inference_node.kv.manager import KvCacheConfig, KVCacheManager
from inference_node.kv.prompt import Prompt
from inference_node.kv.retention import KvCacheRetentionConfig, TokenRange

TRACE_BLOCK_TOKENS = 512
DEFAULT_TRACE_NAME = "mooncake_conversation_trace.jsonl"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def default_trace_path() -> Path:
    """``KVFLOW_TRACE``, else ``../shared/traces/`` next to the checkout, else the copy in
    ``data/traces/`` (so that any clone can run the simulator and the benchmarks)."""
    if env := os.environ.get("KVFLOW_TRACE"):
        return Path(env)
    here = Path(__file__).resolve().parents[1]
    for base in (here.parent / "shared" / "traces", here / "shared" / "traces", here / "data" / "traces"):
        if (base / DEFAULT_TRACE_NAME).is_file():
            return base / DEFAULT_TRACE_NAME
    raise FileNotFoundError(
        f"{DEFAULT_TRACE_NAME} not found (../shared/traces/ next to the checkout, or data/traces/); "
        "set KVFLOW_TRACE"
    )


def load_trace(path: Path | str | None = None, limit: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with Path(path or default_trace_path()).open() as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            out.append(TraceRequest(d["timestamp"] / 1000.0, int(d["input_length"]), int(d["output_length"]),
                                    tuple(int(h) for h in d["hash_ids"])))
            if limit is not None and len(out) >= limit:
                break
    return out


def trace_prompts(trace: Sequence[TraceRequest], block_size: int = TRACE_BLOCK_TOKENS) -> list[Prompt]:
    """One synthetic prompt per request, a full block per hash id (the trace's own granularity).

    With a smaller ``block_size``, each trace block expands into ``512 / block_size`` child
    blocks whose keys chain from the trace id, so equal trace prefixes stay equal prefixes.
    """
    if TRACE_BLOCK_TOKENS % block_size:
        raise ValueError(f"block_size must divide {TRACE_BLOCK_TOKENS}")
    per = TRACE_BLOCK_TOKENS // block_size
    prompts = []
    for r in trace:
        keys = [(h << 8) | j for h in r.hash_ids for j in range(per)] if per > 1 else list(r.hash_ids)
        prompts.append(Prompt.from_block_keys(keys, block_size))
    return prompts


@dataclass
class ReplayResult:
    policy: str
    capacity_blocks: int
    hit_blocks: int
    total_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def replay_core(trace: Sequence[TraceRequest], prompts: Sequence[Prompt], capacity: int, *,
                block_size: int = TRACE_BLOCK_TOKENS, adaptive: AdaptivePolicy | None = None,
                pin_first: bool = False, policy_name: str = "lru",
                progress: Callable[[int], None] | None = None, per_request: list[int] | None = None,
                observe: Callable[[int, KVCacheManager], None] | None = None) -> ReplayResult:
    """Replay on one cache of ``capacity`` blocks (events are drained and dropped).

    ``pin_first``: every request comes with a client's retention config (its first block at
    priority 100, the rest at 35) — plain priority eviction, the cost baseline of the adaptive
    policy (``kvflow bench kv``'s ``ratios.adaptive_cost_vs_priority``). ``per_request``: each
    request's hits are appended to it; ``observe(i, manager)``: called after each request's
    allocation (before its blocks are freed)."""
    clock = ManualClock()
    mgr = KVCacheManager(KvCacheConfig(num_gpu_blocks=capacity, block_size=block_size, adaptive=adaptive,
                                       max_queued_events=1 << 30), clock=clock)
    retention = KvCacheRetentionConfig((TokenRange(0, block_size, 100), TokenRange(block_size, None, 35))) \
        if pin_first else None
    hits = total = 0
    for i, (req, prompt) in enumerate(zip(trace, prompts, strict=True)):
        clock.set(max(clock.now, req.timestamp_s))
        if len(prompt.digests) > capacity:  # cannot fit at all: count as a miss, skip
            total += len(prompt.digests)
            if per_request is not None:
                per_request.append(0)
            continue
        alloc = mgr.allocate("r", prompt, retention)
        hit = alloc.num_cached_tokens // block_size
        hits += hit
        total += len(prompt.digests)
        if per_request is not None:
            per_request.append(hit)
        if observe is not None:
            observe(i, mgr)
        mgr.free("r")
        if i % 256 == 0:
            mgr.drain_events()
            if progress:
                progress(i)
    return ReplayResult(policy_name, capacity, hits, total)


def belady_hit_rate(keys_per_request: Sequence[Sequence[int]], capacity: int) -> ReplayResult:
    """Belady's MIN on block ids with prefix semantics: evict the block used farthest in the future.

    A block's parent is used whenever the block is (prefixes), so farthest-next-use never evicts
    a parent before its child except on ties, which go to the deeper block.
    """
    # next_use[i][j]: the next request index after i that uses keys[i][j] (inf if none)
    inf = len(keys_per_request) + 1
    next_seen: dict[int, int] = {}
    next_use: list[list[int]] = [[] for _ in keys_per_request]
    for i in range(len(keys_per_request) - 1, -1, -1):
        ks = keys_per_request[i]
        next_use[i] = [next_seen.get(k, inf) for k in ks]
        for k in ks:
            next_seen[k] = i
    cache: dict[int, tuple[int, int]] = {}  # key -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key), lazily invalidated
    hits = total = 0
    for i, ks in enumerate(keys_per_request):
        total += len(ks)
        prefix = True
        for k in ks:
            if prefix and k in cache:
                hits += 1
            else:
                prefix = False
        for depth, (k, nu) in enumerate(zip(ks, next_use[i], strict=True)):
            cache[k] = (nu, depth)
            heapq.heappush(heap, (-nu, -depth, k))
        while len(cache) > capacity:
            neg_nu, neg_depth, k = heapq.heappop(heap)
            if cache.get(k) == (-neg_nu, -neg_depth):
                del cache[k]
        if len(heap) > 4 * capacity + 1024:
            heap = [(-nu, -d, k) for k, (nu, d) in cache.items()]
            heapq.heapify(heap)
    return ReplayResult("belady", capacity, hits, total)


def hash_id_lists(trace: Iterable[TraceRequest]) -> list[tuple[int, ...]]:
    return [r.hash_ids for r in trace]
