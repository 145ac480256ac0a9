"""The stack's private PostgreSQL: a cluster created with the installed server binaries
(``initdb``) in a git-ignored folder, on its own port (as root, run as the ``postgres`` user), or an
existing server named by ``KVFLOW_DATABASE_URL``."""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from kvflow.stack.procs import is_root, port_open, run, wait_until
from kvflow.stack.settings import Paths, StackError, StackSettings

#: PostgreSQL refuses to run as root; as root we run its binaries as this user.
PG_OS_USER = "postgres"


def find_pg_bindir() -> Path:
    """The folder of the PostgreSQL server binaries (newest installed version first)."""
    if env := os.environ.get("KVFLOW_PG_BINDIR"):
        return Path(env)
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
        reverse=True,
    )
    if found:
        return found[0].parent
    if initdb := shutil.which("initdb"):
        return Path(initdb).parent
    raise StackError(
        "PostgreSQL server binaries (initdb, pg_ctl) not found; install them "
        "(Debian: apt-get install postgresql) or set KVFLOW_DATABASE_URL to an existing server"
    )


def cluster_pid(data: Path) -> int | None:
    """The postmaster's pid of the PostgreSQL cluster in ``data`` (None: not running, or unknown)."""
    try:
        return int((data / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None


class Postgres:
    """A private PostgreSQL cluster for kvflow, or an external one named by KVFLOW_DATABASE_URL."""

    def __init__(self, paths: Paths, settings: StackSettings) -> None:
        self.paths = paths
        self.settings = settings
        self.external_url = os.environ.get("KVFLOW_DATABASE_URL")

    @property
    def port(self) -> int:
        return self.settings.postgres_port

    @property
    def base(self) -> Path:
        """The cluster's folder: in the state folder, unless the postgres user cannot reach it."""
        inside = self.paths.home / "postgres"
        if not is_root() or self._reachable_by_pg(self.paths.home):
            return inside
        # NOTE: as root, a checkout under /root is not traversable by the postgres user; put the
        # cluster in a folder keyed by the state folder's path instead.
        key = hashlib.sha256(str(self.paths.home).encode()).hexdigest()[:12]
        return Path("/var/tmp") / f"kvflow-pg-{key}"

    @staticmethod
    def _reachable_by_pg(path: Path) -> bool:
        try:
            pw = pwd.getpwnam(PG_OS_USER)
        except KeyError:
            return False
        for p in [path, *path.parents]:
            if not p.exists():
                continue
            st = p.stat()
            mode = st.st_mode
            if st.st_uid == pw.pw_uid:
                ok = bool(mode & 0o100)
            elif st.st_gid == pw.pw_gid:
                ok = bool(mode & 0o010)
            else:
                ok = bool(mode & 0o001)
            if not ok:
                return False
        return True

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def sockets(self) -> Path:
        return self.base / "run"

    @property
    def log(self) -> Path:
        return self.base / "postgres.log"

    def _as_pg(self, cmd: list[str]) -> list[str]:
        if not is_root():
            return cmd
        runuser = shutil.which("runuser")
        if runuser is None:
            raise StackError("running as root needs runuser (util-linux) to start PostgreSQL as 'postgres'")
        try:
            pwd.getpwnam(PG_OS_USER)
        except KeyError as exc:
            raise StackError(
                "running as root needs an OS user 'postgres' (PostgreSQL refuses root); "
                "create it (useradd --system postgres) or run as a normal user"
            ) from exc
        return [runuser, "-u", PG_OS_USER, "--", *cmd]

    def _bin(self, name: str) -> str:
        return str(find_pg_bindir() / name)

    def running(self) -> bool:
        return self.cluster_running(self.data)

    def cluster_running(self, data: Path) -> bool:
        """A cluster of these binaries in ``data`` (this one, or its standby's) runs."""
        if not (data / "PG_VERSION").is_file():
            return False
        proc = subprocess.run(self._as_pg([self._bin("pg_ctl"), "-D", str(data), "status"]),
                              capture_output=True, text=True, check=False)
        return proc.returncode == 0

    def pid(self) -> int | None:
        return cluster_pid(self.data)

    def ready(self) -> bool:
        return self.answers(self.port)

    def answers(self, port: int) -> bool:
        """A server of these binaries on localhost:``port`` accepts connections."""
        proc = subprocess.run([self._bin("pg_isready"), "-h", "localhost", "-p", str(port), "-t", "2"],
                              capture_output=True, text=True, check=False)
        return proc.returncode == 0

    def _initdb(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(parents=True, exist_ok=True)
        if is_root():
            pw = pwd.getpwnam(PG_OS_USER)
            for p in (self.base, self.sockets):
                os.chown(p, pw.pw_uid, pw.pw_gid)
            self.base.chmod(0o700)
        run(
            self._as_pg([self._bin("initdb"), "-D", str(self.data), "-U", "postgres", "-E", "UTF8",
                         "--no-locale", "--auth-local=trust", "--auth-host=scram-sha-256"]),
            log=self.paths.logs / "postgres-initdb.log", timeout=300, what="initdb",
        )
        conf = self.data / "postgresql.conf"
        with conf.open("a") as f:
            f.write(
                "\n# kvflow local stack (kvflow/stack/postgres.py)\n"
                "listen_addresses = 'localhost'\n"
                f"unix_socket_directories = '{self.sockets}'\n"
                "max_connections = 200\n"
                "shared_buffers = 256MB\n"
                "work_mem = 16MB\n"
                "maintenance_work_mem = 128MB\n"
                "max_wal_size = 2GB\n"
                "checkpoint_timeout = 15min\n"
                "log_min_messages = warning\n"
                "log_min_duration_statement = -1\n"
            )

    def _bootstrap(self) -> None:
        """Create the kvflow database and roles (idempotent), as the cluster's superuser."""
        sql = self.paths.deploy / "postgres" / "roles.sql"
        tmp = self.base / "roles.sql"
        shutil.copyfile(sql, tmp)  # readable by the postgres user wherever the checkout is
        if is_root():
            os.chmod(tmp, 0o644)
        psql = self.superuser_psql("-v", "owner_password=kvflow", "-v", "reader_password=kvflow_reader",
                                   "-f", str(tmp))
        run(psql, log=self.paths.logs / "postgres-bootstrap.log", timeout=120,
            what="creating the kvflow database and roles")
        # Development only: the owner may create databases, so that each integration test gets
        # its own (production deployments don't grant this; see deploy/postgres/roles.sql).
        run(self.superuser_psql("-c", "ALTER ROLE kvflow CREATEDB"),
            log=self.paths.logs / "postgres-bootstrap.log", timeout=60, what="granting CREATEDB")

    def superuser_psql(self, *args: str) -> list[str]:
        """The command line of ``psql`` as the cluster's superuser on its ``postgres`` database (over
        the local socket, stopping at the first error; as the ``postgres`` user when root), with ``args``."""
        return self._as_pg([self._bin("psql"), "-X", "-q", "-h", str(self.sockets), "-p", str(self.port),
                            "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", *args])

    def up(self, say: Callable[[str], None]) -> str:
        if self.external_url:
            return "external (KVFLOW_DATABASE_URL)"
        find_pg_bindir()
        if self.running():
            if not wait_until(self.ready, self.settings.start_timeout_s):
                raise StackError(f"PostgreSQL runs in {self.data} but does not answer on port {self.port}")
            self._bootstrap()
            return "already running"
        if port_open(self.port):
            raise StackError(
                f"port {self.port} is taken by another process; stop it or set KVFLOW_STACK_POSTGRES_PORT"
            )
        if not (self.data / "PG_VERSION").is_file():
            say(f"creating a PostgreSQL cluster in {self.data}…")
            self._initdb()
        say(f"starting PostgreSQL on localhost:{self.port}…")
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        run(
            self._as_pg([self._bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                         "-o", f"-p {self.port}", "-w", "-t", str(int(self.settings.start_timeout_s)),
                         "start"]),
            log=self.paths.logs / "postgres-ctl.log", timeout=self.settings.start_timeout_s + 10,
            what="starting PostgreSQL",
        )
        if not wait_until(self.ready, self.settings.start_timeout_s):
            raise StackError(f"PostgreSQL did not answer on port {self.port}; see {self.log}")
        self._bootstrap()
        return "started"

    def down(self) -> str:
        if self.external_url:
            return "external (not managed)"
        if not self.running():
            return "not running"
        pid = self.pid()
        run(self._as_pg([self._bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop"]),
            log=self.paths.logs / "postgres-ctl.log", timeout=90, what="stopping PostgreSQL")
        return f"stopped (pid {pid})"
