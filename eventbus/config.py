"""Configuration shared by every component that talks to Kafka.

Settings come from the environment (``KVFLOW_…`` names) through pydantic-settings, one class per
group, each field with a default and a description. Secrets are ``SecretStr`` and may also be read
from files (``KVFLOW_KAFKA_SASL_PASSWORD_FILE``); placeholder secrets are refused outside
development (see :func:`check_secret`).
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Values that mark a secret as a placeholder: acceptable in development only.
PLACEHOLDER_SECRETS = frozenset({"", "changeme", "change-me", "secret", "password", "kvflow",
                                 "kvflow_reader", "admin"})


class Environment(enum.StrEnum):
    """Where kvflow runs. Development relaxes secrets and access checks, loudly."""

    DEVELOPMENT = "development"
    PRODUCTION = "production"


class RuntimeSettings(BaseSettings):
    """Process-wide settings (``KVFLOW_ENV``)."""

    model_config = SettingsConfigDict(env_prefix="KVFLOW_", extra="ignore")

    env: Environment = Field(
        default=Environment.DEVELOPMENT,
        description="`development` allows placeholder secrets and no API keys; `production` refuses them.",
    )


def read_secret_file(path: str | None) -> SecretStr | None:
    """Return the stripped content of a secret file, or None when no file is named."""
    if not path:
        return None
    return SecretStr(Path(path).read_text(encoding="utf-8").strip())


def check_secret(name: str, value: SecretStr | None, env: Environment) -> None:
    """Refuse a missing or placeholder secret outside development.

    Raises:
        ValueError: naming the setting (never the value) and how to set it.
    """
    if env is Environment.DEVELOPMENT:
        return
    if value is None or value.get_secret_value().strip().lower() in PLACEHOLDER_SECRETS:
        raise ValueError(
            f"{name} is missing or a placeholder; set a real secret (environment or *_FILE) "
            f"or run with KVFLOW_ENV=development"
        )


class KafkaSecurityProtocol(enum.StrEnum):
    PLAINTEXT = "PLAINTEXT"
    SSL = "SSL"
    SASL_PLAINTEXT = "SASL_PLAINTEXT"
    SASL_SSL = "SASL_SSL"


class KafkaSettings(BaseSettings):
    """How to reach Kafka and which topics to use (``KVFLOW_KAFKA_…``)."""

    model_config = SettingsConfigDict(env_prefix="KVFLOW_KAFKA_", extra="ignore")

    bootstrap: str = Field(
        default="localhost:9092", description="Comma-separated bootstrap servers."
    )
    events_topic: str = Field(default="kv-events", description="Topic of EventBatch messages.")
    stats_topic: str = Field(default="node-stats", description="Topic of NodeStats heartbeats.")
    dlq_topic: str = Field(default="kv-events-dlq", description="Dead-letter topic for bad input.")
    control_topic: str = Field(
        default="kv-control", description="Commands to nodes (e.g. resync requests)."
    )
    events_partitions: int = Field(default=6, ge=1, description="Partitions of the events topic.")
    replication_factor: int = Field(
        default=0, ge=0, description="Replicas of each topic kvflow creates; 0: 3, or every broker if fewer."
    )
    events_retention_ms: int = Field(
        default=7 * 24 * 3600 * 1000, description="Retention of kv-events and the DLQ."
    )
    stats_retention_ms: int = Field(
        default=24 * 3600 * 1000, description="Retention of node-stats."
    )
    security_protocol: KafkaSecurityProtocol = Field(
        default=KafkaSecurityProtocol.PLAINTEXT, description="Kafka security.protocol."
    )
    sasl_mechanism: str = Field(
        default="SCRAM-SHA-512", description="SASL mechanism when a SASL protocol is used."
    )
    sasl_username: str | None = Field(default=None, description="SASL user name.")
    sasl_password: SecretStr | None = Field(default=None, description="SASL password.")
    sasl_password_file: str | None = Field(
        default=None, description="File holding the SASL password (wins over sasl_password)."
    )
    ssl_ca_location: str | None = Field(
        default=None, description="CA bundle that signs the brokers' certificates."
    )
    client_id: str = Field(default="kvflow", description="Client id reported to the brokers.")

    @model_validator(mode="after")
    def _load_secret_file(self) -> KafkaSettings:
        from_file = read_secret_file(self.sasl_password_file)
        if from_file is not None:
            self.sasl_password = from_file
        return self

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol in (
            KafkaSecurityProtocol.SASL_PLAINTEXT,
            KafkaSecurityProtocol.SASL_SSL,
        )

    def check(self, env: Environment) -> None:
        """Refuse placeholder SASL secrets outside development."""
        if self.uses_sasl:
            check_secret("KVFLOW_KAFKA_SASL_PASSWORD", self.sasl_password, env)

    def librdkafka(self, **extra: Any) -> dict[str, Any]:
        """The configuration dict of a confluent-kafka (librdkafka) client."""
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap,
            "client.id": self.client_id,
            "security.protocol": self.security_protocol.value,
        }
        if self.uses_sasl:
            conf["sasl.mechanism"] = self.sasl_mechanism
            conf["sasl.username"] = self.sasl_username or ""
            conf["sasl.password"] = (
                self.sasl_password.get_secret_value() if self.sasl_password else ""
            )
        if self.ssl_ca_location:
            conf["ssl.ca.location"] = self.ssl_ca_location
        conf.update(extra)
        return conf
