"""The local stack's settings (``KVFLOW_STACK_…``), its error, where it lives (the checkout and
the state folder) and the status line of one service."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


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

    ``KVFLOW_PROJECT_DIR`` wins; otherwise the folder above the ``kvflow`` package (an editable install, as
    ``make`` creates), then the current directory and its parents.
    """
    candidates: list[Path] = []
    if env := os.environ.get("KVFLOW_PROJECT_DIR"):
        candidates.append(Path(env))
    candidates.append(Path(__file__).resolve().parents[2])  # kvflow/stack/settings.py → the checkout
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


@dataclass
class ServiceStatus:
    name: str
    state: str
    address: str
    pid: int | None
    detail: str
