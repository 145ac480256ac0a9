"""The writer's timestamptz codec (a cached encoder, for speed) stores exactly what asyncpg's own does."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta, timezone

import asyncpg
import pytest

from state_store.config import plain_dsn
from state_store.writer import Writer

pytestmark = pytest.mark.integration

VALUES = [
    datetime(2026, 11, 29, 15, 11, 24, 751659, tzinfo=UTC),
    datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),  # before PostgreSQL's epoch
    datetime(1970, 1, 1, tzinfo=UTC),
    datetime(2026, 3, 1, 12, 0, 0, 1, tzinfo=timezone(timedelta(hours=-7, minutes=-30))),  # not UTC
    datetime(2100, 6, 15, 0, 0, 0, 500000, tzinfo=UTC),
]


def test_timestamps_round_trip_through_the_writer_codec(migrated_database_url):
    async def run() -> tuple[list[datetime], list[datetime], list[datetime]]:
        writer = Writer(migrated_database_url)
        plain = await asyncpg.connect(plain_dsn(migrated_database_url))
        try:
            await plain.execute("CREATE TABLE codec_t (i int, ts timestamptz, arr timestamptz[])")
            pool = await writer.pool()
            async with pool.acquire() as conn:
                await conn.copy_records_to_table("codec_t", records=[(i, v, None) for i, v in enumerate(VALUES)],
                                                 columns=["i", "ts", "arr"])
                await conn.execute("INSERT INTO codec_t SELECT 100, NULL, $1::timestamptz[]", VALUES)
                through_writer = [r["ts"] for r in await conn.fetch("SELECT ts FROM codec_t WHERE i < 100 ORDER BY i")]
            stored = [r["ts"] for r in await plain.fetch("SELECT ts FROM codec_t WHERE i < 100 ORDER BY i")]
            arr = await plain.fetchval("SELECT arr FROM codec_t WHERE i = 100")
            return stored, through_writer, arr
        finally:
            await plain.close()
            await writer.close()

    stored, through_writer, arr = asyncio.run(run())
    assert stored == VALUES  # asyncpg's own decoder reads back exactly what was meant
    assert arr == VALUES  # arrays of timestamps (the upsert's parameters) too
    assert through_writer == VALUES and all(t.tzinfo is not None for t in through_writer)
