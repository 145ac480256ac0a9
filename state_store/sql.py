"""Every SQL statement the materializer runs (the text only: :mod:`state_store.writer` runs them).

Parameters are arrays (``unnest``) so that each statement writes a whole take in one round trip;
hashes are ``bigint`` (``eventbus.protocol.to_sql``), times ``timestamptz``.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------ a take's plan

LOCK_NODES = """
INSERT INTO nodes (node_id, instance_id) SELECT unnest($1::text[]), '' ON CONFLICT (node_id) DO NOTHING;
"""
READ_NODES = """
SELECT node_id, instance_id, last_event_id, status, instance_started_at, window_size, capacity_gpu, capacity_host
FROM nodes WHERE node_id = ANY($1::text[]) ORDER BY node_id
"""
SELECT_NODES = READ_NODES + " FOR UPDATE"
SELECT_BLOCKS = """
SELECT nb.node_id, nb.block_hash, nb.parent_hash, nb.cache_level, nb.priority, nb.num_tokens, nb.lora_id,
       nb.window_size, nb.stored_at, nb.updated_at
FROM node_blocks nb JOIN unnest($1::text[], $2::bigint[]) AS k(node_id, block_hash)
  ON nb.node_id = k.node_id AND nb.block_hash = k.block_hash
"""
RESET_BLOCKS = "DELETE FROM node_blocks WHERE node_id = ANY($1::text[])"
DELETE_BLOCKS = """
DELETE FROM node_blocks nb USING unnest($1::text[], $2::bigint[]) AS d(node_id, block_hash)
WHERE nb.node_id = d.node_id AND nb.block_hash = d.block_hash
"""
BLOCK_COLUMNS = ("node_id", "block_hash", "parent_hash", "cache_level", "priority", "num_tokens", "lora_id",
                 "window_size", "stored_at", "updated_at")
UPSERT_BLOCKS = f"""
INSERT INTO node_blocks ({", ".join(BLOCK_COLUMNS)})
SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::smallint[], $5::smallint[], $6::integer[],
                     $7::bigint[], $8::integer[], $9::timestamptz[], $10::timestamptz[])
ON CONFLICT (node_id, block_hash) DO UPDATE SET
  parent_hash = EXCLUDED.parent_hash, cache_level = EXCLUDED.cache_level, priority = EXCLUDED.priority,
  num_tokens = EXCLUDED.num_tokens, lora_id = EXCLUDED.lora_id, window_size = EXCLUDED.window_size,
  stored_at = EXCLUDED.stored_at, updated_at = EXCLUDED.updated_at
"""
# The compiled hot path's node_blocks changes arrive as COPY data: new rows straight into
# node_blocks, changed rows and deleted keys into per-connection staging tables (emptied at every
# commit) that one statement each applies. (Made with each connection, once the schema is there; a
# connection without them fails its hot-path write, which is replanned.)
CREATE_STAGING = """
DO $$ BEGIN
  IF to_regclass('node_blocks') IS NOT NULL THEN
    CREATE TEMP TABLE IF NOT EXISTS kvflow_stage_updates (LIKE node_blocks) ON COMMIT DELETE ROWS;
    CREATE TEMP TABLE IF NOT EXISTS kvflow_stage_deletes (node_id text NOT NULL, block_hash bigint NOT NULL)
      ON COMMIT DELETE ROWS;
  END IF;
END $$
"""
UPDATE_NODES = """
UPDATE nodes n SET
  instance_id = u.instance_id, last_event_id = u.last_event_id,
  status_changed_at = CASE WHEN n.status <> u.status THEN now() ELSE n.status_changed_at END,
  status = u.status, instance_started_at = u.instance_started_at, window_size = u.window_size,
  capacity_gpu = u.capacity_gpu, capacity_host = u.capacity_host, last_seen = now(), updated_at = now()
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::timestamptz[], $6::integer[],
            $7::integer[], $8::integer[])
     AS u(node_id, instance_id, last_event_id, status, instance_started_at, window_size, capacity_gpu, capacity_host)
WHERE n.node_id = u.node_id
"""
# The hot path's staged deletes and updates and its node rows, in one statement (one round trip):
# how many rows each touched, for the caller to check.
APPLY_STAGED = f"""
WITH deleted AS (
  DELETE FROM node_blocks nb USING kvflow_stage_deletes s
  WHERE nb.node_id = s.node_id AND nb.block_hash = s.block_hash
  RETURNING 1
), updated AS (
  UPDATE node_blocks nb SET
    parent_hash = s.parent_hash, cache_level = s.cache_level, priority = s.priority, num_tokens = s.num_tokens,
    lora_id = s.lora_id, window_size = s.window_size, stored_at = s.stored_at, updated_at = s.updated_at
  FROM kvflow_stage_updates s WHERE nb.node_id = s.node_id AND nb.block_hash = s.block_hash
  RETURNING 1
), node_rows AS ({UPDATE_NODES.strip()}
  RETURNING 1
)
SELECT (SELECT count(*) FROM deleted), (SELECT count(*) FROM updated), (SELECT count(*) FROM node_rows)
"""
# Ask a node for a snapshot at most once per cooldown: returns the nodes to ask now.
MARK_RESYNC = """
UPDATE nodes SET resync_requested_at = now()
WHERE node_id = ANY($1::text[])
  AND (resync_requested_at IS NULL OR resync_requested_at < now() - make_interval(secs => $2))
