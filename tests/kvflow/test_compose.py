"""docker-compose.yml: loaded as `docker compose config` loads it, the check that runs without a
Docker engine.

With the docker compose plugin, by `docker compose` itself; without it, by `kvflow-compose`
(`deploy/compose-check/`, compose-go: the library `docker compose` loads files with), which
`make test` builds. Under `KVFLOW_REQUIRE_SERVICES=1` having neither is a failure.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REQUIRE_SERVICES

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {"POSTGRES_PASSWORD": "pg", "KVFLOW_DB_PASSWORD": "owner", "KVFLOW_DB_READER_PASSWORD": "reader",
           "KVFLOW_ROUTER_API_KEYS": "key", "KVFLOW_NODE_API_KEY": "nodekey"}
#: The extra each kvflow service's image installs (the Dockerfile's KVFLOW_EXTRA): torch only in the nodes'.
EXTRAS = {"migrate": "db", "topics": "kafka", "model": "node", "materializer": "materializer", "router": "router",
          "node-a": "node", "node-b": "node", "node-gpu": "node", "bridge-vllm": "bridge"}
#: kvflow-compose, as `make test` builds it (KVFLOW_COMPOSE_CHECK: another one).
COMPOSE_CHECK = Path(os.environ.get("KVFLOW_COMPOSE_CHECK", ROOT / ".kvflow" / "bin" / "kvflow-compose"))


@functools.cache
def _loader() -> tuple[str, ...]:
    """The command that loads compose files: `docker compose`, else kvflow-compose."""
    if shutil.which("docker") is not None:
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, check=False)
        if probe.returncode == 0:
            return ("docker", "compose")
    if COMPOSE_CHECK.is_file():
        return (str(COMPOSE_CHECK),)
    return ()


def _compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    loader = _loader()
    if not loader:
        message = f"neither the docker compose plugin nor {COMPOSE_CHECK} (make compose-check) is there"
        if REQUIRE_SERVICES:
            pytest.fail(message)
        pytest.skip(message)
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    return subprocess.run([*loader, *args], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, check=False)


def test_compose_config_is_valid_with_secrets():
    proc = _compose("--profile", "gpu", "config", "--format", "json", env=SECRETS)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    services = cfg["services"]
    assert set(services) == {"kafka", "postgres", "migrate", "topics", "model", "materializer", "router",
                             "node-a", "node-b", "node-gpu"}
    # The real model: pulled once into a volume, served by every node, the router's tokenizer.
    assert services["model"]["command"] == ["model", "pull", "smollm2-135m", "--home", "/models"]
    folder = "/models/models/SmolLM2-135M-Instruct"
    for name in ("node-a", "node-b", "node-gpu"):
        assert services[name]["environment"]["KVFLOW_NODE_MODEL_DIR"] == folder, name
        assert services[name]["depends_on"]["model"]["condition"] == "service_completed_successfully", name
        assert [(v["source"], v["target"], v.get("read_only")) for v in services[name]["volumes"]] == [
            ("models", "/models", True)], name
    assert services["router"]["environment"]["KVFLOW_ROUTER_TOKENIZER_DIR"] == folder
    assert services["kafka"]["image"].startswith("apache/kafka:4.")
    assert services["postgres"]["image"] == "postgres:16"
    assert services["node-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert services["materializer"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("kafka", "postgres", "router", "node-a", "node-b", "materializer"):
        assert "healthcheck" in services[name], name
    assert services["router"]["environment"]["KVFLOW_DATABASE_READER_URL"].startswith(
        "postgresql+asyncpg://kvflow_reader:reader@")
    # Least privilege: the writer's credentials only where it writes, none on the nodes.
    has_writer = {name for name, svc in services.items() if "KVFLOW_DATABASE_URL" in svc.get("environment", {})}
    assert has_writer == {"migrate", "materializer"}
    for name in ("node-a", "node-b", "node-gpu", "topics", "model"):
        assert not any(k.startswith("KVFLOW_DATABASE") for k in services[name]["environment"]), name


def test_each_kvflow_service_builds_an_image_with_only_its_extra():
    proc = _compose("-f", "docker-compose.yml", "-f", "docker-compose.vllm.yml", "--profile", "gpu", "config",
                    "--format", "json", env={**SECRETS, "VLLM_MODEL": "Qwen/Qwen2.5-0.5B-Instruct"})
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    built = {name for name, svc in services.items() if "build" in svc}
    assert built == set(EXTRAS)
    images: dict[str, dict[str, str]] = {}
    for name, extra in EXTRAS.items():
        build = services[name]["build"]
        assert Path(build["context"]).resolve() == ROOT, name
        assert build["args"]["KVFLOW_EXTRA"] == extra, name
        # one image, one set of build arguments: no service runs an image built for another extra
        assert images.setdefault(services[name]["image"], build["args"]) == build["args"], name
    assert services["node-gpu"]["build"]["args"]["TORCH_INDEX_URL"].endswith("/cu124")
    assert services["node-gpu"]["image"] != services["node-a"]["image"]
    assert "TORCH_INDEX_URL" not in services["node-a"]["build"]["args"]


def test_compose_refuses_to_start_without_secrets():
    proc = _compose("config", env={})
    assert proc.returncode != 0
    assert "required variable" in proc.stderr and "is missing a value" in proc.stderr


def test_sasl_override_puts_every_kafka_client_on_scram_over_tls():
    env = {**SECRETS, "KVFLOW_KAFKA_PASSWORD": "kafka-pw"}
    proc = _compose("-f", "docker-compose.yml", "-f", "docker-compose.sasl.yml", "config", "--format", "json", env=env)
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    kafka_env = services["kafka"]["environment"]
    protocol_map = kafka_env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
    assert protocol_map == "CONTROLLER:PLAINTEXT,INTERNAL:PLAINTEXT,SASL_SSL:SASL_SSL"
    assert kafka_env["KAFKA_SASL_ENABLED_MECHANISMS"] == "SCRAM-SHA-512"
    for name in ("topics", "materializer", "node-a", "node-b"):
        env_ = services[name]["environment"]
        assert env_["KVFLOW_KAFKA_BOOTSTRAP"] == "kafka:9094", name
        assert env_["KVFLOW_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL", name
        assert env_["KVFLOW_KAFKA_SASL_PASSWORD_FILE"] == "/run/secrets/kafka_password", name
        assert "KVFLOW_KAFKA_SASL_PASSWORD" not in env_, name  # the password travels as a secret only
        assert services[name]["depends_on"]["kafka-users"]["condition"] == "service_completed_successfully", name
    assert "KVFLOW_KAFKA_SECURITY_PROTOCOL" not in services["router"].get("environment", {})
    assert services["node-a"]["environment"]["KVFLOW_NODE_API_KEYS"] == "nodekey"


def test_sasl_override_requires_the_kafka_password():
    proc = _compose("-f", "docker-compose.yml", "-f", "docker-compose.sasl.yml", "config", env=SECRETS)
    assert proc.returncode != 0
    assert "KVFLOW_KAFKA_PASSWORD" in proc.stderr


def test_vllm_override_adds_an_engine_and_its_bridge():
    proc = _compose("-f", "docker-compose.yml", "-f", "docker-compose.vllm.yml", "config", "--format", "json",
                    env={**SECRETS, "VLLM_MODEL": "Qwen/Qwen2.5-0.5B-Instruct"})
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    assert {"vllm", "bridge-vllm"} <= set(services)
    cmd = services["bridge-vllm"]["command"]
    assert cmd[:2] == ["bridge", "vllm"] and "tcp://vllm:5557" in cmd and "tcp://vllm:5558" in cmd
    events = json.loads(services["vllm"]["command"][services["vllm"]["command"].index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] and events["endpoint"] == "tcp://*:5557"
    assert services["bridge-vllm"]["environment"]["KVFLOW_BRIDGE_ENGINE_API_KEY"] == "nodekey"
    missing = _compose("-f", "docker-compose.yml", "-f", "docker-compose.vllm.yml", "config", env=SECRETS)
    assert missing.returncode != 0 and "VLLM_MODEL" in missing.stderr


def test_cluster_override_runs_three_brokers_with_three_replicas_and_two_in_sync():
    proc = _compose("-f", "docker-compose.yml", "-f", "docker-compose.cluster.yml", "--profile", "gpu", "config",
                    "--format", "json", env=SECRETS)
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    brokers = [services[n]["environment"] for n in ("kafka", "kafka-2", "kafka-3")]
    assert [b["KAFKA_NODE_ID"] for b in brokers] == ["1", "2", "3"]
    assert {b["KAFKA_CONTROLLER_QUORUM_VOTERS"] for b in brokers} == {"1@kafka:9093,2@kafka-2:9093,3@kafka-3:9093"}
    assert {b["KAFKA_MIN_INSYNC_REPLICAS"] for b in brokers} == {"2"}
    assert {b["KAFKA_DEFAULT_REPLICATION_FACTOR"] for b in brokers} == {"3"}
    assert len({b["CLUSTER_ID"] for b in brokers}) == 1
    assert [b["KAFKA_ADVERTISED_LISTENERS"] for b in brokers] == [
        "PLAINTEXT://kafka:9092", "PLAINTEXT://kafka-2:9092", "PLAINTEXT://kafka-3:9092"]
    for name in ("topics", "materializer", "node-a", "node-b", "node-gpu"):
        assert services[name]["environment"]["KVFLOW_KAFKA_BOOTSTRAP"] == "kafka:9092,kafka-2:9092,kafka-3:9092", name
    assert services["topics"]["environment"]["KVFLOW_KAFKA_REPLICATION_FACTOR"] == "3"
    assert {"kafka", "kafka-2", "kafka-3"} <= set(services["topics"]["depends_on"])
    # The writer's credentials stay where they were.
    assert "KVFLOW_DATABASE_URL" in services["materializer"]["environment"]
