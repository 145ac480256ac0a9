"""Routing anchors for the simulator: other routers' policies, written from their source, on blocks.

Neither of them sees the nodes' caches: each keeps an *approximate* index built from the requests
it routed (as these routers do by default), which the simulator's true caches then confirm or not.
Both work here on the simulator's blocks (512 tokens; a block key stands for its text).

* :class:`SGLangCacheAware` — SGLang's cache-aware router, ``sgl-router``
  (``sgl-router/src/policies/cache_aware.rs`` and ``src/tree.rs``, sgl-project/sglang at commit
  026f853 / 0e6ed14; defaults of its launcher, ``py_src/sglang_router/router_args.py`` at 083d601:
  ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5,
  ``eviction_interval_secs`` 120, ``max_tree_size`` 2^26 characters).
* :class:`LlmdScorer` — llm-d's inference scheduler as its "inference scheduling" guide configures
  it (llm-d/llm-d ``guides/inference-scheduling/scheduler/inference-scheduling.values.yaml`` at
  086f217: ``queue-scorer`` weight 2, ``kv-cache-utilization-scorer`` 2, ``prefix-cache-scorer``
  3, the max-score picker), the scorers of the Gateway API Inference Extension it builds on
  (``pkg/epp/scheduling/framework/plugins``: ``scorer/queue.go``, ``scorer/kvcache_utilization.go``,
  ``multi/prefix/plugin.go``: ``maxPrefixBlocksToMatch`` 256, an LRU index per server as large as the
  server's GPU blocks with ``autoTune``, else 31,250).
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, OrderedDict
from collections.abc import Sequence

from inference_node.kv.prompt import Prompt
from kvflow.sim.node import SimNode
from kvflow.sim.request import BLOCK_TOKENS, SimRequest

#: SGLang counts its tree in characters, llm-d its block sizes in tokens × 4 characters
#: (``averageCharactersPerToken``); the same estimate turns SGLang's characters into blocks here.
CHARS_PER_TOKEN = 4


class _TrieNode:
    __slots__ = ("children", "key", "parent", "tenants")

    def __init__(self, key: int, parent: _TrieNode | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _TrieNode] = {}
        self.tenants: dict[int, float] = {}  # worker -> last access (insertion order: SGLang's "first")


class ApproxTree:
    """SGLang's multi-tenant approximate radix tree, one node per block: which worker was sent which
    prefix, with each worker's last access, and LRU eviction of a worker's leaves by size."""

    def __init__(self, workers: int) -> None:
        self.root = _TrieNode(-1, None)
        self.size = [0] * workers  # blocks per worker
        for w in range(workers):  # init_workers: every worker is a tenant of the root
            self.root.tenants[w] = 0.0

    def insert(self, keys: Sequence[int], worker: int, now: float) -> None:
        node = self.root
        node.tenants[worker] = now
        for k in keys:
            child = node.children.get(k)
            if child is None:
                child = node.children[k] = _TrieNode(k, node)
            if worker not in child.tenants:
                self.size[worker] += 1
            child.tenants[worker] = now
            node = child

    def prefix_match(self, keys: Sequence[int], now: float) -> tuple[int, int]:
        """The longest matched prefix over all workers (blocks) and the first worker holding its
        deepest node, whose access times along the path are refreshed (``Tree::prefix_match``)."""
        node, matched = self.root, 0
        for k in keys:
            child = node.children.get(k)
            if child is None:
                break
            node, matched = child, matched + 1
        worker = next(iter(node.tenants))
        n: _TrieNode | None = node
        while n is not None:
            n.tenants[worker] = now
            n = n.parent
        return matched, worker

    def smallest(self) -> int:
        """The worker with the fewest blocks in the tree (``get_smallest_tenant``)."""
        return min(range(len(self.size)), key=lambda w: (self.size[w], w))

    def evict(self, max_blocks: int) -> None:
        """Each worker over ``max_blocks``: take its least recently used leaves off until it fits
        (``evict_tenant_by_size``)."""
        for w, size in enumerate(self.size):
            if size > max_blocks:
                self._evict_worker(w, max_blocks)

    def _evict_worker(self, w: int, max_blocks: int) -> None:
        heap: list[tuple[float, int, _TrieNode]] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            below = [c for c in n.children.values() if w in c.tenants]
            if n is not self.root and not below:
                heap.append((n.tenants[w], id(n), n))
            stack.extend(below)
        heapq.heapify(heap)
        while self.size[w] > max_blocks and heap:
            _, _, n = heapq.heappop(heap)
            del n.tenants[w]
            self.size[w] -= 1
            parent = n.parent
            assert parent is not None
            if not n.tenants:
                del parent.children[n.key]
            if parent is not self.root and not any(w in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[w], id(parent), parent))


class SGLangCacheAware:
    """SGLang's cache-aware policy (``CacheAwarePolicy::select_worker``).

    Load is each worker's requests in flight from the router (``Worker::load``). If the fleet is
    imbalanced — ``max − min > balance_abs_threshold`` and ``max > balance_rel_threshold × min`` —
    the request goes to the least-loaded worker (shortest queue). Otherwise to the worker of the
    longest prefix match in the approximate tree if the match covers more than ``cache_threshold``
    of the prompt, else to the worker with the smallest tree. Either way the prompt is inserted
    under the chosen worker; every ``eviction_interval_s`` each worker's tree is cut back to
    ``max_tree_size`` characters."""

    def __init__(self, workers: int, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, eviction_interval_s: float = 120.0,
                 max_tree_size_chars: int = 2**26) -> None:
        self.tree = ApproxTree(workers)
        self.cache_threshold = cache_threshold
        self.abs_threshold, self.rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_blocks = max_tree_size_chars // (BLOCK_TOKENS * CHARS_PER_TOKEN)
        self.next_eviction = eviction_interval_s

    def imbalanced(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.abs_threshold and hi > lo * self.rel_threshold

    def choose(self, req: SimRequest, prompt: Prompt, nodes: Sequence[SimNode]) -> int:
        while req.t >= self.next_eviction:
            self.tree.evict(self.max_blocks)
            self.next_eviction += self.eviction_interval_s
        loads = [nd.inflight for nd in nodes]
        if self.imbalanced(loads):
            k = min(range(len(nodes)), key=lambda j: (loads[j], j))
        else:
            matched, worker = self.tree.prefix_match(req.keys, req.t)
            rate = matched / len(req.keys) if req.keys else 0.0
            k = worker if rate > self.cache_threshold else self.tree.smallest()
        self.tree.insert(req.keys, k, req.t)
        return k


class _LruIndex:
    """GIE's prefix indexer: per server an LRU of the block hashes routed to it, and which servers
    hold each hash."""

    def __init__(self, servers: int, capacity: int) -> None:
        self.lru: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(servers)]
        self.holders: dict[bytes, set[int]] = {}
        self.capacity = capacity

    def add(self, hashes: Sequence[bytes], server: int) -> None:
        lru = self.lru[server]
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self.holders.setdefault(h, set()).add(server)
            if len(lru) > self.capacity:
                old, _ = lru.popitem(last=False)
                held = self.holders[old]
                held.discard(server)
                if not held:
                    del self.holders[old]

    def match(self, hashes: Sequence[bytes]) -> Counter[int]:
        """``matchLongestPrefix``: for each hash in order while some server holds it, +1 to every
        server holding it."""
        res: Counter[int] = Counter()
        for h in hashes:
            servers = self.holders.get(h)
            if not servers:
                break
            for s in servers:
                res[s] += 1
        return res


class LlmdScorer:
    """llm-d's scheduling profile: ``3 × prefix + 2 × queue + 2 × KV utilization``, the highest wins
    (ties at random: the max-score picker shuffles first).

    * prefix-cache-scorer: the server's matched blocks over the prompt's (at most 256), from the
      index of what was routed to it (updated after each choice, ``PreRequest``);
    * queue-scorer: ``(max − q) / (max − min)`` of the waiting queues (all equal: 1);
    * kv-cache-utilization-scorer: ``1 − the server's KV usage``."""

    def __init__(self, servers: int, capacity: int, rng: random.Random, *, prefix_weight: float = 3.0,
                 queue_weight: float = 2.0, kv_weight: float = 2.0, max_prefix_blocks: int = 256) -> None:
        self.index = _LruIndex(servers, capacity)
        self.rng = rng
        self.prefix_weight, self.queue_weight, self.kv_weight = prefix_weight, queue_weight, kv_weight
        self.max_prefix_blocks = max_prefix_blocks

    def scores(self, prompt: Prompt, nodes: Sequence[SimNode]) -> list[float]:
        hashes = prompt.digests[: self.max_prefix_blocks]
        matched = self.index.match(hashes)
        queues = [nd.waiting for nd in nodes]
        lo, hi = min(queues), max(queues)
        out = []
        for j, nd in enumerate(nodes):
            prefix = matched[j] / len(hashes) if hashes else 0.0
            queue = 1.0 if hi == lo else (hi - queues[j]) / (hi - lo)
            out.append(self.prefix_weight * prefix + self.queue_weight * queue + self.kv_weight * (1 - nd.kv_usage))
        return out

    def choose(self, req: SimRequest, prompt: Prompt, nodes: Sequence[SimNode]) -> int:
        scores = self.scores(prompt, nodes)
        best = max(scores)
        k = self.rng.choice([j for j, s in enumerate(scores) if s == best])
        self.index.add(prompt.digests[: self.max_prefix_blocks], k)
        return k
