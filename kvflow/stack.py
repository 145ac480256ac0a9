"""The local development stack: a real Apache Kafka broker (KRaft) and a private PostgreSQL.

No Docker: Kafka's jars are resolved from Maven Central through ``deploy/kafka/pom.xml`` (once,
then cached), its storage is formatted with Kafka's own ``StorageTool`` and the broker runs with
``java``; PostgreSQL is a cluster created with the installed server binaries (``initdb``) in a
git-ignored folder, on its own port. ``KVFLOW_DATABASE_URL`` names an existing server instead.

Everything the stack writes lives under one state folder (``.kvflow/`` in the project, or
``KVFLOW_STACK_HOME``): jars, data, logs (``logs/``) and the pid files through which ``down``
stops exactly what ``up`` started. ``up`` is idempotent.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvflow.supervise import die_with_parent

#: PostgreSQL refuses to run as root; as root we run its binaries as this user.
PG_OS_USER = "postgres"


class StackError(RuntimeError):
    """A problem the user can fix, told in one line (never a stack trace)."""


class StackSettings(BaseSettings):
    """Where the local stack lives and listens (``KVFLOW_STACK_…``)."""

    model_config = SettingsConfigDict(env_prefix="KVFLOW_STACK_", extra="ignore")

    home: Path | None = Field(
        default=None, description="State folder (jars, data, logs, pids); default <project>/.kvflow."
    )
    kafka_port: int = Field(default=9092, description="Kafka client listener on localhost.")
    kafka_controller_port: int = Field(default=9093, description="KRaft controller listener.")
    kafka_heap: str = Field(default="768m", description="Maximum JVM heap of the broker.")
    kafka_brokers: int | None = Field(
        default=None, ge=1, le=9,
        description="Brokers of the KRaft cluster (each broker + controller); default: as formatted, else 1.",
    )
    kafka_ports: list[int] = Field(
        default_factory=list, description="Client port of each broker (default: kafka_port + 2 × i).")
    kafka_controller_ports: list[int] = Field(
        default_factory=list, description="Controller port of each broker (default: kafka_controller_port + 2 × i).")
    kafka_cluster_heap: str = Field(default="512m", description="Maximum JVM heap of each broker of a cluster.")
    postgres_port: int = Field(default=55432, description="Port of the private PostgreSQL.")
    replica: bool | None = Field(
        default=None, description="A streaming standby of the private PostgreSQL; default: if one was made.")
    replica_port: int = Field(default=55433, description="Port of the PostgreSQL standby.")
    start_timeout_s: float = Field(default=120.0, description="How long `up` waits for each service.")


def project_dir() -> Path:
    """The kvflow checkout: the folder holding ``deploy/kafka/pom.xml``.

    ``KVFLOW_PROJECT_DIR`` wins; otherwise the folder above this package (an editable install, as
    ``make`` creates), then the current directory and its parents.
    """
    candidates: list[Path] = []
    if env := os.environ.get("KVFLOW_PROJECT_DIR"):
        candidates.append(Path(env))
    candidates.append(Path(__file__).resolve().parents[1])
    cwd = Path.cwd().resolve()
    candidates.extend([cwd, *cwd.parents])
    for c in candidates:
        if (c / "deploy" / "kafka" / "pom.xml").is_file():
            return c
    raise StackError(
        "cannot find the kvflow checkout (deploy/kafka/pom.xml); run from it or set KVFLOW_PROJECT_DIR"
    )


@dataclass(frozen=True)
class Paths:
    project: Path
    home: Path

    @property
    def deploy(self) -> Path:
        return self.project / "deploy"

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def kafka(self) -> Path:
        return self.home / "kafka"

    @property
    def kafka_libs(self) -> Path:
        return self.kafka / "libs"

    @property
    def kafka_data(self) -> Path:
        return self.kafka / "data"

    @property
    def kafka_conf(self) -> Path:
        return self.kafka / "server.properties"

    @property
    def kafka_pid(self) -> Path:
        return self.kafka / "kafka.pid"


def is_root() -> bool:
    return os.geteuid() == 0


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not reaped) counts as dead.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def pid_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return check()


def run(cmd: Sequence[str], *, log: Path | None = None, timeout: float = 600,
        env: dict[str, str] | None = None, what: str) -> subprocess.CompletedProcess[str]:
    """Run a helper command; on failure raise StackError with the tail of its output."""
    try:
        proc = subprocess.run(  # (the helper dies with this process, even killed with SIGKILL)
            list(cmd), capture_output=True, text=True, timeout=timeout, env=env, check=False,
            preexec_fn=die_with_parent,
        )
    except FileNotFoundError as exc:
        raise StackError(f"{what}: {cmd[0]} not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise StackError(f"{what}: timed out after {timeout:.0f} s") from exc
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise StackError(f"{what} failed (exit {proc.returncode}): {' | '.join(detail)}")
    return proc


# --------------------------------------------------------------------------------------------
# Apache Kafka


def new_cluster_id(random_uuid: Callable[[], uuid.UUID] | None = None) -> str:
    """A KRaft cluster id: 16 random bytes in URL-safe base64 without padding.

    As Kafka's own ``Uuid.randomUuid()``, draw again while the text starts with ``-``: one id
    in 64 does, and ``kafka-storage format -t -…`` reads it as an option and refuses to run.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode((random_uuid or uuid.uuid4)().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


class Kafka:
    """One KRaft node (broker and controller in one JVM) run from Maven Central jars.

    ``node_id`` 1 keeps the single broker's folders (``kafka/data``, ``kafka/server.properties``,
    ``kafka/kafka.pid``, ``logs/kafka``); broker ``k`` of a cluster has ``kafka/broker-k/…`` and
    ``logs/kafka-k``. ``brokers``: the size of the cluster it belongs to (its controller quorum).
    """

    def __init__(self, paths: Paths, settings: StackSettings, node_id: int = 1, brokers: int = 1) -> None:
        self.paths = paths
        self.settings = settings
        self.node_id = node_id
        self.brokers = brokers

    @property
    def port(self) -> int:
        return broker_port(self.settings, self.node_id)

    @property
    def controller_port(self) -> int:
        return broker_port(self.settings, self.node_id, controller=True)

    @property
    def address(self) -> str:
        return f"localhost:{self.port}"

    @property
    def dir(self) -> Path:
        return self.paths.kafka if self.node_id == 1 else self.paths.kafka / f"broker-{self.node_id}"

    @property
    def data(self) -> Path:
        return self.paths.kafka_data if self.node_id == 1 else self.dir / "data"

    @property
    def conf(self) -> Path:
        return self.paths.kafka_conf if self.node_id == 1 else self.dir / "server.properties"

    @property
    def pid_file(self) -> Path:
        return self.paths.kafka_pid if self.node_id == 1 else self.dir / "kafka.pid"

    @property
    def log_dir(self) -> Path:
        return self.paths.logs / ("kafka" if self.node_id == 1 else f"kafka-{self.node_id}")

    # -- jars
    def _pom(self) -> Path:
        return self.paths.deploy / "kafka" / "pom.xml"

    def _pom_digest(self) -> str:
        return hashlib.sha256(self._pom().read_bytes()).hexdigest()

    def jars_ready(self) -> bool:
        marker = self.paths.kafka_libs / ".pom-sha256"
        return marker.is_file() and marker.read_text().strip() == self._pom_digest()

    def ensure_jars(self, say: Callable[[str], None]) -> None:
        """Resolve the broker's jars from Maven Central once; reuse them while the pom is unchanged."""
        if self.jars_ready():
            return
        mvn = shutil.which("mvn")
        if mvn is None:
            raise StackError(
                "Maven (mvn) not found: it resolves Kafka's jars once; install it "
                "(Debian: apt-get install maven)"
            )
        say("resolving Apache Kafka jars from Maven Central (first run only)…")
        staging = self.paths.kafka / "libs.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        run(
            [mvn, "-q", "-B", "-f", str(self._pom()), "dependency:copy-dependencies",
             "-DincludeScope=runtime", f"-DoutputDirectory={staging}"],
            log=self.paths.logs / "maven.log", timeout=1200, what="resolving Kafka jars with Maven",
        )
        (staging / ".pom-sha256").write_text(self._pom_digest())
        shutil.rmtree(self.paths.kafka_libs, ignore_errors=True)
        staging.rename(self.paths.kafka_libs)

    # -- configuration and storage
    def _java(self) -> str:
        home = os.environ.get("JAVA_HOME")
        java = str(Path(home) / "bin" / "java") if home and (Path(home) / "bin" / "java").is_file() \
            else shutil.which("java")
        if java is None:
            raise StackError(
                "Java not found: Apache Kafka 4 needs Java 17 or newer; install it "
                "(Debian: apt-get install openjdk-17-jre-headless)"
            )
        return java

    def _java_cmd(self, main: str, *args: str, heap: str = "256m") -> list[str]:
        return [
            self._java(), f"-Xmx{heap}", "-Xms128m", "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.paths.deploy / 'kafka' / 'log4j2.yaml'}",
            f"-Dkafka.logs.dir={self.log_dir}",
            "-cp", f"{self.paths.kafka_libs}/*", main, *args,
        ]

    def config_overrides(self) -> dict[str, str]:
        """What this stack sets over deploy/kafka/server.properties: the node's id, listeners,
        folder and controller quorum; in a cluster of three or more, three replicas of every
        internal topic and ``min.insync.replicas=2`` (a write is acknowledged by two brokers)."""
        s = self.settings
        n = self.brokers
        voters = ",".join(f"{i}@localhost:{broker_port(s, i, controller=True)}" for i in range(1, n + 1))
        out = {
            "node.id": str(self.node_id),
            "listeners": f"PLAINTEXT://localhost:{self.port},CONTROLLER://localhost:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://localhost:{self.port}",
            "controller.quorum.voters": voters,
            "log.dirs": str(self.data),
        }
        if n > 1:
            rf, isr = str(replication_factor(n)), str(min_insync_replicas(n))
            out.update({
                "offsets.topic.replication.factor": rf,
                "transaction.state.log.replication.factor": rf,
                "transaction.state.log.min.isr": isr,
                "share.coordinator.state.topic.replication.factor": rf,
                "share.coordinator.state.topic.min.isr": isr,
                "default.replication.factor": rf,
                "min.insync.replicas": isr,
            })
        return out

    def write_config(self) -> None:
        """The checked-in server.properties, plus the listeners and folders of this stack."""
        base = (self.paths.deploy / "kafka" / "server.properties").read_text()
        overrides = self.config_overrides()
        lines = [ln for ln in base.splitlines() if ln.split("=", 1)[0].strip() not in overrides]
        lines.append("\n# Written by kvflow/stack.py for this stack:")
        lines.extend(f"{k}={v}" for k, v in overrides.items())
        self.dir.mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join(lines) + "\n")

    def formatted(self) -> bool:
        return (self.data / "meta.properties").is_file()

    def ensure_formatted(self, cluster_id: str | None = None) -> None:
        if self.formatted():
            return
        cluster_id = cluster_id or new_cluster_id()
        self.data.mkdir(parents=True, exist_ok=True)
        run(
            self._java_cmd("kafka.tools.StorageTool", "format", "-t", cluster_id,
                           "-c", str(self.conf), "--ignore-formatted"),
            log=self.paths.logs / "kafka-format.log", timeout=120,
            what="formatting Kafka storage",
        )

    # -- process
    def pid(self) -> int | None:
        """The pid of the broker this stack started, if it still runs."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if pid_alive(pid) and "kafka.Kafka" in pid_cmdline(pid) and str(self.conf) in pid_cmdline(pid):
            return pid
        return None

    def ready(self, brokers: int = 1) -> bool:
        """The broker answers metadata requests, listing at least ``brokers`` brokers."""
        from confluent_kafka.admin import AdminClient

        if not port_open(self.port):
            return False
        try:
            md = AdminClient({"bootstrap.servers": self.address, "socket.timeout.ms": 2000}).list_topics(timeout=3)
        except Exception:
            return False
        return len(md.brokers) >= max(1, brokers)

    def spawn(self, say: Callable[[str], None]) -> int:
        """Start the broker's JVM (its config written, its storage formatted); return its pid."""
        if port_open(self.port):
            raise StackError(
                f"port {self.port} is taken by another process; stop it or set "
                "KVFLOW_STACK_KAFKA_PORT" + ("" if self.brokers == 1 else " / KVFLOW_STACK_KAFKA_PORTS")
            )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.write_config()
        self.ensure_formatted()
        say(f"starting Apache Kafka (KRaft) broker {self.node_id} on {self.address}…")
        # NOTE: posix_spawn with setsid, not Popen: the broker outlives this process (it is
        # stopped by `down`, through its pid file) and must not die with our terminal.
        heap = self.settings.kafka_heap if self.brokers == 1 else self.settings.kafka_cluster_heap
        argv = self._java_cmd("kafka.Kafka", str(self.conf), heap=heap)
        stdout = str(self.log_dir / "stdout.log")
        pid = os.posix_spawn(argv[0], argv, dict(os.environ), setsid=True, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ])
        self.pid_file.write_text(str(pid))
        return pid

    def check_exited(self, pid: int) -> None:
        """Raise StackError if the broker we spawned has exited."""
        with contextlib.suppress(ChildProcessError):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                raise StackError(
                    f"Kafka broker {self.node_id} exited with status {os.waitstatus_to_exitcode(status)}; see "
                    f"{self.log_dir}:\n" + tail(self.log_dir / "server.log")
                )

    def up(self, say: Callable[[str], None]) -> str:
        if self.pid() is not None:
            if not wait_until(self.ready, self.settings.start_timeout_s):
                raise StackError(f"Kafka (pid {self.pid()}) runs but does not answer on {self.address}")
            return "already running"
        self._java()
        self.ensure_jars(say)
        pid = self.spawn(say)

        def ok() -> bool:
            self.check_exited(pid)
            return self.ready()

        if not wait_until(ok, self.settings.start_timeout_s, interval=0.5):
            raise StackError(f"Kafka did not answer on {self.address} within "
                             f"{self.settings.start_timeout_s:.0f} s; see {self.log_dir}")
        return "started"

    def ensure_topics(self) -> None:
        """kvflow's topics (kv-events, node-stats, …) with their default names and settings."""
        ensure_stack_topics(self.address, self.brokers)

    def down(self) -> str:
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return "not running"
        os.kill(pid, signal.SIGTERM)
        if not wait_until(lambda: not pid_alive(pid), 60):
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not pid_alive(pid), 10)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        self.pid_file.unlink(missing_ok=True)
        return f"stopped (pid {pid})"


