"""Apache Kafka for the local stack: one KRaft node (broker and controller in one JVM) run from
jars resolved from Maven Central through ``deploy/kafka/pom.xml``, its storage formatted with
Kafka's own ``StorageTool``; the ports, replication settings and topics of a cluster of them."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
import signal
import uuid
from collections.abc import Callable
from pathlib import Path

from kvflow.stack.procs import pid_alive, pid_cmdline, port_open, run, tail, wait_until
from kvflow.stack.settings import Paths, StackError, StackSettings


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
        lines.append("\n# Written by kvflow/stack/kafka.py for this stack:")
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
