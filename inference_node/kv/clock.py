"""Clocks for the KV core: monotonic time in production, a hand-driven clock in tests and sims."""

from __future__ import annotations

import time
from collections.abc import Callable

#: A clock returns seconds as a float; only differences matter (retention durations).
Clock = Callable[[], float]

monotonic: Clock = time.monotonic


class ManualClock:
    """A clock that moves only when told to (tests, trace replays)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self.now += seconds

    def set(self, now: float) -> None:
        if now < self.now:
            raise ValueError("a clock does not go backwards")
        self.now = now
