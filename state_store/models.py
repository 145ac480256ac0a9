"""SQLAlchemy 2 typed models of kvflow's tables (docs/architecture.md#postgresql).

The schema itself is created by the Alembic migrations in ``migrations/`` (which also hold the
views and the partition functions); these models mirror the tables for typed queries, and
``tests/state_store/test_migrations.py`` checks that the two agree.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Index, Integer, SmallInteger, Text, text
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

TZ = TIMESTAMP(timezone=True)


class Base(DeclarativeBase):
    pass


class Node(Base):
    """One inference node: identity, liveness, capacity, usage and load."""

    __tablename__ = "nodes"

    node_id: Mapped[str] = mapped_column(Text, primary_key=True)
    instance_id: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text, server_default=text("'live'"))
    url: Mapped[str | None] = mapped_column(Text)
    model: Mapped[str | None] = mapped_column(Text)
    block_size: Mapped[int | None] = mapped_column(Integer)
    window_size: Mapped[int | None] = mapped_column(Integer)
    last_event_id: Mapped[int] = mapped_column(BigInteger, server_default=text("-1"))
    instance_started_at: Mapped[datetime | None] = mapped_column(TZ)
    capacity_gpu: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    capacity_host: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    used_gpu: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    used_host: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    active_requests: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    queued_requests: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    active_blocks: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    reported_event_id: Mapped[int | None] = mapped_column(BigInteger)
    counters: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    first_seen: Mapped[datetime] = mapped_column(TZ, server_default=text("now()"))
    last_seen: Mapped[datetime] = mapped_column(TZ, server_default=text("now()"))
    last_stats_at: Mapped[datetime | None] = mapped_column(TZ)
    status_changed_at: Mapped[datetime] = mapped_column(TZ, server_default=text("now()"))
    resync_requested_at: Mapped[datetime | None] = mapped_column(TZ)
    resync_attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    stopped_at: Mapped[datetime | None] = mapped_column(TZ)
    engine: Mapped[str] = mapped_column(Text, server_default=text("'kvflow'"))
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=text("now()"))


class NodeBlock(Base):
    """A block cached on a node now."""

    __tablename__ = "node_blocks"
    __table_args__ = (
        Index("node_blocks_block_hash_idx", "block_hash",
              postgresql_include=["node_id", "cache_level", "priority"]),
    )

    node_id: Mapped[str] = mapped_column(Text, primary_key=True)
    block_hash: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    parent_hash: Mapped[int | None] = mapped_column(BigInteger)
    cache_level: Mapped[int] = mapped_column(SmallInteger)
    priority: Mapped[int] = mapped_column(SmallInteger)
    num_tokens: Mapped[int] = mapped_column(Integer)
    lora_id: Mapped[int | None] = mapped_column(BigInteger)
    window_size: Mapped[int | None] = mapped_column(Integer)
    stored_at: Mapped[datetime] = mapped_column(TZ)
    updated_at: Mapped[datetime] = mapped_column(TZ)


class BlockEvent(Base):
    """One event x block of the history (partitioned by event_ts; no primary key in SQL)."""

    __tablename__ = "block_events"
    __table_args__ = (
        Index("block_events_event_ts_brin", "event_ts", postgresql_using="brin"),
        {"postgresql_partition_by": "RANGE (event_ts)"},
    )

    # NOTE: the mapper needs an identity; (node_id, instance_id, event_id, seq) is unique by
    # construction (the materializer applies each event once) but not declared in SQL.
    node_id: Mapped[str] = mapped_column(Text, primary_key=True)
    instance_id: Mapped[str] = mapped_column(Text, primary_key=True)
    event_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(Text)
    block_hash: Mapped[int | None] = mapped_column(BigInteger)
    parent_hash: Mapped[int | None] = mapped_column(BigInteger)
    cache_level_old: Mapped[int | None] = mapped_column(SmallInteger)
    cache_level_new: Mapped[int | None] = mapped_column(SmallInteger)
    priority_old: Mapped[int | None] = mapped_column(SmallInteger)
    priority_new: Mapped[int | None] = mapped_column(SmallInteger)
    num_tokens: Mapped[int | None] = mapped_column(Integer)
    lora_id: Mapped[int | None] = mapped_column(BigInteger)
    stored_at: Mapped[datetime | None] = mapped_column(TZ)
    event_ts: Mapped[datetime] = mapped_column(TZ)
    ingested_at: Mapped[datetime] = mapped_column(TZ, server_default=text("clock_timestamp()"))


class NodeStatsSample(Base):
    """One NodeStats heartbeat."""

    __tablename__ = "node_stats_samples"

    node_id: Mapped[str] = mapped_column(Text, primary_key=True)
    instance_id: Mapped[str] = mapped_column(Text)
    ts: Mapped[datetime] = mapped_column(TZ, primary_key=True)
    capacity_gpu: Mapped[int] = mapped_column(Integer)
    capacity_host: Mapped[int] = mapped_column(Integer)
    used_gpu: Mapped[int] = mapped_column(Integer)
    used_host: Mapped[int] = mapped_column(Integer)
    active_requests: Mapped[int] = mapped_column(Integer)
    queued_requests: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    cached_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    counters: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))


class PromptCacheKey(Base):
    """A tenant's ``prompt_cache_key``: the node of its last request and its hit counts (written by the router)."""

    __tablename__ = "prompt_cache_keys"

    tenant: Mapped[str] = mapped_column(Text, primary_key=True, server_default=text("''"))
    model: Mapped[str] = mapped_column(Text, primary_key=True)
    cache_key: Mapped[str] = mapped_column(Text, primary_key=True)
    node_id: Mapped[str] = mapped_column(Text)
    first_seen: Mapped[datetime] = mapped_column(TZ, server_default=text("now()"))
    last_used: Mapped[datetime] = mapped_column(TZ, server_default=text("now()"), index=True)
    requests: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    cached_tokens: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
