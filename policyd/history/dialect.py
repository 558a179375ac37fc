"""DuckDB for SQLAlchemy and Alembic, as the history's migrations use it.

``engine(path)`` is the engine every migration of a history file runs on (``migrate``,
``migrations/env.py``). Its dialect is duckdb-engine's (PostgreSQL's DDL, which DuckDB speaks)
with the reflection Alembic's autogenerate comparison needs and duckdb-engine lacks:

* DOUBLE (``float8``) reflects as ``Double`` and FLOAT / REAL (``float4``) as ``REAL``
  (duckdb-engine reflects both as a bare ``FLOAT``, so a change of width would go unseen);
* indexes reflect from ``duckdb_indexes()`` (duckdb-engine reflects none, so every declared
  index would read as missing): an element that is a column name is a column, anything else an
  expression.

``AlembicDuckDBImpl`` lets Alembic run on the ``duckdb`` dialect at all.
Importing this module loads SQLAlchemy, Alembic and duckdb-engine: import it only to migrate.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, Final

import duckdb_engine
import sqlalchemy as sa
from alembic.ddl.impl import DefaultImpl
from sqlalchemy.dialects import registry
from sqlalchemy.engine import Connection, Engine

DRIVER: Final = "policyd_history"  # the URL's driver: duckdb+policyd_history:///path
_PLAIN_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")
_QUOTED_NAME: Final = re.compile(r'"((?:[^"]|"")*)"')

_INDEXES: Final = sa.text(
    "SELECT table_name, index_name, is_unique, CAST(expressions AS VARCHAR[]) AS elements "
    "FROM duckdb_indexes() WHERE schema_name = :schema AND database_name = current_database() "
    "AND NOT is_primary ORDER BY table_name, index_name"
)


class AlembicDuckDBImpl(DefaultImpl):
    """Alembic has no DuckDB implementation of its own; DuckDB speaks enough PostgreSQL DDL that
    the default one works (without this class Alembic refuses the dialect). DDL is
    transactional: a revision that fails leaves the file as it was."""

    __dialect__ = "duckdb"
    transactional_ddl = True


def _index_column(element: str) -> str | None:
    """The column an index element names, or None for an expression."""
    if _PLAIN_NAME.fullmatch(element):
        return element
    quoted = _QUOTED_NAME.fullmatch(element)
    return quoted[1].replace('""', '"') if quoted else None


def _reflected_index(name: str, unique: bool, elements: list[str]) -> dict[str, Any]:
    columns = [_index_column(element) for element in elements]
    index: dict[str, Any] = {"name": name, "unique": bool(unique), "column_names": columns}
    if None in columns:
        index["expressions"] = list(elements)
    return index


class HistoryDialect(duckdb_engine.Dialect):
    """duckdb-engine's dialect, reflecting float widths and indexes (see the module)."""

    ischema_names = {  # noqa: RUF012 (a class attribute of SQLAlchemy's, never mutated)
        **duckdb_engine.Dialect.ischema_names,
        "float8": sa.Double,
        "float4": sa.REAL,
    }
    supports_statement_cache = False  # as duckdb-engine's (SQLAlchemy asks each subclass)

    def _indexes_by_table(
        self, connection: Connection, schema: str | None, tables: Collection[str] | None
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        rows = connection.execute(_INDEXES, {"schema": schema or "main"})
        for table, name, unique, elements in rows:
            if tables is None or table in tables:
                yield table, _reflected_index(name, unique, list(elements))

    def get_indexes(
        self, connection: Connection, table_name: str, schema: str | None = None, **kw: Any
    ) -> list[Any]:
        return [index for _, index in self._indexes_by_table(connection, schema, {table_name})]

    def get_multi_indexes(  # type: ignore[override] # PostgreSQL's takes them positionally
        self,
        connection: Connection,
        *,
        schema: str | None = None,
        filter_names: Collection[str] | None = None,
        **kw: Any,
    ) -> Iterator[tuple[tuple[str | None, str], list[Any]]]:
        """Tables (``filter_names``, or all) with indexes; ``scope`` and ``kind`` (in ``kw``)
        do not narrow it: views and temporary tables have none here."""
        found: dict[str, list[Any]] = {}
        for table, index in self._indexes_by_table(connection, schema, filter_names):
            found.setdefault(table, []).append(index)
        for table, indexes in found.items():
            yield (schema, table), indexes


registry.register(f"duckdb.{DRIVER}", __name__, HistoryDialect.__name__)


def url(db_path: Path) -> str:
    """The SQLAlchemy URL of a history file, for this module's dialect."""
    return f"duckdb+{DRIVER}:///{db_path}"


def engine(db_path: Path) -> Engine:
    """An engine on the history file ``db_path`` (created by DuckDB when missing)."""
    return sa.create_engine(url(db_path))
