"""Run a multi-statement SQL script inside an Alembic migration.

asyncpg prepares every statement it is given, and a prepared statement holds one command; a
script (tables, plpgsql functions with ``$$`` bodies, views) goes through the simple-query
protocol of the underlying asyncpg connection instead, in the migration's transaction.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import util

_await = getattr(util, "await_", None) or util.await_only


def execute_script(sql: str) -> None:
    bind = op.get_bind()
    driver_conn = bind.connection.dbapi_connection.driver_connection  # type: ignore[union-attr]
    if hasattr(driver_conn, "execute") and bind.dialect.driver == "asyncpg":
        _await(driver_conn.execute(sql))
    else:  # a sync driver (psycopg) accepts scripts directly
        bind.exec_driver_sql(sql)
