"""Initial schema: nodes, node_blocks, block_events (partitioned by time), stats samples, views.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

The tables are kvflow's SQL contract (docs/architecture.md#postgresql). Hashes are ``bigint``: the unsigned 64-bit
``block_hash`` of the wire read as signed (``eventbus.hashing.to_sql``).
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.sqlscript import execute_script

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = """
CREATE TABLE nodes (
    node_id             text PRIMARY KEY,
    instance_id         text NOT NULL,
    status              text NOT NULL DEFAULT 'live'
                        CHECK (status IN ('live', 'stale', 'resyncing', 'gone')),
    url                 text,
    model               text,
    block_size          integer,
    window_size         integer,
    -- The last event_id of instance_id applied to node_blocks (-1: none yet). Written in the
    -- same transaction as the blocks, so a redelivered batch is recognized and skipped.
    last_event_id       bigint NOT NULL DEFAULT -1,
    -- ts of the first batch of instance_id: a replayed batch of an older instance is older.
    instance_started_at timestamptz,
    capacity_gpu        integer NOT NULL DEFAULT 0,
    capacity_host       integer NOT NULL DEFAULT 0,
    used_gpu            integer NOT NULL DEFAULT 0,
    used_host           integer NOT NULL DEFAULT 0,
    active_requests     integer NOT NULL DEFAULT 0,
    queued_requests     integer NOT NULL DEFAULT 0,
    active_blocks       integer NOT NULL DEFAULT 0,
    reported_event_id   bigint,
    counters            jsonb NOT NULL DEFAULT '{}'::jsonb,
    first_seen          timestamptz NOT NULL DEFAULT now(),
    last_seen           timestamptz NOT NULL DEFAULT now(),
    last_stats_at       timestamptz,
    status_changed_at   timestamptz NOT NULL DEFAULT now(),
    resync_requested_at timestamptz,
    updated_at          timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE nodes IS 'One row per inference node: identity, liveness, capacity, usage, load.';
COMMENT ON COLUMN nodes.last_event_id IS 'Last event_id of instance_id applied to node_blocks; -1 when none.';
COMMENT ON COLUMN nodes.reported_event_id IS 'last_event_id the node reported in its latest NodeStats.';

CREATE TABLE node_blocks (
    node_id      text NOT NULL,
    block_hash   bigint NOT NULL,
    parent_hash  bigint,
    cache_level  smallint NOT NULL CHECK (cache_level >= 0),
    priority     smallint NOT NULL CHECK (priority BETWEEN 0 AND 100),
    num_tokens   integer NOT NULL CHECK (num_tokens >= 0),
    lora_id      bigint,
    window_size  integer,
    stored_at    timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    PRIMARY KEY (node_id, block_hash)
) WITH (fillfactor = 90);
COMMENT ON TABLE node_blocks IS 'Every block cached on a node now (cache_level 0 = GPU, 1 = host).';
-- The router's lookup: which nodes hold any of these hashes, at which level and priority;
-- INCLUDE makes it an index-only scan.
CREATE INDEX node_blocks_block_hash_idx ON node_blocks (block_hash) INCLUDE (node_id, cache_level, priority);

CREATE TABLE block_events (
    node_id          text NOT NULL,
    instance_id      text NOT NULL,
    event_id         bigint NOT NULL,
    seq              integer NOT NULL,
    kind             text NOT NULL
                     CHECK (kind IN ('created', 'stored', 'removed', 'updated', 'snapshot')),
    block_hash       bigint,
    parent_hash      bigint,
    cache_level_old  smallint,
    cache_level_new  smallint,
    priority_old     smallint,
    priority_new     smallint,
    num_tokens       integer,
    lora_id          bigint,
    -- For removed and updated blocks: when the block was stored (its residency starts there).
    stored_at        timestamptz,
    event_ts         timestamptz NOT NULL,
    ingested_at      timestamptz NOT NULL DEFAULT clock_timestamp()
) PARTITION BY RANGE (event_ts);
COMMENT ON TABLE block_events IS
    'Every event x block, appended once: seq is the block''s position in its event (0 for created).';
CREATE TABLE block_events_default PARTITION OF block_events DEFAULT;
-- NOTE: a BRIN on time only. A btree on block_hash would halve the ingest rate (random inserts);
-- residency is precomputed (stored_at). Add one yourself if you query single blocks often.
CREATE INDEX block_events_event_ts_brin ON block_events USING brin (event_ts);

CREATE TABLE node_stats_samples (
    node_id          text NOT NULL,
    instance_id      text NOT NULL,
    ts               timestamptz NOT NULL,
    capacity_gpu     integer NOT NULL,
    capacity_host    integer NOT NULL,
    used_gpu         integer NOT NULL,
    used_host        integer NOT NULL,
    active_requests  integer NOT NULL,
    queued_requests  integer NOT NULL,
    prompt_tokens    bigint NOT NULL DEFAULT 0,
    cached_tokens    bigint NOT NULL DEFAULT 0,
    counters         jsonb NOT NULL DEFAULT '{}'::jsonb,
    PRIMARY KEY (node_id, ts)
);
COMMENT ON TABLE node_stats_samples IS 'NodeStats heartbeats, kept for hit-rate history.';
"""

FUNCTIONS = """
-- Daily partitions of block_events from yesterday to days_ahead days on. Rows that already
-- landed in the default partition for such a day are moved into the new partition.
CREATE FUNCTION kvflow_ensure_block_event_partitions(days_ahead integer DEFAULT 7)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    d date;
    lo timestamptz;
    hi timestamptz;
    part text;
    created integer := 0;
BEGIN
    FOR d IN SELECT generate_series(current_date - 1, current_date + days_ahead, interval '1 day')::date LOOP
        part := format('block_events_p%s', to_char(d, 'YYYYMMDD'));
        CONTINUE WHEN to_regclass(part) IS NOT NULL;
        lo := d::timestamptz;
        hi := (d + 1)::timestamptz;
        EXECUTE format('CREATE TABLE %I (LIKE block_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part);
        EXECUTE format('WITH moved AS (DELETE FROM block_events_default WHERE event_ts >= %L AND event_ts < %L RETURNING *) '
                       'INSERT INTO %I SELECT * FROM moved', lo, hi, part);
        EXECUTE format('ALTER TABLE block_events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', part, lo, hi);
        created := created + 1;
    END LOOP;
    RETURN created;
END $$;

-- Retention: drop daily partitions that end before now() - keep, and old rows elsewhere.
CREATE FUNCTION kvflow_apply_retention(keep interval)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    r record;
    dropped integer := 0;
BEGIN
    FOR r IN
        SELECT c.relname,
               (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''([^'']+)''\\)'))[1]::timestamptz AS upper_bound
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'block_events'::regclass AND c.relname <> 'block_events_default'
    LOOP
        IF r.upper_bound IS NOT NULL AND r.upper_bound <= now() - keep THEN
            EXECUTE format('DROP TABLE %I', r.relname);
            dropped := dropped + 1;
        END IF;
    END LOOP;
    DELETE FROM block_events_default WHERE event_ts < now() - keep;
    DELETE FROM node_stats_samples WHERE ts < now() - keep;
    RETURN dropped;
END $$;
"""

VIEWS = """
CREATE VIEW node_cache_summary AS
SELECT n.node_id, n.status, n.instance_id, n.model, n.block_size,
       n.capacity_gpu, n.capacity_host,
       coalesce(b.blocks_gpu, 0) AS blocks_gpu,
       coalesce(b.blocks_host, 0) AS blocks_host,
       coalesce(b.tokens_gpu, 0) AS tokens_gpu,
       coalesce(b.tokens_host, 0) AS tokens_host,
       b.min_priority, b.max_priority, b.avg_priority,
       coalesce(b.pinned_blocks, 0) AS blocks_priority_ge_80,
       n.active_requests, n.queued_requests, n.last_event_id, n.last_seen
FROM nodes n
LEFT JOIN (
    SELECT node_id,
           count(*) FILTER (WHERE cache_level = 0) AS blocks_gpu,
           count(*) FILTER (WHERE cache_level = 1) AS blocks_host,
           coalesce(sum(num_tokens) FILTER (WHERE cache_level = 0), 0) AS tokens_gpu,
           coalesce(sum(num_tokens) FILTER (WHERE cache_level = 1), 0) AS tokens_host,
           min(priority) AS min_priority, max(priority) AS max_priority,
           round(avg(priority), 1) AS avg_priority,
           count(*) FILTER (WHERE priority >= 80) AS pinned_blocks
    FROM node_blocks GROUP BY node_id
) b USING (node_id);

CREATE VIEW node_cache_by_priority AS
SELECT node_id, cache_level, priority, count(*) AS blocks, sum(num_tokens) AS tokens
FROM node_blocks
GROUP BY node_id, cache_level, priority;

-- An eviction is a block leaving a tier: removed (from wherever it was) or offloaded GPU -> host.
CREATE VIEW evictions_by_priority AS
SELECT node_id,
       date_trunc('hour', event_ts) AS hour,
       CASE WHEN kind = 'removed' THEN 'removed' ELSE 'offloaded' END AS action,
       cache_level_old AS from_cache_level,
       priority_old AS priority,
       count(*) AS blocks
FROM block_events
WHERE kind = 'removed' OR (kind = 'updated' AND cache_level_old = 0 AND cache_level_new = 1)
GROUP BY 1, 2, 3, 4, 5;

-- How long each removed block stayed on its node: from when it was stored (or first seen in a
-- snapshot) to its removal.
CREATE VIEW block_residency AS
SELECT node_id, block_hash, priority_old AS priority, cache_level_old AS cache_level,
       stored_at, event_ts AS removed_at, event_ts - stored_at AS residency
FROM block_events
WHERE kind = 'removed' AND stored_at IS NOT NULL;

-- Prompt-token hit rate per node and minute, from the cumulative counters of NodeStats.
CREATE VIEW node_hit_rates AS
WITH deltas AS (
    SELECT node_id, instance_id, ts,
           prompt_tokens - lag(prompt_tokens) OVER w AS d_prompt,
           cached_tokens - lag(cached_tokens) OVER w AS d_cached
    FROM node_stats_samples
    WINDOW w AS (PARTITION BY node_id, instance_id ORDER BY ts)
)
SELECT node_id, date_trunc('minute', ts) AS minute,
       sum(d_prompt) AS prompt_tokens, sum(d_cached) AS cached_tokens,
       CASE WHEN sum(d_prompt) > 0 THEN round(sum(d_cached)::numeric / sum(d_prompt), 4) END AS hit_rate
FROM deltas
WHERE d_prompt IS NOT NULL AND d_prompt >= 0
GROUP BY 1, 2;
"""

GRANTS = """
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvflow_reader') THEN
        GRANT USAGE ON SCHEMA public TO kvflow_reader;
        GRANT SELECT ON ALL TABLES IN SCHEMA public TO kvflow_reader;
        ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO kvflow_reader;
    END IF;
END $$;
"""


def upgrade() -> None:
    execute_script(TABLES)
    execute_script(FUNCTIONS)
    op.execute("SELECT kvflow_ensure_block_event_partitions(7)")
    execute_script(VIEWS)
    execute_script(GRANTS)


def downgrade() -> None:
    execute_script("""
        DROP VIEW IF EXISTS node_hit_rates, block_residency, evictions_by_priority,
                            node_cache_by_priority, node_cache_summary;
        DROP FUNCTION IF EXISTS kvflow_apply_retention(interval);
        DROP FUNCTION IF EXISTS kvflow_ensure_block_event_partitions(integer);
        DROP TABLE IF EXISTS node_stats_samples, block_events, node_blocks, nodes;
    """)