def broker_port(s: StackSettings, node_id: int, *, controller: bool = False) -> int:
    """Broker ``node_id``'s (1-based) client or controller port: from the explicit lists, else
    the base port + 2 × (node_id - 1) (9092, 9094, 9096; controllers 9093, 9095, 9097)."""
    ports = s.kafka_controller_ports if controller else s.kafka_ports
    if len(ports) >= node_id:
        return ports[node_id - 1]
    return (s.kafka_controller_port if controller else s.kafka_port) + 2 * (node_id - 1)


def replication_factor(brokers: int) -> int:
    """Replicas of each topic: 3, or every broker of a smaller cluster."""
    return min(3, brokers)


def min_insync_replicas(brokers: int) -> int:
    """Replicas that must have a write before it is acknowledged (acks=all): 2 of 3, else 1."""
    return 2 if brokers >= 3 else 1


def ensure_stack_topics(bootstrap: str, brokers: int) -> None:
    """kvflow's topics with their default names, replicated over the cluster (``replication_factor``;
    ``min.insync.replicas`` is the brokers' default, set in their config)."""
    from eventbus.config import KafkaSettings
    from eventbus.kafka import ensure_topics

    try:
        ensure_topics(KafkaSettings(bootstrap=bootstrap, replication_factor=replication_factor(brokers)))
    except Exception as exc:  # a broker that answers metadata but not admin requests
        raise StackError(f"creating kvflow's topics on {bootstrap} failed: {exc}") from exc


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


