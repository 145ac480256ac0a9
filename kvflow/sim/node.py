"""One simulated node of :mod:`kvflow.sim.cluster` — its cache, its prefill queue (FIFO) and the
requests it has in hand — and :class:`Policy`, the router that chooses among such nodes (the
cluster's own policies and the anchors of :mod:`kvflow.sim.router_anchors` alike)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from inference_node.kv.clock import ManualClock
from inference_node.kv.manager import KVCacheManager
from inference_node.kv.prompt import Prompt
from kvflow.sim.request import SimRequest


@dataclass
class SimNode:
    """One node: its cache, its prefill queue (FIFO) and the requests it has in hand."""

    core: KVCacheManager
    clock: ManualClock
    capacity: int
    #: (prefill end, prompt blocks) of the requests whose prefill has not ended, in order: the first
    #: is being prefilled, the others wait
    prefills: deque[tuple[float, int]] = field(default_factory=deque)
    #: (last token, prompt blocks) of every request not finished (prefilling, waiting or decoding)
    inflight_heap: list[tuple[float, int]] = field(default_factory=list)
    inflight_blocks: int = 0
    waiting_blocks: int = 0
    busy_until: float = 0.0
    requests: int = 0
    prefill_tokens: int = 0

    def settle(self, now: float) -> None:
        q = self.prefills
        while q and q[0][0] <= now:
            q.popleft()
            if q:
                self.waiting_blocks -= q[0][1]  # the next one is being prefilled now
        h = self.inflight_heap
        while h and h[0][0] <= now:
            self.inflight_blocks -= heapq.heappop(h)[1]

    def admit(self, arrival: float, blocks: int, prefill_s: float, decode_s: float) -> float:
        """Queue a request: returns when its prefill starts."""
        start = max(arrival, self.busy_until)
        self.busy_until = start + prefill_s
        if self.prefills:
            self.waiting_blocks += blocks
        self.prefills.append((self.busy_until, blocks))
        heapq.heappush(self.inflight_heap, (self.busy_until + decode_s, blocks))
        self.inflight_blocks += blocks
        return start

    @property
    def inflight(self) -> int:
        """Requests in hand: being prefilled, waiting, or decoding."""
        return len(self.inflight_heap)

    @property
    def waiting(self) -> int:
        """Requests waiting for their prefill (a node's reported queue length)."""
        return max(0, len(self.prefills) - 1)

    @property
    def kv_usage(self) -> float:
        """The share of the node's blocks its running requests hold (vLLM's KV usage; waiting ones
        hold none)."""
        return (self.inflight_blocks - self.waiting_blocks) / self.capacity if self.capacity else 0.0


class Policy(Protocol):
    """A router: chooses a node for each request, and may learn from what it routed."""

    def choose(self, req: SimRequest, prompt: Prompt, nodes: Sequence[SimNode]) -> int: ...
