"""The node's heartbeats: ``NodeStats`` from a thread of its own, so that a long prefill does not
make the node look gone (see :class:`Heartbeat`)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec

from eventbus.protocol import NodeStats

T = TypeVar("T")


class StatsSource(Protocol):
    """What a heartbeat asks for its stats (the node's ``Engine``): the stats, computed on the
    engine's own thread (``call``), and whether it crashed (``fatal``)."""

    @property
    def node_id(self) -> str: ...
    @property
    def fatal(self) -> BaseException | None: ...

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]: ...
    def node_stats(self) -> NodeStats: ...


class Heartbeat:
    """Sends the engine's ``NodeStats`` every ``interval_s`` from a thread of its own.

    Each beat asks the engine thread for fresh stats (``engine.call``); if the engine does not
    answer within a fraction of the interval (a long prefill holds it), the last stats go out
    again with the current time, so the node stays live. A crashed engine sends none.
    """

    def __init__(self, engine: StatsSource, send: Callable[[NodeStats], None], interval_s: float) -> None:
        self.engine = engine
        self._send = send
        self.interval_s = interval_s
        self.sent = 0
        self.stale_sent = 0  # beats that repeated the last stats (the engine was busy)
        self._last: NodeStats | None = None
        self._pending: concurrent.futures.Future[NodeStats] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{engine.node_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            stats = self._beat()
            if stats is not None:
                self._send(stats)
                self.sent += 1
            if self._stop.wait(self.interval_s):
                return

    def _beat(self) -> NodeStats | None:
        """The stats to send now (None: nothing to send)."""
        if self.engine.fatal is not None:
            return None
        if self._pending is None:
            self._pending = self.engine.call(self.engine.node_stats)
        try:
            stats = self._pending.result(timeout=min(0.5, self.interval_s / 2))
        except concurrent.futures.TimeoutError:  # busy: the last stats, now (the call stays queued)
            if self._last is None:
                return None
            self.stale_sent += 1
            return msgspec.structs.replace(self._last, ts=time.time())
        except RuntimeError:  # the engine crashed meanwhile
            self._pending = None
            return None
        self._pending = None
        self._last = stats
        return stats
