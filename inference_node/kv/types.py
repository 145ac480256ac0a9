"""The KV core's public value types: its configuration, what admitting a request returns, the
copies the model layer must perform, the counters, and the one error of admission.

Re-exported by :mod:`inference_node.kv.manager`, the core's entry point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from eventbus.hashing import DEFAULT_BLOCK_SIZE
from eventbus.protocol import DEFAULT_PRIORITY, EVENT_BLOCKS_CHUNK
from inference_node.kv.adaptive_settings import AdaptivePolicy


class OutOfBlocks(RuntimeError):
    """Not enough GPU blocks can be freed for a request (every candidate is in use)."""


@dataclass(frozen=True)
class KvCacheConfig:
    """Sizes and policies of one node's KV cache."""

    num_gpu_blocks: int
    num_host_blocks: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    secondary_offload_min_priority: int = DEFAULT_PRIORITY
    #: Attention window reported with every event (the model's context length).
    window_size: int = 4096
    #: Events queued before the publisher drains them; beyond this, a snapshot replaces them.
    max_queued_events: int = 100_000
    #: Put the token ids of each block into ``stored`` events.
    emit_token_ids: bool = False
    #: Blocks per ``snapshot`` part (a larger cache is sent in several parts).
    snapshot_part_blocks: int = EVENT_BLOCKS_CHUNK
    #: Assign priorities from observed reuse to requests without a retention config (the policy's
    #: settings; what it learns lives in the manager's ``AdaptiveLearner``).
    adaptive: AdaptivePolicy | None = None

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks must be at least 1")
        if self.num_host_blocks < 0:
            raise ValueError("num_host_blocks must be >= 0")
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if not 0 <= self.secondary_offload_min_priority <= 101:
            raise ValueError("secondary_offload_min_priority must be within 0..101 (101: never offload)")
        if self.max_queued_events < 1:
            raise ValueError("max_queued_events must be at least 1")
        if self.snapshot_part_blocks < 1:
            raise ValueError("snapshot_part_blocks must be at least 1")


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A copy the model layer must perform, in order, before the next forward pass."""

    kind: Literal["offload", "onboard"]
    src_level: int
    src_slot: int
    dst_level: int
    dst_slot: int


@dataclass(slots=True)
class Allocation:
    """The result of admitting a request."""

    #: GPU slot of each of the prompt's blocks (the partial tail included), in order.
    block_table: list[int]
    #: Prompt tokens whose KV is already in the cache (full blocks matched).
    num_cached_tokens: int
    gpu_hit_blocks: int
    host_hit_blocks: int
    #: Copies to perform before computing the prompt (offloads first, then onboards).
    copies: list[BlockCopy]


@dataclass
class KvStats:
    """Cumulative counters of one cache instance."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    requests_with_hit: int = 0
    evictions_by_priority: dict[int, int] = field(default_factory=dict)
    offloads_by_priority: dict[int, int] = field(default_factory=dict)
    onboards: int = 0
    expirations: int = 0
    reprioritizations: int = 0
    events_emitted: int = 0
    events_overflowed: int = 0
    snapshots: int = 0
    rejected_requests: int = 0


