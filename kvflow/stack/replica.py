"""A streaming standby of the stack's private PostgreSQL (``kvflow stack up --replica``), made with
``pg_basebackup`` and fed through a replication slot, for routers to read from."""

from __future__ import annotations

import os
import pwd
import shutil
from collections.abc import Callable
from pathlib import Path

from kvflow.stack.postgres import PG_OS_USER, Postgres, cluster_pid
from kvflow.stack.procs import is_root, port_open, run, wait_until
from kvflow.stack.settings import StackError

#: The standby's physical replication slot on the primary: the primary keeps the WAL the standby
#: has not received, so a standby left stopped while the primary writes catches up when started
#: again instead of failing ("requested WAL segment … has already been removed")…
REPLICA_SLOT = "kvflow_standby"
#: … up to this much of it (``max_slot_wal_keep_size``): past it the primary drops what the slot
#: holds rather than fill its disk, and that standby must be made again.
REPLICA_SLOT_KEEP = "4GB"


class PostgresReplica:
    """A streaming standby of the stack's private PostgreSQL, for routers to read from.

    Made once with ``pg_basebackup -R -C -S kvflow_standby`` (``-R`` writes ``standby.signal`` and
    the ``primary_conninfo`` it streams with: the primary's socket, its superuser, trusted
    locally; ``-C -S`` create the replication slot :data:`REPLICA_SLOT` it streams from), in a
    folder next to the primary's, on its own port (``KVFLOW_STACK_REPLICA_PORT``). It holds the
    same roles and data; it is read-only while it is a standby.
    """

    def __init__(self, primary: Postgres) -> None:
        self.primary = primary
        self.settings = primary.settings
        self.paths = primary.paths

    @property
    def port(self) -> int:
        return self.settings.replica_port

    @property
    def base(self) -> Path:
        return self.primary.base.parent / f"{self.primary.base.name}-replica"

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def log(self) -> Path:
        return self.base / "postgres.log"

    def made(self) -> bool:
        return (self.data / "standby.signal").is_file() or (self.data / "PG_VERSION").is_file()

    def running(self) -> bool:
        return self.primary.cluster_running(self.data)

    def pid(self) -> int | None:
        return cluster_pid(self.data)

    def ready(self) -> bool:
        return self.primary.answers(self.port)

    @property
    def reader_url(self) -> str:
        return f"postgresql+asyncpg://kvflow_reader:kvflow_reader@localhost:{self.port}/kvflow"

    def _base_backup(self, say: Callable[[str], None]) -> None:
        p = self.primary
        say(f"copying the primary into a standby in {self.data} (pg_basebackup)…")
        shutil.rmtree(self.base, ignore_errors=True)
        self.base.mkdir(parents=True)
        if is_root():
            pw = pwd.getpwnam(PG_OS_USER)
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
        self.base.chmod(0o700)
        # A slot left by a standby made before (its folder removed) would keep WAL for nobody.
        run(p.superuser_psql("-c", f"ALTER SYSTEM SET max_slot_wal_keep_size = '{REPLICA_SLOT_KEEP}'",
                             "-c", "SELECT pg_reload_conf()",
                             "-c", "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                                   f" WHERE slot_name = '{REPLICA_SLOT}' AND NOT active"),
            log=self.paths.logs / "postgres-replica.log", timeout=60, what="preparing the replication slot")
        run(p._as_pg([p._bin("pg_basebackup"), "-h", str(p.sockets), "-p", str(p.port), "-U", "postgres",
                      "-D", str(self.data), "-R", "-C", "-S", REPLICA_SLOT, "-X", "stream", "-c", "fast"]),
            log=self.paths.logs / "postgres-replica.log", timeout=600, what="pg_basebackup")

    def up(self, say: Callable[[str], None]) -> str:
        if self.primary.external_url:
            raise StackError("--replica needs the stack's own PostgreSQL (KVFLOW_DATABASE_URL is set)")
        if self.running():
            if not wait_until(self.ready, self.settings.start_timeout_s):
                raise StackError(f"the PostgreSQL standby runs in {self.data} but does not answer on {self.port}")
            return "already running"
        if port_open(self.port):
            raise StackError(f"port {self.port} is taken by another process; stop it or set KVFLOW_STACK_REPLICA_PORT")
        if not (self.data / "PG_VERSION").is_file():
            self._base_backup(say)
        p = self.primary
        say(f"starting the PostgreSQL standby on localhost:{self.port}…")
        run(p._as_pg([p._bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", f"-p {self.port}",
                      "-w", "-t", str(int(self.settings.start_timeout_s)), "start"]),
            log=self.paths.logs / "postgres-replica.log", timeout=self.settings.start_timeout_s + 10,
            what="starting the PostgreSQL standby")
        if not wait_until(self.ready, self.settings.start_timeout_s):
            raise StackError(f"the PostgreSQL standby did not answer on port {self.port}; see {self.log}")
        return "started"

    def down(self) -> str:
        if not self.running():
            return "not running"
        pid = self.pid()
        p = self.primary
        run(p._as_pg([p._bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop"]),
            log=self.paths.logs / "postgres-replica.log", timeout=90, what="stopping the PostgreSQL standby")
        return f"stopped (pid {pid})"
