"""Short-lived databases on the same server (tests, benchmarks): create, name, drop.

The writer role of the local stack has CREATEDB; a database it creates, it owns and may drop.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import asyncpg
from sqlalchemy.engine import make_url

from state_store.config import plain_dsn


def with_database(url: str, name: str) -> str:
    """``url`` pointing at database ``name`` instead."""
    return make_url(url).set(database=name).render_as_string(hide_password=False)


async def create_database(url: str, name: str) -> None:
    conn = await asyncpg.connect(plain_dsn(url), timeout=10)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def drop_database(url: str, name: str) -> None:
    """Drop ``name``, ending our own leftover sessions (e.g. of a process killed with -9).

    NOTE: not ``WITH (FORCE)``: that must also signal the autovacuum workers a big insert wakes
    (superuser processes), which our role may not; a plain DROP cancels those by itself.
    """
    conn = await asyncpg.connect(plain_dsn(url), timeout=10)
    try:
        for attempt in range(40):
            await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE datname = $1 AND usename = current_user AND pid <> pg_backend_pid()", name)
            try:
                await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
                return
            except asyncpg.ObjectInUseError:
                if attempt == 39:
                    raise
                await asyncio.sleep(0.25)
    finally:
        await conn.close()


@contextmanager
def scratch_database(admin_url: str, prefix: str, *, migrate: bool = True) -> Iterator[str]:
    """A fresh database (with kvflow's schema unless ``migrate=False``), dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    asyncio.run(create_database(admin_url, name))
    url = with_database(admin_url, name)
    try:
        if migrate:
            from migrations import upgrade

            upgrade("head", url=url)
        yield url
    finally:
        asyncio.run(drop_database(admin_url, name))
