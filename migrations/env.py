"""Alembic environment for the AgentKV history (DuckDB through duckdb-engine).

Run by ``policyd.history.migrate()`` (and ``policyd migrate``), which configures Alembic in code
and hands over an open SQLAlchemy connection in ``config.attributes["connection"]``; or by the
``alembic`` command with ``migrations/alembic.ini``, naming the file with ``-x db=PATH``
(docs/HISTORY.md, *Changing the schema*). ``target_metadata`` is the declaration of the newest
schema (``policyd.history.tables``): ``alembic revision --autogenerate`` drafts a revision from
its difference with a file at the current head. Revisions themselves never import it: each
keeps the DDL of its own time.
"""

from __future__ import annotations

from pathlib import Path

from alembic import context
from sqlalchemy import Connection

from policyd.history import dialect  # its engine; importing it registers the Alembic impl
from policyd.history.tables import METADATA


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=METADATA,
        transactional_ddl=True,
        compare_type=True,
        compare_server_default=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _db_path() -> Path:
    db = context.get_x_argument(as_dictionary=True).get("db")
    if not db:
        raise RuntimeError("name the history file: alembic -c migrations/alembic.ini -x db=PATH")
    return Path(db)


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = dialect.engine(_db_path())
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported: run `policyd migrate`")
run_migrations_online()
