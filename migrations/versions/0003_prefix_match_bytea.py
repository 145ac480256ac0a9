"""kvflow_prefix_matches(bytea): the prompt's hashes packed, and a leaner bisection.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29

Same result as 0002 (each node's contiguous cached prefix of the prompt: blocks, of which on the
GPU, and the deepest block's priority), three times cheaper:

* The prompt's block hashes come as one ``bytea`` of 8-byte big-endian values
  (``eventbus.hashing.prompt_hash_heads``) instead of a ``bigint[]``: the client encodes nothing
  per element, and the function decodes only the positions it probes (``kvflow_block_at``).
* The bisection keeps its node set as it is while a probe finds all or none of the set holding
  the block, and splits it (a recursive call for the part that stops earlier) only where their
  boundaries differ; a single node is probed with one ``EXISTS``. No array rebuilding per probe.
* The GPU boundary needs a search only for a node whose deepest cached block is on the host:
  every ancestor of a GPU block is on the GPU, so a GPU leaf means the whole prefix is there.

A node's cache is prefix-closed (leaf-only eviction), which is what makes bisection exact:
along a prompt's blocks a node holds positions 1..L and nothing after.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from migrations.sqlscript import execute_script

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FUNCTIONS = """
DROP FUNCTION IF EXISTS kvflow_prefix_matches(bigint[]);
DROP FUNCTION IF EXISTS kvflow_prefix_bounds(bigint[], text[], smallint);

-- Block i (from 1) of a packed prompt: bytes 8i-7 .. 8i, big-endian, as the signed bigint of SQL.
CREATE FUNCTION kvflow_block_at(hashes bytea, i integer) RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT ('x' || encode(substr(hashes, 8 * i - 7, 8), 'hex'))::bit(64)::bigint
$$;

-- For nodes in `candidates`, each of which holds position `lo` (at a level <= max_level), the
-- largest position in [lo, hi] each holds at a level <= max_level.
CREATE FUNCTION kvflow_prefix_bounds(hashes bytea, candidates text[], lo integer, hi integer,
                                     max_level smallint)
RETURNS TABLE (node_id text, bound integer)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    total integer := coalesce(cardinality(candidates), 0);
    mid integer; k integer; h bigint; t text[];
BEGIN
    IF total = 0 THEN
        RETURN;
    END IF;
    WHILE lo < hi LOOP
        mid := (lo + hi + 1) / 2;
        h := ('x' || encode(substr(hashes, 8 * mid - 7, 8), 'hex'))::bit(64)::bigint;
        IF total = 1 THEN
            IF EXISTS (SELECT FROM node_blocks nb WHERE nb.block_hash = h AND nb.node_id = candidates[1]
                       AND nb.cache_level <= max_level) THEN
                lo := mid;
            ELSE
                hi := mid - 1;
            END IF;
            CONTINUE;
        END IF;
        t := ARRAY(SELECT nb.node_id FROM node_blocks nb WHERE nb.block_hash = h
                   AND nb.node_id = ANY (candidates) AND nb.cache_level <= max_level);
        k := cardinality(t);
        IF k = total THEN
            lo := mid;
        ELSIF k = 0 THEN
            hi := mid - 1;
        ELSE  -- the set splits here: those without block `mid` stop in [lo, mid - 1]
            RETURN QUERY SELECT * FROM kvflow_prefix_bounds(
                hashes, ARRAY(SELECT x FROM unnest(candidates) AS x WHERE x <> ALL (t)), lo, mid - 1, max_level);
            candidates := t; total := k; lo := mid;
        END IF;
    END LOOP;
    RETURN QUERY SELECT x, lo FROM unnest(candidates) AS x;
END $$;

CREATE FUNCTION kvflow_prefix_matches(hashes bytea)
RETURNS TABLE (node_id text, blocks integer, gpu integer, leaf_priority smallint)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    n integer := length(hashes) / 8;
    h1 bigint;
    r record;
    on_gpu text[];
BEGIN
    IF length(hashes) % 8 <> 0 THEN
        RAISE EXCEPTION 'kvflow_prefix_matches: % bytes is not a whole number of 8-byte hashes', length(hashes)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF n = 0 THEN
        RETURN;
    END IF;
    h1 := kvflow_block_at(hashes, 1);
    on_gpu := ARRAY(SELECT nb.node_id FROM node_blocks nb WHERE nb.block_hash = h1 AND nb.cache_level = 0);
    FOR r IN
        SELECT b.node_id, b.bound, nb.cache_level, nb.priority
        FROM kvflow_prefix_bounds(hashes, ARRAY(SELECT nb.node_id FROM node_blocks nb WHERE nb.block_hash = h1),
                                  1, n, 1::smallint) AS b
        JOIN node_blocks nb ON nb.node_id = b.node_id AND nb.block_hash = kvflow_block_at(hashes, b.bound)
    LOOP
        node_id := r.node_id; blocks := r.bound; leaf_priority := r.priority;
        IF r.cache_level = 0 THEN
            gpu := r.bound;  -- every ancestor of a GPU block is on the GPU
        ELSIF r.node_id = ANY (on_gpu) THEN
            SELECT g.bound INTO gpu
            FROM kvflow_prefix_bounds(hashes, ARRAY[r.node_id], 1, r.bound - 1, 0::smallint) AS g;
        ELSE
            gpu := 0;
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvflow_reader') THEN
        GRANT EXECUTE ON FUNCTION kvflow_block_at(bytea, integer) TO kvflow_reader;
        GRANT EXECUTE ON FUNCTION kvflow_prefix_bounds(bytea, text[], integer, integer, smallint) TO kvflow_reader;
        GRANT EXECUTE ON FUNCTION kvflow_prefix_matches(bytea) TO kvflow_reader;
    END IF;
END $$;
"""


def upgrade() -> None:
    execute_script(FUNCTIONS)


def downgrade() -> None:
    execute_script("""
        DROP FUNCTION IF EXISTS kvflow_prefix_matches(bytea);
        DROP FUNCTION IF EXISTS kvflow_prefix_bounds(bytea, text[], integer, integer, smallint);
        DROP FUNCTION IF EXISTS kvflow_block_at(bytea, integer);
    """)
    execute_script(importlib.import_module("migrations.versions.0002_prefix_match_function").FUNCTION)
