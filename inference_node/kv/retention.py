"""Retention configuration: TensorRT-LLM's ``KvCacheRetentionConfig``, reproduced.

A request may carry token ranges, each with a priority (0 = evict first … 100) and a duration
after which the priority falls back to the default (35). Blocks of generated tokens take the
decode priority and duration. Ranges must not overlap. A block takes the highest priority among
the ranges it overlaps (docs/architecture.md#retention-and-eviction; ties: the longest duration,
``None`` = never expires), the default where it overlaps none.

NOTE: TensorRT-LLM's ``getPerBlockRetentionPriorityDuration`` gives a block the range that holds
its *first* token; kvflow's contract takes the highest overlapping range instead, so a block in
which a high-priority range begins is kept at that priority. Both agree whenever ranges start on
block boundaries.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from eventbus.protocol import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY


class RetentionConfigError(ValueError):
    """A retention configuration that cannot be honoured, with a message for the client."""


def _check_priority(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RetentionConfigError(f"{where}: priority must be an integer, got {value!r}")
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise RetentionConfigError(
            f"{where}: priority {value} is outside {MIN_PRIORITY}..{MAX_PRIORITY}"
        )
    return value


def _check_duration(value: object, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RetentionConfigError(f"{where}: duration_s must be a number or null, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise RetentionConfigError(f"{where}: duration_s must be finite and >= 0, got {value}")
    return float(value)


@dataclass(frozen=True, slots=True)
class TokenRange:
    """Tokens ``[start, end)`` of the prompt (``end=None``: to the end of the prompt)."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        where = f"token range [{self.start}, {'end' if self.end is None else self.end})"
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise RetentionConfigError(f"{where}: start must be an integer >= 0")
        if self.end is not None and (
            isinstance(self.end, bool) or not isinstance(self.end, int) or self.end <= self.start
        ):
            raise RetentionConfigError(f"{where}: end must be an integer > start, or null")
        _check_priority(self.priority, where)
        object.__setattr__(self, "duration_s", _check_duration(self.duration_s, where))

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether the range shares a token with ``[lo, hi)``."""
        return self.start < hi and (self.end is None or lo < self.end)


@dataclass(frozen=True, slots=True)
class KvCacheRetentionConfig:
    """Per-request retention: prompt token ranges plus the priority of generated tokens."""

    token_ranges: tuple[TokenRange, ...] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None
    _sorted: tuple[TokenRange, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_priority(self.decode_priority, "decode_priority")
        object.__setattr__(
            self, "decode_duration_s", _check_duration(self.decode_duration_s, "decode_duration_s")
        )
        ranges = tuple(sorted(self.token_ranges, key=lambda r: r.start))
        for a, b in itertools.pairwise(ranges):
            if a.end is None or a.end > b.start:
                raise RetentionConfigError(
                    f"token ranges [{a.start}, {'end' if a.end is None else a.end}) and "
                    f"[{b.start}, {'end' if b.end is None else b.end}) overlap; ranges must be disjoint"
                )
        object.__setattr__(self, "_sorted", ranges)

    def block_retention(self, lo: int, hi: int, prompt_len: int) -> tuple[int, float | None]:
        """Priority and duration of the block holding tokens ``[lo, hi)``.

        A block that holds prompt tokens (it was allocated for the prompt) takes the highest
        priority among the ranges its prompt tokens overlap (among equals, the longest
        duration), or the default 35 when it overlaps none. A block that starts at or after
        ``prompt_len`` holds generated tokens only and takes the decode priority and duration.
        """
        if lo >= prompt_len:
            return self.decode_priority, self.decode_duration_s
        p_hi = min(hi, prompt_len)
        best: tuple[int, float | None] | None = None
        for r in self._sorted:
            if r.start >= p_hi:
                break
            if r.overlaps(lo, p_hi):
                best = _better(best, (r.priority, r.duration_s))
        return best if best is not None else (DEFAULT_PRIORITY, None)


def _better(a: tuple[int, float | None] | None, b: tuple[int, float | None]) -> tuple[int, float | None]:
    if a is None or b[0] > a[0]:
        return b
    if b[0] < a[0]:
        return a
    # Same priority: the longer duration (None = never expires) wins.
    if a[1] is None or b[1] is None:
        return (a[0], None)
    return (a[0], max(a[1], b[1]))
