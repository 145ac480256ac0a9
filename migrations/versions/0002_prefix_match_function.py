"""kvflow_prefix_matches(): each node's cached prefix of a prompt in O(breakpoints × log n) probes.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

A node's cache is prefix-closed (a cached block's parent is cached) and every ancestor of a GPU
block is on the GPU. So along a prompt's blocks, a node holds positions 1..L (the first G of them
on the GPU, the rest on the host) and nothing after. The router needs L and G per node; instead
of probing every block of a 32k-token prompt, this function bisects: probing position m tells,
for every candidate node at once, on which side of its boundaries m lies. The number of probes
grows with the number of distinct boundaries, not with the prompt's length.
"""

from __future__ import annotations

from collections.abc import Sequence

from migrations.sqlscript import execute_script

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FUNCTION = """
-- For nodes in `candidates`, each of which holds position `lo` (at level <= max_level), the
-- largest position in [lo, n] each holds at a level <= max_level. Iterative set bisection; node
-- sets travel as comma-joined strings (node ids contain no comma).
CREATE FUNCTION kvflow_prefix_bounds(hashes bigint[], candidates text[], max_level smallint)
RETURNS TABLE (node_id text, bound integer)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    n integer := coalesce(array_length(hashes, 1), 0);
    st_lo integer[] := ARRAY[1];
    st_hi integer[] := ARRAY[n];
    st_set text[] := ARRAY[array_to_string(candidates, ',')];
    lo integer; hi integer; mid integer;
    s text[]; t text[]; u text[];
    top integer;
BEGIN
    IF n = 0 OR coalesce(array_length(candidates, 1), 0) = 0 THEN
        RETURN;
    END IF;
    WHILE coalesce(array_length(st_lo, 1), 0) > 0 LOOP
        top := array_length(st_lo, 1);
        lo := st_lo[top]; hi := st_hi[top]; s := string_to_array(st_set[top], ',');
        st_lo := st_lo[1:top - 1]; st_hi := st_hi[1:top - 1]; st_set := st_set[1:top - 1];
        IF lo = hi THEN
            RETURN QUERY SELECT x, lo FROM unnest(s) AS x;
            CONTINUE;
        END IF;
        mid := (lo + hi + 1) / 2;
        SELECT coalesce(array_agg(nb.node_id), '{}') INTO t FROM node_blocks nb
        WHERE nb.block_hash = hashes[mid] AND nb.node_id = ANY (s) AND nb.cache_level <= max_level;
        SELECT coalesce(array_agg(x), '{}') INTO u FROM unnest(s) AS x WHERE NOT x = ANY (t);
        IF array_length(t, 1) > 0 THEN
            st_lo := st_lo || mid; st_hi := st_hi || hi; st_set := st_set || array_to_string(t, ',');
        END IF;
        IF array_length(u, 1) > 0 THEN
            st_lo := st_lo || lo; st_hi := st_hi || (mid - 1); st_set := st_set || array_to_string(u, ',');
        END IF;
    END LOOP;
END $$;

-- Each node's contiguous cached prefix of the prompt: blocks held, of which on the GPU, and the
-- priority of the deepest one (the next to be evicted: eviction takes leaves first).
CREATE FUNCTION kvflow_prefix_matches(hashes bigint[])
RETURNS TABLE (node_id text, blocks integer, gpu integer, leaf_priority smallint)
LANGUAGE sql STABLE AS $$
    WITH first AS (
        SELECT nb.node_id, nb.cache_level FROM node_blocks nb WHERE nb.block_hash = hashes[1]
    ), held AS (
        SELECT b.node_id, b.bound FROM kvflow_prefix_bounds(
            hashes, ARRAY(SELECT f.node_id FROM first f), 1::smallint) AS b
    ), on_gpu AS (
        SELECT b.node_id, b.bound FROM kvflow_prefix_bounds(
            hashes, ARRAY(SELECT f.node_id FROM first f WHERE f.cache_level = 0), 0::smallint) AS b
    )
    SELECT h.node_id, h.bound, coalesce(g.bound, 0), nb.priority
    FROM held h
    LEFT JOIN on_gpu g ON g.node_id = h.node_id
    JOIN node_blocks nb ON nb.node_id = h.node_id AND nb.block_hash = hashes[h.bound]
$$;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvflow_reader') THEN
        GRANT EXECUTE ON FUNCTION kvflow_prefix_bounds(bigint[], text[], smallint) TO kvflow_reader;
        GRANT EXECUTE ON FUNCTION kvflow_prefix_matches(bigint[]) TO kvflow_reader;
    END IF;
END $$;
"""


def upgrade() -> None:
    execute_script(FUNCTION)


def downgrade() -> None:
    execute_script("""
        DROP FUNCTION IF EXISTS kvflow_prefix_matches(bigint[]);
        DROP FUNCTION IF EXISTS kvflow_prefix_bounds(bigint[], text[], smallint);
    """)
