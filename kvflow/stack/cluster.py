"""The stack's Kafka brokers: one, or a KRaft cluster of ``n`` combined broker+controller nodes
(``kvflow stack up --brokers 3``), started, stopped and reported together."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

from kvflow.stack.kafka import (
    Kafka,
    ensure_stack_topics,
    min_insync_replicas,
    new_cluster_id,
    replication_factor,
)
from kvflow.stack.procs import wait_until
from kvflow.stack.settings import Paths, ServiceStatus, StackError, StackSettings


class KafkaCluster:
    """The stack's brokers: one, or a KRaft cluster of ``n`` combined broker+controller nodes.

    The size is fixed when the storage is first formatted (``kafka/brokers``; a stack formatted
    before clusters existed is one broker): a later ``up`` without a size starts what was
    formatted, and asking for another size is refused (the controller quorum is in the data).
    """

    def __init__(self, paths: Paths, settings: StackSettings) -> None:
        self.paths = paths
        self.settings = settings
        n = settings.kafka_brokers or self.formatted_size() or 1
        self.brokers = [Kafka(paths, settings, i, n) for i in range(1, n + 1)]

    @property
    def size_file(self) -> Path:
        return self.paths.kafka / "brokers"

    def formatted_size(self) -> int | None:
        """The cluster size the storage was formatted for (None: not formatted)."""
        with contextlib.suppress(OSError, ValueError):
            return int(self.size_file.read_text().strip())
        return 1 if (self.paths.kafka_data / "meta.properties").is_file() else None

    @property
    def size(self) -> int:
        return len(self.brokers)

    @property
    def address(self) -> str:
        """The bootstrap list: every broker."""
        return ",".join(b.address for b in self.brokers)

    def ready(self) -> bool:
        return all(b.ready(self.size) for b in self.brokers)

    def up(self, say: Callable[[str], None]) -> str:
        """Start every broker that does not run and wait until each answers and sees the others.

        If that fails or is interrupted (a stop signal, Ctrl-C), the brokers this call started
        are stopped again: a partial cluster is never left behind."""
        formatted = self.formatted_size()
        if formatted is not None and formatted != self.size:
            raise StackError(
                f"the Kafka storage in {self.paths.kafka} is formatted for {formatted} broker(s), not "
                f"{self.size}; run `kvflow stack down` and remove {self.paths.kafka}/data (and broker-*), "
                "or use another KVFLOW_STACK_HOME"
            )
        if self.size == 1:
            return self.brokers[0].up(say)
        missing = [b for b in self.brokers if b.pid() is None]
        if not missing:
            if not wait_until(self.ready, self.settings.start_timeout_s):
                raise StackError(f"the Kafka cluster runs but does not answer on {self.address}")
            return "already running"
        first = self.brokers[0]
        first._java()
        first.ensure_jars(say)
        started: list[tuple[Kafka, int]] = []
        try:
            if formatted is None:
                cluster_id = new_cluster_id()
                for b in self.brokers:
                    b.write_config()
                    b.ensure_formatted(cluster_id)
                self.size_file.write_text(f"{self.size}\n")
            # All at once: no broker answers before a quorum of controllers runs.
            started = [(b, b.spawn(say)) for b in missing]

            def ok() -> bool:
                for b, pid in started:
                    b.check_exited(pid)
                return self.ready()

            if not wait_until(ok, self.settings.start_timeout_s, interval=0.5):
                raise StackError(f"the Kafka cluster did not answer on {self.address} within "
                                 f"{self.settings.start_timeout_s:.0f} s; see {self.paths.logs}/kafka*")
        except BaseException:
            # Every broker that did not run before this call (also one spawned just as the
            # signal came, before it was in `started`): its pid file names it.
            for b in missing:
                with contextlib.suppress(Exception):
                    b.down()
            raise
        ids = ", ".join(str(b.node_id) for b, _ in started)
        return "started" if len(missing) == self.size else f"started broker(s) {ids}"

    def ensure_topics(self) -> None:
        ensure_stack_topics(self.address, self.size)

    def down(self) -> str:
        """Stop every broker with a pid file (whatever the size asked for now)."""
        brokers = list(self.brokers)
        for d in sorted(self.paths.kafka.glob("broker-*")):
            with contextlib.suppress(ValueError):
                k = int(d.name.split("-", 1)[1])
                if k > self.size:
                    brokers.append(Kafka(self.paths, self.settings, k, k))
        if len(brokers) == 1:
            return brokers[0].down()
        # NOTE: all at once: stopped one by one, the last brokers wait for a controller quorum that
        # is gone (a minute each) before they give up their controlled shutdown.
        pids = [b.pid() for b in brokers]
        for pid in pids:
            if pid is not None:
                os.kill(pid, signal.SIGTERM)
        results = [f"stopped (pid {pid})" if (r := b.down()) == "not running" and pid is not None else r
                   for b, pid in zip(brokers, pids, strict=True)]
        stopped = [f"{b.node_id}: {r}" for b, r in zip(brokers, results, strict=True) if r != "not running"]
        return "; ".join(stopped) if stopped else "not running"

    def status(self) -> list[ServiceStatus]:
        out = []
        for b in self.brokers:
            pid = b.pid()
            state = "running" if pid and b.ready() else ("starting" if pid else "stopped")
            name = "kafka" if self.size == 1 else f"kafka-{b.node_id}"
            detail = f"logs {b.log_dir}" + ("" if self.size == 1 else
                                            f", controller :{b.controller_port}, rf {replication_factor(self.size)}"
                                            f" min.insync {min_insync_replicas(self.size)}")
            out.append(ServiceStatus(name, state, b.address, pid, detail))
        return out