# --------------------------------------------------------------------------------------------
# PostgreSQL


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
                "\n# kvflow local stack (kvflow/stack.py)\n"
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


# --------------------------------------------------------------------------------------------
# The stack


@dataclass
class ServiceStatus:
    name: str
    state: str
    address: str
    pid: int | None
    detail: str


class Stack:
    """Kafka (one broker or a cluster), PostgreSQL and its optional standby, for development,
    tests, CI and the demo."""

    def __init__(self, settings: StackSettings | None = None) -> None:
        self.settings = settings or StackSettings()
        project = project_dir()
        home = self.settings.home or project / ".kvflow"
        self.paths = Paths(project=project, home=home.resolve())
        self.kafka = KafkaCluster(self.paths, self.settings)
        self.postgres = Postgres(self.paths, self.settings)
        self.replica = PostgresReplica(self.postgres)

    @property
    def database_url(self) -> str:
        return self.postgres.external_url or (
            f"postgresql+asyncpg://kvflow:kvflow@localhost:{self.settings.postgres_port}/kvflow"
        )

    @property
    def wants_replica(self) -> bool:
        """A standby is asked for (``--replica``), or was made before and not declined."""
        if self.settings.replica is not None:
            return self.settings.replica
        return not self.postgres.external_url and self.replica.made()

    @property
    def reader_url(self) -> str:
        """Where routers read: the standby when there is one, else the primary's read-only role."""
        if self.wants_replica:
            return self.replica.reader_url
        return os.environ.get("KVFLOW_DATABASE_READER_URL") or (
            f"postgresql+asyncpg://kvflow_reader:kvflow_reader@localhost:{self.settings.postgres_port}/kvflow"
        )

    def up(self, say: Callable[[str], None] = lambda _m: None) -> dict[str, str]:
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        result = {"postgres": self.postgres.up(say)}
        if self.wants_replica:
            result["replica"] = self.replica.up(say)
        result["kafka"] = self.kafka.up(say)
        self.kafka.ensure_topics()
        return result

    def down(self) -> dict[str, str]:
        errors: list[str] = []
        result: dict[str, str] = {}
        services: list[tuple[str, KafkaCluster | Postgres | PostgresReplica]] = [("kafka", self.kafka)]
        if self.replica.made():
            services.append(("replica", self.replica))
        services.append(("postgres", self.postgres))
        for name, svc in services:
            try:
                result[name] = svc.down()
            except StackError as exc:  # stop the others anyway
                errors.append(str(exc))
        if errors:
            raise StackError("; ".join(errors))
        return result

    def status(self) -> list[ServiceStatus]:
        out = self.kafka.status()
        if self.postgres.external_url:
            out.append(ServiceStatus("postgres", "external", redact_url(self.postgres.external_url), None,
                                     "KVFLOW_DATABASE_URL"))
            return out
        try:
            running = self.postgres.running()
        except StackError:
            running = False
        out.append(ServiceStatus(
            "postgres", "running" if running and self.postgres.ready() else "stopped",
            f"localhost:{self.settings.postgres_port}", self.postgres.pid() if running else None,
            f"data {self.postgres.data}",
        ))
        if self.wants_replica:
            try:
                standby = self.replica.running()
            except StackError:
                standby = False
            out.append(ServiceStatus(
                "postgres-replica", "running" if standby and self.replica.ready() else "stopped",
                f"localhost:{self.replica.port}", self.replica.pid() if standby else None,
                f"standby of :{self.postgres.port}, data {self.replica.data}",
            ))
        return out


def redact_url(url: str) -> str:
    """A database URL without its password."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparsable URL>"
