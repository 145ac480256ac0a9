"""nodes.resync_attempts and nodes.stopped_at: repeated snapshot requests, and a node's goodbye.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

* ``resync_attempts``: the snapshot requests sent to a node since it became ``resyncing`` (0
  otherwise). A request can be lost (a node's control listener reads only what is new), so the
  materializer asks again while the node resyncs, after a backoff that doubles with each attempt
  (``KVFLOW_MATERIALIZER_RESYNC_RETRY_S``, up to ``…_RESYNC_RETRY_MAX_S``).
* ``stopped_at``: when the node's current instance said goodbye (a heartbeat with ``status``
  ``stopping``, sent when it is stopped): the node is ``gone`` at once, and the later events of
  that instance are history only. Null otherwise; a new instance clears it.
"""

from __future__ import annotations

from collections.abc import Sequence

from migrations.sqlscript import execute_script

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    execute_script("""
        ALTER TABLE nodes ADD COLUMN resync_attempts integer NOT NULL DEFAULT 0,
                          ADD COLUMN stopped_at timestamptz;
        COMMENT ON COLUMN nodes.resync_attempts IS
            'Snapshot requests sent since the node became resyncing (0 otherwise); each waits twice as long.';
        COMMENT ON COLUMN nodes.stopped_at IS
            'When the current instance said goodbye (a stopping heartbeat): gone at once; null otherwise.';
    """)


def downgrade() -> None:
    execute_script("ALTER TABLE nodes DROP COLUMN IF EXISTS stopped_at, DROP COLUMN IF EXISTS resync_attempts;")
