"""The local stack: configuration and errors (unit), a whole second stack up and down (integration)."""

from __future__ import annotations

import base64
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvflow.stack import (
    Kafka,
    Paths,
    Postgres,
    Stack,
    StackError,
    StackSettings,
    find_pg_bindir,
    new_cluster_id,
    pid_alive,
    port_open,
    project_dir,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_broker_config_is_the_checked_in_file_plus_this_stacks_listeners(tmp_path):
    settings = StackSettings(home=tmp_path, kafka_port=19092, kafka_controller_port=19093)
    paths = Paths(project=project_dir(), home=tmp_path)
    paths.kafka.mkdir(parents=True)
    Kafka(paths, settings).write_config()
    props = dict(
        line.split("=", 1) for line in paths.kafka_conf.read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert props["listeners"] == "PLAINTEXT://localhost:19092,CONTROLLER://localhost:19093"
    assert props["advertised.listeners"] == "PLAINTEXT://localhost:19092"
    assert props["controller.quorum.voters"] == "1@localhost:19093"
    assert props["log.dirs"] == str(paths.kafka_data)
    assert props["process.roles"] == "broker,controller"
    assert props["auto.create.topics.enable"] == "false"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert props["offsets.topic.replication.factor"] == "1"
    # Each key once: the overrides replaced the placeholders.
    lines = paths.kafka_conf.read_text().splitlines()
    keys = [ln.split("=", 1)[0] for ln in lines if "=" in ln and not ln.startswith("#")]
    assert len(keys) == len(set(keys))


# 0xF8 in the first byte is base64 "-"; Kafka's own Uuid.randomUuid() never makes such an id.
_DASH_UUID = uuid.UUID(bytes=b"\xf8" + bytes(15))


def test_cluster_id_never_starts_with_a_dash():
    draws = iter([_DASH_UUID, uuid.UUID(int=1)])
    assert base64.urlsafe_b64encode(_DASH_UUID.bytes).startswith(b"-")
    assert new_cluster_id(lambda: next(draws)) == "AAAAAAAAAAAAAAAAAAAAAQ"
    ids = [new_cluster_id() for _ in range(1000)]
    assert {len(i) for i in ids} == {22} and not [i for i in ids if i.startswith("-")]


@pytest.mark.integration
def test_storage_is_formatted_even_when_the_first_id_drawn_starts_with_a_dash(tmp_path, monkeypatch, kafka_bootstrap):
    """Real `kafka-storage format` reads `-t -…` as an option; one random id in 64 starts with `-`."""
    settings = StackSettings(home=tmp_path, kafka_port=_free_port(), kafka_controller_port=_free_port())
    paths = Paths(project=project_dir(), home=tmp_path)
    paths.kafka.mkdir(parents=True)
    paths.kafka_libs.symlink_to(Stack(StackSettings()).paths.kafka_libs)  # the running stack's jars
    kafka = Kafka(paths, settings)
    kafka.write_config()
    draws = iter([_DASH_UUID, uuid.UUID(int=1)])
    monkeypatch.setattr("kvflow.stack.kafka.uuid.uuid4", lambda: next(draws))
    kafka.ensure_formatted()
    meta = dict(line.split("=", 1) for line in (paths.kafka_data / "meta.properties").read_text().splitlines()
                if "=" in line and not line.startswith("#"))
    assert meta["cluster.id"] == "AAAAAAAAAAAAAAAAAAAAAQ"


def test_missing_java_is_one_line_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    kafka = Kafka(Paths(project=project_dir(), home=tmp_path), StackSettings(home=tmp_path))
    with pytest.raises(StackError, match=r"^Java not found: .*apt-get install openjdk-17-jre-headless\)$"):
        kafka._java()


def test_missing_maven_is_one_line_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    kafka = Kafka(Paths(project=project_dir(), home=tmp_path), StackSettings(home=tmp_path))
    with pytest.raises(StackError, match=r"^Maven \(mvn\) not found: .*apt-get install maven\)$"):
        kafka.ensure_jars(say=lambda _m: None)


def test_missing_postgres_binaries_are_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("KVFLOW_PG_BINDIR", raising=False)
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter(()))
    with pytest.raises(StackError, match=r"^PostgreSQL server binaries .* not found; install them"):
        find_pg_bindir()


def test_cli_prints_missing_tool_in_one_line_without_a_traceback(tmp_path):
    env = {"PATH": str(tmp_path), "KVFLOW_STACK_HOME": str(tmp_path), "KVFLOW_PG_BINDIR": str(tmp_path / "nope"),
           "KVFLOW_STACK_POSTGRES_PORT": str(_free_port()), "KVFLOW_STACK_KAFKA_PORT": str(_free_port())}
    proc = subprocess.run([sys.executable, "-m", "kvflow.cli", "stack", "up"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("kvflow stack up: ")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.integration
def test_a_second_stack_comes_up_idempotently_and_down_completely(tmp_path, monkeypatch, kafka_bootstrap, pg_owner_url):
    """A whole stack in a temporary folder on free ports, next to the one `make test` runs."""
    from confluent_kafka.admin import AdminClient

    monkeypatch.delenv("KVFLOW_DATABASE_URL", raising=False)
    settings = StackSettings(home=tmp_path / "home", kafka_port=_free_port(),
                             kafka_controller_port=_free_port(), postgres_port=_free_port())
    stack = Stack(settings)
    pg_base = stack.postgres.base
    try:
        assert stack.up() == {"postgres": "started", "kafka": "started"}
        assert stack.up() == {"postgres": "already running", "kafka": "already running"}
        status = {s.name: s for s in stack.status()}
        assert status["kafka"].state == "running" and status["postgres"].state == "running"
        kafka_pid, pg_pid = status["kafka"].pid, status["postgres"].pid
        assert kafka_pid and pg_pid

        md = AdminClient({"bootstrap.servers": f"localhost:{settings.kafka_port}"}).list_topics(timeout=10)
        assert [b.port for b in md.brokers.values()] == [settings.kafka_port]

        psql = shutil.which("psql") or str(find_pg_bindir() / "psql")
        out = subprocess.run(
            [psql, "-X", "-At", "-h", "localhost", "-p", str(settings.postgres_port), "-U", "kvflow", "-d", "kvflow",
             "-c", "SELECT current_user, (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"],
            env={"PGPASSWORD": "kvflow", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True,
        )
        assert out.stdout.strip() == "kvflow|f"
        assert (settings.home / "logs" / "kafka" / "server.log").is_file()
    finally:
        result = stack.down()
    assert result["kafka"].startswith("stopped") and result["postgres"].startswith("stopped")
    assert not port_open(settings.kafka_port) and not port_open(settings.postgres_port)
    assert not pid_alive(kafka_pid) and not pid_alive(pg_pid)
    assert stack.down() == {"kafka": "not running", "postgres": "not running"}
    assert {s.state for s in stack.status()} == {"stopped"}
    if not pg_base.is_relative_to(tmp_path):
        shutil.rmtree(pg_base, ignore_errors=True)


def test_postgres_data_folder_must_be_reachable_by_the_postgres_user(tmp_path):
    pg = Postgres(Paths(project=project_dir(), home=tmp_path / "h"), StackSettings(home=tmp_path / "h"))
    import os

    if os.geteuid() != 0:
        assert pg.base == tmp_path / "h" / "postgres"
    else:
        # pytest's tmp folders are 0700 and owned by root: the cluster goes elsewhere.
        tmp_path.chmod(0o700)
        assert pg.base.parent == Path("/var/tmp")
