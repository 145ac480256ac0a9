"""kvflow's schema migrations (Alembic, async ``env.py``).

``upgrade``/``downgrade``/``current`` run Alembic programmatically against a URL (default
``KVFLOW_DATABASE_URL``); ``alembic upgrade head`` from the checkout does the same.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from state_store.config import DatabaseSettings, async_url

HERE = Path(__file__).resolve().parent


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("path_separator", "os")
    # NOTE: '%' would be read as interpolation by configparser.
    cfg.set_main_option("sqlalchemy.url", _url(url).replace("%", "%%"))
    return cfg


def _url(url: str | None) -> str:
    return async_url(url) if url else DatabaseSettings().writer()


def _in_thread(fn: object) -> None:
    """Run a blocking Alembic command; off the loop when called inside one (env.py uses asyncio.run)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        fn()  # type: ignore[operator]
        return
    import threading

    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def upgrade(revision: str = "head", url: str | None = None) -> None:
    cfg = alembic_config(url)
    _in_thread(lambda: command.upgrade(cfg, revision))


def downgrade(revision: str, url: str | None = None) -> None:
    cfg = alembic_config(url)
    _in_thread(lambda: command.downgrade(cfg, revision))


async def current(url: str | None = None) -> str | None:
    engine = create_async_engine(_url(url))
    try:
        async with engine.connect() as conn:
            exists = (await conn.execute(text("SELECT to_regclass('alembic_version')"))).scalar()
            if exists is None:
                return None
            return (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalar()
    finally:
        await engine.dispose()
