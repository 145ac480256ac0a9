"""The stack itself: Kafka (one broker or a cluster), PostgreSQL and its optional standby, brought
up, down and reported together."""

from __future__ import annotations

import os
from collections.abc import Callable

from kvflow.stack.cluster import KafkaCluster
from kvflow.stack.postgres import Postgres
from kvflow.stack.replica import PostgresReplica
from kvflow.stack.settings import Paths, ServiceStatus, StackError, StackSettings, project_dir


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
