"""The state store's settings: the database (``KVFLOW_DATABASE_…``) and the materializer
(``KVFLOW_MATERIALIZER_…``).

Two roles, two URLs (docs/architecture.md#postgresql): the owner/writer role used by migrations and the
materializer, and the read-only role used by the routing API and analysts.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url

from eventbus.config import Environment, check_secret, read_secret_file

DEFAULT_URL = "postgresql+asyncpg://kvflow:kvflow@localhost:55432/kvflow"
DEFAULT_READER_URL = "postgresql+asyncpg://kvflow_reader:kvflow_reader@localhost:55432/kvflow"


def async_url(url: str) -> str:
    """Normalize a PostgreSQL URL to SQLAlchemy's asyncpg dialect."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres", "postgresql+psycopg2", "postgresql+psycopg"):
        u = u.set(drivername="postgresql+asyncpg")
    return u.render_as_string(hide_password=False)


def plain_dsn(url: str) -> str:
    """The same URL as a libpq/asyncpg DSN (``postgresql://…``), for raw asyncpg connections."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class DatabaseSettings(BaseSettings):
    """Where PostgreSQL is and how to connect."""

    model_config = SettingsConfigDict(env_prefix="KVFLOW_DATABASE_", extra="ignore")

    url: SecretStr = Field(
        default=SecretStr(DEFAULT_URL),
        description="Owner/writer role URL (migrations, materializer). Env KVFLOW_DATABASE_URL.",
    )
    url_file: str | None = Field(default=None, description="File holding the writer URL.")
    reader_url: SecretStr = Field(
        default=SecretStr(DEFAULT_READER_URL),
        description="Read-only role URL (routing API). Env KVFLOW_DATABASE_READER_URL.",
    )
    reader_url_file: str | None = Field(default=None, description="File holding the reader URL.")
    pool_size: int = Field(default=5, ge=1, description="Connections per pool.")
    statement_timeout_ms: int = Field(
        default=30_000, ge=0, description="statement_timeout of every session (0: none)."
    )

    @model_validator(mode="after")
    def _files(self) -> DatabaseSettings:
        if (v := read_secret_file(self.url_file)) is not None:
            self.url = v
        if (v := read_secret_file(self.reader_url_file)) is not None:
            self.reader_url = v
        return self

    def writer(self) -> str:
        return async_url(self.url.get_secret_value())

    def reader(self) -> str:
        return async_url(self.reader_url.get_secret_value())

    def check(self, env: Environment, *, writer: bool = True, reader: bool = True) -> None:
        """Refuse placeholder database passwords outside development, for the roles a service uses."""
        used = [("KVFLOW_DATABASE_URL", self.url)] if writer else []
        if reader:
            used.append(("KVFLOW_DATABASE_READER_URL", self.reader_url))
        for name, url in used:
            pw = make_url(url.get_secret_value()).password
            check_secret(f"the password in {name}", SecretStr(pw) if pw else None, env)


class MaterializerSettings(BaseSettings):
    """``KVFLOW_MATERIALIZER_…``"""

    model_config = SettingsConfigDict(env_prefix="KVFLOW_MATERIALIZER_", extra="ignore")

    group_id: str = Field(default="kvflow-materializer", description="Kafka consumer group (and faust app id).")
    batch_max: int = Field(default=2000, ge=1, description="Messages per transaction at most.")
    batch_within_s: float = Field(default=0.05, gt=0, description="Longest wait to fill a batch.")
    stale_after_s: float = Field(default=6.0, gt=0, description="No heartbeat or event for this long: stale.")
    gone_after_s: float = Field(default=60.0, gt=0, description="Stale this long: gone, its blocks cleared.")
    retention_days: float = Field(default=7.0, gt=0, description="History kept in block_events.")
    resync_cooldown_s: float = Field(default=5.0, ge=0, description="Ask a node for a snapshot at most this often.")
    resync_retry_s: float = Field(default=5.0, gt=0, description="A node still resyncing this long after a snapshot "
                                                                 "request is asked again; each wait twice the last.")
    resync_retry_max_s: float = Field(default=60.0, gt=0, description="The longest wait between two snapshot "
                                                                      "requests to a node that stays resyncing.")
    prune_gone_after_s: float = Field(default=3600.0, ge=0, description="A node gone (and silent) this long loses "
                                                                        "its nodes row; its history stays (0: never).")
    web_host: str = Field(default="127.0.0.1", description="Bind address of /healthz and /metrics.")
    web_port: int = Field(default=6066, description="Port of /healthz and /metrics (0: no web server).")
    pool_size: int = Field(default=2, ge=1, description="Database connections.")
    datadir: str | None = Field(default=None, description="faust's data folder (no tables are kept there).")
    session_timeout_s: float = Field(default=10.0, description="Kafka group session timeout.")
    fetch_max_wait_ms: int = Field(default=100, ge=1, le=1500,
                                   description="Longest a fetch waits at the broker for partitions without new data.")
    native: bool = Field(default=True, description="Plan plain takes with the compiled hot path when kvflow_native "
                                                   "is installed (state_store/native.py).")
