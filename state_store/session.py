"""The one place that creates database engines and sessions (SQLAlchemy 2, asyncio)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from state_store.config import DatabaseSettings


def make_engine(url: str, settings: DatabaseSettings | None = None, *, app_name: str = "kvflow") -> AsyncEngine:
    s = settings or DatabaseSettings()
    server_settings = {"application_name": app_name}
    if s.statement_timeout_ms:
        server_settings["statement_timeout"] = str(s.statement_timeout_ms)
    return create_async_engine(
        url,
        pool_size=s.pool_size,
        pool_pre_ping=True,
        connect_args={"server_settings": server_settings},
    )


@asynccontextmanager
async def session_scope(engine: AsyncEngine) -> AsyncIterator[AsyncSession]:
    """A session in a transaction: committed on success, rolled back on error."""
    maker = async_sessionmaker(engine, expire_on_commit=False)
    async with maker() as session, session.begin():
        yield session