RETURNING node_id
"""


SELECT_NODE_BLOCKS = """
SELECT node_id, block_hash, parent_hash, cache_level, priority, num_tokens, lora_id, window_size, stored_at,
       updated_at
FROM node_blocks WHERE node_id = ANY($1::text[])
"""


# ------------------------------------------------------------------------------ node-stats

STATS_UPSERT = """
INSERT INTO nodes AS n (node_id, instance_id, url, model, block_size, capacity_gpu, capacity_host, used_gpu,
                        used_host, active_requests, queued_requests, reported_event_id, counters, last_seen,
                        last_stats_at, status, active_blocks)
SELECT u.node_id, u.instance_id, u.url, u.model, u.block_size, u.cap_gpu, u.cap_host, u.used_gpu, u.used_host,
       u.active, u.queued, u.last_event_id, u.counters::jsonb, now(), now(), 'live', u.active_blocks
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::int[], $7::int[], $8::int[], $9::int[],
            $10::int[], $11::int[], $12::bigint[], $13::text[], $14::int[])
     AS u(node_id, instance_id, url, model, block_size, cap_gpu, cap_host, used_gpu, used_host, active, queued,
          last_event_id, counters, active_blocks)
ON CONFLICT (node_id) DO UPDATE SET
  url = EXCLUDED.url, model = EXCLUDED.model, block_size = EXCLUDED.block_size,
  capacity_gpu = EXCLUDED.capacity_gpu, capacity_host = EXCLUDED.capacity_host,
  used_gpu = EXCLUDED.used_gpu, used_host = EXCLUDED.used_host,
  active_requests = EXCLUDED.active_requests, queued_requests = EXCLUDED.queued_requests,
  active_blocks = EXCLUDED.active_blocks,
  reported_event_id = EXCLUDED.reported_event_id, counters = EXCLUDED.counters,
  last_seen = now(), last_stats_at = now(), updated_at = now(),
  -- A heartbeat brings a stale node back; a gone node's blocks were cleared, so it stays gone
  -- until its events (a snapshot) bring it back.
  status = CASE WHEN n.status = 'stale' THEN 'live' ELSE n.status END,
  status_changed_at = CASE WHEN n.status = 'stale' THEN now() ELSE n.status_changed_at END
"""
STATS_SAMPLES = """
INSERT INTO node_stats_samples (node_id, instance_id, ts, capacity_gpu, capacity_host, used_gpu, used_host,
                                active_requests, queued_requests, prompt_tokens, cached_tokens, counters)
SELECT * FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::int[], $5::int[], $6::int[], $7::int[],
                     $8::int[], $9::int[], $10::bigint[], $11::bigint[], $12::jsonb[])
ON CONFLICT DO NOTHING
"""

# ------------------------------------------------------------------------------ upkeep

# live/resyncing → stale after $1 s of silence; stale → gone (blocks cleared) after $2 s. Returns
# the nodes gone now.
LIVENESS = """
WITH stale AS (
  UPDATE nodes SET status = 'stale', status_changed_at = now()
  WHERE status IN ('live', 'resyncing') AND last_seen < now() - make_interval(secs => $1)
  RETURNING node_id
), gone AS (
  UPDATE nodes SET status = 'gone', status_changed_at = now()
  WHERE status = 'stale' AND last_seen < now() - make_interval(secs => $2)
  RETURNING node_id
), cleared AS (
  DELETE FROM node_blocks WHERE node_id IN (SELECT node_id FROM gone) RETURNING node_id
)
SELECT node_id FROM gone
"""
# Maintenance by one worker at a time: the lock is the transaction's; false: another has it.
MAINTENANCE_LOCK = "SELECT pg_try_advisory_xact_lock(hashtext('kvflow-maintenance'))"
# Daily partitions of block_events a week ahead; then drop those older than $1 seconds.
ENSURE_PARTITIONS = "SELECT kvflow_ensure_block_event_partitions(7)"
APPLY_RETENTION = "SELECT kvflow_apply_retention(make_interval(secs => $1))"
# /healthz: the database answers.
PING = "SELECT 1"
