"""prompt_cache_keys: which node serves each ``prompt_cache_key``, and the key's hit rate.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06

A client's ``prompt_cache_key`` (OpenAI's: "a stable key … to route similar requests together")
is scoped to its tenant (the API key's; '' without keys). The router writes one row per (tenant,
model, key) as it proxies: the node it sent the key's last request to, and the key's requests,
prompt tokens and cached prompt tokens (from the answers' usage, when the answer carried one).
Every router replica, and a restarted router, read the key's node here. The reader role (the
router's) may insert and update this table only.
"""

from __future__ import annotations

from collections.abc import Sequence

from migrations.sqlscript import execute_script

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    execute_script("""
        CREATE TABLE prompt_cache_keys (
            tenant          text        NOT NULL DEFAULT '',
            model           text        NOT NULL,
            cache_key       text        NOT NULL,
            node_id         text        NOT NULL,
            first_seen      timestamptz NOT NULL DEFAULT now(),
            last_used       timestamptz NOT NULL DEFAULT now(),
            requests        bigint      NOT NULL DEFAULT 0,
            prompt_tokens   bigint      NOT NULL DEFAULT 0,
            cached_tokens   bigint      NOT NULL DEFAULT 0,
            PRIMARY KEY (tenant, model, cache_key)
        );
        COMMENT ON TABLE prompt_cache_keys IS
            'Per (tenant, model, prompt_cache_key): the node of its last request and its hit counts (the router''s).';
        CREATE INDEX prompt_cache_keys_last_used ON prompt_cache_keys (last_used);
        CREATE VIEW prompt_cache_key_hit_rates AS
        SELECT tenant, model, cache_key, node_id, requests, prompt_tokens, cached_tokens,
               CASE WHEN prompt_tokens > 0 THEN cached_tokens::double precision / prompt_tokens END AS hit_rate,
               last_used
        FROM prompt_cache_keys;
        DO $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvflow_reader') THEN
                GRANT SELECT, INSERT, UPDATE ON prompt_cache_keys TO kvflow_reader;
                GRANT SELECT ON prompt_cache_key_hit_rates TO kvflow_reader;
            END IF;
        END $$;
    """)


def downgrade() -> None:
    execute_script("DROP VIEW IF EXISTS prompt_cache_key_hit_rates; DROP TABLE IF EXISTS prompt_cache_keys;")
