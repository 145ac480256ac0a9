"""A simulator request, in one shape for the Mooncake trace and the generated families.

A request is its arrival time, its prompt as block keys (one key per block of ``BLOCK_TOKENS``
tokens; equal key prefixes are equal prompt prefixes, as in the Mooncake trace), its output
length, and optionally the retention config a client would send. :func:`mooncake` reads the trace
as such requests; :class:`Labelled` is a generated request with what it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eventbus.protocol import DEFAULT_PRIORITY, MAX_PRIORITY
from inference_node.kv.retention import KvCacheRetentionConfig, TokenRange
from kvflow.traces import TRACE_BLOCK_TOKENS, load_trace

BLOCK_TOKENS = TRACE_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class SimRequest:
    t: float
    keys: tuple[int, ...]
    output_tokens: int
    retention: KvCacheRetentionConfig | None = None
    #: Blocks a client would pin (a system prompt, tool definitions), for the "priority" policy.
    pinned_blocks: int = 0


def pin(blocks: int, *, priority: int = MAX_PRIORITY, rest: int = DEFAULT_PRIORITY) -> KvCacheRetentionConfig | None:
    if blocks <= 0:
        return None
    return KvCacheRetentionConfig((TokenRange(0, blocks * BLOCK_TOKENS, priority),
                                   TokenRange(blocks * BLOCK_TOKENS, None, rest)))


def mooncake(path: str | Path | None = None, limit: int | None = None) -> list[SimRequest]:
    """The trace; its first block (shared by every request: a system prompt) is what a client pins."""
    out = []
    for r in load_trace(path, limit):
        pinned = 1 if r.hash_ids and r.hash_ids[0] == 0 else 0
        out.append(SimRequest(r.timestamp_s, r.hash_ids, r.output_length, pin(pinned), pinned))
    return out


def at_load(reqs: Sequence[SimRequest], load: float) -> list[SimRequest]:
    """The same requests at ``load`` × their load: every arrival time ÷ ``load`` (0.67: two-thirds of
    the load, every gap 1.5 × as long); the prompts, the outputs and the order as they are.

    Raises:
        ValueError: ``load`` is not positive.
    """
    if not load > 0:
        raise ValueError(f"load must be positive, not {load}")
    return list(reqs) if load == 1 else [dataclasses.replace(r, t=r.t / load) for r in reqs]


@dataclass(frozen=True, slots=True)
class Labelled:
    """A generated request and what it is.

    ``kind``: the family's own name for it (``"turn"``, ``"step"``, ``"scan"``, ``"hot"`` …);
    ``unit``: what it belongs to (a session, a task, a scan burst, a prefix: an index; for ``rag``
    the system prompt's index then the chunk ids in order); ``family`` and ``phase``: where a
    mixture (``shifting_mix``) took it from.
    """

    req: SimRequest
    kind: str
    unit: tuple[int, ...] = ()
    family: str = ""
    phase: int = 0
