"""Adaptive priorities: a cache without client hints that still beats LRU.

When a request brings no retention config, the core asks this policy for the priority of each
new block and, when a block is reused, whether to raise it. The policy is a segmented LRU written
in the language of priorities and retention durations, so it needs no machinery beyond the
core's own (and its decisions show up in events and SQL like any client's):

* **Probation.** A new block enters at ``probation_priority`` (below the default 35): blocks that
  were never reused are the first to go, least recently used first. Most blocks of a one-off
  prompt are never read again, and this keeps them from pushing out proven ones.
* **Protection.** A block that is reused is raised to ``protected_priority`` + ``step`` per
  earlier reuse (capped at ``max_priority``), for ``protect_s`` seconds after it next becomes
  evictable. When the protection runs out the core drops it to the default 35, which is still
  above probation: proven blocks compete with each other by recency, and fresh blocks are kept
  only as long as there is room.
* **Decode blocks** (generated tokens) enter at ``decode_priority``: a later turn of the same
  conversation reuses them, unlike a one-off prompt's tail.

It only ever *raises* a reused block (a pinned system prompt at 100 stays there).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptivePolicy:
    probation_priority: int = 20
    protected_priority: int = 50
    step: int = 10
    max_priority: int = 90
    protect_s: float | None = 600.0
    decode_priority: int = 20

    def __post_init__(self) -> None:
        for name in ("probation_priority", "protected_priority", "max_priority", "decode_priority"):
            v = getattr(self, name)
            if not 0 <= v <= 100:
                raise ValueError(f"{name} must be within 0..100, got {v}")
        if self.step < 0:
            raise ValueError("step must be >= 0")
        if self.protect_s is not None and self.protect_s < 0:
            raise ValueError("protect_s must be >= 0 or None")

    def new_block(self, index: int, is_decode: bool) -> tuple[int, float | None]:
        """Priority and duration of a new block (``index``: its position in the sequence)."""
        return (self.decode_priority if is_decode else self.probation_priority), None

    def on_reuse(self, priority: int, hits: int, depth: int) -> tuple[int, float | None] | None:
        """A cached block is being reused (``hits``: its earlier reuses). Raise it, or None."""
        new = min(self.max_priority, self.protected_priority + self.step * hits)
        if new < priority:
            return None
        return new, self.protect_s
