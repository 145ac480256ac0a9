"""Kafka with SASL/SCRAM, in the clear and over TLS: every kvflow client (the node's producer, the
faust materializer, the tail consumer) works through configuration alone; a wrong password is
refused. The TLS certificates come from deploy/kafka/make-tls.sh, the script the compose override
(docker-compose.sasl.yml) documents, and the broker reads them the way that override configures it."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr

from eventbus.config import KafkaSecurityProtocol, KafkaSettings
from eventbus.kafka import ensure_topics
from kvflow.stack import new_cluster_id, project_dir, run
from kvflow.tail import tail
from tests.reliability.test_faults import PrivateKafka
from tests.support import CoreNode, applied_through, history_duplicates, materializer, sql_blocks, wait_for

pytestmark = pytest.mark.integration

USER, PASSWORD = "kvflow", "s3cr3t-" + uuid.uuid4().hex[:8]


class ScramKafka(PrivateKafka):
    def __init__(self, home: Path, protocol: KafkaSecurityProtocol, tls_dir: Path | None = None) -> None:
        super().__init__(home)
        self.protocol, self.tls_dir = protocol, tls_dir

    def write_config(self) -> None:
        super().write_config()
        s = self.settings
        keep = [ln for ln in self.paths.kafka_conf.read_text().splitlines()
                if not ln.startswith(("listeners=", "advertised.listeners=", "listener.security.protocol.map=",
                                      "inter.broker.listener.name="))]
        name = self.protocol.value
        keep += [
            f"listeners={name}://localhost:{s.kafka_port},CONTROLLER://localhost:{s.kafka_controller_port}",
            f"advertised.listeners={name}://localhost:{s.kafka_port}",
            f"listener.security.protocol.map={name}:{name},CONTROLLER:PLAINTEXT",
            f"inter.broker.listener.name={name}",
            "sasl.enabled.mechanisms=SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512",
            f"listener.name.{name.lower()}.scram-sha-512.sasl.jaas.config="
            'org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="admin-pw";',
        ]
        if self.tls_dir is not None:  # as docker-compose.sasl.yml: one PEM keystore, the CA to trust
            keep += ["ssl.keystore.type=PEM", f"ssl.keystore.location={self.tls_dir / 'broker.pem'}",
                     "ssl.truststore.type=PEM", f"ssl.truststore.location={self.tls_dir / 'ca.pem'}"]
        self.paths.kafka_conf.write_text("\n".join(keep) + "\n")

    def ensure_formatted(self) -> None:
        if (self.paths.kafka_data / "meta.properties").is_file():
            return
        self.paths.kafka_data.mkdir(parents=True, exist_ok=True)
        cluster_id = new_cluster_id()
        run(self._java_cmd("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(self.paths.kafka_conf),
                           "--add-scram", "SCRAM-SHA-512=[name=admin,password=admin-pw]",
                           "--add-scram", f"SCRAM-SHA-512=[name={USER},password={PASSWORD}]"),
            timeout=120, what="formatting Kafka storage with SCRAM users")

    def ready(self) -> bool:
        from confluent_kafka.admin import AdminClient

        try:
            md = AdminClient(self.sasl().librdkafka(**{"socket.timeout.ms": 2000})).list_topics(timeout=3)
        except Exception:
            return False
        return bool(md.brokers)

    def sasl(self, password: str = PASSWORD) -> KafkaSettings:
        return KafkaSettings(bootstrap=self.address, security_protocol=self.protocol,
                             sasl_mechanism="SCRAM-SHA-512", sasl_username=USER, sasl_password=SecretStr(password),
                             ssl_ca_location=str(self.tls_dir / "ca.pem") if self.tls_dir else None)


def make_tls(dest: Path) -> Path:
    """Run the project's certificate script on a copy, so nothing is written into the checkout."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    script = dest / "make-tls.sh"
    shutil.copy(project_dir() / "deploy" / "kafka" / "make-tls.sh", script)
    subprocess.run(["sh", str(script)], check=True, capture_output=True, timeout=60)
    return dest / "tls"


@pytest.mark.parametrize("protocol", [KafkaSecurityProtocol.SASL_PLAINTEXT, KafkaSecurityProtocol.SASL_SSL])
def test_every_client_speaks_sasl_scram(protocol, tmp_path: Path, kafka_bootstrap, migrated_database_url):
    tls_dir = make_tls(tmp_path) if protocol is KafkaSecurityProtocol.SASL_SSL else None
    broker = ScramKafka(tmp_path / "kafka-home", protocol, tls_dir)
    try:
        broker.up(lambda _m: None)
        suffix = uuid.uuid4().hex[:6]
        k = broker.sasl().model_copy(update={"events_topic": f"ev-{suffix}", "stats_topic": f"st-{suffix}",
                                             "dlq_topic": f"dlq-{suffix}", "control_topic": f"ctl-{suffix}"})
        ensure_topics(k)
        node = CoreNode(k, "node-sasl", seed=4)
        node.run(60)
        node.finish()
        tls_env = {"KVFLOW_KAFKA_SSL_CA_LOCATION": str(tls_dir / "ca.pem")} if tls_dir else {}
        mat = materializer(k, migrated_database_url, tmp_path, KVFLOW_KAFKA_SECURITY_PROTOCOL=protocol.value,
                           KVFLOW_KAFKA_SASL_MECHANISM="SCRAM-SHA-512", KVFLOW_KAFKA_SASL_USERNAME=USER,
                           KVFLOW_KAFKA_SASL_PASSWORD=PASSWORD, **tls_env).start()
        try:
            wait_for(lambda: applied_through(migrated_database_url, node), 90, what="the materializer over SASL")
            assert sql_blocks(migrated_database_url, "node-sasl") == node.truth()
            assert history_duplicates(migrated_database_url, "node-sasl") == 0
            assert PASSWORD not in mat.tail(500)  # secrets are never logged
        finally:
            mat.stop()
        lines: list[str] = []
        summary = tail(k, from_beginning=True, idle_timeout_s=5, emit=lines.append)
        assert sum(summary.events.values()) == node.core.last_event_id + 1

        from confluent_kafka.admin import AdminClient

        wrong = broker.sasl("wrong-password").librdkafka(**{"socket.timeout.ms": 2000})
        with pytest.raises(Exception, match=r"(?i)auth|timed out|transport"):
            AdminClient(wrong).list_topics(timeout=5)
    finally:
        broker.close()
