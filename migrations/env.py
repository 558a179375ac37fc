"""Alembic environment for the AgentKV history (DuckDB through duckdb-engine).

Run by ``policyd.history.migrate()`` (and ``policyd migrate``), which configures Alembic in code:
no alembic.ini. ``config.attributes["connection"]`` may carry an open SQLAlchemy connection;
otherwise ``sqlalchemy.url`` names the file (``duckdb:///path``).
"""

from __future__ import annotations

from alembic import context
from alembic.ddl.impl import DefaultImpl
from sqlalchemy import Connection, create_engine


class AlembicDuckDBImpl(DefaultImpl):
    """Alembic has no DuckDB dialect of its own; DuckDB speaks enough PostgreSQL DDL that the
    default implementation works (without this class Alembic refuses the dialect)."""

    __dialect__ = "duckdb"
    transactional_ddl = True


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=None, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(context.config.get_main_option("sqlalchemy.url") or "")
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported: run `policyd migrate`")
run_migrations_online()
