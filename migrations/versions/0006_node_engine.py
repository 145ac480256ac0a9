"""nodes.engine: what serves each node, so the router sends retention in that engine's words.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06

``NodeStats.engine`` (a heartbeat field, left out by kvflow's own nodes): ``kvflow``, ``vllm``,
``vllm+kvflow`` (vLLM with kvflow's retention plugin), ``sglang`` or ``trtllm`` — a bridge says
which engine it fronts. The router reads it to translate a request's retention (docs/router.md,
"Retention per engine").
"""

from __future__ import annotations

from collections.abc import Sequence

from migrations.sqlscript import execute_script

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    execute_script("""
        ALTER TABLE nodes ADD COLUMN engine text NOT NULL DEFAULT 'kvflow';
        COMMENT ON COLUMN nodes.engine IS
            'What serves the node (its latest heartbeat): kvflow, vllm, vllm+kvflow (with kvflow''s plugin), sglang, trtllm.';
    """)


def downgrade() -> None:
    execute_script("ALTER TABLE nodes DROP COLUMN IF EXISTS engine;")
