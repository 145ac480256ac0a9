"""Reading from a streaming standby: how far behind the primary it is, and where to read.

When ``KVFLOW_DATABASE_READER_URL`` names a PostgreSQL standby (``kvflow stack up --replica``), the
fleet a router sees is the primary's as of the standby's last replayed transaction: its freshness
is the materializer's plus the replication lag. :class:`ReplicaMonitor` measures that lag every
``replica_check_s`` on a connection of its own (not the reader's: an unreachable database here
changes nothing in the reader's outage handling):

* ``lag_bytes``: the WAL the standby has not replayed — against the primary's
  ``pg_current_wal_lsn()`` when ``KVFLOW_ROUTER_PRIMARY_READER_URL`` is set, else against the WAL
  the standby has received (``pg_last_wal_receive_lsn()``: this misses a standby cut off from its
  primary, which receives nothing either);
* ``lag_s``: 0 when nothing is unreplayed; else the time since the last replayed transaction
  committed on the primary (``now() - pg_last_xact_replay_timestamp()``), but at most the time the
  standby has been seen behind without a break (after an idle spell, the first new write would
  otherwise read as the whole spell).

Beyond ``replica_max_lag_s`` the router reads the primary (``primary_reader_url``) until the
standby is back within it; without a primary URL it goes on reading the standby and flags it
(``stale`` in ``/v1/stats`` and ``/healthz``, ``kvflow_router_replica_stale``). A reader that is
not a standby is checked once, then left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import asyncpg
from prometheus_client import CollectorRegistry, Counter, Gauge

from routing_api.queries import StateReader
from state_store.config import plain_dsn

log = logging.getLogger("kvflow.router")

#: On the reader: whether it is a standby, what it has not replayed of what it received (or of the
#: primary's position, $1), since when, and whether replay is paused.
STANDBY = """
SELECT pg_is_in_recovery() AS standby,
       CASE WHEN pg_is_in_recovery() THEN
         pg_wal_lsn_diff(coalesce($1::text::pg_lsn, pg_last_wal_receive_lsn()), pg_last_wal_replay_lsn())
       END AS lag_bytes,
       extract(epoch FROM now() - pg_last_xact_replay_timestamp()) AS since_replay_s,
       CASE WHEN pg_is_in_recovery() THEN pg_is_wal_replay_paused() END AS paused
"""
PRIMARY_LSN = "SELECT pg_current_wal_lsn()::text"


@dataclass
class Replication:
    """What the router knows of its standby (``/v1/stats``: ``replication``)."""

    standby: bool | None = None  # None: not measured yet
    lag_s: float = 0.0
    lag_bytes: int = 0
    paused: bool = False
    stale: bool = False  # lag_s beyond replica_max_lag_s
    reading: str = "reader"  # or "primary" (the fallback)
    max_lag_s: float = 0.0
    checked_at: float | None = None  # unix time
    error: str | None = None

    def json(self) -> dict[str, Any]:
        return asdict(self)


class ReplicaMetrics:
    """The replication metrics of ``/metrics`` (in the router's registry, made once per app)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lag = Gauge("kvflow_router_replica_lag_seconds", "Replication lag of the standby the router "
                         "reads (0: not a standby, or caught up)", registry=registry)
        self.lag_bytes = Gauge("kvflow_router_replica_lag_bytes", "WAL the standby has not replayed",
                               registry=registry)
        self.stale = Gauge("kvflow_router_replica_stale", "1 while the standby lags beyond "
                           "KVFLOW_ROUTER_REPLICA_MAX_LAG_S", registry=registry)
        self.reading_primary = Gauge("kvflow_router_reading_primary", "1 while the router reads the primary "
                                     "because the standby lags", registry=registry)
        self.fallbacks = Counter("kvflow_router_replica_fallbacks_total", "Times the router turned to the "
                                 "primary because the standby lagged", registry=registry)


