"""The schema can be distributed by ``node_id`` (Citus, docs/scaling.md): every primary key and
unique index of the materializer's tables includes ``node_id``, every such table has the column,
and there is no foreign key (none could cross shards). The router's ``prompt_cache_keys`` (keyed
by tenant, model and key) stays on the coordinator, or is distributed by tenant."""

from __future__ import annotations

import pytest

from tests.support import fetch

pytestmark = pytest.mark.integration

TABLES = ("nodes", "node_blocks", "block_events", "node_stats_samples")


def test_every_unique_index_includes_node_id_and_there_are_no_foreign_keys(migrated_database_url):
    url = migrated_database_url
    unique = fetch(url, """
        SELECT c.relname AS tbl, i.relname AS idx,
               array(SELECT a.attname FROM unnest(x.indkey) k JOIN pg_attribute a
                     ON a.attrelid = x.indrelid AND a.attnum = k) AS cols
        FROM pg_index x JOIN pg_class c ON c.oid = x.indrelid JOIN pg_class i ON i.oid = x.indexrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = current_schema() AND (x.indisunique OR x.indisprimary)
          AND c.relname NOT IN ('alembic_version', 'prompt_cache_keys')""")  # local tables of the coordinator
    assert {r["tbl"] for r in unique} >= {"nodes", "node_blocks", "node_stats_samples"}
    assert [r["idx"] for r in unique if "node_id" not in r["cols"]] == []
    fks = fetch(url, "SELECT conname FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace "
                     "WHERE n.nspname = current_schema() AND c.contype = 'f'")
    assert fks == []
    has = {r["table_name"] for r in fetch(url, "SELECT table_name FROM information_schema.columns "
                                               "WHERE table_schema = current_schema() AND column_name = 'node_id'")}
    assert set(TABLES) <= has
