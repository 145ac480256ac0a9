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
SELECT node_id, instance_id, last_event_id, status, instance_started_at, window_size, capacity_gpu, capacity_host,
       stopped_at
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
# (A node that stops resyncing has its snapshot requests counted from 0 again; a new instance has
# not said goodbye.)
UPDATE_NODES = """
UPDATE nodes n SET
  instance_id = u.instance_id, last_event_id = u.last_event_id,
  status_changed_at = CASE WHEN n.status <> u.status THEN now() ELSE n.status_changed_at END,
  status = u.status, instance_started_at = u.instance_started_at, window_size = u.window_size,
  capacity_gpu = u.capacity_gpu, capacity_host = u.capacity_host, last_seen = now(), updated_at = now(),
  resync_attempts = CASE WHEN u.status = 'resyncing' THEN n.resync_attempts ELSE 0 END,
  stopped_at = CASE WHEN n.instance_id = u.instance_id THEN n.stopped_at END
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
UPDATE nodes SET resync_requested_at = now(), resync_attempts = resync_attempts + 1
WHERE node_id = ANY($1::text[])
  AND (resync_requested_at IS NULL OR resync_requested_at < now() - make_interval(secs => $2))
RETURNING node_id
"""
# Ask again the nodes still resyncing: the wait after the n-th request is $1 * 2^(n-1) seconds, at
# most $2. The update claims the request (one worker sends it). Returns the nodes and the number
# of the request to send now.
REPEAT_RESYNC = """
UPDATE nodes SET resync_requested_at = now(), resync_attempts = resync_attempts + 1
WHERE status = 'resyncing'
  AND (resync_requested_at IS NULL
       OR resync_requested_at < now() - make_interval(
            secs => least($2::float8, $1::float8 * power(2, least(greatest(resync_attempts - 1, 0), 30)))))
RETURNING node_id, resync_attempts
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
                        last_stats_at, status, active_blocks, engine)
SELECT u.node_id, u.instance_id, u.url, u.model, u.block_size, u.cap_gpu, u.cap_host, u.used_gpu, u.used_host,
       u.active, u.queued, u.last_event_id, u.counters::jsonb, now(), now(),
       CASE WHEN u.stopping THEN 'gone' ELSE 'live' END, u.active_blocks, u.engine
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::int[], $7::int[], $8::int[], $9::int[],
            $10::int[], $11::int[], $12::bigint[], $13::text[], $14::int[], $15::boolean[], $16::text[])
     AS u(node_id, instance_id, url, model, block_size, cap_gpu, cap_host, used_gpu, used_host, active, queued,
          last_event_id, counters, active_blocks, stopping, engine)
ON CONFLICT (node_id) DO UPDATE SET
  url = EXCLUDED.url, model = EXCLUDED.model, block_size = EXCLUDED.block_size, engine = EXCLUDED.engine,
  capacity_gpu = EXCLUDED.capacity_gpu, capacity_host = EXCLUDED.capacity_host,
  used_gpu = EXCLUDED.used_gpu, used_host = EXCLUDED.used_host,
  active_requests = EXCLUDED.active_requests, queued_requests = EXCLUDED.queued_requests,
  active_blocks = EXCLUDED.active_blocks,
  reported_event_id = EXCLUDED.reported_event_id, counters = EXCLUDED.counters,
  last_seen = now(), last_stats_at = now(), updated_at = now(),
  -- A heartbeat brings a stale node back, a goodbye does not (its proposed status is 'gone'; GOODBYE
  -- follows); a gone node's blocks were cleared, so it stays gone until its events (a snapshot)
  -- bring it back.
  status = CASE WHEN n.status = 'stale' AND EXCLUDED.status = 'live' THEN 'live' ELSE n.status END,
  status_changed_at = CASE WHEN n.status = 'stale' AND EXCLUDED.status = 'live' THEN now()
                           ELSE n.status_changed_at END
"""
# A node's goodbye (its latest heartbeat says stopping): gone at once, its blocks cleared (its
# history stays), once per instance and only for the instance the row holds (a goodbye of an older
# instance, consumed after the new one started, changes nothing). Returns the nodes gone now.
GOODBYE = """
WITH bye AS (
  UPDATE nodes n SET status = 'gone', stopped_at = now(), resync_attempts = 0, updated_at = now(),
    status_changed_at = CASE WHEN n.status <> 'gone' THEN now() ELSE n.status_changed_at END
  FROM unnest($1::text[], $2::text[]) AS u(node_id, instance_id)
  WHERE n.node_id = u.node_id AND n.instance_id = u.instance_id AND n.stopped_at IS NULL
  RETURNING n.node_id
), cleared AS (
  DELETE FROM node_blocks WHERE node_id IN (SELECT node_id FROM bye) RETURNING node_id
)
SELECT node_id FROM bye ORDER BY node_id
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
  UPDATE nodes SET status = 'stale', status_changed_at = now(), resync_attempts = 0
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
# Rows of nodes gone and silent for $1 s: deleted (their blocks were cleared when they went; their
# history and heartbeats stay). Returns the nodes pruned.
PRUNE_GONE = """
WITH pruned AS (
  DELETE FROM nodes WHERE status = 'gone' AND greatest(last_seen, status_changed_at) < now() - make_interval(secs => $1)
  RETURNING node_id
), cleared AS (
  DELETE FROM node_blocks WHERE node_id IN (SELECT node_id FROM pruned) RETURNING node_id
)
SELECT node_id FROM pruned ORDER BY node_id
"""
# Maintenance by one worker at a time: the lock is the transaction's; false: another has it.
MAINTENANCE_LOCK = "SELECT pg_try_advisory_xact_lock(hashtext('kvflow-maintenance'))"
# Daily partitions of block_events a week ahead; then drop those older than $1 seconds.
ENSURE_PARTITIONS = "SELECT kvflow_ensure_block_event_partitions(7)"
APPLY_RETENTION = "SELECT kvflow_apply_retention(make_interval(secs => $1))"
# /healthz: the database answers.
PING = "SELECT 1"