class ReplicaMonitor:
    """Measures the standby's lag and picks the reader: the standby's, or the primary's beyond
    ``max_lag_s`` (when there is one)."""

    def __init__(self, replica: StateReader, primary: StateReader | None, max_lag_s: float,
                 metrics: ReplicaMetrics) -> None:
        self.replica = replica
        self.primary = primary
        self.state = Replication(max_lag_s=max_lag_s)
        self.metrics = metrics
        self._conns: dict[str, asyncpg.Connection] = {}
        self._behind_since: float | None = None

    @property
    def reader(self) -> StateReader:
        """Where decisions and the read endpoints read now."""
        return self.primary if self.state.reading == "primary" and self.primary is not None else self.replica

    async def _conn(self, which: str, dsn: str) -> asyncpg.Connection:
        conn = self._conns.get(which)
        if conn is None or conn.is_closed():
            conn = self._conns[which] = await asyncpg.connect(
                dsn, timeout=5, command_timeout=5, server_settings={"application_name": "kvflow-router-lag"})
        return conn

    async def _fetch(self, which: str, dsn: str, sql: str, *args: Any) -> Any:
        conn = await self._conn(which, dsn)
        try:
            return await conn.fetchrow(sql, *args)
        except BaseException:
            self._conns.pop(which, None)
            conn.terminate()
            raise

    async def check(self) -> Replication:
        """Measure the lag now; choose the reader. Never raises (an error is kept in ``error``;
        what was chosen stays)."""
        st = self.state
        try:
            lsn = None
            if self.primary is not None:
                lsn = (await self._fetch("primary", self.primary.dsn, PRIMARY_LSN))[0]
            row = await self._fetch("replica", self.replica.dsn, STANDBY, lsn)
        except Exception as exc:  # the database away: the reader's own handling says so
            st.error = f"{type(exc).__name__}: {exc}"
            return st
        self._measured(row)
        return st

    def _measured(self, row: Any) -> None:
        st = self.state
        now = time.monotonic()
        st.error, st.checked_at, st.standby = None, time.time(), bool(row["standby"])
        lag_bytes = max(0, int(row["lag_bytes"] or 0)) if st.standby else 0
        if lag_bytes == 0:
            self._behind_since = None
            lag_s = 0.0
        else:
            self._behind_since = self._behind_since or now
            since = row["since_replay_s"]
            lag_s = min(float(since) if since is not None else float("inf"), now - self._behind_since)
        st.lag_s, st.lag_bytes, st.paused = round(lag_s, 3), lag_bytes, bool(row["paused"])
        st.stale = lag_s > st.max_lag_s
        reading = "primary" if st.stale and self.primary is not None else "reader"
        if reading != st.reading:
            if reading == "primary":
                self.metrics.fallbacks.inc()
                log.warning("the standby lags %.1f s (%d bytes of WAL) behind the primary: reading the primary",
                            lag_s, lag_bytes)
            else:
                log.warning("the standby caught up (lag %.1f s): reading it again", lag_s)
            st.reading = reading
        elif st.stale and self.primary is None:
            log.debug("the standby lags %.1f s and there is no primary to read (answers flagged)", lag_s)
        m = self.metrics
        m.lag.set(lag_s)
        m.lag_bytes.set(lag_bytes)
        m.stale.set(1 if st.stale else 0)
        m.reading_primary.set(1 if st.reading == "primary" else 0)

    async def run(self, interval_s: float, on_change: Callable[[StateReader], None]) -> None:
        """Check every ``interval_s`` and call ``on_change(reader)`` with the reader to use; stop
        after the first check that finds no standby."""
        current = None
        while True:
            st = await self.check()
            if self.reader is not current:
                current = self.reader
                on_change(current)
            if st.standby is False:
                return
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        for conn in self._conns.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 2)
        self._conns.clear()
        if self.primary is not None:
            await self.primary.close()


def primary_reader(url: str | None, like: StateReader) -> StateReader | None:
    """A reader of the primary with ``like``'s settings (None without a URL)."""
    if not url:
        return None
    return StateReader(plain_dsn(url), like.nodes_cache_s, pool_size=like.pool_size,
                       statement_timeout_ms=like.statement_timeout_ms)
